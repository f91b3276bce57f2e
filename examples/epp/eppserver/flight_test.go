package eppserver

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/internal/clocktest"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// flightRig is a real EPP (router, pair booker, selection service, ext_proc
// server over loopback gRPC) on a fake clock, in aggregated mode without KV
// events, with a tokenizer that maps each body byte to a token, and the
// ext_proc driver playing Envoy. Its workers are never dialled: each test's
// forward function answers for them.
type flightRig struct {
	e      *EPP
	clk    *clocktest.Clock
	client *extproctest.Client
}

var rigWorkers = []catalog.Worker{
	{ID: "w1", Endpoint: "10.0.0.1:8000", DPSize: 1},
	{ID: "w2", Endpoint: "10.0.0.2:8000", DPSize: 1},
	{ID: "w3", Endpoint: "10.0.0.3:8000", DPSize: 1},
}

func newFlightRig(t *testing.T, env map[string]string, x extras) *flightRig {
	t.Helper()
	base := map[string]string{"DYN_EPP_TOKENIZER_SERVICE_URL": "http://127.0.0.1:1", "DYN_EPP_KV_EVENT_PORT": "0",
		"DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS": "10", "DYN_EPP_RENEW_INTERVAL_MS": "2000"}
	for k, v := range env {
		base[k] = v
	}
	cfg, err := load(t, base)
	require.NoError(t, err)
	clk := clocktest.New(time.Unix(1_000_000, 0))
	x.now = clk.Now
	e, err := build(context.Background(), cfg, Options{Configure: func(b *selection.SelectionServiceBuilder) { b.SweepInterval(-1) }}, x)
	require.NoError(t, err)
	t.Cleanup(e.Close)
	e.router.tok = fakeTok{}
	e.Apply(discovery.Snapshot{Workers: rigWorkers, Synced: true})

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(e.server.GRPCServerOptions()...)
	e.server.Register(gs)
	served := make(chan struct{})
	go func() { defer close(served); _ = gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-served })
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	client, err := extproctest.NewClient(conn, extproctest.Options{})
	require.NoError(t, err)
	return &flightRig{e: e, clk: clk, client: client}
}

func (r *flightRig) svc() *selection.SelectionService { return r.e.rs.Service(roles.Aggregated) }

// load returns the active load of worker id.
func (r *flightRig) load(t *testing.T, id string) selection.WorkerLoad {
	t.Helper()
	for _, l := range r.svc().Loads(r.e.cfg.Model) {
		if l.WorkerID == id {
			return l
		}
	}
	t.Fatalf("no worker %s", id)
	return selection.WorkerLoad{}
}

// busy lists the workers holding a booking.
func (r *flightRig) busy() []string {
	var out []string
	for _, l := range r.svc().Loads(r.e.cfg.Model) {
		if l.ActiveRequests > 0 {
			out = append(out, l.WorkerID)
		}
	}
	return out
}

// expire runs the lease expiry of the service and of the plans, as the
// sweeper and the EPP's plan loop do.
func (r *flightRig) expire() { r.svc().Reservations().Expire(); r.e.pairs.Expire() }

// chunks returns the response body chunks the EPP has followed.
func (r *flightRig) chunks(t *testing.T) uint64 {
	return uint64(seriesValue(t, r.e, "kvselect_epp_response_chunks_total", nil))
}

// flightReq is one request whose upstream answer the test writes itself:
// the driver relays each write as a response body chunk.
type flightReq struct {
	list string // the destination list the EPP returned
	w    *io.PipeWriter
	done chan error
	stop context.CancelFunc
}

// send routes body through the driver; serve picks the endpoint the
// gateway serves on from the destination list (nil: the primary), and
// contentType is the upstream's. It returns once the request is forwarded.
func (r *flightRig) send(t *testing.T, body string, contentType string, serve func(list []string) string) *flightReq {
	t.Helper()
	return r.sendWith(t, body, contentType, nil, serve)
}

