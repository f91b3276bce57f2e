package selection

import (
	"context"
	"fmt"
	"sync"
)

// Booking is a handle on one booked request: where it goes (the embedded
// Result) and the calls that settle it, so a caller does not carry the
// reservation id around. Book returns it.
//
// A Booking is safe for concurrent use and keeps lifecycle.Handle's
// repeat-call contract: the first PrefillComplete marks the prefill done and
// later ones do nothing; the first MarkFailed marks the worker and later ones
// do nothing; the first Done frees the booking and later ones (and
// PrefillComplete after it) do nothing. Every path of a request must reach Done (end of stream,
// upstream error, client cancel, panic); a booking never done is released
// only when its lease passes.
type Booking struct {
	Result
	svc *SelectionService

	session string // the request's SessionID, for Move

	mu           sync.Mutex
	prefilled    bool
	done         bool
	failed       bool // MarkFailed called
	outputBlocks int  // blocks added by Generated
}

// Book is SelectAndReserve returning a handle on the booking (errors as
// SelectAndReserve). The reservation id is Booking.ReservationID.
func (s *SelectionService) Book(ctx context.Context, req Request) (*Booking, error) {
	res, err := s.SelectAndReserve(ctx, req)
	if err != nil {
		return nil, err
	}
	return &Booking{Result: res, svc: s, session: req.SessionID}, nil
}

// PrefillComplete reports the request's first output byte (see
// Reservations.PrefillComplete). Only the first call counts. It returns
// ErrUnknownReservation when the booking is already gone from the service
// (its lease passed or its worker was deleted), nil otherwise.
func (b *Booking) PrefillComplete() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.prefilled || b.done {
		return nil
	}
	b.prefilled = true
	return b.svc.Reservations().PrefillComplete(b.ReservationID)
}

// Done releases the booking (see Reservations.Free). Only the
// first call frees; it returns ErrUnknownReservation when the booking was
// already gone (its lease passed or its worker was deleted), which needs no
// action.
func (b *Booking) Done() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return nil
	}
	b.done = true
	return b.svc.Reservations().Free(b.ReservationID)
}

// MarkFailed reports that the worker carrying the booking (the one booked,
// or the one Move moved it to) failed the request (see
// Workers.MarkFailed). Only the first call marks; later ones return
// nil. It may come after Done.
func (b *Booking) MarkFailed() error {
	b.mu.Lock()
	if b.failed {
		b.mu.Unlock()
		return nil
	}
	b.failed = true
	worker := b.WorkerID
	b.mu.Unlock()
	return b.svc.Workers().MarkFailed(worker)
}

// Renew extends the booking's lease from now (see
// Reservations.Renew): a request that is still making progress,
// such as a long stream, is not an orphan. After Done, or once the booking is
// gone, it returns ErrUnknownReservation.
func (b *Booking) Renew() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return fmt.Errorf("%w: %q is done", ErrUnknownReservation, b.ReservationID)
	}
	return b.svc.Reservations().Renew(b.ReservationID)
}
