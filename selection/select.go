package selection

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/reservation"
)

// Priority orders a request in the admission queue.
type Priority struct {
	// Tier is a strict priority: every waiting request of a higher tier is
	// admitted before any of a lower tier. Default 0.
	Tier int
	// Jump moves the request ahead within its tier: by that many seconds of
	// arrival time (FCFS, LCFS), or as the weight of WSPT. >= 0.
	Jump float64
}

// Request is one routing request.
type Request struct {
	// Model selects the partition; "" means catalog.DefaultModel.
	Model string
	// ReservationID names the booking (SelectAndReserve). Empty: a random id is
	// minted and returned in the Result.
	ReservationID reservation.ID
	// Tokens are the prompt's token ids exactly as the engine will see them.
	// Alternatively give SeqHashes and ISL.
	Tokens []uint32
	// SeqHashes are precomputed sequence hashes (kvindex.Hasher with this
	// request's LoRA name and salt), used when Tokens is empty; ISL is then the
	// prompt length in tokens and must be > 0 and cover every hash.
	SeqHashes []uint64
	// ISL alone (no Tokens, no SeqHashes) asks for a load-only decision: a
	// prompt of about ISL tokens whose prefix is unknown, so no rank is
	// credited a cached prefix and the pick follows the loads (and the
	// session). A gateway whose tokenizer cannot answer routes that way
	// rather than fail the request (its degraded mode).
	ISL int
	// LoRAName and CacheSalt isolate adapters and tenants.
	LoRAName, CacheSalt string
	// Allowed, when non-nil, restricts the pick to these worker ids (the
	// gateway's subset hint).
	Allowed []string
	// Override changes scoring weights for this request.
	Override *Override
	// Priority orders the request while it waits for capacity (a policy
	// Classifier may replace it).
	Priority Priority
	// Class names the request's policy class (Config.Classes): its weight,
	// tier, limits and default deadline. Empty or unknown: the default class
	// (Config.DefaultClass). Unused without classes. A policy Classifier
	// may replace it.
	Class string
	// Deadline, when not zero, is when the request must have left the
	// admission queue, on the service's clock: one still waiting then is
	// refused (ErrAdmission, RefusalReason "deadline:<class>"), and within
	// its class the earliest deadline is admitted first. Zero: its class's
	// Deadline after it arrives, if any. A policy Classifier may replace it.
	Deadline time.Time
	// ExpectedOutputTokens is recorded with the booking. >= 0.
	ExpectedOutputTokens int
	// SessionID names the conversation or agent run the request belongs to
	// (at most MaxSessionIDLen bytes): its bookings pin the session to a
	// worker rank, which its later requests prefer (see SessionConfig).
	// Empty: no affinity.
	SessionID string
	// Fallbacks asks for up to this many fallback endpoints besides the
	// chosen one (Result.Fallbacks), 0 to MaxFallbacks: where a gateway may
	// retry when the chosen worker cannot be reached (the GAIE protocol's
	// endpoint list). Only the chosen worker is booked.
	Fallbacks int
}

// MaxFallbacks bounds Request.Fallbacks.
const MaxFallbacks = 16

// Fallback is one fallback endpoint of a Result: a worker rank of the same
// model, on another endpoint than the chosen one.
type Fallback struct {
	catalog.WorkerRank
	Endpoint string
	Cost     float64
}

// Overlap is how many of the request's leading blocks the chosen worker holds:
// Device on the accelerator, and Host and Disk extending that prefix from lower
// tiers.
type Overlap struct {
	Device, Host, Disk int
}

