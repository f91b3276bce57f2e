package roles

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

// DefaultPlanningTimeout bounds one Book when BookerOptions.Timeout is zero:
// 30 s, Dynamo's planning deadline.
const DefaultPlanningTimeout = 30 * time.Second

// Reservation id suffixes: a plan p books "p/prefill" on the prefill selector
// and "p/decode" on the decode selector, or "p/aggregated" alone when the
// destination prefills locally.
const (
	suffixPrefill    = "/prefill"
	suffixDecode     = "/decode"
	suffixAggregated = "/aggregated"
)

// PrefillFallback says what Book does when the prefill role cannot take the
// request: it has no ready worker for the model, none of the allowed workers,
// or its admission queue is full. The zero value is PrefillFail.
type PrefillFallback uint8

// Prefill fallbacks.
const (
	// PrefillFail fails the request with the prefill error
	// (ErrRoleCatalogEmpty for an empty prefill role). The default.
	PrefillFail PrefillFallback = iota
	// PrefillDecodeOnly books a decode worker alone, as an aggregated worker
	// that prefills the prompt itself (no prefill hint), with prefill tracking
	// on so its prefill load is counted.
	PrefillDecodeOnly
)

// String returns "fail" or "decode-only".
func (f PrefillFallback) String() string {
	switch f {
	case PrefillFail:
		return "fail"
	case PrefillDecodeOnly:
		return "decode-only"
	default:
		return fmt.Sprintf("PrefillFallback(%d)", uint8(f))
	}
}

// BookerOptions configure a PairBooker. The zero value means the defaults.
type BookerOptions struct {
	// PrefillFallback: what to do when the prefill role cannot take a request.
	// Default PrefillFail.
	PrefillFallback PrefillFallback
	// Timeout bounds each Book while a leg waits in an admission queue. 0
	// means DefaultPlanningTimeout; negative means only the caller's context
	// bounds it. Services without queueing (Config.QueueThreshold nil) never
	// wait, so no timer is set for them.
	Timeout time.Duration
	// Now times plan leases. Default time.Now. Give it the clock the services
	// were built with.
	Now func() time.Time
	// PlanLease is how long a plan may live before Expire settles it. >= 0; 0
	// means the destination role's Config.ActiveRequestExpiry (300 s by
	// default), the lease of the reservations the plan holds.
	PlanLease time.Duration
	// ExpireEvery is how often the booker's own sweeper settles the plans
	// whose lease passed (Expire), as the services sweep their
	// reservations, until Close. 0 means every second; negative starts no
	// sweeper (call Expire yourself, as with a fake clock).
	ExpireEvery time.Duration
	// DecodePrefixHashes sends the decode leg of a pair the whole prompt, so
	// that the decode service's approximate index learns which prefixes each
	// decode worker holds (it receives them from its prefill worker); only
	// PrefillDecodeOnly fallbacks, which restore the overlap credit on decode,
	// read that. Default false: the decode leg carries the prompt's length and
	// no hash of it. Decode scoring ignores the prefix (no credit, no prefill
	// tokens, no assumed reuse), so the pick is the same either way, without
	// hashing, matching and indexing every block of every request.
	DecodePrefixHashes bool
	// LocalPrefillBelow turns on conditional disaggregation: a request whose
	// uncached prompt on the decode worker that would take it alone is at
	// most this many tokens, or that arrives while every prefill worker is
	// busy (with queueing), is booked on that decode worker alone, which
	// prefills it itself (LocalPrefill, no prefill hint), as llm-d decides per
	// request. The decode worker's overlap comes from the decode service's
	// approximate index, so this also turns DecodePrefixHashes on. 0: off (the
	// default); >= 0.
	LocalPrefillBelow int
}

// Plan is a booked request: where it goes and, in disaggregated mode, which
// prefill worker computes its prompt. It is also the handle that settles the
// request: PrefillComplete at the first response byte, Done at its end (on
// every path), Renew while a long request makes progress. Copies of a Plan
// settle the same plan; the calls are safe from any goroutine and keep
// lifecycle.Handle's repeat-call contract.
type Plan struct {
	// ID names the plan (the request's ReservationID, or a minted one).
	ID reservation.ID
	// Prefill is the prefill worker, a hint only (the EPP's
	// x-prefiller-host-port); the zero Result when LocalPrefill.
	Prefill selection.Result
	// Decode is the destination: always a worker of the destination role
	// (Decode, or Aggregated in aggregated mode). For the decode leg of a pair
	// its Overlap, RequestBlocks and EffectivePrefillTokens say nothing (decode
	// scoring ignores the prompt's prefix; see
	// BookerOptions.DecodePrefixHashes).
	Decode selection.Result
	// LocalPrefill is set when the destination prefills the prompt itself:
	// aggregated mode, or the PrefillDecodeOnly fallback.
	LocalPrefill bool

	b  *PairBooker // nil in a Plan not returned by Book
	pl *plan       // its entry in b's plan table
}

