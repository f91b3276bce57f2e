package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// The end-to-end workload: a few long system prompts shared by many requests,
// three engines whose caches hold about half of those prompts each, 16
// requests in flight, a fifth of them cancelled by their client mid-stream and
// one in twenty failed by the engine's side.
const (
	e2eEngines   = 3
	e2eRequests  = 2000
	e2eRRequests = 600 // the round-robin baseline
	e2eInflight  = 16
	e2ePrompts   = 15
	e2eBlock     = 16
	// e2eCapacity is each engine's cache in blocks: about half of the shared
	// prefixes together (15 of 5 blocks), a third of which is what each
	// engine needs when the prefixes stay where they were first computed.
	e2eCapacity  = 36
	e2eMaxTokens = 8
	e2eModel     = "fake-model"
	// e2eEjection is how long a failed worker is left out; short, so that
	// the injected failures (which are not the workers' fault) barely move
	// the prefixes.
	e2eEjection = 5 * time.Millisecond
	// headerFault makes the fault front of an engine fail the request: "500"
	// answers 500, "hangup" closes the connection without an answer.
	headerFault = "x-test-fault"
)

type e2eKind int

const (
	kindComplete e2eKind = iota // read to data: [DONE]
	kindCancel                  // the client cancels after a few events
	kindFail500                 // the engine's front answers 500
	kindHangup                  // the engine's front closes the connection
)

type e2eRequest struct {
	kind   e2eKind
	prompt int
	body   []byte
	reads  int // kindCancel: lines read before the cancel
}

// systemPrompts returns the shared system prompts: with the chat template,
// 85 shared tokens each (5 complete blocks).
func systemPrompts() []string {
	out := make([]string, e2ePrompts)
	for i := range out {
		out[i] = fmt.Sprintf("You are assistant number %d of the fleet. ", i) +
			strings.Repeat(fmt.Sprintf("Policy %d says answer briefly and cite the handbook section %d. ", i, i*7), 6)
	}
	return out
}

// e2ePlan draws n requests from a seeded source: prompts uniformly, 20%
// cancels and (with faults) 5% failures, half of them 500s.
func e2ePlan(n int, seed uint64, faults bool) []e2eRequest {
	rng := rand.New(rand.NewPCG(seed, 0x67617465))
	kinds := make([]e2eKind, n)
	if faults {
		for i := range n / 5 {
			kinds[i] = kindCancel
		}
		for i := range n / 20 {
			kinds[n/5+i] = []e2eKind{kindFail500, kindHangup}[i%2]
		}
		rng.Shuffle(n, func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
	}
	sys := systemPrompts()
	plan := make([]e2eRequest, n)
	for i := range plan {
		p := rng.IntN(e2ePrompts)
		body, _ := json.Marshal(map[string]any{"model": e2eModel, "max_tokens": e2eMaxTokens, "stream": true,
			"messages": []map[string]string{
				{"role": "system", "content": sys[p]},
				{"role": "user", "content": fmt.Sprintf("question %d about part %d", rng.IntN(1000), rng.IntN(50))},
			}})
		plan[i] = e2eRequest{kind: kinds[i], prompt: p, body: body, reads: 1 + rng.IntN(4)}
	}
	return plan
}

// prefixTokens is the number of leading tokens all requests of a system
// prompt share (the template up to the user's content).
func prefixTokens(sys string) int {
	a := fakeengine.ApplyChatTemplate([]fakeengine.Message{{Role: "system", Content: sys}, {Role: "user", Content: "alpha"}})
	b := fakeengine.ApplyChatTemplate([]fakeengine.Message{{Role: "system", Content: sys}, {Role: "user", Content: "omega"}})
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// faultFront is what stands in front of each engine: it fails the requests
// that carry headerFault, and passes the others to the engine.
func faultFront(engine http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Header.Get(headerFault) {
		case "500":
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = io.WriteString(w, `{"error":{"message":"injected failure","type":"InternalServerError","code":500}}`)
		case "hangup":
			_, _ = io.Copy(io.Discard, r.Body)
			if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
				_ = conn.Close()
			}
		default:
			engine.ServeHTTP(w, r)
		}
	})
}

// e2eEnv is the gateway in process, serving on loopback, and the engines it
// routes to, each behind its fault front.
type e2eEnv struct {
	g        *gateway
	url      string
	metrics  string // the URL of GET /metrics
	engines  []*fakeengine.Engine
	fronts   []string // host:port of each engine's front
	client   *http.Client
	closers  []func()
	closeAll sync.Once
}

