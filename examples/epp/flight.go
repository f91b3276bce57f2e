package main

import (
	"context"
	"errors"
	"mime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/selection/httproute"
)

// flight is one booked request between its pick and its end: the Settler of
// its pick and the Follower of its response. The first output byte hands
// the plan off (the prefill leg is done, or the prefill of an aggregated
// worker), the end completes it, each at most once; while the response
// flows, the renewer renews the plan's leases, the SSE events of a 2xx event
// stream grow its decode booking (with output growth on), and a response
// served by another worker than the one picked moves the booking there.
//
// Failure feedback, as selection/httproute gives it: a response status that
// describes the worker's health (httproute.DefaultFailureStatus: 5xx but 501
// and 505, Envoy's own 503 for a refused or reset connection included)
// marks the worker that carries the booking failed, and a response served
// by one of the pick's fallbacks marks the pick failed (the gateway moves
// to a fallback only when the pick could not answer). Either happens at most
// once per request; the destination service then leaves the worker out of
// its picks for its FailureEjection time.
//
// The extproc server calls FirstByte, Done and the Follower methods from the
// request's goroutine; Done may also come from the signer's failure path in
// Pick. The renewer reads progress and writes seen from its own goroutine;
// sse is the request goroutine's alone.
type flight struct {
	r    *router
	plan roles.Plan // its ID, and the decode leg's fallbacks

	first, end sync.Once
	// progress counts the response body chunks seen; the renewer's tick
	// (the only user of seen) renews when it is still 0 (the worker
	// prefills, or computes an answer it does not stream) or when it moved
	// since the tick before.
	progress atomic.Uint64
	seen     uint64
	sse      *httproute.SSECounter // a 2xx event stream's data lines, with output growth; nil otherwise
	// worker carries the booking: the pick, or the worker a served-elsewhere
	// report moved it to; marked is set once a worker was reported failed.
	// The request goroutine's alone.
	worker string
	marked bool
}

var (
	_ extproc.Settler  = (*flight)(nil)
	_ extproc.Follower = (*flight)(nil)
)

// newFlight starts following plan; with renewal on, the renewer holds it
// until Done.
func (r *router) newFlight(plan roles.Plan) *flight {
	f := &flight{r: r, plan: plan, worker: plan.Decode.Worker}
	if r.renew != nil {
		r.renew.add(f)
	}
	return f
}

// FirstByte hands the plan off, once.
func (f *flight) FirstByte() { f.first.Do(func() { _ = f.r.book.Handoff(f.plan.ID) }) }

// Done completes the plan, once, and stops renewing it.
func (f *flight) Done() {
	f.end.Do(func() {
		if f.r.renew != nil {
			f.r.renew.remove(f)
		}
		_ = f.r.book.Complete(f.plan.ID) // an unknown plan expired already: nothing to free
	})
}

// Served moves the booking to the worker the gateway served the request on.
func (f *flight) Served(endpoint string) { f.r.rebook(f, endpoint) }

// ResponseHeaders reports a failed worker for a status that says so, and
// starts counting SSE events for a 2xx event stream when output growth is
// on.
func (f *flight) ResponseHeaders(status int, contentType string) {
	if httproute.DefaultFailureStatus(status) {
		f.markFailed(f.worker, failedStatus, "status", status)
	}
	if !f.r.growth || status < 200 || status > 299 {
		return
	}
	if mt, _, err := mime.ParseMediaType(contentType); err == nil && mt == "text/event-stream" {
		f.sse = &httproute.SSECounter{}
	}
}

// ResponseBody records progress and, for a counted stream, grows the
// booking by the events generated so far.
func (f *flight) ResponseBody(chunk []byte) {
	f.progress.Add(1)
	if f.sse != nil && f.sse.Scan(chunk) {
		_ = f.r.book.Generated(f.plan.ID, f.sse.Events()) // a plan already gone has nothing to grow
	}
}

// rebook moves f's booking to the worker that served endpoint: a fallback
// of the pick, else any worker discovery knows on that endpoint (its first
// rank). A served endpoint that is no known worker, or a worker the
// destination role cannot book (not schedulable, another role), frees the
// booking: its load would be charged to a worker that is not doing the work.
func (r *router) rebook(f *flight, endpoint string) {
	to, known, fallback := r.rankAt(endpoint, f.plan.Decode.Fallbacks)
	if fallback {
		f.markFailed(f.plan.Decode.Worker, failedFallback, "served", endpoint)
	}
	var err error
	if known {
		if err = r.book.Move(f.plan.ID, to); err == nil {
			f.worker = to.Worker
			r.m.rebooked(rebookMoved)
			r.log.Info("booking moved to the served worker", "plan", f.plan.ID,
				"picked", f.plan.Decode.Worker, "served", to.Worker, "rank", to.Rank, "endpoint", endpoint)
			return
		}
		if errors.Is(err, roles.ErrUnknownPlan) || errors.Is(err, selection.ErrUnknownReservation) {
			return // settled already (expired): nothing to move
		}
	}
	f.Done()
	r.m.rebooked(rebookFreed)
	attrs := []any{"plan", f.plan.ID, "picked", f.plan.Decode.Worker, "served", endpoint}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	r.log.Warn("served by an endpoint that is no schedulable worker of the destination role; booking freed", attrs...)
}