// Result is the outcome of Select or SelectAndReserve.
type Result struct {
	// ReservationID is the booking's id (empty for Select).
	ReservationID reservation.ID
	// WorkerRank is the chosen worker and data-parallel rank.
	catalog.WorkerRank
	// Endpoint is the worker's host:port.
	Endpoint  string
	BlockSize int
	Overlap   Overlap
	// RequestBlocks is the number of complete blocks of the prompt.
	RequestBlocks int
	// EffectivePrefillTokens is the prompt length minus the weighted cached
	// tokens: what the worker must still compute.
	EffectivePrefillTokens int
	// PotentialDecodeBlocks is the worker's active blocks after this request.
	PotentialDecodeBlocks int
	// Cost is the chosen worker's cost (lower is better).
	Cost float64
	// QueueWait is how long the request waited for capacity.
	QueueWait time.Duration
	// Busy is set by Select when every eligible worker was busy: the pick is
	// advisory, a SelectAndReserve would have waited.
	Busy bool
	// Fallbacks are the next-cheapest eligible ranks on distinct endpoints
	// other than Endpoint, cheapest first, those not busy before those busy
	// (at most Request.Fallbacks). A gateway that serves the request on one of
	// them moves the booking there (Booking.Move).
	Fallbacks []Fallback
}

// prepared is a validated request.
type prepared struct {
	model    string
	seqs     []uint64
	active   []uint64 // hashes booked as shared active blocks
	private  int      // blocks booked as private active blocks (never shared, so new on every worker)
	isl      int
	w        weights
	allowed  map[string]struct{}
	priority Priority
	id       reservation.ID // the reservation id
	expected int            // expected output tokens
	buf      *[]uint64      // seqs' pooled buffer
	session  string         // Request.SessionID, "" when sessions are off
	peek     bool           // an inspection (PotentialLoads): it changes no state
	decision Decision       // what decided recorded, for the tracer
	retries  int
	fallback int // Request.Fallbacks
	pin      catalog.WorkerRank
	pinned   bool           // the session has a live pin, pin
	pol      *policyScratch // the policy seams' (policy.go); nil without them
	class    int32          // the request's class (Config.Classes; 0 without)
	deadline time.Time      // Request.Deadline
}

var preparedPool = sync.Pool{New: func() any { return new(prepared) }}

var matchPool = sync.Pool{New: func() any { m := make([]kvindex.Match, 0, 64); return &m }}

var seqPool = sync.Pool{New: func() any { s := make([]uint64, 0, 512); return &s }}

func (s *SelectionService) prepare(req *Request) (*prepared, error) {
	w, err := req.Override.apply(s.base)
	if err != nil {
		return nil, err
	}
	if req.ExpectedOutputTokens < 0 {
		return nil, fmt.Errorf("%w: ExpectedOutputTokens %d is negative", ErrBadRequest, req.ExpectedOutputTokens)
	}
	if req.Fallbacks < 0 || req.Fallbacks > MaxFallbacks {
		return nil, fmt.Errorf("%w: Fallbacks %d, want 0 to %d", ErrBadRequest, req.Fallbacks, MaxFallbacks)
	}
	if len(req.SessionID) > MaxSessionIDLen {
		return nil, fmt.Errorf("%w: SessionID is %d bytes, want at most %d", ErrBadRequest, len(req.SessionID), MaxSessionIDLen)
	}
	if math.IsNaN(req.Priority.Jump) || math.IsInf(req.Priority.Jump, 0) || req.Priority.Jump < 0 {
		return nil, fmt.Errorf("%w: Priority.Jump %v, want a finite value >= 0", ErrBadRequest, req.Priority.Jump)
	}
	bs := s.cfg.BlockSize
	buf := seqPool.Get().(*[]uint64)
	pr := preparedPool.Get().(*prepared)
	*pr = prepared{
		model: modelOf(req.Model), priority: req.Priority, w: w, buf: buf,
		id: req.ReservationID, expected: req.ExpectedOutputTokens, fallback: req.Fallbacks,
	}
	if s.cfg.Sessions.Mode != SessionOff {
		pr.session = req.SessionID
	}
	switch {
	case len(req.Tokens) > 0:
		h, _ := kvindex.NewHasher(bs, kvindex.HashOptions{LoRAName: req.LoRAName, CacheSalt: req.CacheSalt})
		pr.seqs = h.AppendSeqHashes((*buf)[:0], req.Tokens)
		pr.isl = len(req.Tokens)
	case len(req.SeqHashes) > 0:
		if req.ISL <= 0 || req.ISL < len(req.SeqHashes)*bs {
			pr.release()
			return nil, fmt.Errorf("%w: ISL %d does not cover %d hashed blocks of %d tokens", ErrBadRequest, req.ISL, len(req.SeqHashes), bs)
		}
		pr.seqs = append((*buf)[:0], req.SeqHashes...)
		pr.isl = req.ISL
	case req.ISL > 0:
		pr.seqs = (*buf)[:0]
		pr.isl = req.ISL
	default:
		pr.release()
		return nil, fmt.Errorf("%w: request has neither tokens, sequence hashes nor a length", ErrBadRequest)
	}
	if req.Allowed != nil {
		pr.allowed = make(map[string]struct{}, len(req.Allowed))
		for _, id := range req.Allowed {
			pr.allowed[id] = struct{}{}
		}
	}
	if pr.w.trackActive {
		// Blocks no other request can share are booked as a count, not as
		// invented hashes: the ledger adds them to the worker's active blocks
		// without touching its shared block index.
		if pr.w.assumeReuse {
			pr.active = pr.seqs
			if pr.isl%bs != 0 { // the partial tail block is private to the request
				pr.private = 1
			}
		} else {
			pr.private = (pr.isl + bs - 1) / bs
		}
	}
	return pr, nil
}

