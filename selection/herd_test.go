package selection

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/reservation"
)

// burstOver books n requests of distinct prompts (no worker caches any),
// arriving in the same instant, round-robin over the routers (which share
// nothing within the instant: their bookings have not reached each other),
// and returns how many each worker got.
func burstOver(t *testing.T, routers []*SelectionService, n int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for i := range n {
		s := routers[i%len(routers)]
		r, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(64, 10+i)})
		require.NoError(t, err)
		got[r.WorkerID]++
	}
	return got
}

// newRouters builds n routers on one clock. Told of their peers, each has
// first seen its requests come in same-instant runs (booked and freed), as
// a burst's requests do.
func newRouters(t *testing.T, n int, peers bool) []*SelectionService {
	rs, _ := newRoutersOn(t, newFakeClock(), n, peers, nil)
	return rs
}

// newRoutersOn is newRouters on clk, each router's own bookings observed by
// observe(k) when it is not nil.
func newRoutersOn(t *testing.T, clk *fakeClock, n int, peers bool, observe func(k int) BookingObserver) ([]*SelectionService, *fakeClock) {
	t.Helper()
	var out []*SelectionService
	for k := range n {
		cfg := DefaultConfig(4)
		cfg.UseKVEvents, cfg.Cost = false, CostPredictive
		b := NewSelectionServiceBuilder(cfg).Clock(clk.Now).Rand(rand.NewPCG(1, uint64(k))).SweepInterval(-1)
		if observe != nil {
			b = b.Observe(observe(k))
		}
		s, err := b.Build(context.Background())
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		addWorkers(t, s, "a", "b", "c", "d", "e", "f")
		if peers {
			require.NoError(t, s.Replicas().SetPeers(Peers{Count: n - 1, Position: k, Window: 5 * time.Millisecond}))
			for i := range 64 {
				r, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(64, 1000+i)})
				require.NoError(t, err)
				require.NoError(t, s.Reservations().Free(r.ReservationID))
				if i%4 == 3 {
					clk.Advance(time.Second)
				}
			}
		}
		out = append(out, s)
	}
	clk.Advance(time.Hour) // the burst is a run of its own, the warm-up's recent bookings long decayed
	return out, clk
}

// peerLink hands router from's bookings to its peers window after they
// were made (deliver), as the replicas' sync does.
type peerLink struct {
	net  *peerNet
	from int
}

// peerNet is the routers' sync: bookings in flight to the peers.
type peerNet struct {
	routers []*SelectionService
	clk     *fakeClock
	window  time.Duration
	armed   bool // off during the warm-up, whose bookings stay local
	flight  []flying
}

type flying struct {
	due  time.Time
	from int
	ev   BookingEvent
}

func (l peerLink) Booked(ev BookingEvent) {
	if n := l.net; n.armed {
		ev.SeqHashes = slices.Clone(ev.SeqHashes)
		n.flight = append(n.flight, flying{n.clk.Now().Add(n.window - time.Nanosecond), l.from, ev})
	}
}

func (peerLink) Settled(reservation.ID, Settlement) {}

// deliver books on the peers every booking due by now.
func (n *peerNet) deliver(t *testing.T) {
	rest := n.flight[:0]
	for _, f := range n.flight {
		if f.due.After(n.clk.Now()) {
			rest = append(rest, f)
			continue
		}
		for k, s := range n.routers {
			if k != f.from {
				require.NoError(t, s.Replicas().Book(fmt.Sprint("router-", f.from), f.ev))
			}
		}
	}
	n.flight = rest
}

