package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
}

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestLoadConfig(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	c, err := loadConfig(fs, []string{"--block-size", "32", "--addr", "127.0.0.1:0", "--tokenizer-no-degrade=true", "--role-label", "example.com/role"}, env(map[string]string{
		"DYN_EPP_TOPOLOGY_MODE": " Disaggregated ", "DYN_EPP_WORKER_ROLE_LABEL": "ignored.example.com/role",
		"DYN_EPP_WORKERS_FILE": "w.json", "DYN_EPP_TOKENIZER_SERVICE_URL": " http://10.0.0.1:8000, https://10.0.0.2:8000 ,",
		"DYN_KV_CACHE_BLOCK_SIZE": "64", "DYN_ROUTER_USE_KV_EVENTS": "false", "GATEWAY_FAILURE_EJECTION": "250ms",
		"DYN_EPP_COST": "predictive", "GATEWAY_BODY_TIMEOUT": "2s", "DYN_EPP_MAX_PROMPT_TOKENS": "4096",
	}))
	require.NoError(t, err)
	require.Equal(t, config{
		Addr: "127.0.0.1:0", MetricsAddr: ":9090", WorkersFile: "w.json", Model: "default",
		Topology: roles.ModeDisaggregated, RoleLabel: "example.com/role",
		TokenizerURLs: []string{"http://10.0.0.1:8000", "https://10.0.0.2:8000"}, TokenizerNoDegrade: true,
		TokenizerProtocol: "vllm-render", TokenizerTimeout: 5 * time.Second, BlockSize: 32, UseKVEvents: false,
		MaxBodyBytes: 8 << 20, FailureEjection: 250 * time.Millisecond, Cost: selection.CostPredictive,
		ReadTimeout: 40 * time.Second, IdleTimeout: 2 * time.Minute, BodyTimeout: 2 * time.Second,
		MaxInflight: 1024, MaxPromptTokens: 4096, OverloadStatus: 429,
	}, c, "flags win over the environment, which wins over the defaults")

	fs = flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	_, err = loadConfig(fs, []string{"--block-size", "0", "--tokenizer-protocol", "nope", "--addr", "8080", "--cost", "cheapest",
		"--body-timeout", "0s", "--max-inflight", "0", "--max-prompt-tokens", "-1", "--metrics-addr", "9090",
		"--tokenizer-no-degrade", "maybe", "--topology", "both"}, env(nil))
	require.ErrorIs(t, err, errConfig)
	for _, want := range []string{"--block-size", "--tokenizer-protocol", "--addr", "--cost", "--body-timeout", "--max-inflight",
		"--max-prompt-tokens", "--metrics-addr", "--tokenizer-no-degrade", "--topology", "--workers-file / DYN_EPP_WORKERS_FILE: required"} {
		require.ErrorContains(t, err, want)
	}
	require.NotContains(t, err.Error(), "--tokenizer-url", "without one, the workers are the tokenizers")

	// The tokenizer URLs: each one an absolute http(s) URL, none twice, at
	// most discovery.MaxTokenizers.
	many := make([]string, discovery.MaxTokenizers+1)
	for i := range many {
		many[i] = fmt.Sprintf("http://10.0.0.%d:8000", i)
	}
	for list, want := range map[string]string{
		"http://10.0.0.1:8000,10.0.0.2:8000":         `"10.0.0.2:8000" is not an absolute http(s) URL`,
		"http://10.0.0.1:8000,ftp://10.0.0.2":        `"ftp://10.0.0.2" is not an absolute http(s) URL`,
		"http://10.0.0.1:8000, http://10.0.0.1:8000": `"http://10.0.0.1:8000" is listed twice`,
		" , ":                   "names no URL",
		strings.Join(many, ","): fmt.Sprintf("%d URLs, at most %d", discovery.MaxTokenizers+1, discovery.MaxTokenizers),
	} {
		fs = flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		_, err = loadConfig(fs, []string{"--workers-file", "w.json", "--tokenizer-url", list}, env(nil))
		require.ErrorIs(t, err, errConfig, list)
		require.ErrorContains(t, err, want, list)
		require.ErrorContains(t, err, "DYN_EPP_TOKENIZER_SERVICE_URL (from --tokenizer-url)", list)
	}

	// The bind address for engines that dial out: tcp://host:port, with KV
	// events on.
	base := map[string]string{"DYN_EPP_WORKERS_FILE": "w.json", "DYN_EPP_TOKENIZER_SERVICE_URL": "http://10.0.0.1:8000"}
	c, err = loadConfig(flag.NewFlagSet("t", flag.ContinueOnError), []string{"--kv-event-bind", "tcp://0.0.0.0:5557"}, env(base))
	require.NoError(t, err)
	require.Equal(t, "tcp://0.0.0.0:5557", c.KVEventBind)
	require.Equal(t, roles.ModeAggregated, c.Topology, "the default topology")
	require.Equal(t, roles.DefaultRoleLabel, c.RoleLabel)
	for _, args := range [][]string{{"--kv-event-bind", "0.0.0.0:5557"}, {"--kv-event-bind", "tcp://0.0.0.0:5557", "--use-kv-events=false"}} {
		fs = flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		_, err = loadConfig(fs, args, env(base))
		require.ErrorContains(t, err, "--kv-event-bind", "%v", args)
	}
}