// PrefillComplete reports the first response byte: the prefill leg is
// freed and the decode leg marked prefill-complete (for a LocalPrefill plan,
// only the latter). Only the first call acts; later ones, and calls after
// Done, return nil. A plan that expired is ErrUnknownPlan.
func (p Plan) PrefillComplete() error {
	if p.b == nil {
		return notBooked(p.ID)
	}
	s, err := p.b.plans.HandoffOf(p.pl)
	if err != nil {
		return err
	}
	p.b.settle(s)
	return nil
}

// Done settles the plan at the end of its request (completion, error or
// cancel): it frees the decode leg, and the prefill leg when the plan was
// never handed off. Only the first call acts; later ones return nil. A first
// call on a plan that expired is ErrUnknownPlan, which needs no action.
func (p Plan) Done() error {
	if p.b == nil {
		return notBooked(p.ID)
	}
	s, err := p.b.plans.FinishOf(p.pl)
	if err != nil {
		return err
	}
	p.b.settle(s)
	return nil
}

// Renew extends the leases of the plan and of the reservations it still
// holds (the decode leg, and the prefill leg until hand-off) from now: its
// request is making progress, as a long stream does, and must not be
// expired mid-flight. After Done, or once the plan expired, it is
// ErrUnknownPlan; a leg already gone from its service is reported
// (selection.ErrUnknownReservation) after the others were renewed.
func (p Plan) Renew() error {
	if p.b == nil {
		return notBooked(p.ID)
	}
	legs, err := p.b.plans.Touch(p.ID)
	if err != nil {
		return err
	}
	var errs []error
	if legs.Prefill != "" && p.b.prefill != nil {
		errs = append(errs, p.b.prefill.RenewReservation(legs.Prefill))
	}
	errs = append(errs, p.b.dest.RenewReservation(legs.Decode))
	return errors.Join(errs...)
}

// Generated reports that the plan's request has generated tokens output
// tokens so far (a running count: the SSE events of its stream, or the usage
// of a finished answer) and grows its decode reservation, the one that holds
// the output, by one block per block size of the decode worker booked
// (Decode.BlockSize) not counted before
// (selection.Reservations.AddOutputBlocks), so that worker's decode cost
// follows what it holds. A count not larger than before changes nothing.
// After Done it is ErrUnknownPlan; a decode leg already gone from its service
// is selection.ErrUnknownReservation.
func (p Plan) Generated(tokens int) error {
	if p.b == nil {
		return notBooked(p.ID)
	}
	leg, n, err := p.b.plans.Grow(p.ID, tokens)
	if err != nil || n == 0 {
		return err
	}
	return p.b.dest.AddOutputBlocks(leg, n)
}

// Move moves the plan's decode reservation (the destination) to worker rank
// to of the destination role, with its load, its lease and its session's pin
// (selection.Reservations.Move): the gateway served the
// request on another endpoint than the one picked (a fallback of the list, a
// retry). The prefill leg stays: it is where the prompt was computed. The
// Plan's Decode still names the worker booked first; MarkFailed marks the one
// moved to. Moving to the rank held does nothing. Errors: after Done,
// ErrUnknownPlan; to not a schedulable rank of the destination role's model,
// selection.ErrNotFound (the plan is unchanged: its owner decides whether to
// keep it or end it); selection.ErrUnknownReservation when the leg is
// already gone.
func (p Plan) Move(to catalog.WorkerRank) error {
	if p.b == nil {
		return notBooked(p.ID)
	}
	legs, err := p.b.plans.Legs(p.ID)
	if err != nil {
		return err
	}
	if err := p.b.dest.MoveSessionReservation(legs.Decode, to, legs.Session); err != nil {
		return roleError(p.b.destRole, err)
	}
	p.b.plans.MovedOf(p.pl, to.WorkerID)
	return nil
}

