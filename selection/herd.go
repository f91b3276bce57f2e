package selection

import (
	"fmt"
	"math"
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
// every router, and where a request has no cached prefix to go to, each
// router sends it to the same least loaded workers. To spread a burst as
// one router would, a router prices each decision as if the requests of the
// instant had been booked in turn, round-robin over the routers in Position
// order: before its own, Count bookings of its peers for every earlier round
// of its run (its own bookings each within Window of the one before; the
// first request of a run is round 0) and, when its arrivals have been coming
// together (at least half of its recent bookings within Window of the one
// before), Position more for the peers ahead of it in this round. Each is
// priced as a request of this one's length that no worker caches (a peer's
// request has a prefix of its own: what it shares with this one is its
// load) on the cheapest candidate, whose cost then counts it; ties go to
// the first candidate in the ranks' order, which every router shares, and
// so does the router's own pick in a burst, after them (not at random), so
// that what each prices is what the others book. The sparse decision (CostAuto above
// AutoPredictiveMaxRanks, CostDynamo on a large model) does not spread.
// Stats.Spread counts the decisions that priced peers' bookings.
//
// Measured on the replay with same-instant batches of 10 over three
// replicas (docs/ROUTING.md), it brings their TTFT p90 closer to one
// router's on multi-turn, RAG, mixed and bursty traffic, and leaves steady
// traffic as it was; on agent loops, whose bursts share a hot prefix, it
// does worse than deciding blind.
//
// With Hold set, a router does not guess: a request of a burst waits
// Position x Window from its arrival before it books (ReplicaPlane.Hold
// says how long; the caller waits), so that the bookings of the routers
// ahead of it in Position order have reached it, and the routers after it
// will see its own. The routers then decide a burst in turn, as one router
// would, at the price of up to Count x Window more time to first token for
// the requests of a burst (none for the router at Position 0, none outside
// bursts).
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
	// Hold: a request of a burst waits for the peers ahead of this router
	// (ReplicaPlane.Hold) instead of pricing their likely bookings.
	Hold bool
}

// maxSpread bounds the peers' bookings a decision prices, whatever the
// run's length.
const maxSpread = 64

// maxHoldWindows bounds a hold (ReplicaPlane.Hold) at this many Windows,
// whatever the router's Position: the routers past it decide a burst
// together, as routers that do not hold do, rather than keep its requests
// waiting for long.
const maxHoldWindows = 16

// peerState is a service's Peers, read without a lock.
type peerState struct {
	count, position atomic.Int32
	window          atomic.Int64 // nanoseconds
	hold            atomic.Bool
}

// burst is a partition's run of its own bookings, each within the peers'
// Window of the one before. last and run are updated without a lock: two
// concurrent bookings may count once, which only prices one peer booking
// fewer.
type burst struct {
	last atomic.Int64 // unix nanoseconds of the last booking; 0: none
	run  atomic.Int32
	// bursty is the recent share of bookings made within Window of the one
	// before (float64 bits): the mean of the first burstyMemory of them,
	// then each weighing 1/burstyMemory, so that a router learns from its
	// first burst that its arrivals come together. seen counts the bookings
	// folded in, up to burstyMemory.
	bursty atomic.Uint64
	seen   atomic.Int32
}

// burstyMemory is about how many bookings burst.bursty remembers.
const burstyMemory = 32

// SetPeers tells the service of its peers (see Peers). It returns an error
// wrapping ErrInvalidConfig for a negative count or window or a position
// outside 0..Count, and changes nothing.
func (view ReplicaPlane) SetPeers(p Peers) error {
	if p.Count < 0 || p.Count > 1<<20 || p.Position < 0 || p.Position > p.Count || p.Window < 0 {
		return fmt.Errorf("%w: peers %+v: want 0 <= Count, 0 <= Position <= Count, Window >= 0", ErrInvalidConfig, p)
	}
	ps := &view.s.routers
	ps.count.Store(int32(p.Count))
	ps.position.Store(int32(p.Position))
	ps.window.Store(int64(p.Window))
	ps.hold.Store(p.Hold)
	return nil
}