// sendWith is send with extra request headers.
func (r *flightRig) sendWith(t *testing.T, body, contentType string, h http.Header, serve func(list []string) string) *flightReq {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	fr := &flightReq{done: make(chan error, 1), stop: cancel}
	forwarded := make(chan struct{})
	forward := func(dest string, req *http.Request) (*http.Response, error) {
		pr, pw := io.Pipe()
		context.AfterFunc(req.Context(), func() { _ = pw.CloseWithError(req.Context().Err()) })
		fr.list, fr.w = req.Header.Get(extproc.HeaderDestination), pw
		if serve != nil {
			req.URL.Host = serve(strings.Split(fr.list, ","))
		}
		close(forwarded)
		return &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {contentType}},
			Body: pr, ContentLength: -1, Request: req}, nil
	}
	go func() {
		headers := http.Header{"Content-Type": {"application/json"}}
		for k, vs := range h {
			headers[k] = vs
		}
		_, err := r.client.Roundtrip(ctx, extproctest.HTTPRequest{Path: "/v1/chat/completions", Body: []byte(body),
			Headers: headers}, forward)
		fr.done <- err
	}()
	select {
	case <-forwarded:
	case err := <-fr.done:
		t.Fatalf("the request was not routed: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the request was never forwarded")
	}
	t.Cleanup(cancel)
	return fr
}

// write sends s as one chunk and waits until the EPP has seen it (want:
// the chunks seen in flight after it).
func (r *flightRig) write(t *testing.T, fr *flightReq, s string, want uint64) {
	t.Helper()
	_, err := io.WriteString(fr.w, s)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return r.chunks(t) >= want }, 10*time.Second, time.Millisecond, "chunk %d seen", want)
}

// end ends the upstream answer and waits for the exchange to end.
func (fr *flightReq) end(t *testing.T) {
	t.Helper()
	require.NoError(t, fr.w.Close())
	select {
	case err := <-fr.done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the exchange never ended")
	}
}

const sseEvent = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n"

// A stream of three times the lease keeps its booking to its end: the
// renewer renews it before its first byte and while chunks flow. A stream
// that stalls is renewed once after its last chunk, then no more, and
// expires at its lease; its late end frees nothing twice.
func TestLeaseRenewalFollowsTheStream(t *testing.T) {
	rig := newFlightRig(t, nil, extras{})
	lease := rig.e.cfg.Router.ActiveRequestExpiry // 10 s
	step := lease * 6 / 10
	before := rig.e.pairs.Stats().Plans

	fr := rig.send(t, "a long answer", "text/event-stream", nil)
	picked := rig.busy()
	require.Len(t, picked, 1)
	rig.clk.Advance(step) // prefilling: no byte yet
	renewed, stalled := rig.e.router.renew.tick()
	require.Equal(t, [2]int{1, 0}, [2]int{renewed, stalled}, "renewed before the first byte")
	for i := range 5 { // 7 steps of 0.6 lease in all: 4.2 leases
		rig.clk.Advance(step)
		rig.expire()
		require.Equal(t, picked, rig.busy(), "step %d: alive, still booked", i)
		rig.write(t, fr, sseEvent, uint64(i+1))
		renewed, stalled = rig.e.router.renew.tick()
		require.Equal(t, [2]int{1, 0}, [2]int{renewed, stalled})
	}
	rig.clk.Advance(step)
	rig.expire()
	require.Equal(t, picked, rig.busy(), "4.2 leases in, still booked")
	fr.end(t)
	require.Empty(t, rig.busy())
	after := rig.e.pairs.Stats().Plans
	require.Equal(t, before.Completed+1, after.Completed, "settled by its end")
	require.Equal(t, before.Expired, after.Expired)
	require.Zero(t, rig.svc().Stats().Expired)

	// A stream that stalls after its first chunk.
	stall := rig.send(t, "a stalled answer", "text/event-stream", nil)
	rig.write(t, stall, sseEvent, rig.chunks(t)+1) // the count is the EPP's, over both streams
	renewed, _ = rig.e.router.renew.tick()
	require.Equal(t, 1, renewed, "the chunk since the last tick renews")
	rig.clk.Advance(step)
	renewed, stalled = rig.e.router.renew.tick()
	require.Equal(t, [2]int{0, 1}, [2]int{renewed, stalled}, "silent since: not renewed")
	rig.clk.Advance(lease - step - time.Millisecond)
	rig.expire()
	require.Len(t, rig.busy(), 1, "not before its lease")
	rig.clk.Advance(time.Millisecond)
	rig.expire()
	require.Empty(t, rig.busy(), "expired at its lease")
	require.EqualValues(t, 1, rig.svc().Stats().Expired)
	require.Equal(t, after.Expired+1, rig.e.pairs.Stats().Plans.Expired)
	stall.end(t)
	require.Equal(t, after.Completed, rig.e.pairs.Stats().Plans.Completed, "its end finds the plan gone")
	eventually(t, 10*time.Second, func() error { return uncounted(rig.svc().Stats()) })
	st := rig.svc().Stats()
	require.Equal(t, st.Bookings, st.Frees+uint64(st.Ledger.Expired), "every booking settled once (%+v)", st)
}

