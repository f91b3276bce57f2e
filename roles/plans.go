package roles

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/btree"

	"github.com/kvselect/kvselect/reservation"
)

// ErrUnknownPlan reports a plan id that is not registered: never registered,
// or already completed or expired. The call changed nothing.
var ErrUnknownPlan = errors.New("roles: unknown plan")

// planLegs names the reservations of one disaggregated plan. Each id is booked
// on a different service (the prefill and the decode selector), which is why
// the plan table only names them and never frees them itself.
type planLegs struct {
	// Prefill is the reservation on the prefill selector, or "" for a plan
	// whose decode worker prefills locally (nothing to free at hand-off).
	Prefill reservation.ID
	// Decode is the reservation on the decode selector: the request's
	// destination. Required.
	Decode reservation.ID
	// Session is the request's session id ("" for none), which moves its
	// pin when the decode leg moves (PairBooker.Move).
	Session string
	// BlockSize is the decode worker's block size in tokens, in which
	// generated output is counted (PairBooker.Generated); 0 counts none.
	BlockSize int
}

// planInfo is a snapshot of one registered plan, as returned by Get.
type planInfo struct {
	ID   reservation.ID
	Legs planLegs
	// HandedOff is set once Handoff has run: the prefill leg was released.
	HandedOff    bool
	RegisteredAt time.Time
	// Deadline is when Expire settles the plan if nobody completed it.
	Deadline time.Time
}

// settlement is what the owner of a plan must do to the two services after a
// plan table call: each non-empty field names a reservation and the action to take.
// The table has already recorded the step, so the owner acts on every field and
// treats an unknown-reservation answer from a service as done (its own lease
// may have released the booking first).
type settlement struct {
	// Plan is the plan the actions belong to.
	Plan reservation.ID
	// FreePrefill is a reservation to free on the prefill service.
	FreePrefill reservation.ID
	// DecodePrefillComplete is a reservation to mark prefill-complete on the
	// decode service.
	DecodePrefillComplete reservation.ID
	// FreeDecode is a reservation to free on the decode service.
	FreeDecode reservation.ID
}

// Empty reports whether the settlement asks for nothing.
func (s settlement) Empty() bool {
	return s.FreePrefill == "" && s.DecodePrefillComplete == "" && s.FreeDecode == ""
}

// PlanStats are the counters of a PairBooker's plans. Each is read
// atomically, but the set is not one snapshot while calls are in flight.
type PlanStats struct {
	Registered int64 // successful Register calls
	HandedOff  int64 // plans handed off (first Handoff only)
	Completed  int64 // plans settled by Complete
	Expired    int64 // plans settled by Expire
	Active     int64 // registered plans not yet settled
}

type plan struct {
	id           reservation.ID
	legs         planLegs
	handedOff    bool
	outputBlocks int // output blocks added to the decode leg (Grow)
	// worker is the decode leg's worker: the one booked, or the one Moved
	// to; what Plan.MarkFailed marks.
	worker string
	// finished, failMarked and prefillMarked are the handle's repeat-call
	// state (Plan.Done, Plan.MarkFailed and Plan.MarkPrefillFailed called);
	// they outlive the plan's removal.
	finished, failMarked, prefillMarked bool
	at                                  time.Time
	deadline                            time.Time
	order                               uint64
}

func planLess(a, b *plan) bool {
	if c := a.deadline.Compare(b.deadline); c != 0 {
		return c < 0
	}
	return a.order < b.order
}

// settle is the settlement that finishes p: its prefill leg unless already
// handed off, and its decode leg.
func (p *plan) settle() settlement {
	s := settlement{Plan: p.id, FreeDecode: p.legs.Decode}
	if !p.handedOff {
		s.FreePrefill = p.legs.Prefill
	}
	return s
}

// planTable ties the role reservations of disaggregated requests together: plan id
// -> prefill reservation id, decode reservation id, hand-off state and a lease.
// It is the bookkeeping half of a pair booking (see package roles): it never
// calls a service; every state change returns a settlement that tells the owner
// which reservations to free or mark prefill-complete, so the state machine is
// testable on its own and the owner keeps the only references to the services.
//
//	Register  plan live, both legs booked (or decode only)
//	Handoff   prefill done: free the prefill leg, mark the decode leg prefill-complete (once)
//	Complete  request over: free the decode leg, and the prefill leg if not handed off; plan gone
//	Expire    Complete for every plan whose lease ran out (an owner that died mid-plan)
//
// Create one with newPlanTable. It is safe for
// concurrent use: one mutex guards its map and its lease B-tree, every method
// holds it for a bounded critical section (Expire for the plans it settles), and
// nothing in it starts a goroutine or reads the wall clock except through the
// injected Clock.
type planTable struct {
	now   func() time.Time
	lease time.Duration

	mu     sync.Mutex
	plans  map[reservation.ID]*plan
	leases *btree.BTreeG[*plan]
	order  uint64

	registered, handedOff, completed, expired, active atomic.Int64
}