// release returns pr and its hash buffer to their pools; pr must not be used
// afterwards.
func (pr *prepared) release() {
	if pr.seqs != nil {
		*pr.buf = pr.seqs[:0] // the buffer may have grown
	}
	seqPool.Put(pr.buf)
	*pr = prepared{}
	preparedPool.Put(pr)
}

// Select picks a worker for req without booking it and without waiting: when
// every eligible worker is busy it still answers, with Result.Busy set. Errors:
// ErrBadRequest, ErrNotReady, ErrNoEndpoints, ErrClosed.
func (s *SelectionService) Select(ctx context.Context, req Request) (Result, error) {
	return s.decide(ctx, &req, false)
}

// SelectAndReserve picks a worker for req and books it atomically: two
// concurrent calls never both decide on the load from before the other's
// booking of the same worker rank (see the package doc). When queueing is on
// and every eligible worker is busy it waits in the model's admission queue
// until capacity frees, ctx is done (nothing is booked; ctx's error is
// returned) or the service closes. A ctx already done books nothing. Errors: ErrBadRequest, ErrNotReady,
// ErrNoEndpoints, ErrConflict (the reservation id is booked), ErrOverloaded
// (queue full), ErrClosed, ctx errors.
func (s *SelectionService) SelectAndReserve(ctx context.Context, req Request) (Result, error) {
	return s.decide(ctx, &req, true)
}