// With output growth on, a 2xx event stream's data lines grow its decode
// booking by one block per block size (16) of them, split across chunks
// anywhere; a JSON answer, and any answer with growth off, never grow.
func TestOutputGrowthFollowsSSEEvents(t *testing.T) {
	rig := newFlightRig(t, map[string]string{"DYN_EPP_OUTPUT_GROWTH": "true"}, extras{})
	prompt := strings.Repeat("p", 40) // 2 complete blocks

	fr := rig.send(t, prompt, "text/event-stream; charset=utf-8", nil)
	w := rig.busy()[0]
	start := rig.load(t, w).ActiveBlocks
	stream := strings.Repeat(sseEvent, 40) // 40 events: 2 blocks
	cut := len(stream) / 3
	rig.write(t, fr, stream[:cut+3], 1) // the cuts fall inside events
	rig.write(t, fr, stream[cut+3:2*cut+1], 2)
	rig.write(t, fr, stream[2*cut+1:], 3)
	require.Equal(t, start+2, rig.load(t, w).ActiveBlocks, "40 events of a 16-token block size")
	rig.write(t, fr, strings.Repeat(sseEvent, 8), 4) // 48 in all: a third block
	require.Equal(t, start+3, rig.load(t, w).ActiveBlocks)
	fr.end(t)
	require.Zero(t, rig.load(t, w).ActiveBlocks)

	js := rig.send(t, prompt, "application/json", nil)
	w = rig.busy()[0]
	start = rig.load(t, w).ActiveBlocks
	rig.write(t, js, strings.Repeat(sseEvent, 40), rig.chunks(t)+1)
	require.Equal(t, start, rig.load(t, w).ActiveBlocks, "not an event stream")
	js.end(t)

	off := newFlightRig(t, nil, extras{})
	fr = off.send(t, prompt, "text/event-stream", nil)
	w = off.busy()[0]
	start = off.load(t, w).ActiveBlocks
	off.write(t, fr, strings.Repeat(sseEvent, 40), 1)
	require.Equal(t, start, off.load(t, w).ActiveBlocks, "growth is opt-in")
	fr.end(t)
}