// rankAt maps a served endpoint to a worker rank; fallback tells that it is
// one of the pick's fallbacks.
func (r *router) rankAt(endpoint string, fallbacks []selection.Fallback) (wr catalog.WorkerRank, known, fallback bool) {
	for _, fb := range fallbacks {
		if ep, err := extproc.CanonicalEndpoint(fb.Endpoint); err == nil && ep == endpoint {
			return fb.WorkerRank, true, true
		}
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	id, ok := r.byAddr[endpoint]
	if !ok {
		return catalog.WorkerRank{}, false, false
	}
	return r.firstRank[id], true, false
}

// markFailed reports worker failed to the destination service, once per
// request (see flight).
func (f *flight) markFailed(worker, cause string, attrs ...any) {
	if f.marked || worker == "" {
		return
	}
	f.marked = true
	err := f.r.loads.MarkFailed(worker)
	f.r.m.markedFailed(cause)
	attrs = append([]any{"plan", f.plan.ID, "worker", worker, "cause", cause}, attrs...)
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	f.r.log.Warn("worker marked failed: out of the picks for the failure ejection time", attrs...)
}

// renewer renews, every interval, the leases of the plans in flight that
// make progress (see flight.progress), so that a stream longer than the
// lease keeps its booking to its end while one that went silent expires:
// it is renewed at most once after its last chunk, so it expires within an
// interval past its lease. It is safe for concurrent use; tick is called by
// one goroutine at a time (run's, or a test's).
type renewer struct {
	book booker
	m    *routerMetrics

	mu   sync.Mutex
	live map[*flight]struct{}
	buf  []*flight // tick's scratch
}

func newRenewer(book booker, m *routerMetrics) *renewer {
	return &renewer{book: book, m: m, live: map[*flight]struct{}{}}
}

func (w *renewer) add(f *flight) {
	w.mu.Lock()
	w.live[f] = struct{}{}
	w.mu.Unlock()
}

func (w *renewer) remove(f *flight) {
	w.mu.Lock()
	delete(w.live, f)
	w.mu.Unlock()
}

// tick renews the plans that made progress since the last tick, or have
// not started their response yet, and returns how many it renewed and how
// many it skipped as stalled.
func (w *renewer) tick() (renewed, stalled int) {
	w.mu.Lock()
	w.buf = w.buf[:0]
	for f := range w.live {
		w.buf = append(w.buf, f)
	}
	w.mu.Unlock()
	for _, f := range w.buf {
		p := f.progress.Load()
		if p != 0 && p == f.seen {
			stalled++
			continue
		}
		f.seen = p
		if w.book.Renew(f.plan.ID) == nil {
			renewed++
		}
	}
	clear(w.buf)
	w.m.renewals(renewed, stalled)
	return renewed, stalled
}

// tickEvery calls f every interval until ctx is done.
func tickEvery(ctx context.Context, every time.Duration, f func()) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f()
		}
	}
}

// explainCandidates bounds the debug header to the cheapest candidates.
const explainCandidates = 4

// explain renders the x-kvselect-debug value: the rank booked, then the
// cheapest candidates (at most explainCandidates) with their cost terms as
// the destination role scored them just before the booking (the cost in
// its unit: blocks, or the predictive cost's seconds): cached blocks
// (device+host+disk), the prefill tokens they would have, their decode
// blocks with the request, their active requests, busy. Worker ids are
// shortened and reduced to a safe alphabet; the value stays under
// extproc.MaxDebugLen.
func explain(chosen catalog.WorkerRank, sc []selection.Scored) string {
	var b strings.Builder
	b.WriteString("chosen=")
	writeRank(&b, chosen)
	top := make([]selection.Scored, 0, explainCandidates)
	for _, s := range sc {
		i := len(top)
		for i > 0 && s.Cost < top[i-1].Cost {
			i--
		}
		if i >= explainCandidates {
			continue
		}
		if len(top) < explainCandidates {
			top = append(top, selection.Scored{})
		}
		copy(top[i+1:], top[i:len(top)-1])
		top[i] = s
	}
	for _, s := range top {
		b.WriteString("; ")
		writeRank(&b, s.WorkerRank)
		b.WriteString(" cost=")
		if c := s.Cost; c > -1 && c < 1 { // three significant digits: the predictive cost is in seconds
			b.WriteString(strconv.FormatFloat(c, 'g', 3, 64))
		} else {
			b.WriteString(strconv.FormatFloat(c, 'f', 2, 64))
		}
		b.WriteString(" cached=")
		b.WriteString(strconv.Itoa(s.Overlap.Device))
		b.WriteByte('+')
		b.WriteString(strconv.Itoa(s.Overlap.Host))
		b.WriteByte('+')
		b.WriteString(strconv.Itoa(s.Overlap.Disk))
		b.WriteString(" prefill=")
		b.WriteString(strconv.FormatInt(s.PotentialPrefill, 10))
		b.WriteString(" decode=")
		b.WriteString(strconv.Itoa(s.PotentialDecodeBlock))
		b.WriteString(" reqs=")
		b.WriteString(strconv.Itoa(s.ActiveRequests))
		if s.Busy {
			b.WriteString(" busy")
		}
	}
	return b.String()
}

// maxExplainedID bounds a worker id in the debug header.
const maxExplainedID = 64

func writeRank(b *strings.Builder, wr catalog.WorkerRank) {
	id := wr.Worker
	if len(id) > maxExplainedID {
		id = id[:maxExplainedID]
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '.' || c == '_' {
			b.WriteByte(c)
		} else {
			b.WriteByte('_')
		}
	}
	b.WriteByte('/')
	b.WriteString(strconv.Itoa(wr.Rank))
}
