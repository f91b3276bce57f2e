package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/selection"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
}

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestLoadConfig(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	c, err := loadConfig(fs, []string{"--block-size", "32", "--addr", "127.0.0.1:0"}, env(map[string]string{
		"DYN_EPP_WORKERS_FILE": "w.json", "DYN_EPP_TOKENIZER_SERVICE_URL": "http://10.0.0.1:8000",
		"DYN_KV_CACHE_BLOCK_SIZE": "64", "DYN_ROUTER_USE_KV_EVENTS": "false", "GATEWAY_FAILURE_EJECTION": "250ms",
		"DYN_EPP_COST": "predictive", "GATEWAY_BODY_TIMEOUT": "2s", "DYN_EPP_MAX_PROMPT_TOKENS": "4096",
	}))
	require.NoError(t, err)
	require.Equal(t, config{
		Addr: "127.0.0.1:0", WorkersFile: "w.json", Model: "default", TokenizerURL: "http://10.0.0.1:8000",
		TokenizerProtocol: "vllm-render", TokenizerTimeout: 5 * time.Second, BlockSize: 32, UseKVEvents: false,
		MaxBodyBytes: 8 << 20, FailureEjection: 250 * time.Millisecond, Cost: selection.CostPredictive,
		ReadTimeout: 40 * time.Second, IdleTimeout: 2 * time.Minute, BodyTimeout: 2 * time.Second,
		MaxInflight: 1024, MaxPromptTokens: 4096,
	}, c, "flags win over the environment, which wins over the defaults")

	fs = flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	_, err = loadConfig(fs, []string{"--block-size", "0", "--tokenizer-protocol", "nope", "--addr", "8080", "--cost", "cheapest",
		"--body-timeout", "0s", "--max-inflight", "0", "--max-prompt-tokens", "-1"}, env(nil))
	require.ErrorIs(t, err, errConfig)
	for _, want := range []string{"--block-size", "--tokenizer-protocol", "--addr", "--cost", "--body-timeout", "--max-inflight",
		"--max-prompt-tokens", "--workers-file / DYN_EPP_WORKERS_FILE: required",
		"--tokenizer-url / DYN_EPP_TOKENIZER_SERVICE_URL: required"} {
		require.ErrorContains(t, err, want)
	}

	// The bind address for engines that dial out: tcp://host:port, with KV
	// events on.
	base := map[string]string{"DYN_EPP_WORKERS_FILE": "w.json", "DYN_EPP_TOKENIZER_SERVICE_URL": "http://10.0.0.1:8000"}
	c, err = loadConfig(flag.NewFlagSet("t", flag.ContinueOnError), []string{"--kv-event-bind", "tcp://0.0.0.0:5557"}, env(base))
	require.NoError(t, err)
	require.Equal(t, "tcp://0.0.0.0:5557", c.KVEventBind)
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
	require.NoError(t, os.WriteFile(path, []byte(`{"workers":[{"id":"e0","endpoint":"127.0.0.1:1"}]}`), 0o600))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w := &signalWriter{want: "workers file applied", seen: make(chan struct{})}
	code := make(chan int, 1)
	go func() {
		code <- run(ctx, []string{"--addr", "127.0.0.1:0", "--workers-file", path, "--tokenizer-url", "http://127.0.0.1:1",
			"--use-kv-events=false"}, env(nil), w)
	}()
	select {
	case <-w.seen:
	case c := <-code:
		require.FailNow(t, "run returned early", "code %d: %s", c, w.String())
	}
	cancel()
	require.Equal(t, 0, <-code, w.String())
	require.Contains(t, w.String(), "gateway listening")
}
