package selection

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
)

type recordingObserver struct {
	mu      sync.Mutex
	booked  []BookingEvent
	settled []string
}

func (o *recordingObserver) Booked(ev BookingEvent) {
	o.mu.Lock()
	defer o.mu.Unlock()
	ev.SeqHashes = append([]uint64(nil), ev.SeqHashes...)
	o.booked = append(o.booked, ev)
}

func (o *recordingObserver) Settled(id reservation.ID, how Settlement) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.settled = append(o.settled, string(id)+":"+how.String())
}

// What one service books and settles, replayed into another with ReplicaPlane.Book
// and ReplicaPlane.Settle, is the same load there.
func TestObserverAndRemoteBookings(t *testing.T) {
	obs := &recordingObserver{}
	a, _ := newTestService(t, nil)
	a.obs = obs
	b, _ := newTestService(t, nil)
	addWorkers(t, a, "w1", "w2")
	addWorkers(t, b, "w1", "w2")

	bk, err := a.Book(context.Background(), Request{Tokens: toks(16, 1)})
	require.NoError(t, err)
	require.Len(t, obs.booked, 1)
	ev := obs.booked[0]
	require.Equal(t, bk.ReservationID, ev.ID)
	require.Equal(t, bk.WorkerID, ev.Worker.WorkerID)
	require.NoError(t, b.Replicas().Book("replica-a", ev))
	require.Equal(t, a.Loads(""), b.Loads(""), "the peer carries the same load")
	require.ErrorIs(t, b.Replicas().Book("replica-a", ev), ErrConflict)

	require.NoError(t, bk.PrefillComplete())
	require.NoError(t, bk.Renew())
	require.NoError(t, b.Replicas().Settle("replica-a", ev.ID, SettlePrefill))
	require.NoError(t, b.Replicas().Settle("replica-a", ev.ID, SettleRenew))
	require.Equal(t, a.Loads(""), b.Loads(""))
	require.NoError(t, bk.Done())
	require.Equal(t, []string{string(ev.ID + ":prefill"), string(ev.ID + ":renew"), string(ev.ID + ":free")}, obs.settled)
	require.NoError(t, b.Replicas().Settle("replica-a", ev.ID, SettleFree))
	requireIdle(t, b)
	require.ErrorIs(t, b.Replicas().Settle("replica-a", ev.ID, SettleFree), ErrUnknownReservation)
	require.Equal(t, uint64(1), b.Stats().RemoteBookings)
	require.Zero(t, b.Stats().Bookings, "remote bookings are not the service's own")

	// A booking on a worker or rank the peer does not know is refused.
	ev.Worker = catalog.WorkerRank{WorkerID: "w3"}
	require.ErrorIs(t, b.Replicas().Book("replica-a", ev), ErrNotFound)
	ev.Worker = catalog.WorkerRank{WorkerID: "w1", Rank: 5}
	require.ErrorIs(t, b.Replicas().Book("replica-a", ev), ErrNotFound)
	// A remote id never collides with a local one.
	ev.Worker = catalog.WorkerRank{WorkerID: "w1"}
	ev.ID = "same"
	require.NoError(t, b.Replicas().Book("replica-a", ev))
	_, err = b.SelectAndReserve(context.Background(), Request{ReservationID: "same", Tokens: toks(8, 2)})
	require.NoError(t, err)
	require.NoError(t, b.Reservations().Free("same"))
	require.NoError(t, b.Replicas().Settle("replica-a", "same", SettleFree))
	requireIdle(t, b)
}

// A peer's booking copied late (from a snapshot) first lives what is left of
// its lease; a renewal gives it the whole lease again.
func TestBookRemoteRemainingLease(t *testing.T) {
	b, clk := newTestService(t, func(c *Config) { c.ActiveRequestExpiry = time.Minute })
	addWorkers(t, b, "w1")
	ev := BookingEvent{ID: "x", Worker: catalog.WorkerRank{WorkerID: "w1"}, SeqHashes: []uint64{1, 2}, Lease: time.Minute, Remaining: 10 * time.Second}
	require.NoError(t, b.Replicas().Book("peer", ev))
	ev.ID = "y"
	require.NoError(t, b.Replicas().Book("peer", ev))
	clk.Advance(5 * time.Second)
	require.NoError(t, b.Replicas().Settle("peer", "y", SettleRenew))
	clk.Advance(5 * time.Second)
	require.Equal(t, 1, b.Reservations().Expire(), "x lived its remaining 10 s")
	clk.Advance(50 * time.Second)
	require.Zero(t, b.Reservations().Expire(), "y was renewed by the whole minute at 5 s")
	clk.Advance(5 * time.Second)
	require.Equal(t, 1, b.Reservations().Expire())
	requireIdle(t, b)
}

// A peer's lease, and what is left of it, is at most this service's own: a
// forged lease of 24 days cannot pin a worker's load longer than a local
// booking is held, and neither can its renewals.
func TestBookRemoteLeaseClamped(t *testing.T) {
	b, clk := newTestService(t, func(c *Config) { c.ActiveRequestExpiry = time.Minute })
	addWorkers(t, b, "w1")
	require.Equal(t, time.Minute, b.Replicas().LeaseLimit())
	huge := time.Duration(1<<31-1) * time.Millisecond
	ev := BookingEvent{ID: "x", Worker: catalog.WorkerRank{WorkerID: "w1"}, SeqHashes: []uint64{1}, PrivateBlocks: 1 << 30,
		Lease: huge, Remaining: huge}
	require.NoError(t, b.Replicas().Book("peer", ev))
	clk.Advance(30 * time.Second)
	require.NoError(t, b.Replicas().Settle("peer", "x", SettleRenew))
	clk.Advance(time.Minute - time.Second)
	require.Zero(t, b.Reservations().Expire(), "renewed at 30 s by a minute")
	clk.Advance(time.Second)
	require.Equal(t, 1, b.Reservations().Expire(), "and no longer")
	requireIdle(t, b)
}
