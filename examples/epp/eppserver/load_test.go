package eppserver

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// The mixed load: how many requests per topology, how many in flight, and the
// bounds the EPP must be back within once they are over.
const (
	loadRequests      = 5000
	loadRequestsShort = 1000 // -short and -race
	loadInflight      = 16
	loadEngines       = 4
	loadDocs          = 8  // shared system prompts (prefixes)
	loadCacheBlocks   = 48 // per engine: about four prompts, so caches evict all the time
	// loadGoroutineSlack allows for connections a transport keeps idle (the
	// tokenizer's) and timers winding down; a leak of the request path grows
	// with the requests, by hundreds.
	loadGoroutineSlack = 12
	loadHeapSlack      = 8 << 20
	loadIdleWithin     = 10 * time.Second
)

// loadKind is what the client does with one request.
type loadKind int

const (
	runToEnd loadKind = iota // the streamed answer is read to its end

	// Client cancels (20%): the stream is reset and the upstream request
	// cancelled, at one of these points.
	cancelBeforeDecision  // headers and half the body sent, the EPP cannot have answered
	cancelRacingPick      // the whole body sent, reset within a millisecond (tokenizing or booking)
	cancelAfterDecision   // routed, never forwarded
	cancelAfterHeaders    // the engine's response headers relayed
	cancelAfterFirstChunk // the first streamed token relayed
	cancelMidBody         // after a random number of streamed reads

	// ext_proc stream drops (5%): what Envoy does on a crash or a reset.
	dropHalfClose      // half-close without end of stream, at a random point
	dropConnection     // the gRPC connection closed mid-body
	dropConnectionPick // the gRPC connection closed while the EPP picks
)

var (
	cancelKinds = []loadKind{cancelBeforeDecision, cancelRacingPick, cancelAfterDecision, cancelAfterHeaders, cancelAfterFirstChunk, cancelMidBody}
	dropKinds   = []loadKind{dropHalfClose, dropConnection, dropConnectionPick}
)

func (k loadKind) class() string {
	switch {
	case k == runToEnd:
		return "completed"
	case k < dropHalfClose:
		return "cancelled"
	}
	return "dropped"
}

// loadRequest is one planned request; its random choices are drawn up front
// from a seeded source, so a run's plan is reproducible.
type loadRequest struct {
	kind  loadKind
	body  []byte
	reads int                        // cancelMidBody, dropConnection: streamed reads before the cut
	delay time.Duration              // cancelRacingPick, dropConnectionPick: wait before the cut
	at    extproctest.InterruptPoint // dropHalfClose
}

func loadPlan(n int, seed uint64) []loadRequest {
	rng := rand.New(rand.NewPCG(seed, 0x6c6f6164))
	kinds := make([]loadKind, n)
	for i := range n / 5 {
		kinds[i] = cancelKinds[i%len(cancelKinds)]
	}
	for i := range n / 20 {
		kinds[n/5+i] = dropKinds[i%len(dropKinds)]
	}
	rng.Shuffle(n, func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
	docs := make([]string, loadDocs)
	for d := range docs {
		docs[d] = fmt.Sprintf("You are assistant %d. ", d) +
			strings.Repeat(fmt.Sprintf("Document %d says the quick brown fox jumps over the lazy dog. ", d), 12)
	}
	plan := make([]loadRequest, n)
	for i, k := range kinds {
		maxTokens := 4 + rng.IntN(13)
		body, _ := json.Marshal(map[string]any{"model": demofleet.Model, "max_tokens": maxTokens, "stream": true,
			"messages": []map[string]string{
				{"role": "system", "content": docs[rng.IntN(len(docs))]},
				{"role": "user", "content": fmt.Sprintf("question %d about part %d", rng.IntN(64), rng.IntN(8))},
			}})
		plan[i] = loadRequest{kind: k, body: body, reads: rng.IntN(maxTokens + 2),
			delay: time.Duration(rng.IntN(1000)) * time.Microsecond,
			at:    []extproctest.InterruptPoint{extproctest.AfterDecision, extproctest.AfterResponseHeaders, extproctest.AfterFirstChunk}[rng.IntN(3)]}
	}
	return plan
}

// raceBuild reports a binary built with -race (its build settings say so).
func raceBuild() bool {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return false
	}
	for _, s := range bi.Settings {
		if s.Key == "-race" {
			return s.Value == "true"
		}
	}
	return false
}

