package selection

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
)

// A booking moved by id with its session moves the session's pin too, as
// Booking.Move does; Reservations.Move, which knows no session, leaves the pin.
func TestMoveSessionReservationMovesThePin(t *testing.T) {
	cfg := DefaultConfig(4)
	cfg.UseKVEvents = false
	cfg.Sessions.Mode = SessionHard
	s, err := NewSelectionServiceBuilder(cfg).Clock(newFakeClock().Now).SweepInterval(-1).Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	addWorkers(t, s, "a", "b", "c")

	first, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(8, 1), SessionID: "s1", Allowed: []string{"a"}})
	require.NoError(t, err)
	require.NoError(t, s.Reservations().Move(first.ReservationID, catalog.WorkerRank{WorkerID: "c"}, ""))
	require.Equal(t, 1, loadOf(t, s, "c").ActiveRequests)
	again, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(4, 2), SessionID: "s1"})
	require.NoError(t, err)
	require.Equal(t, "a", again.WorkerID, "MoveReservation leaves the pin where it was booked")

	require.NoError(t, s.Reservations().Move(again.ReservationID, catalog.WorkerRank{WorkerID: "b"}, "s1"))
	require.Equal(t, 1, loadOf(t, s, "b").ActiveRequests)
	require.Zero(t, loadOf(t, s, "a").ActiveRequests)
	next, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(4, 3), SessionID: "s1"})
	require.NoError(t, err)
	require.Equal(t, "b", next.WorkerID, "the pin followed the move")

	require.ErrorIs(t, s.Reservations().Move("gone", catalog.WorkerRank{WorkerID: "b"}, "s1"), ErrUnknownReservation)
	require.ErrorIs(t, s.Reservations().Move(next.ReservationID, catalog.WorkerRank{WorkerID: "nope"}, "s1"), ErrNotFound)
	for _, id := range []reservation.ID{first.ReservationID, again.ReservationID, next.ReservationID} {
		require.NoError(t, s.Reservations().Free(id))
	}
	requireIdle(t, s)
}