// newPlanTable returns an empty plan table whose plans live lease (> 0).
func newPlanTable(now func() time.Time, lease time.Duration) *planTable {
	return &planTable{now: now, lease: lease, plans: make(map[reservation.ID]*plan), leases: btree.NewG(16, planLess)}
}

// Register records a plan whose legs are booked, its decode leg on worker,
// with a lease ending at the clock's now plus the table's lease, and returns
// its entry (a Plan's handle on it). It returns a wrapped
// reservation.ErrInvalid for an empty plan id, an empty decode id or legs
// that share an id, and reservation.ErrConflict when id is registered
// already; either way nothing changed.
func (p *planTable) Register(id reservation.ID, legs planLegs, worker string) (*plan, error) {
	var errs []error
	if id == "" {
		errs = append(errs, errors.New("plan id is empty"))
	}
	if legs.Decode == "" {
		errs = append(errs, errors.New("decode reservation id is empty"))
	}
	if legs.Prefill != "" && legs.Prefill == legs.Decode {
		errs = append(errs, fmt.Errorf("prefill and decode share the reservation id %q", legs.Decode))
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("%w: plan %q: %w", reservation.ErrInvalid, id, errors.Join(errs...))
	}
	now := p.now()
	pl := &plan{id: id, legs: legs, worker: worker, at: now, deadline: now.Add(p.lease)}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.plans[id]; ok {
		return nil, fmt.Errorf("%w: plan %q is registered", reservation.ErrConflict, id)
	}
	p.order++
	pl.order = p.order
	p.plans[id] = pl
	p.leases.ReplaceOrInsert(pl)
	p.registered.Add(1)
	p.active.Add(1)
	return pl, nil
}

// Handoff records that the plan's prefill is done. The first call returns the
// settlement {FreePrefill: prefill leg, DecodePrefillComplete: decode leg};
// later calls return an empty settlement and nil (idempotent). An unknown plan
// returns a wrapped ErrUnknownPlan.
func (p *planTable) Handoff(id reservation.ID) (settlement, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.handoffLocked(id, p.plans[id])
}

// HandoffOf is Handoff of a Plan's entry: after FinishOf it returns an
// empty settlement and nil.
func (p *planTable) HandoffOf(pl *plan) (settlement, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pl.finished {
		return settlement{Plan: pl.id}, nil
	}
	id := pl.id
	if p.plans[id] != pl {
		pl = nil
	}
	return p.handoffLocked(id, pl)
}

func (p *planTable) handoffLocked(id reservation.ID, pl *plan) (settlement, error) {
	if pl == nil {
		return settlement{}, fmt.Errorf("%w: hand-off of %q", ErrUnknownPlan, id)
	}
	if pl.handedOff {
		return settlement{Plan: id}, nil
	}
	pl.handedOff = true
	p.handedOff.Add(1)
	return settlement{Plan: id, FreePrefill: pl.legs.Prefill, DecodePrefillComplete: pl.legs.Decode}, nil
}

// Complete settles the plan (its request ended, failed or was cancelled) and
// forgets it. It returns {FreeDecode: decode leg} plus FreePrefill when the plan
// was never handed off. Like the ledger's Free, a second call, or a call for a
// plan that expired, returns a wrapped ErrUnknownPlan and changes nothing, so a
// repeated Complete is harmless.
func (p *planTable) Complete(id reservation.ID) (settlement, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := p.plans[id]
	if pl == nil {
		return settlement{}, fmt.Errorf("%w: complete %q", ErrUnknownPlan, id)
	}
	p.removeLocked(pl)
	p.completed.Add(1)
	return pl.settle(), nil
}

// FinishOf is Complete of a Plan's entry, with the handle's repeat-call
// contract: its first call completes the plan, or returns a wrapped
// ErrUnknownPlan when it is no longer live (it expired); later calls return
// an empty settlement and nil.
func (p *planTable) FinishOf(pl *plan) (settlement, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pl.finished {
		return settlement{Plan: pl.id}, nil
	}
	pl.finished = true
	if p.plans[pl.id] != pl {
		return settlement{}, fmt.Errorf("%w: complete %q", ErrUnknownPlan, pl.id)
	}
	p.removeLocked(pl)
	p.completed.Add(1)
	return pl.settle(), nil
}