// Hold is how long a request for model arriving now should wait before it
// books, when the peers hold (Peers.Hold): Position x Window, at most 16
// Windows, in a burst (a
// run of this router's bookings goes on, or its arrivals have been coming
// together; see Peers), else 0. The caller waits, then books; a caller
// that books without waiting decides blind, since a holding service
// prices none of the peers' bookings.
func (view ReplicaPlane) Hold(model string) time.Duration {
	s := view.s
	if !s.routers.hold.Load() {
		return 0
	}
	p := s.partition(model)
	if p == nil {
		return 0
	}
	if _, inBurst := s.burstRound(p, s.now().UnixNano()); !inBurst {
		return 0
	}
	d := time.Duration(min(s.routers.position.Load(), maxHoldWindows)) * time.Duration(s.routers.window.Load())
	if d > 0 {
		s.st.held.Add(1)
	}
	return d
}

// spreadCount is how many peer bookings a decision at now prices (see
// Peers), and whether it is in a burst: of its run's second round or later,
// or of a router whose arrivals have been coming together. A decision in a
// burst breaks ties as the peers' bookings were priced, whether it prices
// some or, first of all, none. With Peers.Hold the decision prices none
// and breaks ties as a router alone does: it waited for the peers'
// bookings.
func (s *SelectionService) spreadCount(p *partition, now int64) (n int, inBurst bool) {
	if s.routers.hold.Load() {
		return 0, false
	}
	round, inBurst := s.burstRound(p, now)
	if !inBurst {
		return 0, false
	}
	return min(round*int(s.routers.count.Load())+int(s.routers.position.Load()), maxSpread), true
}

// burstRound is a decision's round in its router's run of bookings at now
// (0 for the first of a run), and whether it is in a burst (see
// spreadCount).
func (s *SelectionService) burstRound(p *partition, now int64) (round int, inBurst bool) {
	count, window := int(s.routers.count.Load()), s.routers.window.Load()
	if count == 0 || window == 0 {
		return 0, false
	}
	if last := p.burst.last.Load(); last != 0 && now-last <= window {
		round = int(p.burst.run.Load())
	}
	if round == 0 && math.Float64frombits(p.burst.bursty.Load()) < 0.5 {
		return 0, false // arrivals have not been coming together: likely alone
	}
	return round, true
}

// booked counts a booking at now into the run. The first booking of all
// has no booking before it to be near, and teaches the share nothing.
func (b *burst) booked(now, window int64) {
	within := 0.0
	last := b.last.Load()
	if last != 0 && now-last <= window {
		b.run.Add(1)
		within = 1
	} else {
		b.run.Store(1)
	}
	b.last.Store(now)
	if last == 0 {
		return
	}
	n := b.seen.Load()
	if n < burstyMemory {
		n++
		b.seen.Store(n)
	}
	v := math.Float64frombits(b.bursty.Load())
	b.bursty.Store(math.Float64bits(v + (within-v)/float64(n)))
}

// spread prices n peer bookings (see Peers) on copies of pool's candidates
// in sim and leaves in pool the costs they then have. It returns sim for
// reuse.
func spread(pool, sim []candidate, in costInput, w *weights, n int) []candidate {
	sim = append(append(sim[:0], pool...), pool...)
	warm, cold := sim[:len(pool)], sim[len(pool):] // cold: the same candidates, caching nothing
	for i := range cold {
		c := &cold[i]
		c.device, c.host, c.disk, c.pending = 0, 0, 0, 0
		c.cost = cost(c, &in, w)
	}
	var own int64
	if w.trackPrefill {
		own = int64(in.isl)
	}
	for range n {
		b := cheapest(cold)
		for _, c := range [2]*candidate{&warm[b], &cold[b]} {
			c.activePrefill += own
			c.activeRequests++
			c.activeBlocks += c.newBlocks
			c.arrivals++
		}
		if w.predictive && w.balanceW > 0 { // the mean moved: every balance term
			in.meanArrivals += 1 / float64(len(pool))
			for i := range pool {
				warm[i].cost, cold[i].cost = cost(&warm[i], &in, w), cost(&cold[i], &in, w)
			}
			continue
		}
		warm[b].cost, cold[b].cost = cost(&warm[b], &in, w), cost(&cold[b], &in, w)
	}
	for i := range pool {
		pool[i].cost = warm[i].cost
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
