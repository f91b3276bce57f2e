package selection

import (
	"context"
	"testing"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/stretchr/testify/require"
)

// A request whose prefix another request is prefilling on a worker (booked,
// not yet in the index) follows it there with the in-flight credit, and goes
// to the idle worker without it.
func TestInFlightHitWeight(t *testing.T) {
	for _, w := range []float64{0, 1} {
		cfg := DefaultConfig(4)
		cfg.InFlightHitWeight = w
		s, err := NewSelectionServiceBuilder(cfg).ExternalEvents().Clock(newFakeClock().Now).SweepInterval(-1).Build(context.Background())
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		addWorkers(t, s, "a", "b")
		prompt := toks(64, 1)
		first, err := s.SelectAndReserve(context.Background(), Request{Tokens: prompt, Allowed: []string{"a"}})
		require.NoError(t, err)
		next, err := s.Select(context.Background(), Request{Tokens: append(prompt[:60:60], 7, 7, 7, 7)})
		require.NoError(t, err)
		if w == 0 {
			require.Equal(t, "b", next.WorkerID, "without the credit, the loaded worker loses")
		} else {
			require.Equal(t, first.WorkerID, next.WorkerID, "the prefix being computed on a draws the next request")
			require.Zero(t, next.Overlap.Device, "the index itself holds nothing yet")
		}
	}
	cfg := DefaultConfig(4)
	cfg.InFlightHitWeight = 1.5
	require.ErrorIs(t, cfg.Validate(), ErrInvalidConfig)
	require.Equal(t, DefaultInFlightHitWeight, DefaultConfig(4).InFlightHitWeight)
	require.Zero(t, DynamoConfig(4).InFlightHitWeight, "Dynamo has no such credit")
}

// With credit decay, a cached worker whose queued prefill exceeds the least
// loaded candidate's gets less credit for its cache; the least loaded keeps
// all of it.
func TestOverlapCreditDecay(t *testing.T) {
	costs := func(decay float64) map[string]float64 {
		cfg := DefaultConfig(4)
		cfg.OverlapCreditDecay, cfg.InFlightHitWeight = decay, 0
		cfg.Cost = CostDynamo // the decay is Dynamo's cost's
		s, err := NewSelectionServiceBuilder(cfg).ExternalEvents().Clock(newFakeClock().Now).SweepInterval(-1).Build(context.Background())
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		addWorkers(t, s, "a", "b", "c")
		prompt := toks(32, 1)
		h, _ := kvindex.NewHasher(4, kvindex.HashOptions{})
		hashes := h.AppendSeqHashes(nil, prompt)
		for _, w := range []string{"a", "b"} {
			require.NoError(t, s.Events().Apply(catalog.WorkerRank{WorkerID: w}, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: hashes, Tokens: prompt}))
		}
		_, err = s.SelectAndReserve(context.Background(), Request{Tokens: toks(40, 9), Allowed: []string{"a"}})
		require.NoError(t, err)
		return costsOf(t, s, Request{Tokens: prompt})
	}
	off, on := costs(0), costs(1)
	require.Greater(t, on["a"], off["a"], "the loaded cached worker's credit decays")
	require.Equal(t, off["b"], on["b"], "the idle cached worker keeps its credit")
	require.Equal(t, off["c"], on["c"])
	cfg := DefaultConfig(4)
	cfg.OverlapCreditDecay = -1
	require.ErrorIs(t, cfg.Validate(), ErrInvalidConfig)
}