// TestMixedLoadLeaksNothing is the hostile-peers acceptance for the request
// path: 5,000 streamed requests per topology through the real EPP (ext_proc
// server, engine tokenizer, selection or pair booking) to real fake engines,
// 16 in flight, of which 20% are cancelled by the client at every point of the
// exchange and 5% drop the ext_proc stream. Once they are over the EPP is idle
// (no booking, load, plan or request in its request phase), its counters add
// up (every booking freed by its request, none left to expiry, no unknown id),
// the request path's goroutines are gone and the heap kept no more than the
// tokenizer cache holds; torn down, nothing is left running.
func TestMixedLoadLeaksNothing(t *testing.T) {
	n := loadRequests
	if testing.Short() || raceBuild() {
		n = loadRequestsShort
	}
	for _, topology := range []string{"aggregated", "disaggregated"} {
		t.Run(topology, func(t *testing.T) { mixedLoad(t, topology, n) })
	}
}

func mixedLoad(t *testing.T, topology string, n int) {
	started := time.Now()
	ignore := goleak.IgnoreCurrent()
	env := newLoadEnv(t, topology)
	defer env.close()

	// Warm up (connections, caches, lazily started goroutines), then take the
	// baseline the load is compared with.
	for i, r := range loadPlan(2*loadInflight, 1) {
		r.kind = runToEnd
		require.NoError(t, env.one(context.Background(), i, r))
	}
	env.waitIdle(t)
	env.completed.Store(0)
	heapBefore, cacheBefore := env.settle(), env.e.cache.Stats().Bytes
	goBefore, idleBefore := goroutines()

	plan := loadPlan(n, 2)
	loadStart := time.Now()
	var (
		next     atomic.Int64
		wg       sync.WaitGroup
		mu       sync.Mutex
		planned  = map[string]int{}
		failures []error
	)
	for range loadInflight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= len(plan) {
					return
				}
				err := env.one(context.Background(), i, plan[i])
				mu.Lock()
				planned[plan[i].kind.class()]++
				if err != nil {
					failures = append(failures, fmt.Errorf("request %d (kind %d): %w", i, plan[i].kind, err))
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	loadTime := time.Since(loadStart)
	require.Empty(t, failures, "requests that should have run to the end did not: %d, first %v", len(failures), first(failures))

	env.waitIdle(t)
	env.checkCounters(t, n, env.completed.Load())
	var goAfter, idleAfter int
	eventually(t, loadIdleWithin, func() error {
		env.httpc.CloseIdleConnections()
		goAfter, idleAfter = goroutines()
		if goAfter-idleAfter > goBefore-idleBefore+loadGoroutineSlack {
			return fmt.Errorf("%d goroutines (%d of idle keep-alive connections), %d (%d) before the load, slack %d",
				goAfter, idleAfter, goBefore, idleBefore, loadGoroutineSlack)
		}
		return nil
	})
	// The idle connections are the tokenizer's pool (both ends), which keeps
	// at most 64 per host.
	require.LessOrEqual(t, idleAfter, 3*64, "goroutines of idle keep-alive connections")
	heapAfter, cacheAfter := env.settle(), env.e.cache.Stats().Bytes
	t.Logf("%s: %d requests (planned %v; %d answers read to the end), load %v; goroutines %d -> %d (idle keep-alive %d -> %d); heap %.1f -> %.1f MiB (tokenizer cache %.1f -> %.1f MiB)",
		topology, n, planned, env.completed.Load(), loadTime.Round(time.Millisecond), goBefore, goAfter, idleBefore, idleAfter,
		mib(heapBefore), mib(heapAfter), mib(cacheBefore), mib(cacheAfter))
	// The tokenizer cache fills up to its bound (64 MiB by default) by design;
	// anything else the heap kept is what the requests left behind.
	require.LessOrEqual(t, int64(heapAfter)-int64(heapBefore), cacheAfter-cacheBefore+loadHeapSlack,
		"heap growth beyond the tokenizer cache's, bytes")

	env.close()
	require.NoError(t, goleak.Find(ignore, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction)))
	t.Logf("%s: %v in all", topology, time.Since(started).Round(time.Millisecond))
}