// MarkFailed reports that the worker carrying the plan's decode leg (the
// destination booked, or the one it moved to) failed the request: the
// destination role's service leaves it out of its picks for a while
// (selection.Workers.MarkFailed). Only the first call marks; later
// ones return nil. It may come after Done.
func (p Plan) MarkFailed() error {
	if p.b == nil {
		return notBooked(p.ID)
	}
	w := p.b.plans.FailOf(p.pl)
	if w == "" {
		return nil
	}
	if err := p.b.dest.MarkFailed(w); err != nil {
		return roleError(p.b.destRole, err)
	}
	return nil
}

// MarkPrefillFailed reports that the plan's prefill leg failed on the
// prefill worker (the decode sidecar said so, lifecycle.PrefillMarker): the
// prefill role's service leaves that worker out of its picks for a while.
// Only the first call marks; later ones, and a plan whose destination
// prefills locally, return nil. It may come after Done.
func (p Plan) MarkPrefillFailed() error {
	if p.b == nil {
		return notBooked(p.ID)
	}
	if p.LocalPrefill || p.Prefill.WorkerID == "" || !p.b.plans.PrefillFailOf(p.pl) {
		return nil
	}
	if err := p.b.prefill.MarkFailed(p.Prefill.WorkerID); err != nil {
		return roleError(Prefill, err)
	}
	return nil
}

func notBooked(id reservation.ID) error {
	return fmt.Errorf("%w: %q was not booked", ErrUnknownPlan, id)
}

// Destination returns the endpoint the request is sent to.
func (p Plan) Destination() string { return p.Decode.Endpoint }

// PrefillHint returns the prefill worker's endpoint, and false when the
// destination prefills locally.
func (p Plan) PrefillHint() (string, bool) {
	if p.LocalPrefill || p.Prefill.ReservationID == "" {
		return "", false
	}
	return p.Prefill.Endpoint, true
}

// BookerStats are a PairBooker's counters. Each is read atomically; the set is
// not one snapshot while calls are in flight.
type BookerStats struct {
	// Booked counts plans returned by Book, LocalPrefill the ones among them
	// whose destination prefills locally, Fallbacks the ones booked that way
	// because the prefill role could not take them, Conditional the ones
	// booked that way by BookerOptions.LocalPrefillBelow.
	Booked, LocalPrefill, Fallbacks, Conditional int64
	// Failed counts Book calls that returned an error; Compensated the legs
	// such calls (and fallbacks) booked and then freed.
	Failed, Compensated int64
	// Plans counts the plans themselves.
	Plans PlanStats
}

// leg is what the booker needs of a role's service. *selection.SelectionService
// implements it; tests put a fake behind it to inject failures and blocks.
type leg interface {
	Select(ctx context.Context, req selection.Request) (selection.Result, error)
	SelectAndReserve(ctx context.Context, req selection.Request) (selection.Result, error)
	FreeReservation(id reservation.ID) error
	PrefillComplete(id reservation.ID) error
	RenewReservation(id reservation.ID) error
	AddOutputBlocks(id reservation.ID, n int) error
	MoveSessionReservation(id reservation.ID, to catalog.WorkerRank, session string) error
	MarkFailed(workerID string) error
	PotentialLoads(ctx context.Context, req selection.Request) ([]selection.Scored, error)
}

// serviceLeg is a role's selection service as a leg: its by-id calls go
// through the service's Reservations.
type serviceLeg struct{ *selection.SelectionService }

func (l serviceLeg) FreeReservation(id reservation.ID) error { return l.Reservations().Free(id) }
func (l serviceLeg) PrefillComplete(id reservation.ID) error {
	return l.Reservations().PrefillComplete(id)
}
func (l serviceLeg) RenewReservation(id reservation.ID) error { return l.Reservations().Renew(id) }
func (l serviceLeg) AddOutputBlocks(id reservation.ID, n int) error {
	return l.Reservations().AddOutputBlocks(id, n)
}
func (l serviceLeg) MoveSessionReservation(id reservation.ID, to catalog.WorkerRank, session string) error {
	return l.Reservations().Move(id, to, session)
}
func (l serviceLeg) MarkFailed(workerID string) error { return l.Workers().MarkFailed(workerID) }

var _ leg = serviceLeg{}

