package selection

import (
	"fmt"
	"sync/atomic"
	"time"
)

// Peers is what a replica knows of the other routers that book the same
// workers (package replica tells the service through ReplicaPlane.SetPeers):
// how many there are, this router's place among them, and how long a
// booking takes to reach them.
//
// Routers that share their bookings still decide blind within Window: a
// burst of requests spread over them (a gateway balancing same-instant
// arrivals round-robin over its Endpoint Pickers) meets the same view on
// every router, and each sends its share to the same cheapest workers. To
// spread such a burst as one router would, a service that has booked j >= 1
// requests in a run, each within Window of the one before, prices its next
// decision as if its peers had just made their bookings of the run too,
// as requests like this one: the first round's where its own first went
// (nothing told them a burst was under way either, so they chose what it
// chose), then (j-1) x Count + Position more, the later rounds' and those
// ahead of it in this one, each on the cheapest candidate, whose cost then
// counts it. The request takes the cheapest after them, ties going to the
// first candidate (in the ranks' order, which every router shares), as the
// peers' were priced. The first request of a run prices none. The sparse decision (CostAuto above
// AutoPredictiveMaxRanks, CostDynamo on a large model) does not spread.
// Stats.Spread counts the decisions that did.
type Peers struct {
	// Count is the number of other routers booking now; 0 turns the
	// spreading off.
	Count int
	// Position is this router's place among all Count+1 (0..Count), the
	// same order on every router (for example, by sorted replica id).
	Position int
	// Window is how long a booking takes to reach the peers (the replica
	// plane's batching interval plus its delivery time); 0 turns the
	// spreading off.
	Window time.Duration
}

// maxSpread bounds the peers' bookings a decision prices, whatever the
// run's length.
const maxSpread = 64

// peerState is a service's Peers, read without a lock.
type peerState struct {
	count, position atomic.Int32
	window          atomic.Int64 // nanoseconds
}

// burst is a partition's run of its own bookings, each within the peers'
// Window of the one before. last and run are updated without a lock: two
// concurrent bookings may count once, which only prices one peer booking
// fewer.
type burst struct {
	last atomic.Int64 // unix nanoseconds of the last booking; 0: none
	run  atomic.Int32
	// firstSet and firstIdx name where the run's first booking went: a
	// candidate index of that rank snapshot.
	firstSet atomic.Pointer[rankSet]
	firstIdx atomic.Int32
}

// SetPeers tells the service of its peers (see Peers). It returns an error
// wrapping ErrInvalidConfig for a negative count or window or a position
// outside 0..Count, and changes nothing.
func (view ReplicaPlane) SetPeers(p Peers) error {
	if p.Count < 0 || p.Position < 0 || p.Position > p.Count || p.Window < 0 || p.Count > 1<<20 {
		return fmt.Errorf("%w: peers %+v: want Count >= 0, 0 <= Position <= Count, Window >= 0", ErrInvalidConfig, p)
	}
	ps := &view.s.routers
	ps.count.Store(int32(p.Count))
	ps.position.Store(int32(p.Position))
	ps.window.Store(int64(p.Window))
	return nil
}

// spreadCount is how many peer bookings a decision at now prices (see
// Peers): mirrored, on the run's first rank, and greedy, on the cheapest.
func (s *SelectionService) spreadCount(p *partition, now int64) (mirrored, greedy int) {
	count, window := int(s.routers.count.Load()), s.routers.window.Load()
	if count == 0 || window == 0 {
		return 0, 0
	}
	last := p.burst.last.Load()
	if last == 0 || now-last > window {
		return 0, 0
	}
	j := int(p.burst.run.Load())
	if j == 0 {
		return 0, 0
	}
	return count, min((j-1)*count+int(s.routers.position.Load()), maxSpread)
}

// booked counts a booking on candidate idx of rs at now into the run.
func (b *burst) booked(now, window int64, rs *rankSet, idx int) {
	if last := b.last.Load(); last != 0 && now-last <= window {
		b.run.Add(1)
	} else {
		b.firstSet.Store(rs)
		b.firstIdx.Store(int32(idx))
		b.run.Store(1)
	}
	b.last.Store(now)
}

// first is the candidate of pool the run's first booking went to, -1 when
// it is not among them (or the ranks changed since).
func (b *burst) first(rs *rankSet, pool []candidate) int {
	if b.firstSet.Load() != rs {
		return -1
	}
	idx := int(b.firstIdx.Load())
	for i := range pool {
		if pool[i].idx == idx {
			return i
		}
	}
	return -1
}

// spread prices peer bookings like pr on copies of the candidates in sim:
// mirrored on pool[first] (none when first is -1), then greedy ones, each on
// the cheapest; it leaves in pool the costs they then have and returns sim
// for reuse.
func spread(pool, sim []candidate, in costInput, w *weights, bs, first, mirrored, greedy int) []candidate {
	sim = append(sim[:0], pool...)
	if first < 0 {
		mirrored = 0
	}
	for k := range mirrored + greedy {
		b := first
		if k >= mirrored {
			b = cheapest(sim)
		}
		c := &sim[b]
		if w.trackPrefill {
			c.activePrefill += int64(in.isl - min(cachedTokens(c, w, bs), in.isl))
		}
		c.activeRequests++
		c.activeBlocks += c.newBlocks
		c.arrivals++
		if w.predictive && w.balanceW > 0 {
			in.meanArrivals += 1 / float64(len(sim))
			for i := range sim {
				sim[i].cost = cost(&sim[i], in, w)
			}
			continue
		}
		c.cost = cost(c, in, w)
	}
	for i := range pool {
		pool[i].cost = sim[i].cost
	}
	return sim
}

// cheapest is the index of the first of the cheapest candidates.
func cheapest(cands []candidate) int {
	b := 0
	for i := 1; i < len(cands); i++ {
		if cands[i].cost < cands[b].cost {
			b = i
		}
	}
	return b
}