// role is the metrics' role label of the aggregated gateway's one selection
// service.
const role = "aggregated"

// svc is the aggregated gateway's selection service.
func (env *e2eEnv) svc() *selection.SelectionService { return env.g.rs.Service(roles.Aggregated) }

func (env *e2eEnv) close() {
	env.closeAll.Do(func() {
		for i := len(env.closers) - 1; i >= 0; i-- {
			env.closers[i]()
		}
	})
}

func quietServer(h http.Handler) *httptest.Server {
	s := httptest.NewUnstartedServer(h)
	s.Config.ErrorLog = log.New(io.Discard, "", 0)
	s.Start()
	return s
}

func newE2EEnv(t *testing.T) *e2eEnv { return newE2EEnvWith(t, e2eOptions{}) }

// feedMode is how the engines' KV events travel, and whether the gateway
// hears them.
type feedMode int

const (
	// feedDialed: each engine binds its PUB, the workers file lists it as
	// kv_events_endpoint, and the gateway dials it.
	feedDialed feedMode = iota
	// feedBound: the gateway binds a SUB (--kv-event-bind) and the engines
	// dial out to it, each publishing the topic kv@<its front's
	// ip:port>@<model>, the address the workers file lists.
	feedBound
	// feedBindMissing: the engines dial out, as with feedBound, but the
	// gateway was started without --kv-event-bind: it dials the
	// kv_events_endpoint the workers file lists, where nothing listens,
	// and hears nothing. The engines reach a SUB bound elsewhere (a
	// fakeengine that dials out needs its dial to succeed; a real engine
	// retries in silence): what it receives is no business of the gateway's.
	feedBindMissing
)

// e2eOptions vary the end-to-end environment.
type e2eOptions struct {
	feeds feedMode
	// tokenizers returns the --tokenizer-url list from the live
	// tokenizer's URL; nil: that URL alone.
	tokenizers func(live string) []string
	noDegrade  bool
	// feedTrust is the gateway's config.FeedTrust.
	feedTrust selection.FeedTrust
	// log receives the gateway's log (text); nil discards it.
	log io.Writer
}