func (s *SelectionService) decide(ctx context.Context, req *Request, reserve bool) (res Result, err error) {
	model := modelOf(req.Model)
	defer func() {
		if err != nil {
			s.st.rejected.Add(1)
			s.rec.Rejected(model, err)
		}
	}()
	if s.closed.Load() {
		return Result{}, ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err // the caller is gone: book nothing
	}
	if reserve && req.ReservationID == "" {
		req.ReservationID = NewReservationID()
	}
	var span DecisionSpan
	if s.tracer != nil {
		span = s.tracer.StartDecision(ctx, model, reserve)
	}
	ps, err := s.pol.begin(ctx, req, true) // the Classifier's verdict (policy.go)
	defer s.pol.end(ps)
	var pr *prepared
	if err == nil {
		pr, err = s.prepare(req)
	}
	if err != nil {
		if span != nil {
			span.End(nil, err)
		}
		return Result{}, err
	}
	pr.pol, pr.deadline = ps, req.Deadline
	defer pr.release()
	if cs := s.classes; cs != nil {
		c := cs.of(req.Class)
		if !cs.hold(c) {
			st := &cs.classes[c]
			err = &refusal{st.inflightFull, fmt.Errorf("%w: class %q has %d requests in flight (its InFlightLimit)", ErrAdmission, st.Name, st.InFlightLimit)}
			if span != nil {
				span.End(nil, err)
			}
			return Result{}, err
		}
		pr.class = c
		defer func() {
			if err != nil {
				cs.unhold(c)
				return
			}
			cs.admit(c, res.ReservationID, reserve)
		}()
	}
	if span != nil {
		defer func() {
			if err != nil {
				span.End(nil, err)
			} else {
				span.End(&pr.decision, nil)
			}
		}()
	}
	s.mu.RLock()
	p := s.partitions[pr.model]
	s.mu.RUnlock()
	if p == nil {
		return Result{}, errNoModel(pr.model)
	}
	if pr.session != "" {
		pr.pin, pr.pinned = p.sessions.get(pr.session, s.now().UnixNano())
	}
	// Overlap lookups run outside the partition lock; the index has its own.
	mbuf := matchPool.Get().(*[]kvindex.Match)
	defer func() { *mbuf = (*mbuf)[:0]; matchPool.Put(mbuf) }()
	*mbuf = p.matches(*mbuf, pr.seqs)
	sc := scratchPool.Get().(*evalScratch)
	defer scratchPool.Put(sc)
	sc.matches = *mbuf
	// Map matches to ranks outside the lock; re-checked before booking.
	sc.resolve(p.ranksOf())
	if !reserve || s.cfg.QueueThreshold == nil {
		return s.decideLockFree(p, pr, sc, reserve)
	}
	return s.decideQueued(ctx, p, pr, sc)
}

// decideLockFree decides without the partition lock: nobody waits (no queueing,
// or Select), so a decision needs only the loads it read to be current for the
// rank it books, which BookAt checks. A stale decision is made again; each
// retry means another booking on that rank succeeded, so the calls as a whole
// always progress.
func (s *SelectionService) decideLockFree(p *partition, pr *prepared, sc *evalScratch, reserve bool) (Result, error) {
	for {
		if s.closed.Load() {
			return Result{}, ErrClosed
		}
		sc.refresh(p)
		pr.w.forRanks(len(sc.rs.ranks))
		var ev *evaluation
		var c candidate
		var pinned, sparse bool
		var err error
		if s.sparseOK(pr, sc.rs, len(sc.matches)) {
			ev, c, pinned, sparse, err = s.decideSparse(p, pr, sc)
			if errors.Is(err, errStale) {
				s.st.retries.Add(1)
				pr.retries++
				continue
			}
		}
		if !sparse {
			ev, err = s.evaluate(p, pr, sc)
			if err == nil {
				c, pinned, err = s.choose(p, pr, ev)
			}
		}
		if err != nil {
			return Result{}, err
		}
		if reserve {
			if s.beforeBook != nil {
				s.beforeBook()
			}
			p.mu.RLock()
			if p.ranksOf() != sc.rs { // the catalog changed meanwhile
				p.mu.RUnlock()
				continue
			}
		}
		res, err := s.book(p, pr, ev, c, pinned, reserve, true)
		if reserve {
			p.mu.RUnlock()
		}
		if errors.Is(err, errStale) {
			s.st.retries.Add(1)
			pr.retries++
			continue
		}
		if err != nil {
			return Result{}, err
		}
		s.decided(pr, ev, &res, reserve, 0)
		return res, nil
	}
}

