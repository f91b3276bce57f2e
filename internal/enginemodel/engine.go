package enginemodel

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
)

// Errors of this package. They are wrapped with context; test with errors.Is.
var (
	// ErrInvalidParams: New was given Params that fail validation. The
	// message lists every problem.
	ErrInvalidParams = errors.New("enginemodel: invalid params")
	// ErrDuplicateID: Add was given the id of a request the engine holds.
	ErrDuplicateID = errors.New("enginemodel: duplicate request id")
	// ErrInvalidRequest: Add was given a negative token count.
	ErrInvalidRequest = errors.New("enginemodel: invalid request")
)

// Defaults applied by New to zero-valued Params fields (see the package doc
// for where they come from).
const (
	// DefaultMaxBatchedTokens is vLLM's max_num_batched_tokens for online
	// serving on GPUs of 70 GiB or more other than the A100.
	DefaultMaxBatchedTokens = 8192
	// DefaultMaxRunning is vLLM's max_num_seqs for online serving on the same
	// GPUs.
	DefaultMaxRunning = 1024
	// DefaultStepBase, DefaultPrefillToken and DefaultDecodeSeq are the fake
	// engines' step costs: 2 ms a step, 20 us a prompt token (a 500-token
	// prompt in 12 ms), 50 us a decoding request.
	DefaultStepBase     = 2 * time.Millisecond
	DefaultPrefillToken = 20 * time.Microsecond
	DefaultDecodeSeq    = 50 * time.Microsecond
)

// Params configure an Engine. The zero value is valid and means every
// default. New copies them; the Engine never writes them.
type Params struct {
	// RequestOverhead is the time from Add to the moment the request can be
	// scheduled: the HTTP server, tokenization and the trip to the engine
	// core. Default 0; must be >= 0.
	RequestOverhead time.Duration
	// MaxBatchedTokens is the token budget of one step (vLLM's
	// max_num_batched_tokens). Default DefaultMaxBatchedTokens; must be >=
	// MaxRunning (as vLLM requires), so that every running request can
	// decode in every step.
	MaxBatchedTokens int
	// MaxRunning is how many requests hold a seat at once (vLLM's
	// max_num_seqs); more wait. Default DefaultMaxRunning; must be >= 1.
	MaxRunning int
	// StepBase is what every step costs whatever it holds (reading the
	// weights, launching the kernels). 0 means DefaultStepBase; negative
	// means none.
	StepBase time.Duration
	// PrefillToken is the cost of one prompt token computed in a step. 0
	// means DefaultPrefillToken; negative means none.
	PrefillToken time.Duration
	// DecodeSeq is the cost of one decoding request in a step (reading its
	// KV). 0 means DefaultDecodeSeq; negative means none.
	DecodeSeq time.Duration
	// Speed divides every step's duration: 1 is the nominal engine, 0.5 one
	// twice as slow, 2 one twice as fast. 0 means 1; otherwise finite and >
	// 0.
	Speed float64
	// Cached, when set, is called once per request when it is first
	// scheduled, with its id; it returns how many of its prompt tokens (the
	// count given to Add) the engine's prefix cache holds. The request then
	// computes the rest, at least one token. Nil means Add's tokens are all
	// computed. It is called from within Advance.
	Cached func(id uint64) int
}

// withDefaults returns a validated copy of p with defaults applied.
func (p Params) withDefaults() (Params, error) {
	var problems []string
	if p.RequestOverhead < 0 {
		problems = append(problems, fmt.Sprintf("RequestOverhead %v < 0", p.RequestOverhead))
	}
	if p.MaxRunning == 0 {
		p.MaxRunning = DefaultMaxRunning
	} else if p.MaxRunning < 0 {
		problems = append(problems, fmt.Sprintf("MaxRunning %d < 1", p.MaxRunning))
	}
	if p.MaxBatchedTokens == 0 {
		p.MaxBatchedTokens = max(DefaultMaxBatchedTokens, p.MaxRunning)
	} else if p.MaxBatchedTokens < p.MaxRunning {
		problems = append(problems, fmt.Sprintf("MaxBatchedTokens %d < MaxRunning %d", p.MaxBatchedTokens, p.MaxRunning))
	}
	p.StepBase = costDefault(p.StepBase, DefaultStepBase)
	p.PrefillToken = costDefault(p.PrefillToken, DefaultPrefillToken)
	p.DecodeSeq = costDefault(p.DecodeSeq, DefaultDecodeSeq)
	switch {
	case p.Speed == 0:
		p.Speed = 1
	case math.IsNaN(p.Speed) || math.IsInf(p.Speed, 0) || p.Speed < 0:
		problems = append(problems, fmt.Sprintf("Speed %v, want a finite value > 0", p.Speed))
	}
	if len(problems) > 0 {
		return Params{}, fmt.Errorf("%w: %s", ErrInvalidParams, strings.Join(problems, "; "))
	}
	return p, nil
}

