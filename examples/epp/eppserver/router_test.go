package eppserver

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/lifecycle"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

type fakeTok struct {
	err error
}

func (f fakeTok) Tokenize(_ context.Context, req tokenize.Request) (tokenize.Result, error) {
	if f.err != nil {
		return tokenize.Result{}, f.err
	}
	toks := make([]uint32, len(req.Body))
	for i, b := range req.Body {
		toks[i] = uint32(b)
	}
	return tokenize.Result{Tokens: toks}, nil
}

// progressless gives a test booker the advisory scores, as none.
type progressless struct{}

func (progressless) Scores(context.Context, selection.Request) ([]selection.Scored, error) {
	return nil, nil
}

// settles is a fake booker's record of its plans' settles, by plan id.
type settles interface {
	Handoff(id string) error
	Complete(id string) error
}

// fakeHandle settles a fake booker's plan through its record; the calls on
// a plan in flight are no-ops.
type fakeHandle struct {
	s  settles
	id string
}

func (h fakeHandle) PrefillComplete() error      { return h.s.Handoff(h.id) }
func (h fakeHandle) Done() error                 { return h.s.Complete(h.id) }
func (fakeHandle) Renew() error                  { return nil }
func (fakeHandle) Generated(int) error           { return nil }
func (fakeHandle) Move(catalog.WorkerRank) error { return nil }
func (fakeHandle) MarkFailed() error             { return nil }
func handlesOf(s settles) func(roles.Plan) lifecycle.Handle {
	return func(p roles.Plan) lifecycle.Handle { return fakeHandle{s: s, id: string(p.ID)} }
}

type fakeSvc struct {
	progressless
	mu       sync.Mutex
	last     selection.Request
	err      error
	prefill  map[string]int
	freed    map[string]int
	loads    []selection.WorkerLoad
	endpoint string
}

func (f *fakeSvc) Book(_ context.Context, req selection.Request) (roles.Plan, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.last = req
	if f.err != nil {
		return roles.Plan{}, f.err
	}
	return roles.Plan{ID: "r1", Decode: selection.Result{ReservationID: "r1/aggregated", Endpoint: f.endpoint}, LocalPrefill: true}, nil
}
func (f *fakeSvc) Handoff(id string) error {
	f.mu.Lock()
	f.prefill[id]++
	f.mu.Unlock()
	return nil
}
func (f *fakeSvc) Complete(id string) error {
	f.mu.Lock()
	f.freed[id]++
	f.mu.Unlock()
	return nil
}
func (f *fakeSvc) Loads(string) []selection.WorkerLoad { return f.loads }

func newTestRouter(svc *fakeSvc, tok tokenize.Tokenizer) *router {
	r := newRouter("m", tok, svc, svc)
	r.handleOf = handlesOf(svc)
	r.setWorkers([]catalog.Worker{
		{ID: "a", Endpoint: "10.0.0.1:8000"}, {ID: "b", Endpoint: "10.0.0.2:8000"}, {ID: "c", Endpoint: "10.0.0.2:9000"},
		{ID: "v6", Endpoint: "[fd00::1]:8000"}, {ID: "named", Endpoint: "pod.example:8000"},
	})
	return r
}

func TestRouterPickAndSettle(t *testing.T) {
	svc := &fakeSvc{endpoint: "10.0.0.1:8000", prefill: map[string]int{}, freed: map[string]int{}}
	r := newTestRouter(svc, fakeTok{})
	p, err := r.Pick(context.Background(), extproc.PickRequest{Path: "/v1/completions", Body: []byte("hello"),
		Headers: map[string]string{headerPriority: "2.5", headerStrictPriority: "1"}})
	require.NoError(t, err)
	require.Equal(t, "10.0.0.1:8000", p.Destination)
	require.Equal(t, selection.Priority{Tier: 1, Jump: 2.5}, svc.last.Priority)
	require.Len(t, svc.last.Tokens, 5)
	require.Nil(t, svc.last.Allowed)
	// The first chunk hands off; the end is once, from any goroutine.
	p.Settle.(extproc.Follower).ResponseBody([]byte("x"))
	p.Settle.(extproc.Follower).ResponseBody([]byte("y"))
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); p.Settle.FirstByte(); p.Settle.Done() }()
	}
	wg.Wait()
	require.Equal(t, 1, svc.prefill["r1"])
	require.Equal(t, 1, svc.freed["r1"])
}

