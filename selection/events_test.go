package selection

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/reservation"
)

// TestRoutesToTheEngineHoldingThePrefix runs the real ZeroMQ feed against fake
// engines: a request goes to the engine that cached its prefix, unless that
// engine is busy, in which case it goes elsewhere.
func TestRoutesToTheEngineHoldingThePrefix(t *testing.T) {
	th := 1.0
	cfg := DefaultConfig(4)
	cfg.QueueThreshold = &th
	clk := newFakeClock()
	s, err := NewSelectionServiceBuilder(cfg).Clock(clk.Now).Rand(rand.NewPCG(3, 3)).SweepInterval(-1).
		EventFeed(FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond}).Build(context.Background())
	require.NoError(t, err)
	defer s.Close()

	var engines []*fakeengine.Engine
	for i := range 3 {
		e, err := fakeengine.New(fakeengine.Options{BlockSize: 4, CapacityBlocks: 256, EnableReplay: true})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		require.NoError(t, e.Start(ctx))
		cancel()
		defer e.Close()
		engines = append(engines, e)
		rec, err := s.Workers().Upsert(catalog.Worker{
			ID: fmt.Sprintf("e%d", i), Endpoint: fmt.Sprintf("127.0.0.%d:8000", i+1), DPSize: 1, BlockSize: 4,
			MaxNumBatchedTokens: 64, KVEventEndpoints: map[int]string{0: e.PubEndpoint()}, ReplayEndpoint: e.ReplayEndpoint(),
		})
		require.NoError(t, err)
		require.Equal(t, catalog.Schedulable, rec.Lifecycle, rec.Reasons)
	}
	for _, e := range engines { // a PUB drops what it sends before the SUB subscribed
		require.NoError(t, e.WaitSubscribed(context.Background()))
	}
	prompt := toks(48, 42) // 12 blocks
	// Engine 1 serves the prompt: its cache now holds it and it says so.
	_, err = engines[1].Serve(fakeengine.Request{Tokens: prompt})
	require.NoError(t, err)
	h, _ := kvindex.NewHasher(4, kvindex.HashOptions{})
	require.Eventually(t, func() bool {
		ov, err := overlapScores(s, context.Background(), Request{Tokens: prompt})
		return err == nil && ov[catalog.WorkerRank{WorkerID: "e1"}].Device == len(h.SeqHashes(prompt))
	}, 20*time.Second, 2*time.Millisecond)
	require.NotEmpty(t, s.Events().Sources())

	res, err := s.SelectAndReserve(context.Background(), Request{ReservationID: "hit", Tokens: prompt})
	require.NoError(t, err)
	require.Equal(t, "e1", res.WorkerID)
	require.Equal(t, 12, res.Overlap.Device)
	require.Zero(t, res.EffectivePrefillTokens)

	// Make e1 busy (above 1.0 x 64 prefill tokens): the same prompt now goes to
	// an idle engine even though e1 holds it.
	_, err = s.SelectAndReserve(context.Background(), Request{ReservationID: "load", Tokens: toks(100, 7), Allowed: []string{"e1"}})
	require.NoError(t, err)
	res2, err := s.SelectAndReserve(context.Background(), Request{ReservationID: "miss", Tokens: prompt})
	require.NoError(t, err)
	require.NotEqual(t, "e1", res2.WorkerID)
	for _, id := range []string{"hit", "load", "miss"} {
		require.NoError(t, s.Reservations().Free(reservation.ID(id)))
	}

	// Deleting the worker removes its index state; its late events are refused.
	_, err = s.Workers().Delete("e1")
	require.NoError(t, err)
	ov, err := overlapScores(s, context.Background(), Request{Tokens: prompt})
	require.NoError(t, err)
	require.Zero(t, ov[catalog.WorkerRank{WorkerID: "e1"}].Device)
	_, err = engines[1].Serve(fakeengine.Request{Tokens: toks(16, 9)})
	require.NoError(t, err)
	require.Zero(t, s.partition("").index.Stats().WorkerRanks, "only e1 ever held blocks")
}
