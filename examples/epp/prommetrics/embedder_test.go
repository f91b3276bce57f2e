package prommetrics_test

import (
	"bufio"
	"context"
	"flag"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/eppserver"
	"github.com/kvselect/kvselect/examples/epp/prommetrics"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// The service both sides build: one worker of model "m" whose KV-event
// endpoint nobody serves, and a tokenizer nobody serves (no request is
// routed: the families are there from the start).
const (
	embModel     = "m"
	embWorker    = "w0"
	embEndpoint  = "127.0.0.1:8000"
	embEvents    = "tcp://127.0.0.1:1"
	embTokenizer = "http://127.0.0.1:1"
)

// A program that embeds kvselect, with no EPP, registers the collectors in
// a registry of its own for the selection service, tokenizer cache and pool
// it built, and gets the families the reference EPP exports for the same
// service: every kvselect_* family of the EPP's /metrics, but those of the
// EPP's own ext_proc path (kvselect_epp_*) and of its workers file
// (NewWorkersFileCollector, for a program that reads one), with the same
// names, and none the EPP lacks.
func TestCollectorsGiveAnEmbedderTheEPPFamilies(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// The embedder: its own service, cache and pool, its own registry.
	reg := prometheus.NewRegistry()
	dec, err := prommetrics.NewDecisions(reg)
	require.NoError(t, err)
	svc, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(16)).Recorder(dec.ForRole("aggregated")).Build(ctx)
	require.NoError(t, err)
	defer func() { _ = svc.Close() }()
	rec, err := svc.Workers().Upsert(catalog.Worker{ID: embWorker, Model: embModel, Endpoint: embEndpoint, DPSize: 1, BlockSize: 16,
		KVEventEndpoints: map[int]string{0: embEvents}})
	require.NoError(t, err)
	require.Equal(t, catalog.Schedulable, rec.Lifecycle, "%v", rec.Reasons)
	client, err := tokenize.New(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: embTokenizer})
	require.NoError(t, err)
	defer client.Close()
	pool, err := tokenize.NewPool(tokenize.PoolOptions{Endpoints: []tokenize.Endpoint{{Name: embTokenizer, Tokenizer: client}}})
	require.NoError(t, err)
	cache, err := tokenize.NewCache(pool, tokenize.CacheOptions{Protocol: tokenize.ProtocolVLLMRender, Model: embModel})
	require.NoError(t, err)
	defer cache.Close()
	sc, err := prommetrics.NewServiceCollector(prommetrics.ServiceOptions{
		Services: map[string]*selection.SelectionService{"aggregated": svc}, Cache: cache, Model: embModel})
	require.NoError(t, err)
	tc, err := prommetrics.NewTokenizerCollector(prommetrics.TokenizerOptions{Pool: pool})
	require.NoError(t, err)
	require.NoError(t, reg.Register(sc))
	require.NoError(t, reg.Register(tc))
	families, err := reg.Gather()
	require.NoError(t, err)
	var embedder []string
	for _, f := range families {
		embedder = append(embedder, f.GetName())
	}
	all := gather(t, reg)
	w := map[string]string{"role": "aggregated", "worker": embWorker, "rank": "0"}
	require.Equal(t, 1.0, find(t, all, "kvselect_workers", map[string]string{"role": "aggregated", "lifecycle": "schedulable"}))
	require.Equal(t, 1.0, find(t, all, "kvselect_kv_feed_state", map[string]string{"worker": embWorker, "state": "healthy"}))
	require.Equal(t, 1.0, find(t, all, "kvselect_kv_feed_trusted", w))
	require.Equal(t, 0.0, find(t, all, "kvselect_worker_active_requests", w))
	require.Equal(t, 0.0, find(t, all, "kvselect_tokenizer_endpoint_calls_total", map[string]string{"endpoint": embTokenizer}))

	// The reference EPP, in process, for the same service.
	exported := eppFamilies(ctx, t)
	var missing, extra []string
	for _, f := range exported {
		if !strings.HasPrefix(f, "kvselect_") || strings.HasPrefix(f, "kvselect_epp_") || f == "kvselect_workers_file_rejected_total" {
			continue
		}
		if !slices.Contains(embedder, f) {
			missing = append(missing, f)
		}
	}
	for _, f := range embedder {
		if !slices.Contains(exported, f) {
			extra = append(extra, f)
		}
	}
	require.Empty(t, missing, "families the EPP exports and the embedder's registry lacks")
	require.Empty(t, extra, "families the embedder gets under names the EPP does not export")
	require.Greater(t, len(embedder), 40, "%v", embedder)
}