// costDefault maps a cost field: 0 is the default, negative is none.
func costDefault(d, def time.Duration) time.Duration {
	switch {
	case d == 0:
		return def
	case d < 0:
		return 0
	}
	return d
}

// EventKind says what happened to a request.
type EventKind uint8

const (
	// EventFirstToken: the request's prompt is computed and its first output
	// token is out (its time to first token ends).
	EventFirstToken EventKind = iota + 1
	// EventToken: one more output token is out.
	EventToken
	// EventFinished: the request has all its output tokens and has left the
	// engine; it always follows the request's last token event, at the same
	// time.
	EventFinished
)

// String returns "first-token", "token" or "finished".
func (k EventKind) String() string {
	switch k {
	case EventFirstToken:
		return "first-token"
	case EventToken:
		return "token"
	case EventFinished:
		return "finished"
	default:
		return fmt.Sprintf("EventKind(%d)", uint8(k))
	}
}

// Event is something that happened to a request at a step's end. It is a
// plain value.
type Event struct {
	At   time.Duration
	ID   uint64
	Kind EventKind
	// Tokens is the number of output tokens the request has had so far (1
	// for EventFirstToken; its output count for EventFinished).
	Tokens int
}

// Stats is a snapshot of an engine's queues.
type Stats struct {
	// Waiting counts requests added and not yet scheduled (those still in
	// their RequestOverhead included); Running those holding a seat.
	Waiting, Running int
	// QueuedPrefillTokens is the prompt work left: the tokens of waiting
	// requests (their whole count as given to Add, when Params.Cached has not
	// been asked yet) plus what running requests have not computed yet.
	QueuedPrefillTokens int
	// Steps counts the steps begun.
	Steps uint64
}

// request states.
const (
	stateFree uint8 = iota
	stateWaiting
	stateRunning
)

type request struct {
	id       uint64
	ready    time.Duration // schedulable from
	prompt   int           // prompt tokens to compute (after Cached)
	done     int           // prompt tokens computed
	out      int           // output tokens wanted
	tokens   int           // output tokens out so far
	inStep   int           // tokens scheduled in the step in progress
	state    uint8
	asked    bool // Cached has been called
	canceled bool // canceled while in the step in progress
}

// Engine is the model of one engine's scheduler; see the package doc. It is
// not safe for concurrent use. Create it with New.
type Engine struct {
	p     Params
	now   time.Duration // the engine's time: the last Advance's bound
	reqs  []request     // slab; indexes are stable while a request lives
	free  []int32       // free slab slots
	index map[uint64]int32

	waiting []int32 // FCFS; -1 marks a slot taken out of the middle
	whead   int
	nwait   int
	running []int32 // in the order they were admitted

	holes int // slots marked -1 in waiting[whead:]

	stepping   bool
	stepEnd    time.Duration
	steps      uint64
	queuedToks int
}

// New validates p, applies its defaults and returns an idle engine at time 0.
// It returns an error wrapping ErrInvalidParams that lists every problem.
func New(p Params) (*Engine, error) {
	q, err := p.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Engine{p: q, index: make(map[uint64]int32)}, nil
}

// Params returns the engine's parameters with defaults applied.
func (e *Engine) Params() Params { return e.p }

// Now returns the engine's time: the largest bound Advance was called with.
func (e *Engine) Now() time.Duration { return e.now }