func mib[T int64 | uint64](n T) float64 { return float64(n) / (1 << 20) }

func first(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	return errs[0]
}

// loadEnv is the EPP in process, its ext_proc server on loopback (h2c) and the
// fake engines it routes to.
type loadEnv struct {
	e         *EPP
	engines   []*fakeengine.Engine
	services  map[string]*selection.SelectionService
	addr      string
	conn      *grpc.ClientConn
	client    *extproctest.Client
	httpc     *http.Client
	completed atomic.Int64 // answers read to the end
	close     func()
}

func newLoadEnv(t *testing.T, topology string) *loadEnv { return newLoadEnvWith(t, topology, nil) }

// newLoadEnvWith is newLoadEnv with more of the EPP's variables set.
func newLoadEnvWith(t *testing.T, topology string, vars map[string]string) *loadEnv {
	all := map[string]string{"DYN_EPP_TOPOLOGY_MODE": topology, "DYN_EPP_TOKENIZER_PROTOCOL": "vllm-render"}
	maps.Copy(all, vars)
	cfg, err := load(t, all)
	require.NoError(t, err)
	cfg.Model = demofleet.Model
	env := &loadEnv{}
	var closers []func()
	var once sync.Once
	env.close = func() {
		once.Do(func() {
			for i := len(closers) - 1; i >= 0; i-- {
				closers[i]()
			}
		})
	}
	defer func() {
		if t.Failed() {
			env.close()
		}
	}()
	var workers []catalog.Worker
	for i := range loadEngines {
		eng, err := fakeengine.New(fakeengine.Options{BlockSize: 16, CapacityBlocks: loadCacheBlocks, ReplayBuffer: 256,
			EnableHTTP: true, EnableReplay: true, Model: demofleet.Model})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = eng.Start(ctx)
		cancel()
		require.NoError(t, err)
		closers = append(closers, func() { _ = eng.Close() })
		env.engines = append(env.engines, eng)
		w := catalog.Worker{
			ID: fmt.Sprintf("w%d", i), Model: demofleet.Model, Endpoint: eng.HTTPEndpoint(), DPSize: 1, BlockSize: 16,
			KVEventEndpoints: map[int]string{0: eng.PubEndpoint()}, ReplayEndpoint: eng.ReplayEndpoint(),
		}
		if topology == "disaggregated" {
			w.Labels = map[string]string{roles.DefaultRoleLabel: [...]string{"prefill", "decode"}[i%2]}
		}
		workers = append(workers, w)
	}
	cfg.TokenizerURLs = []string{"http://" + env.engines[0].HTTPEndpoint()}
	env.e, err = New(context.Background(), cfg, Options{Configure: func(b *selection.SelectionServiceBuilder) {
		b.EventFeed(selection.FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 50 * time.Millisecond})
	}})
	require.NoError(t, err)
	closers = append(closers, env.e.Close)
	env.e.Apply(discovery.Snapshot{Workers: workers, Synced: true})
	require.True(t, env.e.server.Ready())
	env.services = map[string]*selection.SelectionService{}
	for _, r := range env.e.rs.Census().Roles {
		env.services[r.Role.String()] = env.e.rs.Service(r.Role)
	}
	for i, eng := range env.engines {
		if topology == "disaggregated" && i%2 == 1 {
			continue // decode services follow no KV events
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := eng.WaitSubscribed(ctx)
		cancel()
		require.NoError(t, err)
	}

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	env.addr = lis.Addr().String()
	gs := grpc.NewServer(env.e.server.GRPCServerOptions()...)
	env.e.server.Register(gs)
	served := make(chan struct{})
	go func() { defer close(served); _ = gs.Serve(lis) }()
	closers = append(closers, func() { gs.Stop(); <-served })
	env.conn, err = grpc.NewClient(env.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	closers = append(closers, func() { _ = env.conn.Close() })
	env.client, err = extproctest.NewClient(env.conn, extproctest.Options{})
	require.NoError(t, err)
	env.httpc = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: loadInflight}}
	closers = append(closers, env.httpc.CloseIdleConnections)
	return env
}