// decideQueued picks and books under the partition lock, waiting in the
// admission queue while every eligible worker is busy.
func (s *SelectionService) decideQueued(ctx context.Context, p *partition, pr *prepared, sc *evalScratch) (Result, error) {
	p.inflight.Add(1)
	defer p.inflight.Add(-1)
	start := s.now()
	deadline := int64(noDeadline)
	switch {
	case !pr.deadline.IsZero():
		deadline = pr.deadline.UnixNano()
	case s.classes != nil && s.classes.classes[pr.class].Deadline > 0:
		deadline = start.Add(s.classes.classes[pr.class].Deadline).UnixNano()
	}
	var w *waiter
	var timer *time.Timer // wakes a waiter with a deadline at it
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		wake := p.waitChan() // taken before evaluating: no wake-up can be lost
		p.mu.Lock()
		sc.refresh(p)
		pr.w.forRanks(len(sc.rs.ranks))
		if s.closed.Load() {
			s.leaveQueueLocked(p, w, false)
			p.mu.Unlock()
			return Result{}, ErrClosed
		}
		now := s.now().UnixNano()
		// Every waiter whose deadline has passed leaves the queue before
		// anyone looks at its head (the round robin's turns do not depend
		// on who looks first); they are woken to leave.
		expired := p.queue.expire(now)
		if w != nil && w.expired {
			// Its own deadline passed while it waited.
			s.leaveQueueLocked(p, w, false)
			p.mu.Unlock()
			p.signal()
			return Result{}, s.lateRefusal(pr)
		}
		ev, err := s.evaluate(p, pr, sc)
		if err != nil {
			// Leaving as the head must wake the next waiter: nothing else may.
			wasHead := w != nil && p.queue.head() == w
			s.leaveQueueLocked(p, w, false)
			p.mu.Unlock()
			if wasHead || expired {
				p.signal()
			}
			return Result{}, err
		}
		if !ev.allBusy && (p.queue.Len() == 0 || p.queue.head() == w) {
			res, err := s.commit(p, pr, ev, true, false)
			// Admitted or failed, the request is done waiting.
			s.leaveQueueLocked(p, w, err == nil)
			more := p.queue.Len() > 0
			p.mu.Unlock()
			if more || expired {
				p.signal() // the next head may fit too
			}
			if err != nil {
				return Result{}, err
			}
			wait := s.now().Sub(start)
			if w != nil {
				s.st.queueWaitNanos.Add(int64(wait))
			}
			s.decided(pr, ev, &res, true, wait)
			return res, nil
		}
		kick, joined := expired, false
		if w == nil {
			if p.queue.Len() >= s.cfg.QueueLimit {
				p.mu.Unlock()
				if expired {
					p.signal()
				}
				s.st.queueRejected.Add(1)
				return Result{}, fmt.Errorf("%w: model %q has %d requests waiting", ErrOverloaded, pr.model, p.queue.Len())
			}
			quantum := 1.0
			if cs := s.classes; cs != nil {
				c := &cs.classes[pr.class]
				if c.QueueLimit > 0 && p.queue.classWaiting(pr.class) >= c.QueueLimit {
					p.mu.Unlock()
					if expired {
						p.signal()
					}
					c.refusedQueue.Add(1)
					return Result{}, &refusal{c.queueFull, fmt.Errorf("%w: class %q has %d requests waiting for model %q (its QueueLimit)", ErrAdmission, c.Name, c.QueueLimit, pr.model)}
				}
				quantum = c.quantum
				c.waiting.Add(1)
			}
			p.seq++
			w = &waiter{
				tier: pr.priority.Tier, class: pr.class, cost: math.Max(1, float64(ev.bestPrefill)),
				deadline: deadline, score: s.queueScore(p, pr, ev, start), seq: p.seq,
			}
			if s.classes != nil {
				w.tier = s.classes.classes[pr.class].Tier
			}
			p.queue.push(w, quantum)
			s.st.queued.Add(1)
			joined = true
			// Capacity exists but others wait ahead: make sure the head looks
			// (once, when joining; later looks come from capacity changes).
			kick = kick || !ev.allBusy
		}
		p.mu.Unlock()
		if kick {
			p.signal()
		}
		if joined && s.onQueued != nil {
			s.onQueued()
		}
		var timeout <-chan time.Time
		if deadline != noDeadline {
			left := time.Duration(deadline - s.now().UnixNano())
			if timer == nil {
				timer = time.NewTimer(max(left, 0))
			} else {
				timer.Reset(max(left, 0))
			}
			timeout = timer.C
		}
		select {
		case <-ctx.Done():
			p.mu.Lock()
			expired := p.queue.expire(s.now().UnixNano())
			wasHead := w.index >= 0 && p.queue.head() == w
			s.leaveQueueLocked(p, w, false)
			p.mu.Unlock()
			if wasHead || expired {
				p.signal()
			}
			s.st.queueCanceled.Add(1)
			return Result{}, fmt.Errorf("selection: request withdrawn from the queue of model %q: %w", pr.model, ctx.Err())
		case <-wake:
		case <-timeout:
		}
	}
}