// Add puts request id in the engine at time at (taken as Now when it is
// earlier): it is schedulable RequestOverhead later, computes max(1,
// promptTokens) prompt tokens (fewer with Params.Cached) and generates
// max(1, outputTokens) tokens. A time in the future delays it further (a
// KV transfer, for instance). It returns ErrDuplicateID for an id the engine
// holds, ErrInvalidRequest for a negative count.
func (e *Engine) Add(id uint64, promptTokens, outputTokens int, at time.Duration) error {
	if promptTokens < 0 || outputTokens < 0 {
		return fmt.Errorf("%w: request %d: prompt %d, output %d tokens", ErrInvalidRequest, id, promptTokens, outputTokens)
	}
	if _, ok := e.index[id]; ok {
		return fmt.Errorf("%w: %d", ErrDuplicateID, id)
	}
	var slot int32
	if n := len(e.free); n > 0 {
		slot = e.free[n-1]
		e.free = e.free[:n-1]
	} else {
		slot = int32(len(e.reqs))
		e.reqs = append(e.reqs, request{})
	}
	r := &e.reqs[slot]
	*r = request{id: id, ready: max(at, e.now) + e.p.RequestOverhead, prompt: max(1, promptTokens),
		out: max(1, outputTokens), state: stateWaiting, asked: e.p.Cached == nil}
	e.index[id] = slot
	e.waiting = append(e.waiting, slot)
	e.nwait++
	e.queuedToks += r.prompt
	return nil
}

// Cancel removes request id (a client that went away): it gets no event
// after this call, and its seat is free for the next step. A request in the
// step in progress still counts in that step's duration. It reports whether
// the engine held the request.
func (e *Engine) Cancel(id uint64) bool {
	slot, ok := e.index[id]
	if !ok {
		return false
	}
	r := &e.reqs[slot]
	e.queuedToks -= r.prompt - r.done
	switch r.state {
	case stateWaiting:
		for i := e.whead; i < len(e.waiting); i++ {
			if e.waiting[i] == slot {
				e.waiting[i] = -1
				e.holes++
				break
			}
		}
		e.nwait--
		e.release(slot)
		e.compactWaiting()
	case stateRunning:
		if r.inStep > 0 {
			// Its share of the step stands; it leaves at the step's end.
			r.canceled = true
			delete(e.index, id)
			return true
		}
		e.dropRunning(slot)
		e.release(slot)
	}
	return true
}

// release forgets a request and frees its slot.
func (e *Engine) release(slot int32) {
	delete(e.index, e.reqs[slot].id)
	e.freeSlot(slot)
}

// freeSlot frees a slot whose request the index no longer names.
func (e *Engine) freeSlot(slot int32) {
	e.reqs[slot] = request{}
	e.free = append(e.free, slot)
}

// dropRunning removes slot from the running list, keeping the order.
func (e *Engine) dropRunning(slot int32) {
	for i, s := range e.running {
		if s == slot {
			e.running = append(e.running[:i], e.running[i+1:]...)
			return
		}
	}
}

// Stats returns a snapshot of the engine's queues.
func (e *Engine) Stats() Stats {
	return Stats{Waiting: e.nwait, Running: len(e.running), QueuedPrefillTokens: e.queuedToks, Steps: e.steps}
}

// Next returns the time of the engine's next change (a step that ends, or
// one that can begin) and true; false when it holds nothing to do. Call
// Advance with that time to make it happen. Add and Cancel may change it.
func (e *Engine) Next() (time.Duration, bool) {
	if e.stepping {
		return e.stepEnd, true
	}
	return e.nextStart()
}

// nextStart is when the next step can begin, if any: now when a running
// request or a ready waiting one can take a token, else the earliest time a
// waiting request becomes schedulable.
func (e *Engine) nextStart() (time.Duration, bool) {
	if len(e.running) > 0 {
		return e.now, true
	}
	if e.nwait == 0 {
		return 0, false
	}
	first := time.Duration(math.MaxInt64)
	for i := e.whead; i < len(e.waiting); i++ {
		if s := e.waiting[i]; s >= 0 {
			first = min(first, e.reqs[s].ready)
		}
	}
	return max(first, e.now), true
}