// With fallbacks, the EPP returns the GAIE list (the pick, then the next
// workers on other endpoints). A request the gateway serves on a fallback
// ends with its load on the served worker and none on the picked one,
// counted as moved; one served by an endpoint that is no worker is freed.
func TestServedFallbackMovesTheBooking(t *testing.T) {
	rig := newFlightRig(t, map[string]string{"DYN_EPP_FALLBACKS": "2", "DYN_EPP_SESSION_AFFINITY": "hard",
		"DYN_EPP_SESSION_HEADER": "x-session-id"}, extras{})
	workerAt := map[string]string{}
	for _, w := range rigWorkers {
		workerAt[w.Endpoint] = w.ID
	}
	var list []string
	fr := rig.send(t, strings.Repeat("q", 64), "text/event-stream", func(l []string) string { list = l; return l[1] })
	require.Len(t, list, 3, "the pick and two fallbacks")
	picked, served := workerAt[list[0]], workerAt[list[1]]
	require.NotEqual(t, picked, served)
	rig.write(t, fr, sseEvent, 1) // the response headers, with the served endpoint, came first
	require.Equal(t, []string{served}, rig.busy(), "the booking followed the served worker")
	require.Zero(t, rig.load(t, picked).ActiveBlocks)
	require.Positive(t, rig.load(t, served).ActiveBlocks)
	fr.end(t)
	require.Empty(t, rig.busy())
	require.Equal(t, 1.0, seriesValue(t, rig.e, "kvselect_epp_rebookings_total", map[string]string{"result": "moved"}))

	// The session moves with it: its next request goes to the served worker.
	session := http.Header{"X-Session-Id": {"conv"}}
	fr = rig.sendWith(t, strings.Repeat("s", 64), "text/event-stream", session, func(l []string) string { list = l; return l[1] })
	rig.write(t, fr, sseEvent, rig.chunks(t)+1)
	first := workerAt[list[1]]
	require.Equal(t, []string{first}, rig.busy())
	fr.end(t)
	fr = rig.sendWith(t, strings.Repeat("s", 64), "text/event-stream", session, nil)
	require.Equal(t, []string{first}, rig.busy(), "the session's pin followed the served worker")
	fr.end(t)

	// Served by an endpoint that is no worker of the pool: freed.
	fr = rig.send(t, strings.Repeat("r", 64), "text/event-stream", func([]string) string { return "10.9.9.9:8000" })
	_, err := io.WriteString(fr.w, sseEvent) // freed at the headers: no longer in flight
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(rig.busy()) == 0 }, 10*time.Second, time.Millisecond,
		"freed: its load belongs to no known worker")
	fr.end(t)
	require.Equal(t, 1.0, seriesValue(t, rig.e, "kvselect_epp_rebookings_total", map[string]string{"result": "freed"}))
	eventually(t, 10*time.Second, func() error { return uncounted(rig.svc().Stats()) })
	st := rig.svc().Stats()
	require.Equal(t, st.Bookings, st.Frees, "every booking freed once (%+v)", st)
	require.EqualValues(t, 2, st.Moves)
}

// The debug header names the booked worker and the cheapest candidates'
// cost terms, bounded.
func TestDebugHeaderExplainsTheDecision(t *testing.T) {
	rig := newFlightRig(t, map[string]string{"DYN_EPP_DEBUG_HEADER": "true"}, extras{})
	res, err := rig.client.Roundtrip(context.Background(), extproctest.HTTPRequest{Path: "/v1/chat/completions",
		Body: []byte(strings.Repeat("d", 64))}, func(dest string, req *http.Request) (*http.Response, error) {
		return &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"text/event-stream"}},
			Body: io.NopCloser(strings.NewReader(sseEvent)), ContentLength: -1, Request: req}, nil
	})
	require.NoError(t, err)
	require.Len(t, res.Header[extproc.HeaderDebug], 1)
	v := res.Header[extproc.HeaderDebug][0]
	require.True(t, strings.HasPrefix(v, "chosen=w"), v)
	require.Equal(t, 3, strings.Count(v, "cost="), "one entry per candidate (3 workers): %s", v)
	for _, term := range []string{"cached=0+0+0", "prefill=", "decode=", "reqs=0"} {
		require.Contains(t, v, term)
	}
	require.LessOrEqual(t, len(v), extproc.MaxDebugLen)

	many := make([]selection.Scored, 40)
	for i := range many {
		many[i] = selection.Scored{WorkerLoad: selection.WorkerLoad{WorkerRank: catalog.WorkerRank{WorkerID: strings.Repeat("x", 300) + fmt.Sprint(i)}},
			Cost: float64(40 - i)}
	}
	v = explain(catalog.WorkerRank{WorkerID: "bad id\n"}, many)
	require.Equal(t, explainCandidates, strings.Count(v, "cost="))
	require.Contains(t, v, "cost=1.00", "the cheapest are kept")
	require.True(t, strings.HasPrefix(v, "chosen=bad_id_/0"), v)
	require.LessOrEqual(t, len(v), extproc.MaxDebugLen)
	// The predictive cost's seconds keep three significant digits.
	v = explain(catalog.WorkerRank{WorkerID: "a"}, []selection.Scored{{Cost: 0.01637}})
	require.Contains(t, v, "cost=0.0164 ", v)
	require.NotContains(t, v, "rate=", "no calibrated rate yet")
	// A calibrated rank shows its rate and slowness.
	v = explain(catalog.WorkerRank{WorkerID: "a"}, []selection.Scored{{Cost: 0.01, WorkerLoad: selection.WorkerLoad{PrefillRate: 12345.6, Slowness: 1.5}}})
	require.Contains(t, v, " rate=12346 slow=1.50", v)
}

