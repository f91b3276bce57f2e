package selection

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/kvindex/kvevents"
)

func TestEventsOfMadeUpRanksAndOverfullRanksAreRefused(t *testing.T) {
	s, err := NewSelectionServiceBuilder(DefaultConfig(1)).ExternalEvents().SweepInterval(-1).Build(context.Background())
	require.NoError(t, err)
	defer s.Close()
	_, err = s.Workers().Upsert(catalog.Worker{ID: "w", Endpoint: "10.0.0.1:8000", DPStart: 2, DPSize: 2, BlockSize: 1, TotalKVBlocks: 2})
	require.NoError(t, err)
	store := func(rank int, hs ...uint64) error {
		toks := make([]uint32, len(hs))
		for i, h := range hs {
			toks[i] = uint32(h)
		}
		return s.Events().Apply(catalog.WorkerRank{WorkerID: "w", Rank: rank}, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: hs, Tokens: toks})
	}
	for _, r := range []int{0, 1, 4, 30000} {
		require.ErrorIs(t, store(r, 1), kvevents.ErrUnknownRank, "rank %d", r)
	}
	require.NoError(t, store(2, 1, 2, 3))
	require.NoError(t, store(3, 1, 2, 3))
	// TotalKVBlocks 2: each rank may hold 4 x 2 blocks per tier.
	require.NoError(t, store(2, 4, 5, 6, 7, 8))
	require.ErrorIs(t, store(2, 9), kvindex.ErrRankFull)

	// A worker that shrinks loses its upper ranks.
	_, err = s.Workers().Upsert(catalog.Worker{ID: "w", Endpoint: "10.0.0.1:8000", DPStart: 2, DPSize: 1, BlockSize: 1})
	require.NoError(t, err)
	require.ErrorIs(t, store(3, 10), kvevents.ErrUnknownRank)
	require.NoError(t, store(2, 9), "no declared capacity: the default limit")
}

func TestCancelledCallerBooksNothing(t *testing.T) {
	s, err := NewSelectionServiceBuilder(DefaultConfig(1)).ExternalEvents().SweepInterval(-1).Build(context.Background())
	require.NoError(t, err)
	defer s.Close()
	_, err = s.Workers().Upsert(catalog.Worker{ID: "w", Endpoint: "10.0.0.1:8000", DPSize: 1, BlockSize: 1})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = s.SelectAndReserve(ctx, Request{ReservationID: "r", Tokens: []uint32{1, 2}})
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, s.Reservations().Free("r"), ErrUnknownReservation, "nothing was booked")
}
