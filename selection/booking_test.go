package selection

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

// A Booking settles its reservation once, whatever the number of calls and
// goroutines, and never counts an unknown id for its own repeats.
func TestBookingSettlesOnce(t *testing.T) {
	s, _ := newTestService(t, nil)
	addWorkers(t, s, "a", "b")
	b, err := s.Book(context.Background(), Request{Tokens: toks(12, 1)})
	require.NoError(t, err)
	require.NotEmpty(t, b.ReservationID, "an id is minted")
	require.NotEmpty(t, b.Endpoint)

	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			_ = b.PrefillComplete()
			_ = b.Done()
		})
	}
	wg.Wait()
	require.NoError(t, b.PrefillComplete())
	require.NoError(t, b.Done())
	st := s.Stats()
	require.Equal(t, uint64(1), st.Frees)
	require.LessOrEqual(t, st.PrefillCompleted, uint64(1))
	require.Zero(t, st.UnknownReservations, "repeats on a handle are not unknown ids")
	require.ErrorIs(t, b.Renew(), ErrUnknownReservation)
	requireIdle(t, s)
}

// Renew keeps a live request's load past its first lease; without it the
// sweeper releases it.
func TestBookingRenewExtendsLease(t *testing.T) {
	s, clk := newTestService(t, func(c *Config) { c.ActiveRequestExpiry = time.Minute })
	addWorkers(t, s, "a")
	long, err := s.Book(context.Background(), Request{Tokens: toks(8, 1)})
	require.NoError(t, err)
	short, err := s.Book(context.Background(), Request{Tokens: toks(8, 2)})
	require.NoError(t, err)
	clk.Advance(50 * time.Second)
	require.NoError(t, long.Renew())
	clk.Advance(20 * time.Second)
	require.Equal(t, 1, s.ExpireReservations(), "only the booking that was not renewed")
	require.Equal(t, 1, s.Loads("")[0].ActiveRequests)
	require.ErrorIs(t, short.Done(), ErrUnknownReservation, "expired before its end")
	require.NoError(t, long.Done())
	requireIdle(t, s)
	require.ErrorIs(t, s.RenewReservation("nope"), ErrUnknownReservation)
}

// A worker registered without what it needs is named, with its reasons, by
// the error of the first request; a worker without a block size takes the
// service's.
func TestNotReadySaysWhy(t *testing.T) {
	s, _ := newTestService(t, nil)
	w := worker("a", nil)
	w.BlockSize = 0
	rec, err := s.UpsertWorker(w)
	require.NoError(t, err)
	require.Equal(t, catalog.Schedulable, rec.Lifecycle, "block size inherited: %v", rec.Reasons)
	require.Equal(t, 4, rec.Worker.BlockSize)

	bad := worker("b", nil)
	bad.Model, bad.DPSize = "m1", 0
	rec, err = s.UpsertWorker(bad)
	require.NoError(t, err)
	require.NotEqual(t, catalog.Schedulable, rec.Lifecycle)
	_, err = s.SelectAndReserve(context.Background(), Request{Model: "m1", Tokens: toks(8, 1)})
	require.ErrorIs(t, err, ErrNotReady)
	require.ErrorContains(t, err, `b is `)
	require.ErrorContains(t, err, string(catalog.ReasonNoDPSize))
}
