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

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/roles"
)

// renderEngine is a worker's HTTP endpoint on 127.0.0.1 that serves vLLM's
// chat render route, counting its calls.
type renderEngine struct {
	srv   *httptest.Server
	calls atomic.Int64
}

func newRenderEngine(t *testing.T) *renderEngine {
	t.Helper()
	e := &renderEngine{}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/chat/completions/render" {
			http.NotFound(w, r)
			return
		}
		e.calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"request_id":"chatcmpl-1","token_ids":[%s]}`, strings.TrimSuffix(strings.Repeat("7,", 64), ","))
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *renderEngine) endpoint() string { return e.srv.Listener.Addr().String() }
func (e *renderEngine) url() string      { return "http://" + e.endpoint() }

func (e *renderEngine) worker(id string, labels map[string]string) catalog.Worker {
	return catalog.Worker{ID: id, Endpoint: e.endpoint(), DPSize: 1, Labels: labels}
}

// hasSeries reports whether the EPP's registry has a series of name with
// the label endpoint=url.
func hasSeries(t *testing.T, e *EPP, name, url string) bool {
	t.Helper()
	families, err := e.reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "endpoint" && l.GetValue() == url {
					return true
				}
			}
		}
	}
	return false
}

func tokenizerNames(e *EPP) []string {
	var names []string
	for _, ep := range e.TokenizerStats().Endpoints {
		names = append(names, ep.Name)
	}
	return names
}

// chatNo is the n-th of distinct chat bodies (the tokenizer cache answers
// a repeated one without a call).
var chatNo atomic.Int64

func nextChat() []byte {
	return []byte(fmt.Sprintf(`{"model":"default","messages":[{"role":"user","content":"%d %s"}]}`, chatNo.Add(1), strings.Repeat("hello ", 40)))
}

// pickTokenized picks a new chat request and settles it; it fails the test
// on an error or a request routed without tokens (degraded).
func pickTokenized(t *testing.T, e *EPP) {
	t.Helper()
	before := e.router.degraded.Load()
	p, err := e.router.Pick(context.Background(), extproc.PickRequest{Path: "/v1/chat/completions", Body: nextChat()})
	require.NoError(t, err)
	p.Settle.Done()
	require.Equal(t, before, e.router.degraded.Load(), "tokenized, not degraded")
}

// Without DYN_EPP_TOKENIZER_SERVICE_URL the tokenizers are the discovered
// workers' own endpoints, and they follow discovery: a worker that comes is
// a tokenizer (and a metric series), one that goes is neither; workers of
// another model, and workers labelled with another engine (TensorRT-LLM),
// are left out, and a set that leaves no tokenizer is a WARN and the
// degraded mode. A configured URL list wins over discovery.
func TestTokenizersFollowDiscovery(t *testing.T) {
	a, b, c, trt, other := newRenderEngine(t), newRenderEngine(t), newRenderEngine(t), newRenderEngine(t), newRenderEngine(t)
	cfg, err := load(t, map[string]string{"DYN_EPP_KV_EVENT_PORT": "0"})
	require.NoError(t, err)
	require.Empty(t, cfg.TokenizerURLs)
	var logs syncBuffer
	e, err := New(context.Background(), cfg, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	defer e.Close()
	require.Contains(t, logs.String(), "tokenizers: the discovered workers' own endpoints")
	require.Empty(t, tokenizerNames(e), "no worker discovered yet")

	trtWorker := trt.worker("trt", map[string]string{discovery.EngineLabel: "trtllm"})
	otherModel := other.worker("other", nil)
	otherModel.Model = "another-model"
	e.Apply(discovery.Snapshot{Synced: true, Workers: []catalog.Worker{
		a.worker("a", nil), b.worker("b", map[string]string{discovery.EngineLabel: "vllm"}), trtWorker, otherModel}})
	require.Equal(t, []string{a.url(), b.url()}, tokenizerNames(e))
	require.Contains(t, logs.String(), "workers left out of the tokenizer pool")
	require.Contains(t, logs.String(), "workers=[trt]")
	for range 4 {
		pickTokenized(t, e)
	}
	require.Positive(t, a.calls.Load())
	require.Positive(t, b.calls.Load())
	require.Zero(t, trt.calls.Load()+other.calls.Load(), "neither TensorRT-LLM's nor another model's worker tokenizes")
	require.True(t, hasSeries(t, e, "kvselect_tokenizer_endpoint_calls_total", a.url()))

	// a goes, c comes: the pool and its metrics follow.
	e.Apply(discovery.Snapshot{Synced: true, Workers: []catalog.Worker{b.worker("b", nil), c.worker("c", nil), trtWorker}})
	require.Equal(t, []string{b.url(), c.url()}, tokenizerNames(e))
	require.False(t, hasSeries(t, e, "kvselect_tokenizer_endpoint_calls_total", a.url()), "a left the pool")
	require.True(t, hasSeries(t, e, "kvselect_tokenizer_endpoint_circuit_open", c.url()))
	calls := a.calls.Load()
	for range 4 {
		pickTokenized(t, e)
	}
	require.Equal(t, calls, a.calls.Load(), "no call goes to a worker that left")
	require.Positive(t, c.calls.Load())
	require.Equal(t, 1, strings.Count(logs.String(), "workers left out of the tokenizer pool"), "logged once, while it does not change")

	// Only TensorRT-LLM is left: no tokenizer, a WARN, and requests are
	// routed on load alone.
	e.Apply(discovery.Snapshot{Synced: true, Workers: []catalog.Worker{trtWorker}})
	require.Empty(t, tokenizerNames(e))
	require.Contains(t, logs.String(), "no discovered worker can serve as a tokenizer")
	p, err := e.router.Pick(context.Background(), extproc.PickRequest{Path: "/v1/chat/completions", Body: nextChat()})
	require.NoError(t, err)
	require.Equal(t, trt.endpoint(), p.Destination)
	p.Settle.Done()
	require.EqualValues(t, 1, e.router.degraded.Load())
	require.Zero(t, trt.calls.Load())

	// A configured URL wins over discovery.
	cfg, err = load(t, map[string]string{"DYN_EPP_KV_EVENT_PORT": "0", "DYN_EPP_TOKENIZER_SERVICE_URL": c.url()})
	require.NoError(t, err)
	var clogs syncBuffer
	configured, err := New(context.Background(), cfg, Options{Logger: slog.New(slog.NewTextHandler(&clogs, nil))})
	require.NoError(t, err)
	defer configured.Close()
	require.Contains(t, clogs.String(), "tokenizers: the configured URLs")
	configured.Apply(discovery.Snapshot{Synced: true, Workers: []catalog.Worker{a.worker("a", nil), b.worker("b", nil)}})
	require.Equal(t, []string{c.url()}, tokenizerNames(configured))
}

// Discovery changes the tokenizer set while requests are being picked:
// every set has a live worker, so every request is tokenized, none routed
// degraded (run it with -race).
func TestTokenizersChangeWhilePicking(t *testing.T) {
	engines := []*renderEngine{newRenderEngine(t), newRenderEngine(t), newRenderEngine(t)}
	cfg, err := load(t, map[string]string{"DYN_EPP_KV_EVENT_PORT": "0"})
	require.NoError(t, err)
	e, err := New(context.Background(), cfg, Options{})
	require.NoError(t, err)
	defer e.Close()
	snapshot := func(ids ...int) discovery.Snapshot {
		s := discovery.Snapshot{Synced: true}
		for _, i := range ids {
			s.Workers = append(s.Workers, engines[i].worker(fmt.Sprintf("w%d", i), nil))
		}
		return s
	}
	sets := []discovery.Snapshot{snapshot(0), snapshot(0, 1), snapshot(1, 2), snapshot(2), snapshot(0, 2)}
	e.Apply(sets[0])
	const pickers, picks = 4, 40
	var wg sync.WaitGroup
	picked := make(chan struct{}, pickers*picks)
	errs := make(chan error, pickers)
	for range pickers {
		wg.Go(func() {
			for range picks {
				p, err := e.router.Pick(context.Background(), extproc.PickRequest{Path: "/v1/chat/completions", Body: nextChat()})
				if err != nil {
					errs <- err
					return
				}
				p.Settle.Done()
				picked <- struct{}{}
			}
		})
	}
	go func() { wg.Wait(); close(picked) }()
	applied := 0
	for range picked { // the discovery loop: one goroutine applies, a new set per pick done
		applied++
		e.Apply(sets[applied%len(sets)])
	}
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	require.Zero(t, e.router.degraded.Load(), "every set had a tokenizer")
	require.Zero(t, e.TokenizerStats().Exhausted)
	require.Positive(t, applied)
	require.EqualValues(t, pickers*picks, e.Service(roles.Aggregated).Stats().Bookings)
}
