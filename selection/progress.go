package selection

import (
	"errors"
	"fmt"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
)

// AddOutputBlocks grows booking id by n blocks (n >= 0): the KV blocks its
// generated output has filled on the worker, one per BlockSize generated
// tokens, so that the worker's decode cost follows what it holds while a long
// answer runs (Dynamo's add_output_block). Booking.Generated counts them for
// a caller that knows the tokens generated so far. Unknown id:
// ErrUnknownReservation; n < 0: ErrBadRequest.
func (view Reservations) AddOutputBlocks(id reservation.ID, n int) error {
	s := view.s
	if n < 0 {
		return fmt.Errorf("%w: %d output blocks", ErrBadRequest, n)
	}
	if err := s.ledger.AddOutputBlocks(id, n); err != nil {
		return s.settleError(err)
	}
	for range n {
		s.observeSettled(id, SettleOutputBlock)
	}
	return nil
}

// Move moves booking id to worker rank to: the gateway served the request on
// another endpoint than the one picked (a retry, a fallback), so its load,
// lease and prefix belong there. to must be a schedulable rank of the
// booking's model. Moving to the rank that holds it does nothing. session is
// the booking's Request.SessionID: the session's pin moves with it, as
// Booking.Move does for its own session (a caller that books by id, such as
// a plan over several services, keeps the session and passes it here; empty,
// or sessions off, moves no pin). The caller must not settle id while it
// moves (a Booking handle serialises its calls). Errors:
// ErrUnknownReservation, ErrNotFound (to is not a rank of the model),
// ErrClosed.
func (view Reservations) Move(id reservation.ID, to catalog.WorkerRank, session string) error {
	s := view.s
	_, _, err := s.moveReservation(id, to, session)
	return err
}

// moveReservation moves id to to and returns whether it moved and to's
// endpoint.
func (s *SelectionService) moveReservation(id reservation.ID, to catalog.WorkerRank, session string) (bool, string, error) {
	if s.closed.Load() {
		return false, "", ErrClosed
	}
	from, ok := s.ledger.Holder(id)
	if !ok {
		s.st.unknownIDs.Add(1)
		return false, "", fmt.Errorf("%w: move %q", ErrUnknownReservation, id)
	}
	if from == to {
		return false, "", nil
	}
	// Held for reading so that the rank cannot be deleted between the check
	// and the move (as in ReplicaPlane.Book).
	s.mu.RLock()
	defer s.mu.RUnlock()
	p := s.workerPart[to.WorkerID]
	var endpoint string
	if p != nil && p == s.workerPart[from.WorkerID] {
		rs := p.ranksOf()
		if i, ok := rs.pos[to]; ok {
			endpoint = rs.ranks[i].endpoint
		}
	}
	if endpoint == "" {
		return false, "", fmt.Errorf("%w: move %q from %v to %v: not a schedulable rank of its model", ErrNotFound, id, from, to)
	}
	b, err := s.ledger.Move(id, to)
	if err != nil {
		if errors.Is(err, reservation.ErrUnknownReservation) {
			return false, "", s.settleError(err)
		}
		return false, "", err
	}
	s.st.moves.Add(1)
	if p.approx != nil {
		p.approx.Record(to, b.SeqHashes)
	}
	if session != "" && s.cfg.Sessions.Mode != SessionOff {
		p.sessions.put(session, to, s.now().UnixNano())
	}
	if s.obs != nil {
		// A peer applies a move as what it is to it: the booking freed on
		// its old rank and booked anew on the new one.
		s.obs.Settled(id, SettleFree)
		s.obs.Booked(BookingEvent{
			ID: id, Model: p.model, Worker: to, SeqHashes: b.SeqHashes, PrivateBlocks: b.PrivateBlocks,
			PrefillTokens: b.PrefillTokens, ExpectedOutputTokens: b.ExpectedOutputTokens, Lease: b.Lease,
			Session: session,
		})
	}
	return true, endpoint, nil
}

// Generated reports that the request has generated tokens output tokens so
// far (a running count: SSE events, or the usage of a finished answer) and
// grows the booking by one block per BlockSize of them not yet counted (see
// Reservations.AddOutputBlocks). A smaller count than before changes
// nothing; after Done it returns ErrUnknownReservation.
func (b *Booking) Generated(tokens int) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return fmt.Errorf("%w: %q is done", ErrUnknownReservation, b.ReservationID)
	}
	blocks := tokens / max(b.BlockSize, 1)
	if blocks <= b.outputBlocks {
		return nil
	}
	n := blocks - b.outputBlocks
	b.outputBlocks = blocks
	return b.svc.Reservations().AddOutputBlocks(b.ReservationID, n)
}

// Move moves the booking to worker rank to, the one that served the request,
// with its session's pin (see Reservations.Move); the Result's
// WorkerRank and Endpoint then name to (read them on the goroutine that
// calls Move). Moving to the rank held does nothing.
func (b *Booking) Move(to catalog.WorkerRank) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return fmt.Errorf("%w: %q is done", ErrUnknownReservation, b.ReservationID)
	}
	moved, endpoint, err := b.svc.moveReservation(b.ReservationID, to, b.session)
	if err != nil {
		return err
	}
	if moved {
		b.WorkerRank, b.Endpoint = to, endpoint
	}
	return nil
}