// one runs request i as planned. It returns an error only for a request meant
// to run to the end that did not; the others may end any way they like.
func (env *loadEnv) one(ctx context.Context, i int, r loadRequest) error {
	req := extproctest.HTTPRequest{Path: "/v1/chat/completions", Body: r.body,
		Headers: http.Header{"Content-Type": {"application/json"}, "X-Request-Id": {"load-" + strconv.Itoa(i)}}}
	forward := extproctest.HTTPForward(env.httpc)
	client := env.client
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	switch r.kind {
	case runToEnd:
		resp, err := client.Roundtrip(ctx, req, forward)
		switch {
		case err != nil:
			return err
		case resp.StatusCode != http.StatusOK:
			return fmt.Errorf("status %d: %s", resp.StatusCode, resp.Body)
		case !bytes.HasSuffix(bytes.TrimSpace(resp.Body), []byte("data: [DONE]")):
			return fmt.Errorf("streamed answer cut short: %q", resp.Body)
		}
		env.completed.Add(1)
		return nil
	case cancelBeforeDecision, cancelRacingPick:
		resetEarly(ctx, env.conn, &req, r.kind == cancelRacingPick, r.delay, cancel)
		return nil
	case cancelAfterDecision:
		req.Interrupt = extproctest.Interrupt{At: extproctest.AfterDecision, Kind: extproctest.Cancel}
	case cancelAfterHeaders:
		req.Interrupt = extproctest.Interrupt{At: extproctest.AfterResponseHeaders, Kind: extproctest.Cancel}
	case cancelAfterFirstChunk:
		req.Interrupt = extproctest.Interrupt{At: extproctest.AfterFirstChunk, Kind: extproctest.Cancel}
	case cancelMidBody:
		forward = cutAfter(forward, r.reads, cancel)
	case dropHalfClose:
		req.Interrupt = extproctest.Interrupt{At: r.at, Kind: extproctest.Abort}
	case dropConnection, dropConnectionPick:
		// A connection of its own, as an Envoy that crashes takes its
		// connections with it.
		conn, err := grpc.NewClient(env.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer conn.Close()
		if r.kind == dropConnectionPick {
			resetEarly(ctx, conn, &req, true, r.delay, func() { _ = conn.Close() })
			return nil
		}
		if client, err = extproctest.NewClient(conn, extproctest.Options{}); err != nil {
			return err
		}
		forward = cutAfter(forward, r.reads, func() { _ = conn.Close() })
	}
	_, _ = client.Roundtrip(ctx, req, forward)
	return nil
}

// cutAfter wraps forward so that cut runs once the upstream body has been read
// reads times (at once when reads is 0), wherever the relay stands.
func cutAfter(forward extproctest.Forward, reads int, cut func()) extproctest.Forward {
	return func(dest string, req *http.Request) (*http.Response, error) {
		resp, err := forward(dest, req)
		if err == nil {
			if reads == 0 {
				cut()
			} else {
				resp.Body = &cutBody{ReadCloser: resp.Body, left: reads, cut: cut}
			}
		}
		return resp, err
	}
}

type cutBody struct {
	io.ReadCloser
	left int
	cut  func()
}

func (b *cutBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if b.left > 0 {
		if b.left--; b.left == 0 {
			b.cut()
		}
	}
	return n, err
}

// resetEarly plays an Envoy whose client goes away before the EPP answers: it
// opens a stream, sends the request headers and the body (whole, with end of
// stream, or only its first half), waits delay and cuts with cut, without
// reading any reply.
func resetEarly(ctx context.Context, conn grpc.ClientConnInterface, req *extproctest.HTTPRequest, whole bool,
	delay time.Duration, cut func()) {
	defer cut()
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return
	}
	hv := func(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, RawValue: []byte(v)} }
	headers := []*corev3.HeaderValue{hv(":method", http.MethodPost), hv(":path", req.Path),
		hv(":authority", extproctest.DefaultAuthority), hv(":scheme", "http"),
		hv("content-length", strconv.Itoa(len(req.Body)))}
	for k, vs := range req.Headers {
		headers = append(headers, hv(strings.ToLower(k), vs[0]))
	}
	body := req.Body
	if !whole {
		body = body[:len(body)/2]
	}
	full := extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	if st.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: headers}}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: full, ResponseBodyMode: full,
			SendBodyWithoutWaitingForHeaderResponse: true},
	}) != nil {
		return
	}
	if st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: whole}}}) != nil {
		return
	}
	if delay > 0 {
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
		}
	}
}