// newE2EEnvWith is newE2EEnv with o.
func newE2EEnvWith(t *testing.T, o e2eOptions) *e2eEnv {
	env := &e2eEnv{}
	t.Cleanup(env.close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type fileWorker struct {
		ID       string `json:"id"`
		Endpoint string `json:"endpoint"`
		Events   string `json:"kv_events_endpoint,omitempty"`
	}
	// The fronts come first: an engine that dials out names its front in its
	// topic, and the engines start last, once the bind port is known.
	handlers := make([]atomic.Pointer[http.Handler], e2eEngines)
	var workers []fileWorker
	for i := range e2eEngines {
		front := quietServer(faultFront(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			(*handlers[i].Load()).ServeHTTP(w, r)
		})))
		env.closers = append(env.closers, front.Close)
		env.fronts = append(env.fronts, front.Listener.Addr().String())
		workers = append(workers, fileWorker{ID: fmt.Sprintf("engine-%d", i), Endpoint: env.fronts[i]})
	}
	startEngine := func(i int, o fakeengine.Options) {
		o.BlockSize, o.CapacityBlocks, o.Model, o.TokenInterval = e2eBlock, e2eCapacity, e2eModel, 2*time.Millisecond
		eng, err := fakeengine.New(o)
		require.NoError(t, err)
		require.NoError(t, eng.Start(ctx))
		env.closers = append(env.closers, func() { _ = eng.Close() })
		env.engines = append(env.engines, eng)
		h := eng.Handler()
		handlers[i].Store(&h)
	}
	dialOut := func(addr net.Addr) {
		for i := range e2eEngines {
			startEngine(i, fakeengine.Options{PubMode: fakeengine.PubDial, PubEndpoint: "tcp://" + addr.String(),
				Topic: "kv@" + env.fronts[i] + "@" + e2eModel})
		}
	}
	switch o.feeds {
	case feedDialed:
		for i := range e2eEngines {
			startEngine(i, fakeengine.Options{})
			workers[i].Events = env.engines[i].PubEndpoint()
		}
	case feedBindMissing:
		// Where the engines publish: a SUB bound by someone else.
		scfg := selection.DefaultConfig(e2eBlock)
		elsewhere, err := selection.NewSelectionServiceBuilder(scfg).BindEvents("tcp://127.0.0.1:0").BindEventsFromAnyPeer().Build(ctx)
		require.NoError(t, err)
		env.closers = append(env.closers, func() { _ = elsewhere.Close() })
		dialOut(elsewhere.Events().BindAddr())
		for i := range workers {
			// What the operator wrote, as for engines that bind: nothing
			// listens there (port 1, never served here).
			workers[i].Events = "tcp://127.0.0.1:1"
		}
	}
	// The engines' tokenizer (vLLM's render endpoint), without faults.
	tokEngine, err := fakeengine.New(fakeengine.Options{BlockSize: e2eBlock, Model: e2eModel})
	require.NoError(t, err)
	env.closers = append(env.closers, func() { _ = tokEngine.Close() })
	tok := quietServer(tokEngine.Handler())
	env.closers = append(env.closers, tok.Close)
	file, err := json.Marshal(map[string]any{"workers": workers})
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "workers.json")
	require.NoError(t, os.WriteFile(path, file, 0o600))

	cfg := config{Addr: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0", WorkersFile: path, Model: e2eModel, TokenizerURLs: []string{tok.URL},
		TokenizerProtocol: tokenize.ProtocolVLLMRender, TokenizerTimeout: 5 * time.Second, BlockSize: e2eBlock,
		UseKVEvents: true, MaxBodyBytes: 8 << 20, FailureEjection: e2eEjection,
		TokenizerNoDegrade: o.noDegrade, FeedTrust: o.feedTrust}
	if o.tokenizers != nil {
		cfg.TokenizerURLs = o.tokenizers(tok.URL)
	}
	if o.feeds == feedBound {
		cfg.KVEventBind = "tcp://127.0.0.1:0"
	}
	logTo := o.log
	if logTo == nil {
		logTo = io.Discard
	}
	logger := slog.New(slog.NewTextHandler(logTo, nil))
	env.g, env.url, env.metrics = startGateway(ctx, t, cfg, logger, func(f func()) { env.closers = append(env.closers, f) })
	if o.feeds == feedBound {
		addr := env.svc().Events().BindAddr()
		require.NotNil(t, addr, "the gateway bound no SUB")
		dialOut(addr)
	}
	for _, eng := range env.engines {
		require.NoError(t, eng.WaitSubscribed(ctx))
	}
	env.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: e2eInflight}}
	env.closers = append(env.closers, env.client.CloseIdleConnections)
	return env
}

// startGateway builds the gateway from cfg, serves its API and /metrics on
// loopback and waits until its workers file is applied. It returns the
// gateway and the URLs of its API and of GET /metrics. It hands onClose the
// gateway's close, then its shutdown (which requires serve to return nil):
// run them in reverse, as t.Cleanup does.
func startGateway(ctx context.Context, t *testing.T, cfg config, logger *slog.Logger, onClose func(func())) (g *gateway, api, metrics string) {
	t.Helper()
	g, err := newGateway(ctx, cfg, logger, func(b *selection.SelectionServiceBuilder) {
		b.EventFeed(selection.FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 50 * time.Millisecond})
	})
	require.NoError(t, err)
	onClose(g.close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	mln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = ln.Close()
		require.NoError(t, err)
	}
	serveCtx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- g.serve(serveCtx, ln, mln) }()
	onClose(func() {
		stop()
		require.NoError(t, <-served)
	})
	select {
	case <-g.synced:
	case <-ctx.Done():
		require.FailNow(t, "the workers file was never applied")
	}
	return g, "http://" + ln.Addr().String(), "http://" + mln.Addr().String() + "/metrics"
}

// testWriter sends a logger's lines to the test log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// e2eResult is what the client saw of one request.
type e2eResult struct {
	status int
	cached int  // the engine's x-fake-cached-tokens
	done   bool // the stream ended with data: [DONE]
}

