package lifecycle

import (
	"errors"
	"mime"
	"sync"
	"sync/atomic"

	"github.com/kvselect/kvselect/catalog"
)

// Handle settles one booked request (see the package documentation for the
// vocabulary and the repeat-call contract).
type Handle interface {
	PrefillComplete() error
	Renew() error
	Generated(tokens int) error
	Move(to catalog.WorkerRank) error
	MarkFailed() error
	Done() error
}

// PrefillMarker is implemented by a handle whose request has a prefill leg
// on a worker of its own (roles.Plan of a prefill/decode pair):
// MarkPrefillFailed marks that worker failed, not the one carrying the
// booking, with the repeat-call contract of MarkFailed.
type PrefillMarker interface {
	MarkPrefillFailed() error
}

// ErrNoHandle reports a Follower asked for without a Handle.
var ErrNoHandle = errors.New("lifecycle: no handle")

// Cause is why a Follower marked a worker failed.
type Cause uint8

const (
	// CauseStatus: the response's status describes the worker's health
	// (Options.FailureStatus).
	CauseStatus Cause = iota + 1
	// CauseFallback: a fallback of the pick served the request, which a
	// gateway does only when the pick could not answer.
	CauseFallback
	// CauseUpstream: the worker could not be reached, reset the connection
	// or cut its answer short (Follower.Fail).
	CauseUpstream
	// CausePrefill: the request's prefill leg failed on its prefill worker,
	// which is the one marked (Follower.PrefillFailed).
	CausePrefill
)

// String names the cause as the reference EPP's metrics do.
func (c Cause) String() string {
	switch c {
	case CauseStatus:
		return "status"
	case CauseFallback:
		return "fallback"
	case CauseUpstream:
		return "upstream"
	case CausePrefill:
		return "prefill"
	}
	return "unknown"
}

// FailureStatus is the default Options.FailureStatus: every 5xx except 501
// Not Implemented and 505 HTTP Version Not Supported, which answer the
// request rather than describe the worker's health. A 4xx never counts: it
// is the request's fault (429 is the engine's own back-pressure, which the
// service's load already tracks). Envoy answers 503 for a connection to the
// worker refused or reset, so that counts.
func FailureStatus(status int) bool {
	return status >= 500 && status <= 599 && status != 501 && status != 505
}

// Options configure a Follower. The zero value follows with the defaults.
type Options struct {
	// OutputGrowth counts the data lines of a 2xx event stream as the
	// tokens generated so far (Handle.Generated), so the decode booking
	// grows with the output.
	OutputGrowth bool
	// FailureStatus reports whether a response status marks the worker
	// failed. Nil: FailureStatus.
	FailureStatus func(status int) bool
	// Marked, when set, is called once when the follower marks the worker
	// failed, with the cause and Handle.MarkFailed's error (with
	// CausePrefill, MarkPrefillFailed's), on the goroutine of the call that
	// marked it.
	Marked func(c Cause, err error)
}

// Follower drives one Handle from one response (see the package
// documentation). Create it with NewFollower.
type Follower struct {
	h    Handle
	opts Options

	// The request goroutine's alone.
	status  int
	started bool
	prefill bool       // the prefill leg failed (PrefillFailed): the destination is not to blame
	counted bool       // a 2xx event stream, with output growth
	sse     sseCounter // its data lines

	marked atomic.Bool
	ended  atomic.Bool
	end    sync.Once
	endErr error

	// progress counts the body chunks seen; seen is Renew's alone.
	progress atomic.Uint64
	seen     uint64
}

// NewFollower returns a follower of h. A nil h is ErrNoHandle.
func NewFollower(h Handle, opts Options) (*Follower, error) {
	if h == nil {
		return nil, ErrNoHandle
	}
	if opts.FailureStatus == nil {
		opts.FailureStatus = FailureStatus
	}
	return &Follower{h: h, opts: opts}, nil
}

// Response reports the response's status (0 when unknown) and content type,
// once, before its body.
func (f *Follower) Response(status int, contentType string) {
	f.status = status
	if f.opts.FailureStatus(status) && !f.prefill {
		f.mark(CauseStatus)
	}
	if f.opts.OutputGrowth && success(status) && status != 0 {
		if mt, _, err := mime.ParseMediaType(contentType); err == nil && mt == "text/event-stream" {
			f.counted = true
		}
	}
}