// PairBooker books requests across the role selectors: in disaggregated mode a
// (prefill, decode) pair per request, in aggregated mode one aggregated worker,
// and settles each plan at hand-off and completion.
//
// A PairBooker is safe for concurrent use. Book runs the decode leg on an
// errgroup goroutine and the prefill leg on the caller's, and waits for both
// before it returns, so it leaves no goroutine behind; the rest is
// synchronous but for the sweeper (BookerOptions.ExpireEvery), which Close
// stops and waits for. The plans live in the plan table (plans.go), with its
// own lock. A PairBooker does not own the RoleSelectors it books on: close
// those after the last call.
type PairBooker struct {
	destRole   Role
	prefill    leg // nil in aggregated mode
	dest       leg
	destOver   *selection.Override // merged over every request to dest
	localOver  *selection.Override // merged over a PrefillDecodeOnly fallback
	fallback   PrefillFallback
	fullHashes bool // BookerOptions.DecodePrefixHashes
	legsWait   bool // a leg may wait in an admission queue
	blockSize  int  // the destination service's block size
	timeout    time.Duration
	now        func() time.Time
	plans      *planTable
	readyCheck func() bool

	localBelow                                                 int // BookerOptions.LocalPrefillBelow
	booked, local, fallbacks, conditional, failed, compensated atomic.Int64

	log       *slog.Logger  // the RoleSelectors' (the sweeper's WARN); discard from newPairBooker
	stop      chan struct{} // closed by Close; nil without a sweeper
	closeOnce sync.Once
	wg        sync.WaitGroup
}

// NewPairBooker returns a booker over rs. It validates opts (wrapped
// ErrInvalidOptions).
func NewPairBooker(rs *RoleSelectors, opts BookerOptions) (*PairBooker, error) {
	if rs == nil {
		return nil, fmt.Errorf("%w: nil RoleSelectors", ErrInvalidOptions)
	}
	dr := rs.mode.Destination()
	dp := rs.profiles[dr]
	var pre leg
	if rs.mode == ModeDisaggregated {
		pre = serviceLeg{rs.services[Prefill]}
	}
	if opts.PlanLease == 0 {
		opts.PlanLease = dp.Config.ActiveRequestExpiry
		if opts.PlanLease == 0 {
			opts.PlanLease = selection.DefaultActiveRequestExpiry
		}
	}
	b, err := newPairBooker(dr, pre, serviceLeg{rs.services[dr]}, dp, opts)
	if err != nil {
		return nil, err
	}
	b.log = rs.logger
	b.legsWait = false
	for _, r := range rs.mode.Roles() {
		if rs.profiles[r].Config.QueueThreshold != nil {
			b.legsWait = true
		}
	}
	fallback := opts.PrefillFallback
	b.readyCheck = func() bool {
		if rs.closed.Load() || !rs.roleReady(dr) {
			return false
		}
		return rs.mode == ModeAggregated || fallback == PrefillDecodeOnly || rs.roleReady(Prefill)
	}
	if every := opts.ExpireEvery; every >= 0 {
		if every == 0 {
			every = time.Second
		}
		b.stop = make(chan struct{})
		b.wg.Add(1)
		go b.sweep(every)
	}
	return b, nil
}

// sweep expires plans every interval until Close.
func (b *PairBooker) sweep(every time.Duration) {
	defer b.wg.Done()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-t.C:
			if n := b.Expire(); n > 0 {
				b.log.Warn("roles: plans expired: their requests never ended (a gateway that died mid-request, or a caller that never called Done)", "plans", n)
			}
		}
	}
}

// Close stops the sweeper and waits for it. Plans still live stay booked
// on their services until those expire them. It is idempotent; the booker
// still books and settles after it, but nothing expires its plans.
func (b *PairBooker) Close() {
	b.closeOnce.Do(func() {
		if b.stop != nil {
			close(b.stop)
		}
	})
	b.wg.Wait()
}