// Advance runs the engine up to time to and appends to buf, in time order,
// the events of the steps that end at or before it; it returns buf. When a
// step ends exactly at to, Advance returns before beginning the next one, so
// that the caller can act on the events (store the blocks a prefill
// computed) before Params.Cached is asked about the requests that step
// admits: a caller whose Cached depends on its events calls Advance(Next())
// until Next is past the time it wants. A to before Now changes nothing.
func (e *Engine) Advance(to time.Duration, buf []Event) []Event {
	for {
		if e.stepping {
			if e.stepEnd > to {
				break
			}
			buf = e.endStep(buf)
			if e.now == to {
				return buf
			}
			continue
		}
		s, ok := e.nextStart()
		if !ok || s > to {
			break
		}
		e.now = s
		e.beginStep()
	}
	e.now = max(e.now, to)
	return buf
}

// beginStep composes the step that begins at e.now, as vLLM's schedule()
// does: running requests first, then waiting ones in order.
func (e *Engine) beginStep() {
	budget := e.p.MaxBatchedTokens
	prefill, decode := 0, 0
	for _, slot := range e.running {
		if budget == 0 {
			break
		}
		r := &e.reqs[slot]
		if left := r.prompt - r.done; left > 0 {
			r.inStep = min(left, budget)
			prefill += r.inStep
		} else {
			r.inStep = 1
			decode++
		}
		budget -= r.inStep
	}
	for i := e.whead; i < len(e.waiting) && budget > 0 && len(e.running) < e.p.MaxRunning; i++ {
		slot := e.waiting[i]
		if slot < 0 {
			continue
		}
		r := &e.reqs[slot]
		if r.ready > e.now {
			continue
		}
		if !r.asked {
			r.asked = true
			cached := min(max(e.p.Cached(r.id), 0), r.prompt-1)
			r.prompt -= cached
			e.queuedToks -= cached
		}
		e.waiting[i] = -1
		e.holes++
		e.nwait--
		r.state = stateRunning
		e.running = append(e.running, slot)
		r.inStep = min(r.prompt, budget)
		prefill += r.inStep
		budget -= r.inStep
	}
	e.compactWaiting()
	d := e.p.StepBase + time.Duration(prefill)*e.p.PrefillToken + time.Duration(decode)*e.p.DecodeSeq
	if e.p.Speed != 1 {
		d = time.Duration(float64(d) / e.p.Speed)
	}
	e.stepping, e.stepEnd = true, e.now+d
	e.steps++
}

// compactWaiting drops the slots taken out of the waiting list: those at its
// head at once, the others when they are many.
func (e *Engine) compactWaiting() {
	for e.whead < len(e.waiting) && e.waiting[e.whead] < 0 {
		e.whead++
		e.holes--
	}
	if e.whead == len(e.waiting) {
		e.waiting, e.whead = e.waiting[:0], 0
		return
	}
	if e.holes < 64 && e.holes*2 < len(e.waiting)-e.whead && e.whead*2 < len(e.waiting) {
		return
	}
	n := 0
	for _, s := range e.waiting[e.whead:] {
		if s >= 0 {
			e.waiting[n] = s
			n++
		}
	}
	e.waiting, e.whead, e.holes = e.waiting[:n], 0, 0
}

// endStep ends the step in progress at e.stepEnd and appends its events.
func (e *Engine) endStep(buf []Event) []Event {
	e.now = e.stepEnd
	e.stepping = false
	n := 0
	for _, slot := range e.running {
		r := &e.reqs[slot]
		k := r.inStep
		r.inStep = 0
		if r.canceled { // Cancel already forgot its id
			e.freeSlot(slot)
			continue
		}
		if k > 0 {
			if r.done < r.prompt {
				r.done += k
				e.queuedToks -= k
				if r.done == r.prompt {
					r.tokens = 1
					buf = append(buf, Event{At: e.now, ID: r.id, Kind: EventFirstToken, Tokens: 1})
				}
			} else {
				r.tokens++
				buf = append(buf, Event{At: e.now, ID: r.id, Kind: EventToken, Tokens: r.tokens})
			}
			if r.tokens == r.out && r.done == r.prompt {
				buf = append(buf, Event{At: e.now, ID: r.id, Kind: EventFinished, Tokens: r.tokens})
				e.release(slot)
				continue
			}
		}
		e.running[n] = slot
		n++
	}
	e.running = e.running[:n]
	return buf
}