// TestRouterHoldsABurst: with replicas that hold bursts, a request books
// no sooner than the hold after its arrival (the replicas ahead of this one
// have booked theirs by then), and a request whose client left while it
// waited books nothing.
func TestRouterHoldsABurst(t *testing.T) {
	svc := &fakeSvc{endpoint: "10.0.0.1:8000", prefill: map[string]int{}, freed: map[string]int{}}
	r := newTestRouter(svc, fakeTok{})
	const hold = 30 * time.Millisecond
	var asked []string
	r.hold = func(model string) time.Duration { asked = append(asked, model); return hold }
	start := time.Now()
	p, err := r.Pick(context.Background(), extproc.PickRequest{Path: "/v1/completions", Body: []byte("hello")})
	require.NoError(t, err)
	require.GreaterOrEqual(t, time.Since(start), hold)
	require.Equal(t, []string{"m"}, asked)
	p.Settle.Done()

	svc.last = selection.Request{}
	r.hold = func(string) time.Duration { return time.Hour }
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = r.Pick(ctx, extproc.PickRequest{Path: "/v1/completions", Body: []byte("hello")})
	require.ErrorIs(t, err, context.Canceled)
	require.Nil(t, svc.last.Tokens, "nothing booked")
}

func TestRouterSubsetHint(t *testing.T) {
	svc := &fakeSvc{endpoint: "10.0.0.2:8000", prefill: map[string]int{}, freed: map[string]int{}}
	r := newTestRouter(svc, fakeTok{})
	cases := []struct {
		subset []string
		want   []string
	}{
		{[]string{"10.0.0.2:8000"}, []string{"b"}},
		{[]string{"10.0.0.2"}, []string{"b", "c"}}, // a bare IP means any port
		{[]string{"[fd00::1]:8000", "10.0.0.1:8000"}, []string{"v6", "a"}},
		{[]string{"fd00::1"}, []string{"v6"}},
	}
	for _, c := range cases {
		_, err := r.Pick(context.Background(), extproc.PickRequest{Body: []byte("x"), Subset: c.subset})
		require.NoError(t, err)
		require.ElementsMatch(t, c.want, svc.last.Allowed, "%v", c.subset)
	}
	_, err := r.Pick(context.Background(), extproc.PickRequest{Body: []byte("x"), Subset: []string{"10.9.9.9:1"}})
	require.ErrorIs(t, err, selection.ErrNoEndpoints)
	require.Equal(t, http.StatusServiceUnavailable, statusOf(err))
}

func TestRouterBodylessGoesToLeastLoaded(t *testing.T) {
	svc := &fakeSvc{loads: []selection.WorkerLoad{{WorkerRank: catalog.WorkerRank{WorkerID: "a"}, ActiveRequests: 3}, {WorkerRank: catalog.WorkerRank{WorkerID: "b"}, ActiveRequests: 1}, {WorkerRank: catalog.WorkerRank{WorkerID: "c"}, ActiveRequests: 0}}}
	r := newTestRouter(svc, fakeTok{})
	p, err := r.Pick(context.Background(), extproc.PickRequest{})
	require.NoError(t, err)
	require.Equal(t, "10.0.0.2:9000", p.Destination)
	p, err = r.Pick(context.Background(), extproc.PickRequest{Subset: []string{"10.0.0.1:8000", "10.0.0.2:8000"}})
	require.NoError(t, err)
	require.Equal(t, "10.0.0.2:8000", p.Destination)
	svc.loads = nil
	_, err = r.Pick(context.Background(), extproc.PickRequest{})
	require.ErrorIs(t, err, selection.ErrNoEndpoints)
}

