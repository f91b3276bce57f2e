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
	require.Equal(t, 1, s.Reservations().Expire(), "only the booking that was not renewed")
	require.Equal(t, 1, s.Loads("")[0].ActiveRequests)
	require.ErrorIs(t, short.Done(), ErrUnknownReservation, "expired before its end")
	require.NoError(t, long.Done())
	requireIdle(t, s)
	require.ErrorIs(t, s.Reservations().Renew("nope"), ErrUnknownReservation)
}

// A worker registered without what it needs is named, with its reasons, by
// the error of the first request; a worker without a block size takes the
// service's.
func TestNotReadySaysWhy(t *testing.T) {
	s, _ := newTestService(t, nil)
	w := worker("a", nil)
	w.BlockSize = 0
	rec, err := s.Workers().Upsert(w)
	require.NoError(t, err)
	require.Equal(t, catalog.Schedulable, rec.Lifecycle, "block size inherited: %v", rec.Reasons)
	require.Equal(t, 4, rec.Worker.BlockSize)

	bad := worker("b", nil)
	bad.Model, bad.DPSize = "m1", 0
	rec, err = s.Workers().Upsert(bad)
	require.NoError(t, err)
	require.NotEqual(t, catalog.Schedulable, rec.Lifecycle)
	_, err = s.SelectAndReserve(context.Background(), Request{Model: "m1", Tokens: toks(8, 1)})
	require.ErrorIs(t, err, ErrNotReady)
	require.ErrorContains(t, err, `b is `)
	require.ErrorContains(t, err, string(catalog.ReasonNoDPSize))
}

// In approximate mode a failed worker loses its affinity and its picks for the
// ejection, then comes back; Workers().Delete's dropped bookings are counted.
func TestMarkFailedEjectsAndForgetsAffinity(t *testing.T) {
	s, clk := newTestService(t, func(c *Config) { c.FailureEjection = 5 * time.Second })
	addWorkers(t, s, "a", "b", "c")
	prompt := toks(64, 7)
	first, err := s.Book(context.Background(), Request{Tokens: prompt})
	require.NoError(t, err)
	require.NoError(t, first.Done())
	warm := first.WorkerID
	// Affinity: the same prefix returns to the warm worker.
	again, err := s.Book(context.Background(), Request{Tokens: prompt})
	require.NoError(t, err)
	require.Equal(t, warm, again.WorkerID)
	require.NoError(t, again.Done())

	ov, err := overlapScores(s, context.Background(), Request{Tokens: prompt})
	require.NoError(t, err)
	require.Positive(t, ov[catalog.WorkerRank{WorkerID: warm}].Device)
	require.NoError(t, s.Workers().MarkFailed(warm))
	ov, err = overlapScores(s, context.Background(), Request{Tokens: prompt})
	require.NoError(t, err)
	require.Zero(t, ov[catalog.WorkerRank{WorkerID: warm}].Device, "its affinity is forgotten")
	for range 20 {
		b, err := s.Book(context.Background(), Request{Tokens: prompt})
		require.NoError(t, err)
		require.NotEqual(t, warm, b.WorkerID, "an ejected worker is not picked")
		require.NoError(t, b.Done())
	}
	// Only the ejected worker allowed: ejection yields rather than failing.
	b, err := s.Book(context.Background(), Request{Tokens: prompt, Allowed: []string{warm}})
	require.NoError(t, err)
	require.Equal(t, warm, b.WorkerID)
	require.NoError(t, b.Done())

	clk.Advance(5 * time.Second)
	seen := map[string]bool{}
	for i := range 60 {
		b, err := s.Book(context.Background(), Request{Tokens: toks(8, 100+i)})
		require.NoError(t, err)
		seen[b.WorkerID] = true
		require.NoError(t, b.Done())
	}
	require.True(t, seen[warm], "back in the picks after the ejection")
	require.Equal(t, uint64(1), s.Stats().Failures)
	require.ErrorIs(t, s.Workers().MarkFailed("nobody"), ErrNotFound)

	// A deleted worker's bookings are counted as dropped.
	live, err := s.Book(context.Background(), Request{Tokens: prompt, Allowed: []string{"c"}})
	require.NoError(t, err)
	_, err = s.Workers().Delete("c")
	require.NoError(t, err)
	require.ErrorIs(t, live.Done(), ErrUnknownReservation)
	st := s.Stats()
	require.Equal(t, uint64(1), st.Dropped)
	require.Equal(t, st.Bookings, st.Frees+st.Expired+st.Dropped)
}

// SetDraining takes a worker out of the picks and back; its booking in flight
// stays until freed.
func TestSetDraining(t *testing.T) {
	s, _ := newTestService(t, nil)
	addWorkers(t, s, "a", "b")
	inflight, err := s.Book(context.Background(), Request{Tokens: toks(8, 1), Allowed: []string{"a"}})
	require.NoError(t, err)
	rec, err := s.Workers().SetDraining("a", true)
	require.NoError(t, err)
	require.Equal(t, catalog.Draining, rec.Lifecycle)
	for i := range 20 {
		b, err := s.Book(context.Background(), Request{Tokens: toks(8, 10+i)})
		require.NoError(t, err)
		require.Equal(t, "b", b.WorkerID)
		require.NoError(t, b.Done())
	}
	_, err = s.Book(context.Background(), Request{Tokens: toks(8, 1), Allowed: []string{"a"}})
	require.ErrorIs(t, err, ErrNoEndpoints)
	require.NoError(t, inflight.Done(), "a draining worker's booking is freed normally")
	rec, err = s.Workers().SetDraining("a", false)
	require.NoError(t, err)
	require.Equal(t, catalog.Schedulable, rec.Lifecycle)
	_, err = s.Workers().SetDraining("zz", true)
	require.ErrorIs(t, err, ErrNotFound)
	requireIdle(t, s)
}
