package reservation

import (
	"time"

	"github.com/kvselect/kvselect/catalog"
)

// Reservation is a snapshot of one live booking, as returned by Get.
type Reservation struct {
	ID                   string
	Worker               catalog.WorkerRank
	PrefillTokens        int
	PrefillDone          bool
	ExpectedOutputTokens int
	Blocks               int // sequence hashes the booking holds (as given, duplicates included)
	PrivateBlocks        int // blocks it holds outside the shared block index (Booking.PrivateBlocks)
	Lease                time.Duration
	BookedAt             time.Time
	Deadline             time.Time // Expire frees the booking at or after this time
}

// Stats are the ledger's counters since New. Each is read atomically, but the set
// is not one snapshot while calls are in flight.
type Stats struct {
	Booked           int64 // successful Book calls
	PrefillCompleted int64 // bookings whose prefill was marked complete (first call only)
	Freed            int64 // bookings settled by Free
	Expired          int64 // bookings settled by Expire
	Removed          int64 // bookings settled by RemoveWorker
	Conflicts        int64 // Book calls rejected with ErrConflict
	Stale            int64 // BookAt calls rejected with ErrStale
	Invalid          int64 // Book calls rejected with ErrInvalid
	UnknownIDs       int64 // PrefillComplete, Free and Touch calls with an unknown id
	Active           int64 // live bookings
}

// Get returns a snapshot of the live booking id, and false when there is none.
func (l *Ledger) Get(id string) (Reservation, bool) {
	bk := l.find(id)
	if bk == nil {
		return Reservation{}, false
	}
	r := bk.rank
	r.mu.Lock()
	defer r.mu.Unlock()
	if bk.settled {
		return Reservation{}, false
	}
	return Reservation{
		ID:                   bk.id,
		Worker:               bk.worker,
		PrefillTokens:        bk.prefill,
		PrefillDone:          bk.prefillDone,
		ExpectedOutputTokens: bk.expected,
		Blocks:               len(bk.buf.seqs),
		PrivateBlocks:        bk.private,
		Lease:                bk.lease,
		BookedAt:             bk.bookedAt,
		Deadline:             bk.deadline,
	}, true
}

// Loads returns a snapshot of the load of every worker rank that has any (each
// worker rank's read at one point); worker ranks without live bookings are
// absent.
func (l *Ledger) Loads() map[catalog.WorkerRank]Load {
	out := make(map[catalog.WorkerRank]Load)
	for _, r := range l.rankList() {
		r.mu.Lock()
		if r.head != nil && !r.dead.Load() {
			out[r.key] = r.load()
		}
		r.mu.Unlock()
	}
	return out
}

// Stats returns the ledger's counters. It does not take the lock.
func (l *Ledger) Stats() Stats {
	return Stats{
		Booked:           l.booked.Load(),
		PrefillCompleted: l.prefillDone.Load(),
		Freed:            l.freed.Load(),
		Expired:          l.expired.Load(),
		Removed:          l.removed.Load(),
		Conflicts:        l.conflicts.Load(),
		Stale:            l.stale.Load(),
		Invalid:          l.invalid.Load(),
		UnknownIDs:       l.unknown.Load(),
		Active:           l.active.Load(),
	}
}
