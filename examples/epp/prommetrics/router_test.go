package prommetrics_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/prommetrics"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/selection/httproute"
	"github.com/kvselect/kvselect/tokenize"
)

// flakyTokenizer is one id per body byte, or ErrUnavailable while down.
type flakyTokenizer struct{ down atomic.Bool }

func (f *flakyTokenizer) Tokenize(_ context.Context, req tokenize.Request) (tokenize.Result, error) {
	if f.down.Load() {
		return tokenize.Result{}, fmt.Errorf("%w: tokenizer down", tokenize.ErrUnavailable)
	}
	ids := make([]uint32, len(req.Body))
	for i, c := range req.Body {
		ids[i] = uint32(c)
	}
	return tokenize.Result{Tokens: ids, PromptCount: 1}, nil
}

// The Router collector reads Router.Stats: requests served, routed without
// tokens (degraded), refused past a bound and failed upstream each land in
// their series; every reason and outcome is exported from the start.
func TestRouterCollector(t *testing.T) {
	_, err := prommetrics.NewRouterCollector(nil)
	require.Error(t, err)

	var fail atomic.Bool
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if fail.Load() {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		_, _ = io.WriteString(w, `{"ok":true}`)
	}))
	defer engine.Close()
	cfg := selection.DefaultConfig(4)
	cfg.UseKVEvents = false
	svc, err := selection.NewSelectionServiceBuilder(cfg).Build(context.Background())
	require.NoError(t, err)
	defer func() { _ = svc.Close() }()
	_, err = svc.Workers().Upsert(catalog.Worker{ID: "e", Endpoint: engine.Listener.Addr().String(), DPSize: 1, BlockSize: 4})
	require.NoError(t, err)
	tok := &flakyTokenizer{}
	router, err := httproute.New(httproute.Options{Service: httproute.Single(svc), Tokenizer: tok, MaxBodyBytes: 2048})
	require.NoError(t, err)
	defer router.CloseIdleConnections()
	gw := httptest.NewServer(router)
	defer gw.Close()

	reg := prometheus.NewRegistry()
	rc, err := prommetrics.NewRouterCollector(router)
	require.NoError(t, err)
	require.NoError(t, reg.Register(rc))
	all := gather(t, reg)
	for _, r := range []string{"overloaded", "body_timeout", "body_too_large", "prompt_too_long", "tokenizer_degraded"} {
		require.Equal(t, 0.0, find(t, all, "kvselect_httproute_refusals_total", map[string]string{"reason": r}), "exported at 0: %s", r)
	}
	for _, o := range []string{"ended", "canceled", "failed", "aborted"} {
		require.Equal(t, 0.0, find(t, all, "kvselect_httproute_done_total", map[string]string{"outcome": o}), "exported at 0: %s", o)
	}

	post := func(body string) int {
		resp, err := http.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	ok := `{"model":"default","messages":[{"role":"user","content":"hello there"}]}`
	require.Equal(t, http.StatusOK, post(ok))
	require.Equal(t, http.StatusOK, post(ok))
	tok.down.Store(true)
	require.Equal(t, http.StatusOK, post(ok), "routed on load alone")
	tok.down.Store(false)
	require.Equal(t, http.StatusRequestEntityTooLarge, post(`{"model":"default","prompt":"`+strings.Repeat("x", 4096)+`"}`))
	fail.Store(true)
	require.Equal(t, http.StatusInternalServerError, post(ok))

	all = gather(t, reg)
	count := func(name string, labels map[string]string) float64 { return find(t, all, name, labels) }
	require.Equal(t, 5.0, count("kvselect_httproute_requests_total", nil))
	require.Equal(t, 1.0, count("kvselect_httproute_rejected_total", nil))
	require.Equal(t, 1.0, count("kvselect_httproute_refusals_total", map[string]string{"reason": "body_too_large"}))
	require.Equal(t, 1.0, count("kvselect_httproute_refusals_total", map[string]string{"reason": "tokenizer_degraded"}))
	require.Equal(t, 4.0, count("kvselect_httproute_booked_total", nil))
	require.Equal(t, 4.0, count("kvselect_httproute_done_total", map[string]string{"outcome": "ended"}), "a 500 answer is read to its end")
	require.Equal(t, 3.0, count("kvselect_httproute_first_bytes_total", nil), "2xx answers only")
	require.Equal(t, 1.0, count("kvselect_httproute_failure_statuses_total", nil))
	require.Equal(t, 1.0, count("kvselect_httproute_workers_marked_failed_total", nil))
	require.Equal(t, 0.0, count("kvselect_httproute_upstream_errors_total", nil))
	st := router.Stats()
	require.Equal(t, st.Booked, st.Done)
}

// The workers-file collector exports the reloads a discovery.Static refused,
// under the EPP's name.
func TestWorkersFileCollector(t *testing.T) {
	_, err := prommetrics.NewWorkersFileCollector(nil)
	require.Error(t, err)
	path := filepath.Join(t.TempDir(), "workers.json")
	require.NoError(t, os.WriteFile(path, []byte(`{"workers":[{"id":"e0","endpoint":"127.0.0.1:1"}]}`), 0o600))
	src, err := discovery.NewStatic(discovery.StaticOptions{Path: path})
	require.NoError(t, err)
	c, err := prommetrics.NewWorkersFileCollector(src)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(c))
	require.Equal(t, 0.0, find(t, gather(t, reg), "kvselect_workers_file_rejected_total", nil))
	require.Error(t, reg.Register(c), "a collector is registered once")
}
