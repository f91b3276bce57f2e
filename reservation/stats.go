package reservation

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
	Moved            int64 // bookings moved to another worker rank (Move)
	OutputBlocks     int64 // blocks added by AddOutputBlocks
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
		Moved:            l.moved.Load(),
		OutputBlocks:     l.outputBlocks.Load(),
	}
}
