package main

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func load(t *testing.T, args []string, vars map[string]string) (*config, error) {
	t.Helper()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return loadConfig(fs, args, env(vars))
}

func TestConfigDefaults(t *testing.T) {
	c, err := load(t, nil, nil)
	require.NoError(t, err)
	require.Equal(t, "0.0.0.0:8000", c.listenAddr)
	require.Equal(t, ":9091", c.metricsAddr)
	require.Equal(t, sidecar.DefaultDecodeURL, c.sidecar.DecodeURL)
	require.Equal(t, sidecar.ProtocolVLLMNIXL, c.sidecar.Protocol)
	require.Equal(t, sidecar.FallbackFail, c.sidecar.Fallback)
	require.Equal(t, 30*time.Second, c.sidecar.PrefillTimeout)
	require.Equal(t, sidecar.DefaultSGLangBootstrapPort, c.sidecar.SGLangBootstrapPort)
	require.Nil(t, c.sidecar.HintKey)
	require.Equal(t, slog.LevelInfo, c.logLevel)
}

// Every invalid value is reported at once, each with its variable's name.
func TestConfigNamesEveryBadVariable(t *testing.T) {
	bad := map[string]string{
		"DYN_PD_LISTEN_ADDR":                "8000",
		"DYN_PD_PROTOCOL":                   "grpc",
		"DYN_PD_METRICS_ADDR":               "nope",
		"DYN_PD_PREFILL_FALLBACK":           "maybe",
		"DYN_PD_PREFILL_TIMEOUT_MS":         "-5",
		"DYN_PD_DECODE_TIMEOUT_MS":          "1.5",
		"DYN_PD_BODY_READ_TIMEOUT_MS":       "0",
		"DYN_PD_DIAL_TIMEOUT_MS":            "x",
		"DYN_PD_MAX_BODY_BYTES":             "12",
		"DYN_PD_MAX_PREFILL_RESPONSE_BYTES": "2GiB",
		"DYN_PD_SGLANG_BOOTSTRAP_PORT":      "70000",
		"DYN_PD_PREFILL_ALLOW_CIDRS":        "10.0.0.0/8,bogus",
		"DYN_PD_HINT_KEY":                   "file:/nonexistent/key",
		"DYN_PD_HINT_AUDIENCE":              "decode-0:8000",
		"DYN_PD_HINT_MAX_LIFETIME_MS":       "forever",
		"DYN_PD_HINT_REPLAY_CACHE":          "0",
		"DYN_PD_LOG_LEVEL":                  "loud",
	}
	_, err := load(t, nil, bad)
	require.ErrorIs(t, err, errConfig)
	for name := range bad {
		require.Contains(t, err.Error(), name)
	}
	// DYN_PD_DECODE_URL is checked by sidecar.New, which names it too.
	c, err := load(t, nil, map[string]string{"DYN_PD_DECODE_URL": "ftp://x"})
	require.NoError(t, err)
	_, err = sidecar.New(c.sidecar)
	require.ErrorContains(t, err, "DecodeURL")
}

func TestConfigFlagsWin(t *testing.T) {
	c, err := load(t, []string{"--protocol", "trtllm", "--prefill-fallback=local", "--sglang-bootstrap-port", "9000"},
		map[string]string{"DYN_PD_PROTOCOL": "sglang", "DYN_PD_PREFILL_FALLBACK": "bogus", "DYN_PD_PREFILL_ALLOW_CIDRS": "10.1.2.3/8"})
	require.NoError(t, err, "a bad variable a flag overrides is not read")
	require.Equal(t, sidecar.ProtocolTRTLLM, c.sidecar.Protocol)
	require.Equal(t, sidecar.FallbackLocal, c.sidecar.Fallback)
	require.Equal(t, 9000, c.sidecar.SGLangBootstrapPort)
	require.Equal(t, "10.0.0.0/8", c.sidecar.AllowedPrefillPrefixes[0].String())
}