// Failure feedback: a 5xx answer takes the worker that gave it out of the
// picks for DYN_EPP_FAILURE_EJECTION_SECS, and so does a request the gateway
// had to serve on one of the pick's fallbacks; once the time has passed,
// the worker is picked again.
func TestFailedWorkersAreEjected(t *testing.T) {
	rig := newFlightRig(t, map[string]string{"DYN_EPP_FALLBACKS": "1", "DYN_EPP_FAILURE_EJECTION_SECS": "30"}, extras{})
	workerAt := map[string]string{}
	for _, w := range rigWorkers {
		workerAt[w.Endpoint] = w.ID
	}
	// roundtrip sends one request (a prompt of its own) whose picked worker
	// answers status, and returns that worker.
	n := 0
	roundtrip := func(status int) string {
		n++
		var picked string
		forward := func(dest string, req *http.Request) (*http.Response, error) {
			picked = workerAt[strings.Split(req.Header.Get(extproc.HeaderDestination), ",")[0]]
			return &http.Response{StatusCode: status, Header: http.Header{"Content-Type": {"application/json"}},
				Body: io.NopCloser(strings.NewReader(`{}`)), ContentLength: 2, Request: req}, nil
		}
		_, err := rig.client.Roundtrip(t.Context(), extproctest.HTTPRequest{Path: "/v1/chat/completions",
			Body: []byte(strings.Repeat(fmt.Sprintf("%d.", n), 32)), Headers: http.Header{"Content-Type": {"application/json"}}}, forward)
		require.NoError(t, err)
		require.NotEmpty(t, picked)
		return picked
	}
	failed := roundtrip(http.StatusBadGateway)
	require.Equal(t, 1.0, seriesValue(t, rig.e, "kvselect_epp_workers_marked_failed_total", map[string]string{"cause": "status"}))
	for range 6 {
		require.NotEqual(t, failed, roundtrip(http.StatusOK), "an ejected worker is not picked")
	}
	require.Equal(t, 1.0, seriesValue(t, rig.e, "kvselect_epp_workers_marked_failed_total", map[string]string{"cause": "status"}),
		"a 2xx marks nothing")
	roundtrip(http.StatusNotImplemented) // the request's answer, not the worker's health
	require.Equal(t, 1.0, seriesValue(t, rig.e, "kvselect_epp_workers_marked_failed_total", map[string]string{"cause": "status"}))

	// Served on the fallback: the pick could not answer.
	var list []string
	fr := rig.send(t, strings.Repeat("f", 64), "text/event-stream", func(l []string) string { list = l; return l[1] })
	rig.write(t, fr, sseEvent, 1)
	fr.end(t)
	require.Len(t, list, 2)
	require.Equal(t, 1.0, seriesValue(t, rig.e, "kvselect_epp_workers_marked_failed_total", map[string]string{"cause": "fallback"}))
	second := workerAt[list[0]]
	require.NotEqual(t, failed, second)
	for range 6 {
		got := roundtrip(http.StatusOK)
		require.NotContains(t, []string{failed, second}, got, "both ejected")
	}

	rig.clk.Advance(31 * time.Second)
	seen := map[string]bool{}
	for range 12 {
		seen[roundtrip(http.StatusOK)] = true
	}
	require.True(t, seen[failed] || seen[second], "ejection ends: %v", seen)
}