// newPairBooker builds a booker over any legs; pre is nil in aggregated mode.
func newPairBooker(destRole Role, pre, dest leg, destProfile profile, opts BookerOptions) (*PairBooker, error) {
	var errs []error
	if opts.PrefillFallback > PrefillDecodeOnly {
		errs = append(errs, fmt.Errorf("PrefillFallback is %v", opts.PrefillFallback))
	}
	if opts.PlanLease < 0 {
		errs = append(errs, fmt.Errorf("PlanLease is %v, want >= 0", opts.PlanLease))
	}
	if opts.LocalPrefillBelow < 0 {
		errs = append(errs, fmt.Errorf("LocalPrefillBelow is %d, want >= 0", opts.LocalPrefillBelow))
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, errors.Join(errs...))
	}
	timeout := opts.Timeout
	if timeout == 0 {
		timeout = DefaultPlanningTimeout
	}
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	plans := newPlanTable(now, opts.PlanLease)
	return &PairBooker{
		destRole: destRole, prefill: pre, dest: dest,
		destOver: destProfile.Override, localOver: destProfile.LocalPrefillOverride,
		fallback: opts.PrefillFallback, fullHashes: opts.DecodePrefixHashes || opts.LocalPrefillBelow > 0,
		localBelow: opts.LocalPrefillBelow, blockSize: destProfile.Config.BlockSize,
		legsWait: true, timeout: timeout, now: now, plans: plans,
		readyCheck: func() bool { return true },
		log:        slog.New(slog.DiscardHandler),
	}, nil
}

// Ready reports whether Book can currently succeed for some request: the
// destination role has a schedulable worker and, in disaggregated mode without
// the PrefillDecodeOnly fallback, so does the prefill role.
func (b *PairBooker) Ready() bool { return b.readyCheck() }

// Book books req and returns its plan. The plan id is req.ReservationID, or a
// minted random id when it is empty; the reservations are the plan id plus
// "/prefill" and "/decode" (or "/aggregated").
//
// In disaggregated mode the prefill and decode legs run concurrently, each on
// its own selector with its own queue, the decode leg with the decode Override
// merged over req.Override. The plan is registered and returned only when both
// legs booked. If a leg fails, the timeout passes or ctx is done, the pending
// leg is cancelled, Book waits for it, and every leg that booked (also one that
// finished after the cancellation) is freed before the error is returned: no
// half-booked plan survives.
//
// The destination is always a worker of the destination role. An empty decode
// role is ErrRoleCatalogEmpty and never falls back to a prefill worker. When the
// prefill role has no ready worker (ErrRoleCatalogEmpty), none of the allowed
// workers (selection.ErrNoEndpoints) or a full queue (selection.ErrOverloaded),
// PrefillDecodeOnly books the decode role alone as aggregated (LocalPrefill);
// PrefillFail returns that error.
//
// Errors wrap the selection errors of the failing leg (see HTTPStatus);
// reservation.ErrConflict when the plan id is live; the context's error when ctx
// ended (also when both legs had booked by then).
func (b *PairBooker) Book(ctx context.Context, req selection.Request) (Plan, error) {
	p, err := b.book(ctx, req)
	if err != nil {
		b.failed.Add(1)
		return Plan{}, err
	}
	b.booked.Add(1)
	if p.LocalPrefill {
		b.local.Add(1)
	}
	p.b = b
	return p, nil
}

