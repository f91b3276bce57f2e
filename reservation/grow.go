package reservation

import (
	"fmt"
	"slices"

	"github.com/kvselect/kvselect/catalog"
)

// AddOutputBlocks adds n blocks to the booking's private blocks: the KV blocks
// its generated output has filled on the worker (one per block size of
// generated tokens), so that the worker's active blocks follow what it really
// holds while a long answer is generated. n >= 0 (0 changes nothing). An
// unknown id returns a wrapped ErrUnknownReservation and changes nothing.
func (l *Ledger) AddOutputBlocks(id ID, n int) error {
	if n < 0 {
		l.invalid.Add(1)
		return fmt.Errorf("%w: id %q: %d output blocks", ErrInvalid, id, n)
	}
	bk := l.find(id)
	if bk == nil {
		l.unknown.Add(1)
		return fmt.Errorf("%w: output blocks for %q", ErrUnknownReservation, id)
	}
	r := bk.rank
	r.mu.Lock()
	if bk.settled {
		r.mu.Unlock()
		l.unknown.Add(1)
		return fmt.Errorf("%w: output blocks for %q", ErrUnknownReservation, id)
	}
	if n == 0 {
		r.mu.Unlock()
		return nil
	}
	// A reader that sees an odd version cannot book on what it read: the
	// rank's load rises under it.
	r.version.Add(1)
	bk.private += n
	r.private.Add(int64(n))
	r.version.Add(1)
	r.mu.Unlock()
	l.outputBlocks.Add(int64(n))
	if l.onRaise != nil {
		l.onRaise(bk.worker)
	}
	return nil
}

// Holder returns the worker rank that holds booking id, and false when the id
// is not booked.
func (l *Ledger) Holder(id ID) (catalog.WorkerRank, bool) {
	bk := l.find(id)
	if bk == nil {
		return catalog.WorkerRank{}, false
	}
	return bk.worker, true
}

// Move moves booking id, everything it holds (its blocks, its private and
// output blocks, its prefill tokens unless its prefill is complete, its
// request), to worker rank to, keeping its id, lease and deadline: the request
// was served by another worker than the one booked. It returns the booking as
// it now stands on to. Moving to the rank that holds it changes nothing.
//
// Move takes the booking from the id map first, so it must not run at the same
// time as the caller's own PrefillComplete, Free, Touch or AddOutputBlocks for
// id (a Free then finds nothing to free); a Booking handle serialises them.
// Expire and RemoveWorker may run meanwhile. Errors: ErrUnknownReservation
// (changes nothing), ErrInvalid for a bad rank (changes nothing), and an error
// wrapping ErrConflict when the id was booked again while it moved (the moved
// booking is then freed).
func (l *Ledger) Move(id ID, to catalog.WorkerRank) (Booking, error) {
	if to.WorkerID == "" || to.Rank < 0 {
		l.invalid.Add(1)
		return Booking{}, fmt.Errorf("%w: move %q to %s", ErrInvalid, id, to)
	}
	bk := l.find(id)
	if bk != nil && bk.worker == to {
		bk.rank.mu.Lock()
		defer bk.rank.mu.Unlock()
		if !bk.settled {
			return bk.asBooking(), nil
		}
	}
	if bk == nil || l.take(id, bk) == nil {
		l.unknown.Add(1)
		return Booking{}, fmt.Errorf("%w: move %q", ErrUnknownReservation, id)
	}
	r := bk.rank
	r.mu.Lock()
	b := bk.asBooking()
	b.Worker = to
	now := l.now()
	if left := bk.deadline.Sub(now); left > 0 {
		b.FirstLease = left
	} else {
		b.FirstLease = 1 // expired already: the next Expire settles it
	}
	prefillDone := bk.prefillDone
	l.arrive(r, -l.decay(1, stamp(bk.bookedAt), stamp(now)), now) // its arrival goes with it
	l.settle(bk)
	r.mu.Unlock()
	if l.onChange != nil {
		l.onChange(bk.worker)
	}
	if prefillDone {
		b.PrefillTokens = 0
	}
	if err := l.book(&b, Stamp{}, false); err != nil {
		l.freed.Add(1) // the taken booking is gone: count it freed
		return Booking{}, fmt.Errorf("reservation: move %q from %s: %w", id, bk.worker, err)
	}
	l.booked.Add(-1) // the same booking, not a new one
	l.moved.Add(1)
	if nb := l.find(id); nb != nil { // the caller's calls for id wait for Move
		nb.rank.mu.Lock()
		nb.prefillDone, nb.bookedAt, nb.ahead = prefillDone, bk.bookedAt, -1
		nb.rank.mu.Unlock()
	}
	return b, nil
}

// asBooking describes bk as a Booking (its hashes copied). bk.rank.mu is held.
func (bk *booking) asBooking() Booking {
	return Booking{
		ID: bk.id, Worker: bk.worker, SeqHashes: slices.Clone(bk.buf.seqs), PrivateBlocks: bk.private,
		PrefillTokens: bk.prefill, ExpectedOutputTokens: bk.expected, Lease: bk.lease,
	}
}