func TestStatusOf(t *testing.T) {
	cases := map[error]int{
		fmt.Errorf("x: %w", tokenize.ErrBadRequest):  400,
		fmt.Errorf("x: %w", tokenize.ErrUpstream):    502,
		fmt.Errorf("x: %w", tokenize.ErrTimeout):     504,
		fmt.Errorf("x: %w", tokenize.ErrUnavailable): 503,
		fmt.Errorf("x: %w", selection.ErrOverloaded): 429,
		fmt.Errorf("x: %w", selection.ErrNotReady):   503,
		fmt.Errorf("x: %w", selection.ErrBadRequest): 400,
		errors.New("boom"):                           500,
	}
	for err, want := range cases {
		require.Equal(t, want, statusOf(err), err.Error())
	}
	// Errors flow from the tokenizer and the service through Pick unchanged.
	svc := &fakeSvc{err: fmt.Errorf("busy: %w", selection.ErrOverloaded), prefill: map[string]int{}, freed: map[string]int{}}
	r := newTestRouter(svc, fakeTok{})
	_, err := r.Pick(context.Background(), extproc.PickRequest{Body: []byte("x")})
	require.Equal(t, 429, statusOf(err))
	r = newTestRouter(svc, fakeTok{err: fmt.Errorf("t: %w", tokenize.ErrTimeout)})
	r.noDegrade = true // DYN_EPP_TOKENIZER_NO_DEGRADE: the tokenizer's status, as before the degraded mode
	_, err = r.Pick(context.Background(), extproc.PickRequest{Body: []byte("x")})
	require.Equal(t, 504, statusOf(err))
	_, err = r.Pick(context.Background(), extproc.PickRequest{Body: []byte("x"), Headers: map[string]string{headerPriority: "-1"}})
	require.Equal(t, 400, statusOf(err))
}

// The metrics endpoint exposes the service's counters through the collector.
func TestMetricsCollector(t *testing.T) {
	cfg, err := load(t, map[string]string{"DYN_EPP_TOKENIZER_SERVICE_URL": "http://127.0.0.1:1", "DYN_EPP_KV_EVENT_PORT": "0"})
	require.NoError(t, err)
	e, err := New(context.Background(), cfg, Options{})
	require.NoError(t, err)
	defer e.Close()
	e.Apply(discovery.Snapshot{Workers: []catalog.Worker{{ID: "a", Endpoint: "10.0.0.1:8000", DPSize: 1}}, Synced: true})
	families, err := e.reg.Gather()
	require.NoError(t, err)
	names := map[string]bool{}
	for _, f := range families {
		names[f.GetName()] = true
	}
	for _, n := range []string{"kvselect_workers", "kvselect_selections_total", "kvselect_queue_depth", "kvselect_reservations_active",
		"kvselect_tokenizer_cache_hits_total", "kvselect_overlap_best_blocks_total"} {
		require.True(t, names[n], n)
	}
}

// With KV events on, every event-plane counter and the feed judgement reach the
// metrics endpoint, the skip counter by reason.
func TestMetricsCollectorEventPlane(t *testing.T) {
	for _, env := range []map[string]string{
		{"DYN_EPP_KV_EVENT_PORT": "1"},                 // dial a port nobody serves
		{"DYN_EPP_KV_EVENT_BIND": "tcp://127.0.0.1:0"}, // engines would dial in
	} {
		env["DYN_EPP_TOKENIZER_SERVICE_URL"] = "http://127.0.0.1:1"
		cfg, err := load(t, env)
		require.NoError(t, err)
		e, err := New(context.Background(), cfg, Options{})
		require.NoError(t, err)
		e.Apply(discovery.Snapshot{Workers: []catalog.Worker{{ID: "a", Endpoint: "127.0.0.1:8000", DPSize: 1,
			KVEventEndpoints: map[int]string{0: "tcp://127.0.0.1:1"}}}, Synced: true})
		families, err := e.reg.Gather()
		require.NoError(t, err)
		e.Close()
		labels := map[string][]map[string]string{}
		for _, f := range families {
			for _, m := range f.GetMetric() {
				l := map[string]string{}
				for _, p := range m.GetLabel() {
					l[p.GetName()] = p.GetValue()
				}
				labels[f.GetName()] = append(labels[f.GetName()], l)
			}
		}
		require.NotEmpty(t, labels["kvselect_kv_feed_state"], env)
		require.NotEmpty(t, labels["kvselect_kv_feed_trusted"], env)
		if _, bind := env["DYN_EPP_KV_EVENT_BIND"]; bind {
			require.Len(t, labels["kvselect_kv_bind_messages_total"], 3)
			continue
		}
		for _, n := range []string{"kvselect_kv_events_skipped_total", "kvselect_kv_event_frames_skipped_total",
			"kvselect_kv_event_batches_lost_total", "kvselect_kv_event_batches_stale_total", "kvselect_kv_event_batches_suspect_total",
			"kvselect_kv_event_source_connected", "kvselect_kv_event_reconnects_total"} {
			require.NotEmpty(t, labels[n], n)
		}
		reasons := map[string]bool{}
		for _, l := range labels["kvselect_kv_events_skipped_total"] {
			reasons[l["reason"]] = true
		}
		for _, r := range []string{"unknown_parent", "unknown_block", "block_size", "undecodable_batch", "rank_full"} {
			require.True(t, reasons[r], r)
		}
	}
}