// one sends r to url and plays its client.
func (env *e2eEnv) one(url string, r e2eRequest) (e2eResult, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", strings.NewReader(string(r.body)))
	if err != nil {
		return e2eResult{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	switch r.kind {
	case kindFail500:
		req.Header.Set(headerFault, "500")
	case kindHangup:
		req.Header.Set(headerFault, "hangup")
	}
	resp, err := env.client.Do(req)
	if err != nil {
		return e2eResult{}, err
	}
	defer resp.Body.Close()
	res := e2eResult{status: resp.StatusCode}
	res.cached, _ = strconv.Atoi(resp.Header.Get(fakeengine.HeaderCachedTokens))
	br := bufio.NewReader(resp.Body)
	if r.kind == kindCancel && resp.StatusCode == http.StatusOK {
		for range r.reads {
			if _, err := br.ReadString('\n'); err != nil {
				return res, fmt.Errorf("stream ended before the cancel: %w", err)
			}
		}
		cancel() // mid-stream
		return res, nil
	}
	body, err := io.ReadAll(br)
	if err != nil {
		return res, err
	}
	res.done = strings.HasSuffix(strings.TrimSpace(string(body)), "data: [DONE]")
	return res, nil
}

// load runs plan against url, e2eInflight at a time, and returns the
// results in plan order.
func (env *e2eEnv) load(t *testing.T, url string, plan []e2eRequest) []e2eResult {
	results := make([]e2eResult, len(plan))
	errs := make([]error, len(plan))
	var next atomic.Int64
	var wg sync.WaitGroup
	for range e2eInflight {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < len(plan); i = int(next.Add(1) - 1) {
				results[i], errs[i] = env.one(url, plan[i])
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "request %d (kind %d)", i, plan[i].kind)
	}
	return results
}

// prefixHitRate is the share of the shared-prefix blocks that the engines
// served from their caches, over the answered (200) requests.
func prefixHitRate(plan []e2eRequest, results []e2eResult) float64 {
	sys := systemPrompts()
	var hit, want float64
	for i, r := range results {
		if r.status != http.StatusOK {
			continue
		}
		shared := prefixTokens(sys[plan[i].prompt]) / e2eBlock * e2eBlock
		hit += float64(min(r.cached, shared))
		want += float64(shared)
	}
	return hit / want
}

// waitIdle waits until the gateway has settled every booking and no engine
// is still answering: a cancel is settled on a goroutine of its own, after
// the client has gone, so the test polls for it.
func (env *e2eEnv) waitIdle(t *testing.T) {
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for {
		rs := env.g.router.Stats()
		// A settle counts the exchange done, then how it ended: wait for both.
		busy := rs.Booked != rs.Done || rs.Done != rs.Ended+rs.Canceled+rs.Failed+rs.Aborted
		for _, l := range env.svc().Loads(e2eModel) {
			busy = busy || l.ActiveRequests != 0 || l.ActiveBlocks != 0 || l.ActivePrefillTokens != 0
		}
		for _, eng := range env.engines {
			busy = busy || eng.HTTPStats().Running != 0
		}
		if !busy {
			return
		}
		require.False(t, time.Now().After(deadline), "still busy: router %+v, loads %+v", rs, env.svc().Loads(e2eModel))
		<-tick.C
	}
}

// Engines that dial out (vLLM with a connect endpoint in its
// kv-events-config) reach a gateway that binds for them (--kv-event-bind):
// their events are applied, each to the worker its topic names, and the
// shared prefixes are served from cache as with engines the gateway dials.
func TestGatewayBindsForEnginesThatDialOut(t *testing.T) {
	env := newE2EEnvWith(t, e2eOptions{feeds: feedBound})
	plan := e2ePlan(600, 3, false)
	results := env.load(t, env.url, plan)
	env.waitIdle(t)
	hit := prefixHitRate(plan, results)
	t.Logf("bind mode: shared-prefix hit rate %.3f over %d requests", hit, len(plan))
	for _, s := range env.svc().Events().Sources() {
		require.True(t, s.Bound, "%v: a source of the bind listener", s.Worker)
		require.Positive(t, s.Handler.EventsApplied, "no event of %v was applied", s.Worker)
	}
	require.Len(t, env.svc().Events().Sources(), e2eEngines, "one source per engine, attributed by topic")
	bs := env.svc().Events().BindStats()
	require.Len(t, bs, 1)
	require.Zero(t, bs[0].Unattributed, "every message named a worker")
	// Round-robin's share, one warm engine in three, is about a third; a
	// gateway that routed on load alone (no events) stays near it.
	require.Greater(t, hit, 0.75, "the engines' caches are routed to")

	// GET /metrics shows it: the selection service's, the feeds', the
	// tokenizer's and the Router's series, the EPP's names for the service.
	m := scrape(t, env.metrics)
	agg := map[string]string{"role": role}
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_bookings_total", agg))
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_frees_total", agg))
	require.Zero(t, mustValue(t, m, "kvselect_reservations_active", agg))
	require.EqualValues(t, e2eEngines, mustValue(t, m, "kvselect_workers", map[string]string{"role": role, "lifecycle": "schedulable"}))
	require.Positive(t, mustValue(t, m, "kvselect_overlap_chosen_blocks_total", agg))
	require.Positive(t, mustValue(t, m, "kvselect_decision_overlap_ratio_count", agg), "the decisions' histograms")
	require.Zero(t, mustValue(t, m, "kvselect_workers_file_rejected_total", nil))
	for i := range e2eEngines {
		w := map[string]string{"role": role, "worker": fmt.Sprintf("engine-%d", i), "rank": "0"}
		require.Positive(t, mustValue(t, m, "kvselect_kv_events_applied_total", w))
		require.Equal(t, 1.0, mustValue(t, m, "kvselect_kv_feed_trusted", w))
		require.Zero(t, mustValue(t, m, "kvselect_worker_active_requests", w))
	}
	require.Positive(t, mustValue(t, m, "kvselect_kv_bind_messages_total", map[string]string{"role": role, "result": "received"}))
	misses := mustValue(t, m, "kvselect_tokenizer_cache_misses_total", nil)
	require.Positive(t, misses)
	require.EqualValues(t, len(plan), misses+mustValue(t, m, "kvselect_tokenizer_cache_hits_total", nil), "one lookup per request")
	require.Equal(t, misses-mustValue(t, m, "kvselect_tokenizer_coalesced_total", nil),
		mustValue(t, m, "kvselect_tokenizer_endpoint_calls_total", nil), "a miss not shared is one call of the pool's one endpoint")
	require.Zero(t, mustValue(t, m, "kvselect_tokenizer_failovers_total", nil))
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_httproute_requests_total", nil))
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_httproute_booked_total", nil))
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_httproute_done_total", map[string]string{"outcome": "ended"}))
	require.EqualValues(t, len(plan), mustValue(t, m, "kvselect_httproute_first_bytes_total", nil))
	for _, r := range []string{"overloaded", "body_timeout", "body_too_large", "prompt_too_long", "tokenizer_degraded"} {
		require.Zero(t, mustValue(t, m, "kvselect_httproute_refusals_total", map[string]string{"reason": r}), r)
	}
}

// TestGatewayEndToEnd drives 2,000 streamed chat requests through the real
// gateway (workers file, engine tokenizer, selection with KV events, Router)
// to three fake engines, 16 in flight: 20% are cancelled by their client
// mid-stream, 5% failed by a front of the engine (500, or the connection
// closed). Requests that share a system prompt must land where it is cached:
// the engines report serving at least twice the share of the shared prefixes
// from cache that routing to a random engine, one warm engine in three, would
// give, which round-robin over the same engines does not reach. Afterwards
// every load is zero and every booking was freed by its request.
func TestGatewayEndToEnd(t *testing.T) {
	start := time.Now()
	env := newE2EEnv(t)
	plan := e2ePlan(e2eRequests, 1, true)
	loadStart := time.Now()
	results := env.load(t, env.url, plan)
	loadTime := time.Since(loadStart)
	env.waitIdle(t)

	planned := map[e2eKind]int{}
	statuses := map[int]int{}
	for i, r := range results {
		k := plan[i].kind
		planned[k]++
		statuses[r.status]++
		switch k {
		case kindComplete:
			require.Equal(t, http.StatusOK, r.status, "request %d", i)
			require.True(t, r.done, "request %d: stream cut short", i)
		case kindCancel:
			require.Equal(t, http.StatusOK, r.status, "request %d", i)
		case kindFail500:
			require.Equal(t, http.StatusInternalServerError, r.status, "request %d", i)
		case kindHangup:
			require.Equal(t, http.StatusBadGateway, r.status, "request %d", i)
		}
	}

	// Every load is back to zero, every booking was freed by its request:
	// none expired, none dropped with a worker.
	for _, l := range env.svc().Loads(e2eModel) {
		require.Zero(t, l.ActiveRequests, "%+v", l)
		require.Zero(t, l.ActiveBlocks, "%+v", l)
		require.Zero(t, l.ActivePrefillTokens, "%+v", l)
	}
	st := env.svc().Stats()
	require.Equal(t, st.Bookings, st.Frees+st.Expired+uint64(st.Ledger.Removed), "%+v", st)
	require.Zero(t, st.Expired)
	require.Zero(t, st.Ledger.Removed)
	require.Zero(t, st.Ledger.Active)
	require.EqualValues(t, e2eRequests, st.Bookings, "one booking per request")
	require.Zero(t, st.UnknownReservations)
	rs := env.g.router.Stats()
	require.EqualValues(t, e2eRequests, rs.Booked, "%+v", rs)
	require.Equal(t, rs.Booked, rs.Done, "%+v", rs)
	require.Equal(t, rs.Done, rs.Ended+rs.Canceled+rs.Failed+rs.Aborted, "%+v", rs)
	require.EqualValues(t, planned[kindFail500]+planned[kindHangup], rs.MarkedFailed, "one MarkFailed per injected failure, none for a cancel")
	require.EqualValues(t, rs.MarkedFailed, st.Failures)
	require.EqualValues(t, planned[kindHangup], rs.Failed, "%+v", rs)
	// A cancel lands mid-stream unless the engine's last token (2 ms apart)
	// has already been read when it arrives.
	require.GreaterOrEqual(t, rs.Canceled, uint64(planned[kindCancel]*3/4), "cancels must land mid-stream (%+v)", rs)
	require.LessOrEqual(t, rs.Canceled, uint64(planned[kindCancel]))
	var aborted uint64
	for _, eng := range env.engines {
		aborted += eng.HTTPStats().Aborted
	}

	hit := prefixHitRate(plan, results)
	bound := 2.0 / e2eEngines

	// The baseline: the same engines, caches emptied, behind a round-robin
	// proxy, with the same system prompts (no cancels, no failures).
	for _, eng := range env.engines {
		_, err := eng.ResetPrefixCache()
		require.NoError(t, err)
	}
	var rr atomic.Uint64
	rrTransport := &http.Transport{MaxIdleConnsPerHost: e2eInflight}
	defer rrTransport.CloseIdleConnections()
	rp := &httputil.ReverseProxy{Transport: rrTransport, Rewrite: func(pr *httputil.ProxyRequest) {
		pr.Out.URL.Scheme, pr.Out.URL.Host = "http", env.fronts[rr.Add(1)%e2eEngines]
	}, ErrorLog: log.New(testWriter{t}, "round-robin proxy: ", 0)}
	rrProxy := quietServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Buffered, as the Router does: an HTTP/1 server closes the inbound
		// body when the answer starts, which a streaming proxy's transport
		// may still read (golang/go#40747), cutting the answer.
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		rp.ServeHTTP(w, r)
	}))
	defer rrProxy.Close()
	rrPlan := e2ePlan(e2eRRequests, 2, false)
	rrHit := prefixHitRate(rrPlan, env.load(t, rrProxy.URL, rrPlan))

	t.Logf("kvselect: %d requests in %v (%d in flight): planned %d complete, %d cancelled, %d 500, %d hang-ups; statuses %v",
		e2eRequests, loadTime.Round(time.Millisecond), e2eInflight, planned[kindComplete], planned[kindCancel],
		planned[kindFail500], planned[kindHangup], statuses)
	t.Logf("router: %+v; engines aborted %d", rs, aborted)
	t.Logf("selection: bookings %d, frees %d, expired %d, removed %d, failures %d, chosen/best/request blocks %d/%d/%d",
		st.Bookings, st.Frees, st.Expired, st.Ledger.Removed, st.Failures, st.ChosenOverlapBlocks, st.BestOverlapBlocks, st.RequestBlocks)
	t.Logf("shared-prefix hit rate: kvselect %.3f, round-robin %.3f (%d requests), bound %.3f; %v in all",
		hit, rrHit, e2eRRequests, bound, time.Since(start).Round(time.Millisecond))
	require.GreaterOrEqual(t, hit, bound, "requests sharing a prompt must land on the engine that holds it")
	require.Less(t, rrHit, bound, "the bound must be one that round-robin fails")
}