// eppFamilies runs the reference EPP (a workers file with the embedder's
// worker, the same tokenizer), waits until it has applied the file and
// returns the metric families of its /metrics.
func eppFamilies(ctx context.Context, t *testing.T) []string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "workers.json")
	require.NoError(t, os.WriteFile(path, []byte(`{"workers":[{"id":"`+embWorker+`","endpoint":"`+embEndpoint+
		`","kv_events_endpoint":"`+embEvents+`"}]}`), 0o600))
	env := map[string]string{
		"DYN_EPP_WORKERS_FILE": path, "DYN_EPP_TOKENIZER_SERVICE_URL": embTokenizer, "DYN_MODEL_NAME": embModel,
		"DYN_KV_CACHE_BLOCK_SIZE": "16", "DYN_SECURE_SERVING": "false",
		"DYN_EPP_EXTPROC_ADDR": "127.0.0.1:0", "DYN_EPP_HEALTH_ADDR": "127.0.0.1:0", "DYN_EPP_METRICS_ADDR": "127.0.0.1:0",
	}
	fs := flag.NewFlagSet("epp", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg, err := eppserver.LoadConfig(fs, nil, func(k string) string { return env[k] })
	require.NoError(t, err)
	listening := &listenCatcher{addr: make(chan string, 1)}
	sctx, stop := context.WithCancel(ctx)
	served := make(chan error, 1)
	go func() { served <- eppserver.Serve(sctx, cfg, slog.New(listening)) }()
	defer func() {
		stop()
		require.NoError(t, <-served)
	}()
	var url string
	select {
	case a := <-listening.addr:
		url = "http://" + a + "/metrics"
	case err := <-served:
		require.FailNow(t, "the EPP stopped", "%v", err)
	}
	// Poll until the workers file is applied: its per-rank series are there,
	// its event source's among them (the feed registers it a moment after
	// the worker).
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		names, text := scrapeFamilies(ctx, t, url)
		if strings.Contains(text, `kvselect_kv_feed_state{rank="0",role="aggregated",state="healthy",worker="`+embWorker+`"} 1`) &&
			strings.Contains(text, `kvselect_worker_active_requests{rank="0",role="aggregated",worker="`+embWorker+`"} 0`) &&
			strings.Contains(text, `kvselect_kv_event_source_connected{rank="0",role="aggregated",worker="`+embWorker+`"}`) {
			return names
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			require.FailNow(t, "the EPP never applied its workers file", text)
		}
	}
}

// scrapeFamilies GETs a /metrics page and returns its families' names (its
// "# TYPE" lines) and the page.
func scrapeFamilies(ctx context.Context, t *testing.T, url string) ([]string, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var names []string
	var page strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		page.WriteString(line + "\n")
		if rest, ok := strings.CutPrefix(line, "# TYPE "); ok {
			name, _, _ := strings.Cut(rest, " ")
			names = append(names, name)
		}
	}
	require.NoError(t, sc.Err())
	return names, page.String()
}

// listenCatcher is a slog.Handler that passes on the metrics address of the
// EPP's "epp listening" record and drops the rest.
type listenCatcher struct{ addr chan string }

func (l *listenCatcher) Enabled(context.Context, slog.Level) bool { return true }
func (l *listenCatcher) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *listenCatcher) WithGroup(string) slog.Handler            { return l }
func (l *listenCatcher) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "epp listening" {
		return nil
	}
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "metrics" {
			select {
			case l.addr <- a.Value.String():
			default:
			}
			return false
		}
		return true
	})
	return nil
}
