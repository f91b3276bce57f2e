package selection

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// burstOver books n requests that share a prefix "a" caches, arriving in
// the same instant, round-robin over the routers (which share nothing
// within the instant: their bookings have not reached each other), and
// returns how many each worker got.
func burstOver(t *testing.T, routers []*SelectionService, clk *fakeClock, n int) map[string]int {
	t.Helper()
	prefix := toks(64, 1)
	for _, s := range routers {
		addWorkers(t, s, "a", "b", "c", "d")
		warm, err := s.SelectAndReserve(context.Background(), Request{Tokens: prefix, Allowed: []string{"a"}})
		require.NoError(t, err)
		require.NoError(t, s.Reservations().Free(warm.ReservationID))
	}
	clk.Advance(time.Second) // the warm-up is not part of the burst
	got := map[string]int{}
	for i := range n {
		s := routers[i%len(routers)]
		r, err := s.SelectAndReserve(context.Background(), Request{Tokens: append(append([]uint32(nil), prefix...), toks(32, 10+i)...)})
		require.NoError(t, err)
		got[r.Worker]++
	}
	return got
}

func newRouters(t *testing.T, n int, peers bool) ([]*SelectionService, *fakeClock) {
	t.Helper()
	clk := newFakeClock() // one instant for the whole burst
	var out []*SelectionService
	for k := range n {
		cfg := DefaultConfig(4)
		cfg.UseKVEvents, cfg.Cost = false, CostPredictive
		s, err := NewSelectionServiceBuilder(cfg).Clock(clk.Now).Rand(rand.NewPCG(1, uint64(k))).SweepInterval(-1).Build(context.Background())
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		if peers {
			require.NoError(t, s.Replicas().SetPeers(Peers{Count: n - 1, Position: k, Window: 5 * time.Millisecond}))
		}
		out = append(out, s)
	}
	return out, clk
}

func maxOf(m map[string]int) int {
	best := 0
	for _, v := range m {
		best = max(best, v)
	}
	return best
}

// TestPeersSpreadABurst: twelve same-instant requests with a prefix one
// worker caches, spread round-robin over three routers that cannot see
// each other's bookings yet, herd onto the same workers (9 of 12 on the
// cached one, where one router puts 3 on each); told of their peers, the
// routers spread them much as one router does (at most 5 on one worker:
// the peers' bookings are priced as requests like the router's own, which
// they only resemble).
func TestPeersSpreadABurst(t *testing.T) {
	routers, clk := newRouters(t, 1, false)
	one := burstOver(t, routers, clk, 12)
	routers, clk = newRouters(t, 3, false)
	blind := burstOver(t, routers, clk, 12)
	routers, clk = newRouters(t, 3, true)
	told := burstOver(t, routers, clk, 12)
	t.Logf("one router %v; three blind %v; three told %v", one, blind, told)
	require.Greater(t, maxOf(blind), maxOf(one)+1, "the herd this test is about")
	require.LessOrEqual(t, maxOf(told), maxOf(one)+2)
	require.Less(t, maxOf(told), maxOf(blind)-2)
	var spread uint64
	for _, s := range routers {
		spread += s.Stats().Spread
	}
	require.EqualValues(t, 9, spread, "every request but each router's first priced its peers'")
}

// TestPeersAloneChangeNothing: a router whose last booking is older than
// the window, or that has no peers, prices no peer booking: its decisions
// are those of a router without replicas.
func TestPeersAloneChangeNothing(t *testing.T) {
	s, clk := newTestService(t, func(c *Config) { c.Cost = CostPredictive })
	addWorkers(t, s, "a", "b")
	require.NoError(t, s.Replicas().SetPeers(Peers{Count: 2, Position: 2, Window: time.Millisecond}))
	for i := range 5 {
		_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(16, i)})
		require.NoError(t, err)
		clk.Advance(2 * time.Millisecond)
	}
	require.Zero(t, s.Stats().Spread)
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
