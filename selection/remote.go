package selection

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
)

// BookingEvent is one booking the service made itself, as a peer service
// needs it to carry the same load (package replica ships it).
type BookingEvent struct {
	ID     reservation.ID
	Model  string
	Worker catalog.WorkerRank
	// SeqHashes are the booking's active block hashes. In a Booked call they
	// are the service's own buffer, valid only during the call: copy what you
	// keep.
	SeqHashes            []uint64
	PrivateBlocks        int
	PrefillTokens        int
	ExpectedOutputTokens int
	// Lease is the booking's lease (Config.ActiveRequestExpiry).
	Lease time.Duration
	// Remaining, for ReplicaPlane.Book, is what is left of Lease when the copy is
	// made (a booking a peer made a while ago, received in a snapshot): the
	// copy's first deadline; renewals extend it by the whole Lease, as they
	// do the original. 0 means all of Lease. Booked calls leave it 0.
	Remaining time.Duration
	// Session is the request's SessionID ("" for none, or when sessions are
	// off): ReplicaPlane.Book pins the session to Worker, as the booking did on its
	// origin, so the session's next request finds the same worker through any
	// replica.
	Session string
}

// Settlement is a settling call on a booking.
type Settlement uint8

// Settlements.
const (
	SettlePrefill     Settlement = iota + 1 // PrefillComplete
	SettleRenew                             // Reservations.Renew
	SettleFree                              // Reservations.Free
	SettleOutputBlock                       // one block of AddOutputBlocks
)

// String returns "prefill", "renew", "free" or "output_block".
func (k Settlement) String() string {
	switch k {
	case SettlePrefill:
		return "prefill"
	case SettleRenew:
		return "renew"
	case SettleFree:
		return "free"
	case SettleOutputBlock:
		return "output_block"
	}
	return fmt.Sprintf("Settlement(%d)", uint8(k))
}

// BookingObserver hears of every booking the service makes and of every
// successful settling call on one (PrefillComplete, Reservations.Renew,
// Reservations.Free, and each block of AddOutputBlocks; a Reservations.Move is
// told as a free and a booking on the new rank), but not of remote bookings or of expiries: a peer's copy
// carries the lease and expires by itself. Calls run on the request path,
// after the ledger accepted the change and in its order for one id: they must
// not block and must not call the service.
type BookingObserver interface {
	Booked(ev BookingEvent)
	Settled(id reservation.ID, how Settlement)
}

// Observe sets the observer of the service's own bookings (package replica's
// Replicator shares them with peer services). Default: none.
func (b *SelectionServiceBuilder) Observe(o BookingObserver) *SelectionServiceBuilder {
	b.observer = o
	return b
}

// ReplicaPlane.LeaseLimit is the longest lease a booking holds in this service without a
// renewal (Config.ActiveRequestExpiry): ReplicaPlane.Book clamps a peer's lease to
// it.
func (view ReplicaPlane) LeaseLimit() time.Duration { return view.s.cfg.ActiveRequestExpiry }

// remoteID is the ledger id of a peer's booking: ids of different origins, and
// of the service's own bookings, never collide.
func remoteID(origin string, id reservation.ID) reservation.ID {
	return reservation.ID("\x00" + origin + "\x00" + string(id))
}

// Book books a peer service's booking (ev, from origin's observer) in
// this service's ledger: it counts as load exactly as a local booking does,
// and with the approximate index it is remembered as a prefix of its worker.
// Its first deadline is ev.Remaining (or ev.Lease) from now, and each
// SettleRenew extends it by ev.Lease; both are at most ReplicaPlane.LeaseLimit, so that a
// peer cannot pin load longer than a local booking is held. A booking on a worker or rank this service
// does not route to (discovery not yet caught up, another model) is refused
// with ErrNotFound; a repeated id with ErrConflict.
func (view ReplicaPlane) Book(origin string, ev BookingEvent) error {
	s := view.s
	if s.closed.Load() {
		return ErrClosed
	}
	// Held for reading so that Workers().Delete (which holds it for writing while
	// it drops the worker's load) cannot run between the check and the book.
	s.mu.RLock()
	defer s.mu.RUnlock()
	p := s.workerPart[ev.Worker.WorkerID]
	if p == nil || p.model != modelOf(ev.Model) || !s.rankKnownLocked(ev.Worker) {
		return fmt.Errorf("%w: remote booking on %v of model %q", ErrNotFound, ev.Worker, modelOf(ev.Model))
	}
	limit := s.Replicas().LeaseLimit()
	if ev.Lease <= 0 || ev.Lease > limit {
		ev.Lease = limit
	}
	ev.Remaining = min(ev.Remaining, ev.Lease)
	err := s.ledger.Book(reservation.Booking{
		ID: remoteID(origin, ev.ID), Worker: ev.Worker, SeqHashes: ev.SeqHashes, PrivateBlocks: ev.PrivateBlocks,
		PrefillTokens: ev.PrefillTokens, ExpectedOutputTokens: ev.ExpectedOutputTokens, Lease: ev.Lease,
		FirstLease: ev.Remaining,
	})
	if err != nil {
		if errors.Is(err, reservation.ErrConflict) {
			return fmt.Errorf("%w: %w", ErrConflict, err)
		}
		return fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	if p.approx != nil {
		p.approx.Record(ev.Worker, ev.SeqHashes)
	}
	if ev.Session != "" && len(ev.Session) <= MaxSessionIDLen && s.cfg.Sessions.Mode != SessionOff {
		p.sessions.put(ev.Session, ev.Worker, s.now().UnixNano())
	}
	s.st.remoteBookings.Add(1)
	return nil
}

// Settle applies a peer's settling call to its booking id (see
// ReplicaPlane.Book). An id that is not booked here (expired, dropped with its
// worker, never accepted) is ErrUnknownReservation.
func (view ReplicaPlane) Settle(origin string, id reservation.ID, how Settlement) error {
	s := view.s
	rid := remoteID(origin, id)
	var err error
	switch how {
	case SettlePrefill:
		err = s.ledger.PrefillComplete(rid)
	case SettleRenew:
		err = s.ledger.Touch(rid)
	case SettleFree:
		err = s.ledger.Free(rid)
	case SettleOutputBlock:
		err = s.ledger.AddOutputBlocks(rid, 1)
	default:
		return fmt.Errorf("%w: settlement %v", ErrBadRequest, how)
	}
	if err != nil {
		if errors.Is(err, reservation.ErrUnknownReservation) {
			return fmt.Errorf("%w: %w", ErrUnknownReservation, err)
		}
		return err
	}
	return nil
}

// rankKnownLocked reports whether w is a rank of a registered worker. s.mu is
// held.
func (s *SelectionService) rankKnownLocked(w catalog.WorkerRank) bool {
	rr, ok := s.rankRange[w.WorkerID]
	return ok && w.Rank >= rr[0] && w.Rank < rr[0]+rr[1]
}

// observeSettled tells the observer of a successful settling call.
func (s *SelectionService) observeSettled(id reservation.ID, how Settlement) {
	if s.obs != nil {
		s.obs.Settled(id, how)
	}
}