// Engines that dial out (vLLM with a connect endpoint in its
// kv-events-config) and a gateway started without --kv-event-bind: the
// gateway dials the kv_events_endpoint the workers file lists, where nothing
// listens, and never hears a batch. Requests are still served. Once each
// worker was booked enough requests and the feed-silent time has passed, its
// feed is "never-heard", not "silent" (nothing ever connected), on /metrics
// and in a WARN that names the cause and the fix (a bind address), and no
// token parity is judged on it (the wrong cause the issue met: "token parity
// low ... tokenizer, chat template, block size or cache salt differ").
func TestGatewayNeverHeardWithoutBind(t *testing.T) {
	start := time.Now()
	logs := &signalWriter{want: "state=never-heard", seen: make(chan struct{})}
	env := newE2EEnvWith(t, e2eOptions{feeds: feedBindMissing, log: logs, feedTrust: selection.FeedTrust{
		CheckInterval: 10 * time.Millisecond, SilentAfter: 100 * time.Millisecond,
		// Every booking sampled and judged 10 ms after its first byte: a
		// parity judged on a feed that never spoke would show.
		ParityEvery: 1, ParityDelay: 10 * time.Millisecond, ParityMinSamples: 1,
	}})
	workerLabels := func(i int) map[string]string {
		return map[string]string{"role": role, "worker": fmt.Sprintf("engine-%d", i), "rank": "0"}
	}
	neverHeard := func(m map[string][]sample, i int) bool {
		lv := workerLabels(i)
		lv["state"] = selection.FeedNeverHeard.String()
		v, _ := value(m, "kvselect_kv_feed_state", lv)
		return v == 1
	}
	// Rounds of requests, 16 in flight (so that the load spreads them over
	// the workers), until every feed is judged.
	deadline := time.Now().Add(20 * time.Second)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	var m map[string][]sample
	requests := 0
	for round := uint64(0); ; round++ {
		plan := e2ePlan(2*e2eInflight, 100+round, false)
		for i, r := range env.load(t, env.url, plan) {
			require.Equal(t, http.StatusOK, r.status, "request %d of round %d", i, round)
		}
		requests += len(plan)
		m = scrape(t, env.metrics)
		judged := 0
		for i := range e2eEngines {
			if neverHeard(m, i) {
				judged++
			}
		}
		if judged == e2eEngines {
			break
		}
		require.False(t, time.Now().After(deadline), "after %d requests, %d of %d feeds never-heard", requests, judged, e2eEngines)
		<-tick.C
	}
	for i := range e2eEngines {
		lv := workerLabels(i)
		for _, st := range []selection.FeedState{selection.FeedHealthy, selection.FeedSilent, selection.FeedMisSpeaking} {
			lvs := workerLabels(i)
			lvs["state"] = st.String()
			require.Zero(t, mustValue(t, m, "kvselect_kv_feed_state", lvs), "engine-%d: %s", i, st)
		}
		require.Zero(t, mustValue(t, m, "kvselect_kv_feed_trusted", lv), "engine-%d is routed on its own bookings", i)
		require.Zero(t, mustValue(t, m, "kvselect_kv_event_batches_total", lv))
		require.Zero(t, mustValue(t, m, "kvselect_kv_event_source_connected", lv))
		_, judged := value(m, "kvselect_kv_token_parity", lv)
		require.False(t, judged, "engine-%d: no parity is judged on a feed that never spoke", i)
	}

	select {
	case <-logs.seen:
	case <-time.After(10 * time.Second):
		require.FailNow(t, "no never-heard WARN", logs.String())
	}
	warned := map[string]bool{}
	for _, line := range strings.Split(logs.String(), "\n") {
		require.NotContains(t, line, "token parity low")
		if !strings.Contains(line, "state=never-heard") {
			continue
		}
		require.Contains(t, line, "level=WARN")
		require.Contains(t, line, "kv event feed not trusted")
		require.Contains(t, line, "whether the engine dials out (then the service needs a bind address, DYN_EPP_KV_EVENT_BIND)", "the cause and the fix")
		for i := range e2eEngines {
			if strings.Contains(line, fmt.Sprintf("worker=engine-%d/0 ", i)) {
				warned[fmt.Sprintf("engine-%d", i)] = true
			}
		}
	}
	require.Len(t, warned, e2eEngines, "one WARN per worker: %s", logs.String())
	t.Logf("never-heard: %d requests, every feed judged in %v", requests, time.Since(start).Round(time.Millisecond))
}