// waitIdle waits until nothing is booked, loaded, planned, queued or in a
// request phase, and no engine is still answering.
func (env *loadEnv) waitIdle(t *testing.T) {
	t.Helper()
	model := demofleet.Model
	eventually(t, loadIdleWithin, func() error {
		if n := env.e.server.Inflight(); n != 0 {
			return fmt.Errorf("%d requests in their request phase", n)
		}
		for role, svc := range env.services {
			st := svc.Stats()
			if st.Ledger.Active != 0 || st.Waiting != 0 {
				return fmt.Errorf("%s: %d reservations active, %d waiting", role, st.Ledger.Active, st.Waiting)
			}
			if err := uncounted(st); err != nil {
				return fmt.Errorf("%s: %w", role, err)
			}
			for _, l := range svc.Loads(model) {
				if l.ActiveRequests != 0 || l.ActiveBlocks != 0 || l.ActivePrefillTokens != 0 {
					return fmt.Errorf("%s: load left on %s: %+v", role, l.WorkerID, l)
				}
			}
		}
		if p := env.e.pairs; p != nil {
			if st := p.Stats().Plans; st.Active != 0 {
				return fmt.Errorf("%d plans live (%+v)", st.Active, st)
			}
		}
		for i, eng := range env.engines {
			if r := eng.HTTPStats().Running; r != 0 {
				return fmt.Errorf("engine %d: %d completions running", i, r)
			}
		}
		if st := env.e.cache.Stats(); st.Calls != st.Latency.Count {
			return fmt.Errorf("tokenizer: %d upstream calls, %d finished", st.Calls, st.Latency.Count)
		}
		return nil
	})
}

// uncounted says what settle calls of a service are still to be counted: a
// free takes the booking off the ledger (Active, the loads) before it counts
// it (Ledger.Freed, then Frees), so the counters add up only once the calls
// in flight have returned. Without replicas (remote bookings count in Expired
// and Dropped, not in Bookings).
func uncounted(st selection.Stats) error {
	l := st.Ledger
	if l.Booked != l.Active+l.Freed+l.Expired+l.Removed {
		return fmt.Errorf("ledger: %d booked, %d active + %d freed + %d expired + %d removed", l.Booked, l.Active, l.Freed, l.Expired, l.Removed)
	}
	if st.Bookings != st.Frees+st.Expired+st.Dropped {
		return fmt.Errorf("%d bookings, %d frees + %d expired + %d dropped", st.Bookings, st.Frees, st.Expired, st.Dropped)
	}
	return nil
}