func (b *PairBooker) book(ctx context.Context, req selection.Request) (Plan, error) {
	id := req.ReservationID
	if id == "" {
		id = selection.NewReservationID()
	}
	// The legs share lctx: its deadline is the booking timeout, and cancelling
	// it (a leg failed) withdraws the other leg from its queue. Services that
	// never queue never wait on a context, so they get the caller's.
	lctx, cancel := ctx, context.CancelFunc(noCancel)
	if b.legsWait {
		if b.timeout > 0 {
			lctx, cancel = context.WithTimeout(ctx, b.timeout)
		} else {
			lctx, cancel = context.WithCancel(ctx)
		}
		defer cancel()
	}
	if b.prefill == nil {
		return b.bookLocal(lctx, id, req, b.destOver)
	}
	if b.localBelow > 0 && b.prefillNotWorthIt(lctx, req) {
		p, err := b.bookLocal(lctx, id, req, b.localOver)
		if err == nil {
			b.conditional.Add(1)
		}
		return p, err
	}

	preq, dreq := req, req
	preq.ReservationID = id + suffixPrefill
	preq.Fallbacks = 0 // fallbacks are destinations: the decode role's
	if !b.fullHashes {
		dreq = b.decodeRequest(req)
	}
	dreq.ReservationID = id + suffixDecode
	dreq.Override = mergeOverride(req.Override, b.destOver)
	var pres, dres selection.Result
	var perr, derr error
	// The decode leg runs on the group's goroutine and the prefill leg, the
	// longer one (it hashes and matches the prompt), on the caller's: a
	// booking starts one goroutine, and the caller seldom has to sleep in
	// Wait for it.
	var g errgroup.Group
	g.Go(func() error {
		if dres, derr = b.dest.SelectAndReserve(lctx, dreq); derr != nil {
			cancel()
		}
		return nil
	})
	if pres, perr = b.prefill.SelectAndReserve(lctx, preq); perr != nil {
		cancel()
	}
	_ = g.Wait() // both legs have returned: whatever booked is known

	// ended is the caller's cancellation or the timeout; a cancellation by a
	// failing leg is not one.
	ended := ctx.Err()
	if ended == nil && errors.Is(lctx.Err(), context.DeadlineExceeded) {
		ended = lctx.Err()
	}
	if perr == nil && derr == nil && ended == nil {
		legs := planLegs{Prefill: preq.ReservationID, Decode: dreq.ReservationID, Session: req.SessionID, BlockSize: dres.BlockSize}
		pl, err := b.plans.Register(id, legs, dres.WorkerID)
		if err != nil {
			b.compensate(b.prefill, preq.ReservationID)
			b.compensate(b.dest, dreq.ReservationID)
			return Plan{}, fmt.Errorf("roles: plan %q: %w", id, err)
		}
		return Plan{ID: id, Prefill: pres, Decode: dres, pl: pl}, nil
	}
	if perr == nil {
		b.compensate(b.prefill, preq.ReservationID)
	}
	if derr == nil {
		b.compensate(b.dest, dreq.ReservationID)
	}
	// A leg that failed on its own is the cause; a leg that reports its
	// context ended was cancelled, by the caller, the timeout or the other
	// leg's failure.
	if legFailed(derr) {
		return Plan{}, roleError(b.destRole, derr)
	}
	if legFailed(perr) {
		if b.fallback == PrefillDecodeOnly && prefillUnavailable(perr) && ended == nil {
			fctx := ctx
			if d, ok := lctx.Deadline(); ok {
				var fcancel context.CancelFunc
				fctx, fcancel = context.WithDeadline(ctx, d)
				defer fcancel()
			}
			p, err := b.bookLocal(fctx, id, req, b.localOver)
			if err == nil {
				b.fallbacks.Add(1)
			}
			return p, err
		}
		return Plan{}, roleError(Prefill, perr)
	}
	if ended != nil {
		return Plan{}, fmt.Errorf("roles: plan %q abandoned: %w", id, ended)
	}
	return Plan{}, roleError(b.destRole, errors.Join(derr, perr)) // not reached: a leg was cancelled for nothing
}

func noCancel() {}

// prefillNotWorthIt reports whether a request is better prefilled by the
// decode worker that would take it alone: its uncached prompt there is at
// most LocalPrefillBelow tokens, or every prefill worker is busy. Both are
// advisory reads (Select books nothing); a read that fails says no.
func (b *PairBooker) prefillNotWorthIt(ctx context.Context, req selection.Request) bool {
	r := req
	r.Override = mergeOverride(req.Override, b.localOver)
	r.Fallbacks = 0 // advisory reads: nobody retries on them
	if res, err := b.dest.Select(ctx, r); err == nil && res.EffectivePrefillTokens <= b.localBelow {
		return true
	}
	if !b.legsWait {
		return false // without queueing no worker is ever busy
	}
	r = req
	r.Fallbacks = 0
	res, err := b.prefill.Select(ctx, r)
	return err == nil && res.Busy
}

// legFailed reports a leg error that is not the end of the leg's context.
func legFailed(err error) bool {
	return err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
}

// decodeLegHash stands for the prompt in the decode leg of a pair. It names no
// real block (a prompt's first block hashes to it with probability 2^-64).
const decodeLegHash uint64 = 0x6b76_7365_6c65_6374

// decodeRequest returns req reduced to what decode scoring reads: the prompt
// length, with one placeholder block hash instead of the prompt's (a request
// needs at least one). Under the decode override a worker's cost is its active
// blocks, the request's blocks (all new, as no reuse is assumed) and its active
// requests, none of which depends on the prefix, so the pick is unchanged,
// while the service neither hashes, matches nor indexes the prompt, and its
// approximate index is never told that a decode leg (perhaps one compensated a
// moment later) holds the prompt. A prompt shorter than one block carries no
// hash anyway and is passed as it is.
func (b *PairBooker) decodeRequest(req selection.Request) selection.Request {
	isl := len(req.Tokens)
	if isl == 0 {
		isl = req.ISL
	}
	if b.blockSize <= 0 || isl < b.blockSize || (len(req.Tokens) == 0 && len(req.SeqHashes) == 0) {
		return req
	}
	req.Tokens = nil
	req.SeqHashes = decodeLegHashes
	req.ISL = isl
	return req
}

