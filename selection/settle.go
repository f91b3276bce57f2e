package selection

import (
	"errors"
	"fmt"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
)

// PrefillComplete marks the end of a booking's prefill (its first output): the
// prompt tokens stop counting as prefill load; its blocks stay active. Calling it
// again is a no-op. Unknown id: ErrUnknownReservation (harmless).
func (view Reservations) PrefillComplete(id reservation.ID) error {
	s := view.s
	if err := s.ledger.PrefillComplete(id); err != nil {
		return s.settleError(err)
	}
	s.st.prefillDone.Add(1)
	s.observeSettled(id, SettlePrefill)
	if s.healthOn() {
		s.sampleSettled(id, true)
	}
	return nil
}

// Free releases everything a booking added (end of stream, cancel,
// error). Freeing twice, or an unknown or expired id, is ErrUnknownReservation and
// changes nothing.
func (view Reservations) Free(id reservation.ID) error {
	s := view.s
	if err := s.ledger.Free(id); err != nil {
		return s.settleError(err)
	}
	s.st.frees.Add(1)
	s.classes.settled(id)
	s.observeSettled(id, SettleFree)
	if s.healthOn() {
		s.sampleSettled(id, false)
	}
	return nil
}

// Renew extends a booking's lease to the clock's now plus its lease
// (Config.ActiveRequestExpiry): call it while a long request makes progress so
// that its load is not released mid-flight. It never shortens a lease. Unknown,
// freed or expired id: ErrUnknownReservation, and nothing changes.
func (view Reservations) Renew(id reservation.ID) error {
	s := view.s
	if err := s.ledger.Touch(id); err != nil {
		return s.settleError(err)
	}
	s.observeSettled(id, SettleRenew)
	return nil
}

// settleError maps a ledger error of a settling call: an unknown id is counted
// and returned as ErrUnknownReservation.
func (s *SelectionService) settleError(err error) error {
	if errors.Is(err, reservation.ErrUnknownReservation) {
		s.st.unknownIDs.Add(1)
		return fmt.Errorf("%w: %w", ErrUnknownReservation, err)
	}
	return err
}

// Expire frees every booking whose lease has passed by the clock and
// returns how many. The service's sweeper calls it periodically; call it yourself
// with a fake clock or a disabled sweeper.
func (view Reservations) Expire() int {
	s := view.s
	n := s.ledger.Expire(s.now())
	if n > 0 {
		s.classes.prune(s.ledger)
	}
	return n
}

// loadDropped is the ledger's hook: some worker's load went down, so a waiting
// request may now fit, and the partition's cost order follows it. It runs outside the ledger's lock and takes no service lock
// that a ledger caller might hold.
func (s *SelectionService) loadDropped(w catalog.WorkerRank) {
	if p, ok := s.partOf.Load(w.WorkerID); ok {
		p := p.(*partition)
		p.signalIfWaiting()
		p.syncLoad(w, s.ledger)
	}
}

// loadRaised is the ledger's hook for a load that went up (a booking, output
// blocks): the partition's cost order follows it.
func (s *SelectionService) loadRaised(w catalog.WorkerRank) {
	if p, ok := s.partOf.Load(w.WorkerID); ok {
		p.(*partition).syncLoad(w, s.ledger)
	}
}