// FailOf returns the worker a Plan's MarkFailed marks (its decode leg's), on
// its first call only: later calls return "".
func (p *planTable) FailOf(pl *plan) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pl.failMarked {
		return ""
	}
	pl.failMarked = true
	return pl.worker
}

// PrefillFailOf reports whether a Plan's prefill leg is to be marked
// failed now: true on the first call only.
func (p *planTable) PrefillFailOf(pl *plan) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	first := !pl.prefillMarked
	pl.prefillMarked = true
	return first
}

// MovedOf records that a Plan's decode leg moved to worker.
func (p *planTable) MovedOf(pl *plan, worker string) {
	p.mu.Lock()
	pl.worker = worker
	p.mu.Unlock()
}

// Touch extends a live plan's lease to now plus the table's lease (its
// request is making progress); it never shortens one. An unknown plan returns
// a wrapped ErrUnknownPlan.
func (p *planTable) Touch(id reservation.ID) (planLegs, error) {
	now := p.now()
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := p.plans[id]
	if pl == nil {
		return planLegs{}, fmt.Errorf("%w: renew %q", ErrUnknownPlan, id)
	}
	if d := now.Add(p.lease); d.After(pl.deadline) {
		p.leases.Delete(pl)
		pl.deadline = d
		p.leases.ReplaceOrInsert(pl)
	}
	legs := pl.legs
	if pl.handedOff {
		legs.Prefill = "" // freed at hand-off
	}
	return legs, nil
}

// Grow records that the plan's request has generated tokens output tokens so
// far and returns its decode leg and the blocks to add to it: one per
// BlockSize tokens not counted before (0 for a smaller or equal count, or a
// plan without a block size). An unknown plan returns a wrapped
// ErrUnknownPlan.
func (p *planTable) Grow(id reservation.ID, tokens int) (decode reservation.ID, blocks int, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := p.plans[id]
	if pl == nil {
		return "", 0, fmt.Errorf("%w: output of %q", ErrUnknownPlan, id)
	}
	if pl.legs.BlockSize <= 0 || tokens <= 0 {
		return pl.legs.Decode, 0, nil
	}
	n := tokens/pl.legs.BlockSize - pl.outputBlocks
	if n <= 0 {
		return pl.legs.Decode, 0, nil
	}
	pl.outputBlocks += n
	return pl.legs.Decode, n, nil
}

// Legs returns a live plan's legs (the prefill leg "" once handed off). An
// unknown plan returns a wrapped ErrUnknownPlan.
func (p *planTable) Legs(id reservation.ID) (planLegs, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := p.plans[id]
	if pl == nil {
		return planLegs{}, fmt.Errorf("%w: %q", ErrUnknownPlan, id)
	}
	legs := pl.legs
	if pl.handedOff {
		legs.Prefill = ""
	}
	return legs, nil
}

// Expire settles and forgets every plan whose deadline is at or before now,
// earliest deadline first, and returns their settlements (nil when none). Its
// cost is the number it settles times log of the number of live plans.
func (p *planTable) Expire(now time.Time) []settlement {
	var out []settlement
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		pl, ok := p.leases.Min()
		if !ok || pl.deadline.After(now) {
			break
		}
		p.removeLocked(pl)
		out = append(out, pl.settle())
	}
	p.expired.Add(int64(len(out)))
	return out
}

// removeLocked forgets pl. p.mu is held.
func (p *planTable) removeLocked(pl *plan) {
	delete(p.plans, pl.id)
	p.leases.Delete(pl)
	p.active.Add(-1)
}

// NextExpiry returns the earliest deadline among the live plans, and false when
// there are none.
func (p *planTable) NextExpiry() (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl, ok := p.leases.Min()
	if !ok {
		return time.Time{}, false
	}
	return pl.deadline, true
}

// Get returns a snapshot of a live plan.
func (p *planTable) Get(id reservation.ID) (planInfo, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := p.plans[id]
	if pl == nil {
		return planInfo{}, false
	}
	return planInfo{ID: pl.id, Legs: pl.legs, HandedOff: pl.handedOff, RegisteredAt: pl.at, Deadline: pl.deadline}, true
}

// Len returns the number of live plans.
func (p *planTable) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.plans)
}

// Stats returns the counters.
func (p *planTable) Stats() PlanStats {
	return PlanStats{
		Registered: p.registered.Load(), HandedOff: p.handedOff.Load(),
		Completed: p.completed.Load(), Expired: p.expired.Load(), Active: p.active.Load(),
	}
}