func TestHintKeySources(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "key")
	require.NoError(t, os.WriteFile(path, []byte(strings.Repeat("s", 40)+"\n"), 0o600))
	for _, v := range []string{"file:" + path, path} {
		c, err := load(t, nil, map[string]string{"DYN_PD_HINT_KEY": v})
		require.NoError(t, err)
		require.Equal(t, strings.Repeat("s", 40), string(c.sidecar.HintKey), "the trailing newline is trimmed")
	}
	c, err := load(t, nil, map[string]string{"DYN_PD_HINT_KEY": strings.Repeat("v", 32)})
	require.NoError(t, err)
	require.Equal(t, strings.Repeat("v", 32), string(c.sidecar.HintKey))
	c, err = load(t, nil, map[string]string{"DYN_PD_HINT_KEY": "short"})
	require.NoError(t, err)
	_, err = sidecar.New(c.sidecar)
	require.ErrorContains(t, err, "HintKey", "a short key is refused at startup")

	c, err = load(t, nil, map[string]string{"DYN_PD_HINT_AUDIENCE": "[::ffff:10.0.0.5]:8000"})
	require.NoError(t, err)
	sc, err := sidecar.New(c.sidecar)
	require.NoError(t, err)
	sc.Close()
	for _, bad := range []string{"10.0.0.5", "10.0.0.5:0", "[fe80::1%eth0]:8000", "decode-0:8000"} {
		_, err = load(t, nil, map[string]string{"DYN_PD_HINT_AUDIENCE": bad})
		require.ErrorContains(t, err, "DYN_PD_HINT_AUDIENCE", bad)
	}
}

// A key path naming an endless file (/dev/zero), a FIFO, a directory or a
// large file is a named configuration error at once, never a read without end.
func TestHintKeyFileBounded(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big")
	require.NoError(t, os.WriteFile(big, bytes.Repeat([]byte("k"), pdhint.MaxKeyFileBytes+1), 0o600))
	paths := []string{"/dev/zero", "file:/dev/zero", dir, big}
	if fifo := filepath.Join(dir, "fifo"); mkfifo(t, fifo) {
		paths = append(paths, fifo)
	}
	for _, v := range paths {
		if _, err := os.Stat(strings.TrimPrefix(v, "file:")); err != nil {
			continue // no /dev/zero here
		}
		_, err := load(t, nil, map[string]string{"DYN_PD_HINT_KEY": v})
		require.ErrorIs(t, err, errConfig, v)
		require.ErrorIs(t, err, pdhint.ErrKeyFile, v)
		require.ErrorContains(t, err, "DYN_PD_HINT_KEY", v)
		var out, errOut bytes.Buffer
		require.Equal(t, 2, run(context.Background(), nil, env(map[string]string{"DYN_PD_HINT_KEY": v}), &out, &errOut), v)
		require.Contains(t, errOut.String(), "unusable key file", v)
	}
}

// The binary's server answers a P/D client that stalls in its body 408 and
// closes the connection, within the body deadline plus a second.
func TestServeAnswersStalledBody(t *testing.T) {
	sc, err := sidecar.New(sidecar.Options{BodyReadTimeout: 200 * time.Millisecond})
	require.NoError(t, err)
	defer sc.Close()
	ln, _, stop := startServe(t, sc)
	defer stop()

	conn, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer conn.Close()
	_, err = io.WriteString(conn, "POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"+
		sidecar.HeaderPrefiller+": 10.0.0.7:8000\r\nContent-Length: 1000\r\n\r\n{\"prompt\":\"")
	require.NoError(t, err)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(1200*time.Millisecond)))
	answer, err := io.ReadAll(conn)
	require.NoError(t, err, "answered and closed in time; got %q", answer)
	resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(answer)), nil)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusRequestTimeout, resp.StatusCode)
	require.True(t, resp.Close)
	require.Equal(t, uint64(1), sc.Stats().Refused[sidecar.RefusedBodyTimeout])
}

