package reservation

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestAddOutputBlocks(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	a := wr("a", 0)
	require.NoError(t, l.Book(Booking{ID: "r1", Worker: a, SeqHashes: []uint64{1, 2}, PrivateBlocks: 1, PrefillTokens: 40}))
	require.Equal(t, 3, l.Load(a).ActiveBlocks)
	require.NoError(t, l.AddOutputBlocks("r1", 2))
	require.NoError(t, l.AddOutputBlocks("r1", 0))
	require.Equal(t, 5, l.Load(a).ActiveBlocks, "output blocks count as the booking's own")
	got, ok := l.get("r1")
	require.True(t, ok)
	require.Equal(t, 3, got.PrivateBlocks)
	require.ErrorIs(t, l.AddOutputBlocks("r1", -1), ErrInvalid)
	require.ErrorIs(t, l.AddOutputBlocks("nope", 1), ErrUnknownReservation)
	require.NoError(t, l.Free("r1"))
	require.Zero(t, l.Load(a).ActiveBlocks, "Free removes the output blocks too")
	require.ErrorIs(t, l.AddOutputBlocks("r1", 1), ErrUnknownReservation)
	st := l.Stats()
	require.EqualValues(t, 2, st.OutputBlocks)
	require.EqualValues(t, 2, st.UnknownIDs)
}

// Move carries everything a booking holds to another rank, shared blocks
// keep their other holders' references, and the lease deadline stays.
func TestMove(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now, DefaultLease: time.Minute})
	a, b := wr("a", 0), wr("b", 1)
	require.NoError(t, l.Book(Booking{ID: "keep", Worker: a, SeqHashes: []uint64{1}}))
	require.NoError(t, l.Book(Booking{ID: "r1", Worker: a, SeqHashes: []uint64{1, 2, 3}, PrivateBlocks: 1, PrefillTokens: 40, ExpectedOutputTokens: 7}))
	require.NoError(t, l.AddOutputBlocks("r1", 2))
	clk.Advance(20 * time.Second)

	moved, err := l.Move("r1", b)
	require.NoError(t, err)
	require.Equal(t, b, moved.Worker)
	require.ElementsMatch(t, []uint64{1, 2, 3}, moved.SeqHashes)
	require.Equal(t, 3, moved.PrivateBlocks)
	require.Equal(t, 40, moved.PrefillTokens)
	require.Equal(t, 7, moved.ExpectedOutputTokens)
	h, ok := l.Holder("r1")
	require.True(t, ok)
	require.Equal(t, b, h)

	require.Equal(t, Load{ActiveRequests: 1, ActiveBlocks: 1}, l.Load(a), "only the other booking's block is left")
	require.Equal(t, Load{ActiveRequests: 1, ActiveBlocks: 6, ActivePrefillTokens: 40}, l.Load(b))

	// The prefill, once complete, does not move again; the deadline is the
	// original one (booked 20 s before the move, a minute's lease).
	require.NoError(t, l.PrefillComplete("r1"))
	back, err := l.Move("r1", a)
	require.NoError(t, err)
	require.Zero(t, back.PrefillTokens)
	require.NoError(t, l.PrefillComplete("r1"), "still complete: a second call is a no-op")
	require.Equal(t, Load{ActiveRequests: 2, ActiveBlocks: 6}, l.Load(a))
	same, err := l.Move("r1", a)
	require.NoError(t, err, "moving to its holder changes nothing")
	require.Equal(t, a, same.Worker)

	clk.Advance(39 * time.Second)
	require.Zero(t, l.Expire(clk.Now()))
	clk.Advance(time.Second)
	require.Equal(t, 2, l.Expire(clk.Now()), "r1 expires at its original deadline, with keep")

	_, err = l.Move("r1", b)
	require.ErrorIs(t, err, ErrUnknownReservation)
	_, err = l.Move("keep", wr("", 0))
	require.ErrorIs(t, err, ErrInvalid)
	_, ok = l.Holder("r1")
	require.False(t, ok)

	st := l.Stats()
	require.EqualValues(t, 2, st.Moved)
	require.EqualValues(t, 2, st.Booked, "a move is not a booking")
	require.EqualValues(t, 1, st.PrefillCompleted)
	require.Equal(t, st.Booked, st.Freed+st.Expired+st.Removed+st.Active)
	require.Empty(t, l.loads())
}