// Discovery hands the EPP what the cluster says; addresses it cannot or must
// not route to stay unschedulable, with the reason in the record.
func TestEPPRefusesUnroutableEndpoints(t *testing.T) {
	cfg, err := load(t, map[string]string{"DYN_EPP_TOKENIZER_SERVICE_URL": "http://127.0.0.1:1", "DYN_EPP_KV_EVENT_PORT": "0"})
	require.NoError(t, err)
	e, err := New(context.Background(), cfg, Options{})
	require.NoError(t, err)
	defer e.Close()
	e.Apply(discovery.Snapshot{Workers: []catalog.Worker{
		{ID: "ok", Endpoint: "10.0.0.1:8000", DPSize: 1},
		{ID: "metadata", Endpoint: "169.254.169.254:80", DPSize: 1},
		{ID: "name", Endpoint: "vllm-0.vllm:8000", DPSize: 1},
		{ID: "zoned", Endpoint: "[fe80::1%eth0]:8000", DPSize: 1},
	}, Synced: true})
	got := map[string][]catalog.Reason{}
	for _, r := range e.rs.Service(roles.Aggregated).Workers().List() {
		got[r.Worker.ID] = r.Reasons
	}
	require.Empty(t, got["ok"])
	require.Equal(t, []catalog.Reason{catalog.ReasonEndpointNotRoutable}, got["metadata"])
	require.Equal(t, []catalog.Reason{catalog.ReasonEndpointHostname}, got["name"])
	require.Equal(t, []catalog.Reason{catalog.ReasonEndpointNotRoutable}, got["zoned"])

	cfg, err = load(t, map[string]string{"DYN_EPP_TOKENIZER_SERVICE_URL": "http://127.0.0.1:1", "DYN_EPP_KV_EVENT_PORT": "0",
		"DYN_EPP_ALLOW_HOSTNAMES": "true", "DYN_EPP_ALLOW_ADDRESSES": "169.254.0.0/16"})
	require.NoError(t, err)
	require.True(t, cfg.Router.Endpoints.AllowHostnames)
	require.Len(t, cfg.Router.Endpoints.Allow, 1)
	_, err = load(t, map[string]string{"DYN_EPP_ALLOW_ADDRESSES": "169.254.0.0"})
	require.ErrorContains(t, err, "DYN_EPP_ALLOW_ADDRESSES")
}

// The session id comes from the configured header, else Dynamo's; one over
// 256 bytes is a bad request and books nothing.
func TestRouterSessionHeader(t *testing.T) {
	svc := &fakeSvc{endpoint: "10.0.0.1:8000", prefill: map[string]int{}, freed: map[string]int{}}
	r := newTestRouter(svc, fakeTok{})
	r.sessionHeader = "x-session-id"
	pick := func(h map[string]string) error {
		_, err := r.Pick(context.Background(), extproc.PickRequest{Path: "/v1/completions", Body: []byte("hi"), Headers: h})
		return err
	}
	require.NoError(t, pick(map[string]string{"x-session-id": " conv-1 ", headerDynamoSession: "dyn"}))
	require.Equal(t, "conv-1", svc.last.SessionID)
	require.NoError(t, pick(map[string]string{headerDynamoSession: "dyn"}))
	require.Equal(t, "dyn", svc.last.SessionID)
	require.NoError(t, pick(nil))
	require.Empty(t, svc.last.SessionID)
	svc.last = selection.Request{}
	err := pick(map[string]string{"x-session-id": strings.Repeat("s", selection.MaxSessionIDLen+1)})
	require.ErrorIs(t, err, selection.ErrBadRequest)
	require.Equal(t, 400, statusOf(err))
	require.Nil(t, svc.last.Tokens, "nothing was booked")
}