// decodeLegHashes is shared by every decode request; the service only reads it.
var decodeLegHashes = []uint64{decodeLegHash}

// prefillUnavailable reports the prefill failures the PrefillDecodeOnly fallback
// covers: no ready prefill worker, none allowed, queue full.
func prefillUnavailable(err error) bool {
	return errors.Is(err, selection.ErrNotReady) || errors.Is(err, selection.ErrNoEndpoints) ||
		errors.Is(err, selection.ErrOverloaded)
}

// bookLocal books the destination role alone, as an aggregated worker that
// prefills the prompt itself.
func (b *PairBooker) bookLocal(ctx context.Context, id reservation.ID, req selection.Request, over *selection.Override) (Plan, error) {
	r := req
	r.ReservationID = id + suffixAggregated
	r.Override = mergeOverride(req.Override, over)
	res, err := b.dest.SelectAndReserve(ctx, r)
	if err != nil {
		return Plan{}, roleError(b.destRole, err)
	}
	if err := ctx.Err(); err != nil {
		b.compensate(b.dest, r.ReservationID)
		return Plan{}, fmt.Errorf("roles: plan %q abandoned: %w", id, err)
	}
	pl, err := b.plans.Register(id, planLegs{Decode: r.ReservationID, Session: req.SessionID, BlockSize: res.BlockSize}, res.WorkerID)
	if err != nil {
		b.compensate(b.dest, r.ReservationID)
		return Plan{}, fmt.Errorf("roles: plan %q: %w", id, err)
	}
	return Plan{ID: id, Decode: res, LocalPrefill: true, pl: pl}, nil
}

// compensate frees a leg this booker booked and will not hand out. An unknown
// reservation (already expired, or dropped with its worker) is fine.
func (b *PairBooker) compensate(l leg, id reservation.ID) {
	if l.FreeReservation(id) == nil {
		b.compensated.Add(1)
	}
}

// Scores scores req on the destination role as Book would book it there
// (the decode request and Override of a pair, or of an aggregated plan),
// without booking: every eligible rank's overlap, its load with the request
// and its cost (selection.SelectionService.PotentialLoads), for a debug view
// of a decision. Errors as PotentialLoads, wrapped with the role.
func (b *PairBooker) Scores(ctx context.Context, req selection.Request) ([]selection.Scored, error) {
	r := req
	if b.prefill != nil && !b.fullHashes {
		r = b.decodeRequest(req)
	}
	r.Override = mergeOverride(req.Override, b.destOver)
	r.Fallbacks = 0
	sc, err := b.dest.PotentialLoads(ctx, r)
	if err != nil {
		return nil, roleError(b.destRole, err)
	}
	return sc, nil
}

// Expire settles every plan whose lease has passed by the clock (an owner
// that died mid-request) and returns how many. The sweeper calls it (see
// BookerOptions.ExpireEvery); call it yourself with a fake clock or without
// a sweeper.
func (b *PairBooker) Expire() int {
	ss := b.plans.Expire(b.now())
	for _, s := range ss {
		b.settle(s)
	}
	return len(ss)
}

// settle carries out a settlement. The services answer unknown-reservation for
// a booking that is already gone (its lease expired or its worker was
// deleted); that is the state the settlement wants, so it is not an error.
func (b *PairBooker) settle(s settlement) {
	if s.FreePrefill != "" && b.prefill != nil {
		_ = b.prefill.FreeReservation(s.FreePrefill)
	}
	if s.DecodePrefillComplete != "" {
		_ = b.dest.PrefillComplete(s.DecodePrefillComplete)
	}
	if s.FreeDecode != "" {
		_ = b.dest.FreeReservation(s.FreeDecode)
	}
}

// Stats returns the counters.
func (b *PairBooker) Stats() BookerStats {
	return BookerStats{
		Booked: b.booked.Load(), LocalPrefill: b.local.Load(), Fallbacks: b.fallbacks.Load(), Conditional: b.conditional.Load(),
		Failed: b.failed.Load(), Compensated: b.compensated.Load(), Plans: b.plans.Stats(),
	}
}
