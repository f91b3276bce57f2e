package selection

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
)

// A rank's cache pressure is the share of its recently stored device blocks
// that removals matched, 0 until 16 blocks weigh in it, at most 1.
func TestRankPressure(t *testing.T) {
	var r rankPressure
	r.event(8, 0)
	r.event(0, 8)
	require.Zero(t, r.load(), "8 stored blocks are too few to judge")
	r.event(32, 0) // each event keeps 0.98 of the counts before it
	stored, removed := 8*0.98*0.98+32, 8*0.98
	require.InDelta(t, removed/stored, r.load(), 1e-12)
	r.event(0, 20)
	require.InDelta(t, (removed*0.98+20)/(stored*0.98), r.load(), 1e-12)
	r.event(0, 1000)
	require.Equal(t, 1.0, r.load(), "a share, at most 1")
	r.reset()
	require.Zero(t, r.load())
	require.Zero(t, (*rankPressure)(nil).load())
}

// TestCachePressureKeepsAPrefixWhereItIsCached: the predictive cost moves
// a request whose prefix only a busy worker caches to an idle one (computing
// it there is quicker), unless the idle one's cache runs full: computing it
// there evicts what that cache holds, and the request stays. The pressure
// comes from the engines' own events (stored, then removed, blocks), shows
// in Loads, and a cleared cache forgets it.
func TestCachePressureKeepsAPrefixWhereItIsCached(t *testing.T) {
	prompt := toks(64, 1) // 16 blocks of 4
	for _, tc := range []struct {
		name   string
		full   bool
		weight float64
		want   string
	}{
		{"caches with room", false, DefaultPredictiveEvictionWeight, "b"},
		{"b's cache full", true, DefaultPredictiveEvictionWeight, "a"},
		{"b's cache full, eviction weight 0", true, 0, "b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig(4)
			cfg.Cost, cfg.InFlightHitWeight = CostPredictive, 0
			cfg.Predictive.PrefillTokensPerSecond, cfg.Predictive.FixedRate = 1000, true
			cfg.Predictive.BalanceWeight, cfg.Predictive.EvictionWeight = 0, tc.weight
			s, clk, h := newEventService(t, cfg, "a", "b")
			a, b := catalog.WorkerRank{WorkerID: "a"}, catalog.WorkerRank{WorkerID: "b"}
			require.NoError(t, s.Events().Apply(a,
				kvindex.Event{Kind: kvindex.EventStored, BlockHashes: h.AppendSeqHashes(nil, prompt[:60]), Tokens: prompt[:60]}))
			if tc.full {
				// b stores 20 blocks of other prompts and its engine evicts as many.
				other := toks(80, 9)
				hs := h.AppendSeqHashes(nil, other)
				require.NoError(t, s.Events().Apply(b, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: hs, Tokens: other}))
				require.NoError(t, s.Events().Apply(b, kvindex.Event{Kind: kvindex.EventRemoved, BlockHashes: hs}))
			}
			pressure := map[string]float64{}
			for _, l := range s.Loads("") {
				pressure[l.WorkerID] = l.CachePressure
			}
			require.Zero(t, pressure["a"])
			if tc.full {
				require.Equal(t, 1.0, pressure["b"])
			} else {
				require.Zero(t, pressure["b"])
			}
			// 100 ms of prefill queued on a; on a the request then costs 4
			// tokens more, on b 64 (and, full, what they evict).
			_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(100, 7), Allowed: []string{"a"}})
			require.NoError(t, err)
			clk.Advance(time.Millisecond)
			got, err := s.Select(context.Background(), Request{Tokens: prompt})
			require.NoError(t, err)
			require.Equal(t, tc.want, got.WorkerID, "cost %v", got.Cost)

			require.NoError(t, s.Events().Apply(b, kvindex.Event{Kind: kvindex.EventCleared}))
			for _, l := range s.Loads("") {
				require.Zero(t, l.CachePressure, "%s: a cleared cache starts afresh", l.WorkerID)
			}
		})
	}
}