// Body reports a chunk of the response body; an empty one is ignored. It
// reports whether the chunk was the first output (Handle.PrefillComplete
// called, and answered nil).
func (f *Follower) Body(chunk []byte) (first bool) {
	if len(chunk) == 0 {
		return false
	}
	f.progress.Add(1)
	if !f.started {
		f.started = true
		if success(f.status) {
			first = f.h.PrefillComplete() == nil
		}
	}
	if f.counted && f.sse.scan(chunk) {
		_ = f.h.Generated(f.sse.events) // a booking already gone has nothing to grow
	}
	return first
}

// Served reports that the request was served by worker rank to, not by the
// pick; fallback tells that to is one of the pick's fallbacks, so the pick
// is marked failed first. The booking moves to to: Handle.Move's error is
// returned (to is no schedulable rank of the booking's role, or the booking
// is gone), and the caller decides whether to end the booking, so that its
// load is not charged to a worker that is not doing the work.
func (f *Follower) Served(to catalog.WorkerRank, fallback bool) error {
	if fallback {
		f.mark(CauseFallback)
	}
	return f.h.Move(to)
}

// PrefillFailed reports that the request's prefill leg failed on its own
// worker (a decode sidecar's gaie.HeaderFailedLeg), before Response: that
// worker is marked failed (PrefillMarker; nothing for a handle without a
// prefill leg), and the failure status that follows is not the
// destination's. The follower marks at most once, whichever the worker.
func (f *Follower) PrefillFailed() {
	f.prefill = true
	if f.marked.Swap(true) {
		return
	}
	pm, ok := f.h.(PrefillMarker)
	if !ok {
		return
	}
	err := pm.MarkPrefillFailed()
	if f.opts.Marked != nil {
		f.opts.Marked(CausePrefill, err)
	}
}

// Fail reports that the worker carrying the booking failed the request on
// the wire: it could not be reached, reset the connection or cut its answer
// short. Not for a client that left: that is nobody's failure.
func (f *Follower) Fail() { f.mark(CauseUpstream) }

func (f *Follower) mark(c Cause) {
	if f.marked.Swap(true) {
		return
	}
	err := f.h.MarkFailed()
	if f.opts.Marked != nil {
		f.opts.Marked(c, err)
	}
}

// Renew renews the booking's leases when the request made progress since
// the last call, or has not started its body yet, and reports whether it
// renewed (Handle.Renew answered nil) or skipped a stalled stream. After
// Done it does nothing.
func (f *Follower) Renew() (renewed, stalled bool) {
	if f.ended.Load() {
		return false, false
	}
	p := f.progress.Load()
	if p != 0 && p == f.seen {
		return false, true
	}
	f.seen = p
	return f.h.Renew() == nil, false
}

// Done ends the booking (Handle.Done) on its first call and returns that
// call's error; later calls return nil and do nothing.
func (f *Follower) Done() error {
	first := false
	f.end.Do(func() {
		first = true
		f.ended.Store(true)
		f.endErr = f.h.Done()
	})
	if !first {
		return nil
	}
	return f.endErr
}

func success(status int) bool { return status == 0 || status >= 200 && status <= 299 }

// sseCounter counts the data lines of a server-sent event stream ("data:"
// at the start of a line) across chunks that may split a line anywhere. An
// OpenAI-compatible engine streams one chunk per generated token (more with
// speculative decoding, which the count then under-reports), so the count
// is the tokens generated so far (the final "data: [DONE]" adds one, less
// than a block).
type sseCounter struct {
	col     int // bytes into the current line
	matched int // bytes of "data:" matched at its start
	events  int
}

// scan counts p's data lines and reports whether it found one.
func (c *sseCounter) scan(p []byte) bool {
	const field = "data:"
	before := c.events
	for _, ch := range p {
		if ch == '\n' {
			c.col, c.matched = 0, 0
			continue
		}
		if c.col == c.matched && c.matched < len(field) && ch == field[c.matched] {
			if c.matched++; c.matched == len(field) {
				c.events++
			}
		}
		c.col++
	}
	return c.events != before
}