// holdBurst plays a burst of twelve requests no worker caches, arriving in
// the same instant round-robin over three routers told to hold
// (Peers.Hold), on six idle workers, each booking reaching the peers
// within the window. Each request books Hold after its arrival when
// honour is set, at once otherwise. It returns the requests per worker, the
// routers' sync and the peer bookings they priced during the burst.
func holdBurst(t *testing.T, honour bool) (map[string]int, *peerNet, uint64) {
	const window = 5 * time.Millisecond
	n := &peerNet{clk: newFakeClock(), window: window}
	n.routers, _ = newRoutersOn(t, n.clk, 3, true, func(k int) BookingObserver { return peerLink{net: n, from: k} })
	for k, s := range n.routers {
		require.NoError(t, s.Replicas().SetPeers(Peers{Count: 2, Position: k, Window: window, Hold: true}))
	}
	n.armed = true
	spread := func() (sum uint64) {
		for _, s := range n.routers {
			sum += s.Stats().Spread
		}
		return sum
	}
	before := spread()
	type held struct {
		i    int
		hold time.Duration
	}
	var order []held
	for i := range 12 {
		h := n.routers[i%3].Replicas().Hold("")
		require.Equal(t, time.Duration(i%3)*window, h, "request %d, router %d", i, i%3)
		if !honour {
			h = 0
		}
		order = append(order, held{i, h})
	}
	slices.SortStableFunc(order, func(a, b held) int { return cmp.Compare(a.hold, b.hold) })
	start, got := n.clk.Now(), map[string]int{}
	for _, h := range order {
		n.clk.Advance(start.Add(h.hold).Sub(n.clk.Now()))
		n.deliver(t)
		r, err := n.routers[h.i%3].SelectAndReserve(context.Background(), Request{Tokens: toks(64, 10+h.i)})
		require.NoError(t, err)
		got[r.WorkerID]++
	}
	return got, n, spread() - before
}

// TestPeersHoldABurst: told to hold (Peers.Hold), the routers' requests of a
// burst wait Position x Window (ReplicaPlane.Hold: 0 for router 0's) and
// then see the bookings of the routers ahead: the burst spreads as one
// router's does, two on each worker, where the same routers booking at
// once pile up more on some; no decision prices a peer booking, and
// Stats.Held counts the eight requests told to wait.
func TestPeersHoldABurst(t *testing.T) {
	blind, _, _ := holdBurst(t, false)
	got, n, spread := holdBurst(t, true)
	t.Logf("three booking at once %v; three holding %v", blind, got)
	require.Greater(t, maxOf(blind), 2, "the herd the hold is for")
	require.Equal(t, 2, maxOf(got))
	require.Zero(t, spread, "holding routers price no peer booking")
	var held uint64
	for _, s := range n.routers {
		held += s.Stats().Held
	}
	require.EqualValues(t, 8, held)
	// Still in the burst: a router far down a long list of peers waits
	// 16 windows at most.
	require.NoError(t, n.routers[2].Replicas().SetPeers(Peers{Count: 200, Position: 150, Window: 5 * time.Millisecond, Hold: true}))
	require.Equal(t, 16*5*time.Millisecond, n.routers[2].Replicas().Hold(""))

	// Alone again (one request a minute), nothing waits.
	r1 := n.routers[1]
	for i := range 40 {
		n.clk.Advance(time.Minute)
		r, err := r1.SelectAndReserve(context.Background(), Request{Tokens: toks(64, 100+i)})
		require.NoError(t, err)
		require.NoError(t, r1.Reservations().Free(r.ReservationID))
	}
	n.clk.Advance(time.Minute)
	require.Zero(t, r1.Replicas().Hold(""), "arrivals that stopped coming together hold nothing")
	require.Zero(t, n.routers[0].Replicas().Hold("another-model"), "a model it does not route holds nothing")
}

// TestPeersSpreadABurst: twelve same-instant requests that no worker
// caches, spread round-robin over three routers that cannot see each other's
// bookings yet, meet six idle workers: one router puts two on each; blind,
// the routers pick the same least loaded workers (ties at random) and pile
// up to three or more on one; told of their peers, they part ways on the
// ties of their first requests (their requests have been coming in runs:
// each prices the peers ahead of it) and price their peers' bookings in the
// later ones, and spread the burst as one router does.
func TestPeersSpreadABurst(t *testing.T) {
	one := burstOver(t, newRouters(t, 1, false), 12)
	blind := burstOver(t, newRouters(t, 3, false), 12)
	routers := newRouters(t, 3, true)
	spreadOf := func() (n uint64) {
		for _, s := range routers {
			n += s.Stats().Spread
		}
		return n
	}
	warm := spreadOf()
	told := burstOver(t, routers, 12)
	t.Logf("one router %v; three blind %v; three told %v", one, blind, told)
	require.Equal(t, 2, maxOf(one))
	require.Greater(t, maxOf(blind), 2, "the herd this test is about")
	require.Equal(t, 2, maxOf(told))
	require.EqualValues(t, 11, spreadOf()-warm, "every request of the burst but router 0's first priced its peers'")
}