// signalWriter collects the log and closes seen when a line contains want.
type signalWriter struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	want string
	seen chan struct{}
	once sync.Once
}

func (w *signalWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if strings.Contains(w.buf.String(), w.want) {
		w.once.Do(func() { close(w.seen) })
	}
	return len(p), nil
}

func (w *signalWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// run starts the gateway from its flags and stops it cleanly on its context.
func TestRunStartsAndStops(t *testing.T) {
	var stderr bytes.Buffer
	require.Equal(t, 2, run(context.Background(), []string{"--block-size", "x"}, env(nil), &stderr))
	require.Contains(t, stderr.String(), "DYN_KV_CACHE_BLOCK_SIZE")

	path := filepath.Join(t.TempDir(), "workers.json")
	// A worker labelled decode, in the aggregated topology: served as an
	// aggregated worker, with a WARN naming the flag.
	require.NoError(t, os.WriteFile(path, []byte(`{"workers":[{"id":"e0","endpoint":"127.0.0.1:1","labels":{"nvidia.com/dynamo-worker-role":"decode"}}]}`), 0o600))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w := &signalWriter{want: "workers file applied", seen: make(chan struct{})}
	code := make(chan int, 1)
	go func() {
		code <- run(ctx, []string{"--addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", "--workers-file", path,
			"--tokenizer-url", "http://127.0.0.1:1,http://127.0.0.1:2", "--use-kv-events=false"}, env(nil), w)
	}()
	select {
	case <-w.seen:
	case c := <-code:
		require.FailNow(t, "run returned early", "code %d: %s", c, w.String())
	}
	// GET /metrics on the listener it logged: the families of the selection
	// service, the tokenizer cache and pool (one endpoint per URL) and the
	// Router, from the start.
	var listening struct{ Addr, Metrics string }
	for _, line := range strings.Split(w.String(), "\n") {
		if strings.Contains(line, `"msg":"gateway listening"`) {
			require.NoError(t, json.Unmarshal([]byte(line), &listening))
		}
	}
	require.NotEmpty(t, listening.Metrics, w.String())
	require.NotEqual(t, listening.Addr, listening.Metrics)
	m := scrape(t, "http://"+listening.Metrics+"/metrics")
	require.Equal(t, 1.0, mustValue(t, m, "kvselect_workers", map[string]string{"role": role, "lifecycle": "schedulable"}))
	require.Zero(t, mustValue(t, m, "kvselect_bookings_total", map[string]string{"role": role}))
	require.Zero(t, mustValue(t, m, "kvselect_tokenizer_cache_misses_total", nil))
	for _, u := range []string{"http://127.0.0.1:1", "http://127.0.0.1:2"} {
		require.Zero(t, mustValue(t, m, "kvselect_tokenizer_endpoint_calls_total", map[string]string{"endpoint": u}))
	}
	require.Zero(t, mustValue(t, m, "kvselect_httproute_requests_total", nil))
	require.Zero(t, mustValue(t, m, "kvselect_httproute_refusals_total", map[string]string{"reason": "tokenizer_degraded"}))
	require.Contains(t, m, "go_goroutines")
	cancel()
	require.Equal(t, 0, <-code, w.String())
	require.Contains(t, w.String(), "gateway listening")
	require.Contains(t, w.String(), `"msg":"workers labelled prefill or decode are served as aggregated workers; pair them with --topology=disaggregated"`)
	require.Contains(t, w.String(), `"workers":["e0"]`)
}
