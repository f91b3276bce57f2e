package eppserver

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/epp/prommetrics"
	"github.com/kvselect/kvselect/lifecycle"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// flight is one booked request between its pick and its end: the Settler of
// its pick and the extproc Follower of its response, which it passes to the
// library's lifecycle.Follower driving the plan (see package lifecycle: the
// first output of a 2xx answer hands the plan off, body chunks are progress
// for the renewer, the SSE events of a 2xx event stream grow the decode
// booking with output growth on, a status that describes the worker's
// health marks it failed, the end completes the plan, once). What the EPP
// adds: the endpoint a served-elsewhere report names is mapped to a worker
// rank (a fallback of the pick, which marks the pick failed, or any worker
// discovery knows there), and a booking that cannot move there is ended, so
// that its load is not charged to a worker that is not doing the work. Every
// worker marked failed is counted (kvselect_epp_workers_marked_failed_total)
// and logged; the destination service then leaves it out of its picks for
// its FailureEjection time.
//
// The extproc server calls FirstByte, Done and the Follower methods from the
// request's goroutine; Done may also come from the signer's failure path in
// Pick. The renewer calls the follower's Renew from its own goroutine.
type flight struct {
	r      *router
	plan   roles.Plan // its ID, and the decode leg's fallbacks
	follow *lifecycle.Follower
	// worker carries the booking: the pick, or the worker a served-elsewhere
	// report moved it to; status is the response's. Both for the log lines,
	// the request goroutine's alone.
	worker string
	status int
}

var (
	_ extproc.Settler  = (*flight)(nil)
	_ extproc.Follower = (*flight)(nil)
)

// newFlight starts following plan; with renewal on, the renewer holds it
// until Done.
func (r *router) newFlight(plan roles.Plan) *flight {
	fl := &flight{r: r, plan: plan, worker: plan.Decode.WorkerID}
	var h lifecycle.Handle = plan
	if r.handleOf != nil {
		h = r.handleOf(plan)
	}
	fl.follow, _ = lifecycle.NewFollower(h, lifecycle.Options{OutputGrowth: r.growth, Marked: fl.marked}) // never a nil Handle
	if r.renew != nil {
		r.renew.add(fl)
	}
	return fl
}

// FirstByte does nothing: the follower reports the first output from the
// first body chunk, which ResponseBody passes it.
func (fl *flight) FirstByte() {}

// Done completes the plan, once, and stops renewing it.
func (fl *flight) Done() {
	if fl.r.renew != nil {
		fl.r.renew.remove(fl)
	}
	_ = fl.follow.Done() // a plan that expired already has nothing to free
}

// Served moves the booking to the worker the gateway served the request on.
func (fl *flight) Served(endpoint string) { fl.r.rebook(fl, endpoint) }

// ResponseHeaders passes the status and content type on, after a failed
// prefill leg's report.
func (fl *flight) ResponseHeaders(r extproc.Response) {
	fl.status = r.Status
	if r.PrefillFailed {
		fl.follow.PrefillFailed()
	}
	fl.follow.Response(r.Status, r.ContentType)
}

// ResponseBody passes a chunk on, and counts it.
func (fl *flight) ResponseBody(chunk []byte) {
	fl.r.m.Chunk()
	fl.follow.Body(chunk)
}

// marked counts and logs a worker the follower marked failed.
func (fl *flight) marked(c lifecycle.Cause, err error) {
	fl.r.m.MarkedFailed(c)
	worker := fl.worker
	if c == lifecycle.CausePrefill {
		worker = fl.plan.Prefill.WorkerID
	}
	attrs := []any{"plan", fl.plan.ID, "worker", worker, "cause", c.String()}
	if c == lifecycle.CauseStatus || c == lifecycle.CausePrefill {
		attrs = append(attrs, "status", fl.status)
	}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	fl.r.log.Warn("worker marked failed: out of the picks for the failure ejection time", attrs...)
}

// rebook moves fl's booking to the worker that served endpoint: a fallback
// of the pick, else any worker discovery knows on that endpoint (its first
// rank). A served endpoint that is no known worker, or a worker the
// destination role cannot book (not schedulable, another role), ends the
// booking: its load would be charged to a worker that is not doing the work.
func (r *router) rebook(fl *flight, endpoint string) {
	to, known, fallback := r.rankAt(endpoint, fl.plan.Decode.Fallbacks)
	var err error
	if known {
		if err = fl.follow.Served(to, fallback); err == nil {
			fl.worker = to.WorkerID
			r.m.Rebooked(prommetrics.RebookMoved)
			r.log.Info("booking moved to the served worker", "plan", fl.plan.ID,
				"picked", fl.plan.Decode.WorkerID, "served", to.WorkerID, "rank", to.Rank, "endpoint", endpoint)
			return
		}
		if errors.Is(err, roles.ErrUnknownPlan) || errors.Is(err, selection.ErrUnknownReservation) {
			return // settled already (expired): nothing to move
		}
	}
	fl.Done()
	r.m.Rebooked(prommetrics.RebookFreed)
	attrs := []any{"plan", fl.plan.ID, "picked", fl.plan.Decode.WorkerID, "served", endpoint}
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

// renewer ticks, every interval, the followers of the plans in flight
// (lifecycle.Follower.Renew): one that makes progress, or has not started
// its body, is renewed, so that a stream longer than the lease keeps its
// booking to its end while one that went silent expires: it is renewed at
// most once after its last chunk, so it expires within an interval past its
// lease. It is safe for concurrent use; tick is called by one goroutine at a
// time (run's, or a test's), which makes it the followers' one Renew caller.
type renewer struct {
	m *prommetrics.Responses

	mu   sync.Mutex
	live map[*flight]struct{}
	buf  []*flight // tick's scratch
}

func newRenewer(m *prommetrics.Responses) *renewer {
	return &renewer{m: m, live: map[*flight]struct{}{}}
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
		switch r, s := f.follow.Renew(); {
		case r:
			renewed++
		case s:
			stalled++
		}
	}
	clear(w.buf)
	w.m.Renewals(renewed, stalled)
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
// blocks with the request, their active requests, their calibrated prefill
// rate and slowness once known (reservation.Calibration), busy. Worker ids are
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
		if s.PrefillRate > 0 {
			b.WriteString(" rate=")
			b.WriteString(strconv.FormatFloat(s.PrefillRate, 'f', 0, 64))
		}
		if s.Slowness > 0 {
			b.WriteString(" slow=")
			b.WriteString(strconv.FormatFloat(s.Slowness, 'f', 2, 64))
		}
		if s.Busy {
			b.WriteString(" busy")
		}
	}
	return b.String()
}

// maxExplainedID bounds a worker id in the debug header.
const maxExplainedID = 64

func writeRank(b *strings.Builder, wr catalog.WorkerRank) {
	id := wr.WorkerID
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