func TestPrintEnvTable(t *testing.T) {
	var out, errOut bytes.Buffer
	require.Zero(t, run(context.Background(), []string{"--print-env-table"}, env(nil), &out, &errOut), errOut.String())
	for _, v := range new(config).variables() {
		require.Contains(t, out.String(), "`"+v.Env+"`")
	}
	require.Equal(t, 2, run(context.Background(), nil, env(map[string]string{"DYN_PD_PROTOCOL": "x"}), &out, &errOut))
	require.Contains(t, errOut.String(), "DYN_PD_PROTOCOL")
}

// docs/SIDECAR.md carries the table --print-env-table prints; this keeps it
// current.
func TestSidecarDocHasTheEnvTable(t *testing.T) {
	doc, err := os.ReadFile("../../docs/SIDECAR.md")
	require.NoError(t, err)
	require.Contains(t, string(doc), envTable(), "regenerate with: go run ./examples/pdsidecar --print-env-table")
}

// The binary serves the sidecar and its metrics, and stops when ctx ends.
func TestServeAndMetrics(t *testing.T) {
	decode, err := fakeengine.New(fakeengine.Options{})
	require.NoError(t, err)
	dsrv := httptest.NewServer(decode.Handler())
	defer dsrv.Close()
	sc, err := sidecar.New(sidecar.Options{DecodeURL: dsrv.URL})
	require.NoError(t, err)
	defer sc.Close()
	ln, mln, stop := startServe(t, sc)

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	get := func(url string) (int, string) {
		resp, err := c.Get(url)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	status, body := get("http://" + ln.Addr().String() + "/v1/models")
	require.Equal(t, http.StatusOK, status, body)
	req, err := http.NewRequest(http.MethodPost, "http://"+ln.Addr().String()+"/v1/completions", strings.NewReader(`{"prompt":"x"}`))
	require.NoError(t, err)
	req.Header.Set(sidecar.HeaderPrefiller, "not-an-endpoint")
	resp, err := c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadGateway, resp.StatusCode)

	status, body = get("http://" + mln.Addr().String() + "/metrics")
	require.Equal(t, http.StatusOK, status)
	for _, line := range []string{
		`kvselect_pd_requests_total{protocol="vllm-nixl",path="passthrough"} 1`,
		`kvselect_pd_legs_total{protocol="vllm-nixl",leg="passthrough",outcome="ok"} 1`,
		`kvselect_pd_legs_total{protocol="vllm-nixl",leg="prefill",outcome="timeout"} 0`,
		`kvselect_pd_bad_hints_total{protocol="vllm-nixl",reason="malformed"} 1`,
		`kvselect_pd_refused_total{protocol="vllm-nixl",reason="body_too_large"} 0`,
		`kvselect_pd_fallbacks_total{protocol="vllm-nixl"} 0`,
		`kvselect_pd_handoff_seconds_bucket{protocol="vllm-nixl",le="0.005"} 0`,
		`kvselect_pd_handoff_seconds_bucket{protocol="vllm-nixl",le="+Inf"} 0`,
		`kvselect_pd_handoff_seconds_count{protocol="vllm-nixl"} 0`,
		"# TYPE kvselect_pd_handoff_seconds histogram",
	} {
		require.Contains(t, body, line+"\n")
	}
	stop()
	_, err = c.Get("http://" + ln.Addr().String() + "/health")
	require.Error(t, err, "the listener is closed")
}

// startServe runs the binary's serve for sc on two loopback listeners (the
// API's and the metrics'); stop ends it and checks it returned cleanly.
func startServe(t *testing.T, sc *sidecar.Sidecar) (api, metrics net.Listener, stop func()) {
	t.Helper()
	api, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	metrics, err = net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serve(ctx, sc, api, metrics, 30*time.Second, slog.New(slog.DiscardHandler)) }()
	return api, metrics, func() {
		cancel()
		require.NoError(t, <-done)
	}
}