// lateRefusal is the refusal of a request whose deadline passed while it
// waited.
func (s *SelectionService) lateRefusal(pr *prepared) error {
	s.st.deadlineRefused.Add(1)
	cs := s.classes
	if cs == nil {
		return &refusal{RefusedDeadline, fmt.Errorf("%w: the request's deadline passed while it waited for model %q", ErrAdmission, pr.model)}
	}
	c := &cs.classes[pr.class]
	c.refusedLate.Add(1)
	return &refusal{c.late, fmt.Errorf("%w: the request's deadline passed while it waited for model %q (class %q)", ErrAdmission, pr.model, c.Name)}
}

// decided completes a successful decision's result and reports it.
func (s *SelectionService) decided(pr *prepared, ev *evaluation, res *Result, reserve bool, wait time.Duration) {
	res.QueueWait = wait
	pr.decision = Decision{
		WorkerRank: res.WorkerRank, Candidates: ev.candidates,
		ChosenOverlapBlocks: res.Overlap.Device, BestOverlapBlocks: ev.bestOverlap,
		RequestBlocks: res.RequestBlocks, EffectivePrefill: res.EffectivePrefillTokens,
		QueueWait: wait, Reserved: reserve, Cost: res.Cost,
		PotentialDecodeBlocks: res.PotentialDecodeBlocks, Retries: pr.retries, Margin: ev.margin,
		Predicted: pr.w.predictive,
	}
	s.rec.Selected(pr.model, pr.decision)
}

// leaveQueueLocked takes w (nil: none) out of p's queue, unless the queue's
// expire took it out already; admitted: it is the head, admitted. Each
// waiter leaves once.
func (s *SelectionService) leaveQueueLocked(p *partition, w *waiter, admitted bool) {
	if w == nil {
		return
	}
	p.queue.remove(w, admitted)
	if s.classes != nil {
		s.classes.classes[w.class].waiting.Add(-1)
	}
}

// queueScore is the waiter's order within its tier (higher first).
func (s *SelectionService) queueScore(p *partition, pr *prepared, ev *evaluation, arrival time.Time) float64 {
	jump := pr.priority.Jump
	offset := arrival.Sub(p.epoch).Seconds()
	switch s.cfg.QueuePolicy {
	case QueueLCFS:
		return jump + offset
	case QueueWSPT:
		return (1 + jump) / math.Max(1, float64(ev.bestPrefill))
	default:
		return jump - offset
	}
}

