package selection

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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
	t.Helper()
	clk := newFakeClock()
	var out []*SelectionService
	for k := range n {
		cfg := DefaultConfig(4)
		cfg.UseKVEvents, cfg.Cost = false, CostPredictive
		s, err := NewSelectionServiceBuilder(cfg).Clock(clk.Now).Rand(rand.NewPCG(1, uint64(k))).SweepInterval(-1).Build(context.Background())
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
	return out
}

func maxOf(m map[string]int) int {
	best := 0
	for _, v := range m {
		best = max(best, v)
	}
	return best
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