// TestPeersBurstyRoundZero: once a router's bookings have been coming in
// same-instant runs, the first request of a run prices the bookings of the
// peers ahead of it too; a router whose requests come one at a time prices
// none for them.
func TestPeersBurstyRoundZero(t *testing.T) {
	s, clk := newTestService(t, func(c *Config) { c.Cost = CostPredictive })
	addWorkers(t, s, "a", "b")
	require.NoError(t, s.Replicas().SetPeers(Peers{Count: 2, Position: 2, Window: time.Millisecond}))
	book := func(seed int) {
		_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(16, seed)})
		require.NoError(t, err)
	}
	for i := range 40 { // one at a time
		book(i)
		clk.Advance(2 * time.Millisecond)
	}
	require.Zero(t, s.Stats().Spread, "alone, nothing to price")
	for i := range 40 { // runs of four
		book(100 + i)
		if i%4 == 3 {
			clk.Advance(2 * time.Millisecond)
		}
	}
	before := s.Stats().Spread
	book(500) // the first of a run
	require.Equal(t, before+1, s.Stats().Spread, "bursty: round 0 prices the peers ahead")
}

// TestPeersLearnBurstsFromTheFirst: a router that has just started learns
// from its first burst that its arrivals come together, and holds the first
// request of the next (a share remembered over 32 bookings from the start
// took about 40 bookings to learn it, during which the replicas decided
// their bursts blind: three replicas' TTFT p90 1.10x one router's on the
// replay's multi-turn bursts, 1.00x learning from the first); a router
// whose first requests come apart holds none of its next.
func TestPeersLearnBurstsFromTheFirst(t *testing.T) {
	const window = 5 * time.Millisecond
	start := func() (*SelectionService, *fakeClock) {
		s, clk := newTestService(t, func(c *Config) { c.Cost = CostPredictive })
		addWorkers(t, s, "a", "b")
		require.NoError(t, s.Replicas().SetPeers(Peers{Count: 2, Position: 1, Window: window, Hold: true}))
		return s, clk
	}
	book := func(s *SelectionService, seed int) {
		r, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(16, seed)})
		require.NoError(t, err)
		require.NoError(t, s.Reservations().Free(r.ReservationID))
	}

	s, clk := start()
	require.Zero(t, s.Replicas().Hold(""), "nothing learnt yet: no hold")
	for i := range 3 { // one burst
		book(s, i)
	}
	clk.Advance(3 * time.Second)
	require.Equal(t, window, s.Replicas().Hold(""), "the next burst's first request waits for the router ahead")

	s, clk = start()
	for i := range 3 { // one at a time
		book(s, i)
		clk.Advance(time.Second)
	}
	require.Zero(t, s.Replicas().Hold(""))
}

// TestPeersAloneChangeNothing: a router without peers prices no peer
// booking.
func TestPeersAloneChangeNothing(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { c.Cost = CostPredictive })
	addWorkers(t, s, "a", "b")
	require.NoError(t, s.Replicas().SetPeers(Peers{Count: 2, Position: 1, Window: time.Millisecond}))
	require.NoError(t, s.Replicas().SetPeers(Peers{}))
	for i := range 3 {
		_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(16, 10+i)})
		require.NoError(t, err)
	}
	require.Zero(t, s.Stats().Spread)
}

// TestSetPeersRefused: a position outside the routers, or a negative count
// or window, is refused by name and changes nothing.
func TestSetPeersRefused(t *testing.T) {
	s, _ := newTestService(t, nil)
	require.NoError(t, s.Replicas().SetPeers(Peers{Count: 1, Position: 1, Window: time.Millisecond}))
	for _, p := range []Peers{{Count: -1}, {Count: 1, Position: 2}, {Count: 1, Position: -1}, {Count: 1, Window: -1}} {
		err := s.Replicas().SetPeers(p)
		require.ErrorIs(t, err, ErrInvalidConfig, fmt.Sprint(p))
	}
	require.EqualValues(t, 1, s.routers.position.Load(), "unchanged")
}

func maxOf(m map[string]int) int {
	best := 0
	for _, v := range m {
		best = max(best, v)
	}
	return best
}