// checkCounters checks that the EPP's counters add up once it is idle: every
// booking (and plan) was freed by its request, none expired or was freed
// twice, and the ext_proc outcomes match the bookings.
func (env *loadEnv) checkCounters(t *testing.T, n int, completed int64) {
	t.Helper()
	var bookings uint64
	for role, svc := range env.services {
		st := svc.Stats()
		l := st.Ledger
		require.Equal(t, st.Bookings, st.Frees, "%s: bookings and frees (%+v)", role, st)
		require.Equal(t, l.Booked, l.Freed, "%s: ledger (%+v)", role, l)
		require.Zero(t, l.Expired+l.Removed, "%s: bookings settled by the lease or removal, not their request (%+v)", role, l)
		require.Zero(t, st.UnknownReservations, "%s: settle calls for unknown ids", role)
		if env.e.pairs == nil {
			bookings = st.Bookings
		}
	}
	if p := env.e.pairs; p != nil {
		st := p.Stats()
		require.Equal(t, st.Plans.Registered, st.Plans.Completed, "plans (%+v)", st)
		require.Zero(t, st.Plans.Expired, "plans left to expiry (%+v)", st)
		require.Equal(t, st.Booked, st.Plans.Registered, "plans booked and registered (%+v)", st)
		bookings = uint64(st.Booked)
	}
	outcomes := env.outcomes(t)
	var total uint64
	for status, c := range outcomes {
		require.Contains(t, []string{"0", "200"}, status, "no request may be rejected (outcomes %v)", outcomes)
		total += c
	}
	routed := outcomes["200"]
	require.GreaterOrEqual(t, routed, uint64(completed), "outcomes %v", outcomes)
	// A booking whose decision could not be sent (the stream was gone) is
	// freed and counted as outcome 0.
	require.GreaterOrEqual(t, bookings, routed, "bookings and routed requests (outcomes %v)", outcomes)
	require.LessOrEqual(t, bookings, total, "bookings and outcomes (outcomes %v)", outcomes)
	require.LessOrEqual(t, total, uint64(n+2*loadInflight), "outcomes %v", outcomes)
	cs := env.e.cache.Stats()
	require.Zero(t, cs.Errors.BadRequest+cs.Errors.Unavailable+cs.Errors.Timeout+cs.Errors.Upstream+cs.Errors.Other,
		"tokenizer errors but cancellations: %+v", cs.Errors)
	require.LessOrEqual(t, cs.Bytes, cs.MaxBytes)
	t.Logf("outcomes %v, bookings %d; tokenizer calls %d, hits %d, abandoned %d, cache %.1f of %.1f MiB",
		outcomes, bookings, cs.Calls, cs.Hits, cs.Abandoned, mib(cs.Bytes), mib(cs.MaxBytes))
}

// outcomes reads kvselect_epp_requests_total by status.
func (env *loadEnv) outcomes(t *testing.T) map[string]uint64 {
	t.Helper()
	families, err := env.e.reg.Gather()
	require.NoError(t, err)
	out := map[string]uint64{}
	for _, f := range families {
		if f.GetName() != "kvselect_epp_requests_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "status" {
					out[l.GetValue()] += uint64(m.GetCounter().GetValue())
				}
			}
		}
	}
	return out
}

// settle drops the client's idle connections, collects garbage and returns
// the live heap.
func (env *loadEnv) settle() (heap uint64) {
	env.httpc.CloseIdleConnections()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// goroutines counts the goroutines, and among them those of idle keep-alive
// HTTP connections: both ends of the tokenizer's pool, which keeps up to 64
// connections idle whatever the requests did, and the server ends of the
// client's connections being closed.
func goroutines() (total, idle int) {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		total++
		switch {
		case strings.Contains(g, "net/http.(*persistConn).readLoop"), strings.Contains(g, "net/http.(*persistConn).writeLoop"),
			strings.Contains(g, "net/http.(*conn).serve") && strings.Contains(g, "bufio.(*Reader).Peek"):
			idle++
		}
	}
	return total, idle
}

// eventually polls cond until it returns nil or within has passed, then fails
// with its last error.
func eventually(t *testing.T, within time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			require.NoError(t, err, "still not true after %v", within)
		}
		<-tick.C
	}
}