// Refusal reasons of the requests the service cannot route, as
// RefusalReason names them: stable strings, fit for a metric label and an
// answer's body.
const (
	// RefusedUnknownModel: no worker at all is registered for the request's
	// model (a typo in the model, or discovery has found none yet).
	RefusedUnknownModel = "unknown_model"
	// RefusedNoSchedulable: the model has workers, none of them schedulable;
	// RefusalReason appends the first worker's first reason code
	// ("no_schedulable_worker:kv_event_endpoint_missing").
	RefusedNoSchedulable = "no_schedulable_worker"
	// RefusedNoneEligible: the request's allowed subset names none of the
	// model's schedulable workers.
	RefusedNoneEligible = "none_eligible"
	// RefusedOverloaded: the admission queue is full.
	RefusedOverloaded = "overloaded"
	// RefusedClosed: the service is closed.
	RefusedClosed = "closed"
	// RefusedFiltered: a policy Filter excluded every candidate left;
	// RefusalReason appends its name ("filtered:lora").
	RefusedFiltered = "filtered"
	// RefusedClassifier: the policy Classifier refused the request
	// (ErrRefused); RefusalReason appends its reason
	// ("classifier:batch_closed").
	RefusedClassifier = "classifier"
	// RefusedClassQueueFull: the request's policy class has its
	// Class.QueueLimit requests waiting for the model (ErrAdmission);
	// RefusalReason appends the class ("class_queue_full:batch").
	RefusedClassQueueFull = "class_queue_full"
	// RefusedClassInFlightFull: the request's policy class holds its
	// Class.InFlightLimit requests (ErrAdmission); RefusalReason appends the
	// class ("class_inflight_full:batch").
	RefusedClassInFlightFull = "class_inflight_full"
	// RefusedDeadline: the request's deadline passed while it waited in the
	// admission queue (ErrAdmission); RefusalReason appends its class
	// ("deadline:interactive"; "deadline" alone without classes).
	RefusedDeadline = "deadline"
)

// refusal is a routing refusal with its reason (RefusalReason).
type refusal struct {
	reason string
	err    error
}

func (r *refusal) Error() string { return r.err.Error() }
func (r *refusal) Unwrap() error { return r.err }

// RefusalReason names why err refused a request that could not be routed
// (the Refused constants: unknown model, no schedulable worker and the first
// reason why, none of the allowed workers, a full queue, a closed service, a
// filter that left no candidate, the classifier's refusal, a class's full
// queue or in-flight limit, a deadline passed in the queue);
// "" for any other error and for nil. A gateway puts it in its answer's body
// and its metric label, so that a 503 says which of these it is.
func RefusalReason(err error) string {
	var r *refusal
	switch {
	case errors.As(err, &r):
		return r.reason
	case errors.Is(err, ErrNoEndpoints):
		return RefusedNoneEligible
	case errors.Is(err, ErrOverloaded):
		return RefusedOverloaded
	case errors.Is(err, ErrClosed):
		return RefusedClosed
	}
	return ""
}

func errNoModel(model string) error {
	return &refusal{RefusedUnknownModel, fmt.Errorf("%w: no worker serves model %q", ErrNotReady, model)}
}

// errNotReady is ErrNotReady for a model whose partition has no schedulable
// rank, saying why: the workers of the model that are not schedulable, with
// their reasons (the first few), so that a worker registered without what it
// needs (an event endpoint, a DP size...) is named at the first request.
func (s *SelectionService) errNotReady(model string) error {
	const show = 3
	var why []string
	n, first := 0, ""
	for _, rec := range s.cat.List() {
		if modelOf(rec.Worker.Model) != model || rec.Lifecycle == catalog.Schedulable {
			continue
		}
		if n++; n <= show {
			why = append(why, fmt.Sprintf("%s is %s (%v)", rec.Worker.ID, rec.Lifecycle, rec.Reasons))
		}
		if first == "" && len(rec.Reasons) > 0 {
			first, _, _ = strings.Cut(string(rec.Reasons[0]), ":")
		}
	}
	switch {
	case n == 0:
		return &refusal{RefusedNoSchedulable, fmt.Errorf("%w: model %q has no schedulable worker", ErrNotReady, model)}
	case n > show:
		why = append(why, fmt.Sprintf("and %d more", n-show))
	}
	reason := RefusedNoSchedulable
	if first != "" {
		reason += ":" + first
	}
	return &refusal{reason, fmt.Errorf("%w: model %q has no schedulable worker: %s", ErrNotReady, model, strings.Join(why, "; "))}
}
