package eppserver

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/internal/logtest"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// The tokenizer pool's acceptance (issue 30), through real sockets: four
// fake engines serve the requests, and three of them are also the EPP's
// tokenizers (DYN_EPP_TOKENIZER_SERVICE_URL lists them). Each tokenizer URL
// is its engine's own HTTP API mounted on a listener of its own, so that a
// test can take an engine's tokenizer role away and leave it serving.
const (
	poolRequests   = 1600 // the figure
	poolInflight   = 8
	poolEngines    = 4
	poolTokenizers = 3
	poolDegraded   = 200 // phase 2: every tokenizer down
	poolRunWithin  = 50 * time.Second
)

// tokenizerRole is one engine's render endpoint on a listener of its own,
// counting the calls it serves.
type tokenizerRole struct {
	srv   *httptest.Server
	calls atomic.Int64
	once  sync.Once
}

func (r *tokenizerRole) close() {
	r.once.Do(func() {
		r.srv.CloseClientConnections() // the calls in flight fail, as when a pod dies
		r.srv.Close()
	})
}

// TestTokenizerPoolFailoverAndDegradedMode kills the first tokenizer URL
// mid-run (its listener closed, its calls in flight cut) while 8 requests
// are in flight: fewer than 1% of the requests fail (none, in practice), the
// pool fails over to the other URLs and opens the dead one's circuit, and no
// request is routed without tokens. Then every tokenizer goes: requests are
// still routed and served (the degraded mode books them on load alone and
// settles them), none fails for want of tokens, and the degraded counter
// counts each one.
func TestTokenizerPoolFailoverAndDegradedMode(t *testing.T) {
	started := time.Now()
	n := poolRequests
	var engines []*fakeengine.Engine
	var workers []catalog.Worker
	var endpoints []string
	t.Cleanup(func() {
		for _, eng := range engines {
			_ = eng.Close()
		}
	})
	for i := range poolEngines {
		eng, err := fakeengine.New(fakeengine.Options{BlockSize: 16, CapacityBlocks: 1024, ReplayBuffer: 256,
			EnableHTTP: true, EnableReplay: true, Model: demofleet.Model})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = eng.Start(ctx)
		cancel()
		require.NoError(t, err)
		engines = append(engines, eng)
		endpoints = append(endpoints, eng.HTTPEndpoint())
		workers = append(workers, catalog.Worker{
			ID: fmt.Sprintf("w%d", i), Model: demofleet.Model, Endpoint: eng.HTTPEndpoint(), DPSize: 1, BlockSize: 16,
			KVEventEndpoints: map[int]string{0: eng.PubEndpoint()}, ReplayEndpoint: eng.ReplayEndpoint(),
		})
	}
	// The first tokenizer dies once it has served a quarter of its share of
	// the run, in the middle of the run.
	killAfter := int64(n / poolTokenizers / 4)
	kill := make(chan struct{})
	var killOnce sync.Once
	toks := make([]*tokenizerRole, poolTokenizers)
	var urls []string
	for i := range toks {
		r := &tokenizerRole{}
		h := engines[i].Handler()
		r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			if r.calls.Add(1) == killAfter && i == 0 {
				killOnce.Do(func() { close(kill) })
			}
			h.ServeHTTP(w, req)
		}))
		t.Cleanup(r.close)
		toks[i] = r
		urls = append(urls, r.srv.URL)
	}

	cfg, err := load(t, map[string]string{"DYN_EPP_TOKENIZER_PROTOCOL": "vllm-render",
		"DYN_EPP_TOKENIZER_SERVICE_URL": strings.Join(urls, " , ")})
	require.NoError(t, err)
	require.Equal(t, urls, cfg.TokenizerURLs)
	cfg.Model = demofleet.Model
	var logs syncBuffer
	e, err := New(context.Background(), cfg, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Configure: func(b *selection.SelectionServiceBuilder) {
			b.EventFeed(selection.FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 50 * time.Millisecond})
		}})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	e.Apply(discovery.Snapshot{Workers: workers, Synced: true})
	for _, eng := range engines {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := eng.WaitSubscribed(ctx)
		cancel()
		require.NoError(t, err)
	}
	svc := e.Service(roles.Aggregated)
	metric := func(name string, labels map[string]string) float64 { return seriesValue(t, e, name, labels) }
	drive := func(run, requests int) demofleet.Result {
		t.Helper()
		wl, err := demofleet.Workload(demofleet.WorkloadOptions{Requests: requests, Groups: 8, Seed: uint64(run)}, run)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), poolRunWithin)
		defer cancel()
		res, err := demofleet.Drive(ctx, e.ExtProc(), wl, demofleet.DriveOptions{Concurrency: poolInflight, Endpoints: endpoints})
		require.NoError(t, err)
		served := 0
		for _, c := range res.PerEndpoint {
			served += c
		}
		require.Equal(t, res.Requests-res.Failed, served, "every request that did not fail was served by an engine")
		// Every booking, degraded ones included, is settled by its request.
		eventually(t, loadIdleWithin, func() error {
			st := svc.Stats()
			if st.Ledger.Active != 0 || st.Bookings != st.Frees {
				return fmt.Errorf("%d reservations active, %d booked, %d freed", st.Ledger.Active, st.Bookings, st.Frees)
			}
			return nil
		})
		return res
	}

	// Phase 1: the first tokenizer dies mid-run.
	killed := make(chan struct{})
	go func() {
		defer close(killed)
		<-kill
		toks[0].close()
	}()
	phase1 := time.Now()
	res := drive(1, n)
	killOnce.Do(func() { close(kill) }) // releases the goroutine if the run ended first
	<-killed
	require.GreaterOrEqual(t, toks[0].calls.Load(), killAfter, "the first tokenizer died during the run, not after it")
	t.Logf("phase 1: %d requests, %d failed, hit rate %.1f%%, %v; failovers %v, hedges %v (won %v), dead endpoint: %v calls, %v failures, circuit open %v; degraded %v",
		res.Requests, res.Failed, 100*res.HitRate(), time.Since(phase1).Round(time.Millisecond),
		metric("kvselect_tokenizer_failovers_total", nil), metric("kvselect_tokenizer_hedges_total", nil),
		metric("kvselect_tokenizer_hedge_wins_total", nil),
		metric("kvselect_tokenizer_endpoint_calls_total", map[string]string{"endpoint": urls[0]}),
		metric("kvselect_tokenizer_endpoint_failures_total", map[string]string{"endpoint": urls[0]}),
		metric("kvselect_tokenizer_endpoint_circuit_open", map[string]string{"endpoint": urls[0]}),
		metric("kvselect_epp_degraded_requests_total", nil))
	require.Equal(t, n, res.Requests)
	require.Less(t, res.Failed, n/100, "fewer than 1%% fail: %s", res.FirstFailure)
	require.Positive(t, metric("kvselect_tokenizer_failovers_total", nil), "calls failed over from the dead tokenizer")
	require.Equal(t, float64(e.TokenizerStats().Failovers), metric("kvselect_tokenizer_failovers_total", nil), "the metric is the pool's counter")
	require.Equal(t, 1.0, metric("kvselect_tokenizer_endpoint_circuit_open", map[string]string{"endpoint": urls[0]}))
	require.Positive(t, metric("kvselect_tokenizer_endpoint_circuit_opened_total", map[string]string{"endpoint": urls[0]}))
	require.GreaterOrEqual(t, metric("kvselect_tokenizer_endpoint_failures_total", map[string]string{"endpoint": urls[0]}), float64(tokenize.DefaultPoolFailures))
	for _, u := range urls[1:] {
		require.Zero(t, metric("kvselect_tokenizer_endpoint_circuit_open", map[string]string{"endpoint": u}), u)
		require.Zero(t, metric("kvselect_tokenizer_endpoint_failures_total", map[string]string{"endpoint": u}), u)
	}
	require.Zero(t, metric("kvselect_epp_degraded_requests_total", nil), "two tokenizers answered every request: none routed without tokens")
	require.Zero(t, metric("kvselect_tokenizer_exhausted_total", nil))
	require.Greater(t, res.HitRate(), 0.5, "KV-aware routing went on: the engines served most prompt tokens from cache")

	// Phase 2: every tokenizer is down. Requests are routed on load alone
	// and served; none fails for want of tokens.
	for _, r := range toks {
		r.close()
	}
	phase2, before := time.Now(), svc.Stats()
	res = drive(2, poolDegraded)
	t.Logf("phase 2: %d requests, %d failed, %v; degraded %v, exhausted %v; served by %v",
		res.Requests, res.Failed, time.Since(phase2).Round(time.Millisecond),
		metric("kvselect_epp_degraded_requests_total", nil), metric("kvselect_tokenizer_exhausted_total", nil), res.PerEndpoint)
	require.Equal(t, poolDegraded, res.Requests)
	require.Zero(t, res.Failed, res.FirstFailure)
	require.Equal(t, float64(poolDegraded), metric("kvselect_epp_degraded_requests_total", nil), "every request was routed degraded")
	require.Positive(t, metric("kvselect_tokenizer_exhausted_total", nil))
	after := svc.Stats()
	require.Equal(t, before.Bookings+poolDegraded, after.Bookings, "each degraded request was booked")
	require.Equal(t, before.BestOverlapBlocks, after.BestOverlapBlocks, "load-only decisions: no rank credited a cached prefix")
	lines := strings.Count(logs.String(), "routing on load alone")
	require.Positive(t, lines, "the degraded mode is logged")
	require.LessOrEqual(t, lines, 1+int(time.Since(phase2)/degradedLogEvery), "at most one WARN every 10 s:\n%s", logs.String())
	t.Logf("total %v", time.Since(started).Round(time.Millisecond))
}

// DYN_EPP_TOKENIZER_NO_DEGRADE restores the refusal: with the only tokenizer
// down, a request gets the tokenizer error's status and nothing is booked.
func TestTokenizerNoDegradeRefuses(t *testing.T) {
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close() // a URL nobody serves: connection refused
	for _, noDegrade := range []bool{false, true} {
		cfg, err := load(t, map[string]string{"DYN_EPP_TOKENIZER_SERVICE_URL": down.URL, "DYN_EPP_KV_EVENT_PORT": "0",
			"DYN_EPP_TOKENIZER_NO_DEGRADE": fmt.Sprint(noDegrade)})
		require.NoError(t, err)
		require.Equal(t, noDegrade, cfg.TokenizerNoDegrade)
		e, err := New(context.Background(), cfg, Options{})
		require.NoError(t, err)
		e.Apply(discovery.Snapshot{Workers: []catalog.Worker{{ID: "a", Endpoint: "10.0.0.1:8000", DPSize: 1}}, Synced: true})
		body := []byte(`{"model":"default","messages":[{"role":"user","content":"` + strings.Repeat("hello ", 40) + `"}]}`)
		p, err := e.router.Pick(context.Background(), extproc.PickRequest{Path: "/v1/chat/completions", Body: body})
		st := e.Service(roles.Aggregated).Stats()
		if noDegrade {
			require.ErrorIs(t, err, tokenize.ErrUnavailable)
			require.Equal(t, http.StatusServiceUnavailable, statusOf(err))
			require.Zero(t, st.Bookings)
			require.Zero(t, seriesValue(t, e, "kvselect_epp_degraded_requests_total", nil))
		} else {
			require.NoError(t, err)
			require.Equal(t, "10.0.0.1:8000", p.Destination)
			require.EqualValues(t, 1, st.Bookings)
			loads := e.Service(roles.Aggregated).Loads("default")
			require.Len(t, loads, 1)
			require.Equal(t, 1, loads[0].ActiveRequests)
			require.EqualValues(t, len(body)/tokenize.BytesPerToken, loads[0].ActivePrefillTokens, "booked with the prompt's length estimated from the body")
			p.Settle.Done()
			require.Equal(t, 1.0, seriesValue(t, e, "kvselect_epp_degraded_requests_total", nil))
			require.Equal(t, 1.0, seriesValue(t, e, "kvselect_tokenizer_exhausted_total", nil))
		}
		e.Close()
	}
}

// seriesValue reads one counter or gauge series of the EPP's registry.
func seriesValue(t *testing.T, e *EPP, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := e.reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if want, ok := labels[l.GetName()]; ok && want != l.GetValue() {
					continue metrics
				}
			}
			if g := m.GetGauge(); g != nil {
				return g.GetValue()
			}
			return m.GetCounter().GetValue()
		}
	}
	t.Fatalf("no %s%v", name, labels)
	return 0
}

// syncBuffer is a log sink safe for concurrent writes and the test's reads.
type syncBuffer = logtest.Buffer
