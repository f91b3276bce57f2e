package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/internal/logtest"
)

// Dynamo's names configure the same settings as the DYN_PD_* ones, in their
// own form (ports, milliseconds).
func TestConfigDynamoNames(t *testing.T) {
	c, err := load(t, nil, map[string]string{
		"DYN_SIDECAR_PORT":               "9000",
		"DYN_DECODE_ENGINE_PORT":         "9001",
		"DYN_SIDECAR_CONNECT_TIMEOUT_MS": "2500",
		"DYN_SIDECAR_READ_TIMEOUT_MS":    "60000",
		"DYN_SIDECAR_DRAIN_TIMEOUT_MS":   "5000",
	})
	require.NoError(t, err)
	require.Equal(t, "0.0.0.0:9000", c.listenAddr)
	require.Equal(t, "http://127.0.0.1:9001", c.sidecar.DecodeURL)
	require.Equal(t, 2500*time.Millisecond, c.sidecar.DialTimeout)
	require.Equal(t, time.Minute, c.sidecar.ReadIdleTimeout)
	require.Equal(t, 5*time.Second, c.drainTimeout)
	require.Empty(t, c.conflicts)

	c, err = load(t, nil, nil)
	require.NoError(t, err)
	require.Equal(t, sidecar.DefaultReadIdleTimeout, c.sidecar.ReadIdleTimeout, "Dynamo's defaults")
	require.Equal(t, 30*time.Second, c.drainTimeout)
	require.Equal(t, 10*time.Second, c.sidecar.DialTimeout)

	_, err = load(t, nil, map[string]string{"DYN_SIDECAR_PORT": "0", "DYN_DECODE_ENGINE_PORT": "engine", "DYN_SIDECAR_READ_TIMEOUT_MS": "0"})
	require.ErrorIs(t, err, errConfig)
	for _, name := range []string{"DYN_PD_LISTEN_ADDR (from DYN_SIDECAR_PORT)", "DYN_PD_DECODE_URL (from DYN_DECODE_ENGINE_PORT)", "DYN_SIDECAR_READ_TIMEOUT_MS"} {
		require.ErrorContains(t, err, name)
	}
}

// When both names of a setting are set, Dynamo's wins; different values are
// a conflict the binary logs as a WARN naming both (values left out), equal
// values in the two forms are none.
func TestConfigDynamoNameWins(t *testing.T) {
	c, err := load(t, nil, map[string]string{
		"DYN_SIDECAR_PORT": "9000", "DYN_PD_LISTEN_ADDR": "127.0.0.1:9100",
		"DYN_DECODE_ENGINE_PORT": "9001", "DYN_PD_DECODE_URL": "http://127.0.0.1:9001",
		"DYN_SIDECAR_CONNECT_TIMEOUT_MS": "2500", "DYN_PD_DIAL_TIMEOUT_MS": "4000",
	})
	require.NoError(t, err)
	require.Equal(t, "0.0.0.0:9000", c.listenAddr)
	require.Equal(t, 2500*time.Millisecond, c.sidecar.DialTimeout)
	require.ElementsMatch(t, []string{"DYN_SIDECAR_PORT>DYN_PD_LISTEN_ADDR", "DYN_SIDECAR_CONNECT_TIMEOUT_MS>DYN_PD_DIAL_TIMEOUT_MS"},
		conflictNames(c), "the decode URL is the same in both forms")

	c, err = load(t, []string{"--listen-addr", "127.0.0.1:9200"}, map[string]string{"DYN_SIDECAR_PORT": "9000", "DYN_PD_LISTEN_ADDR": "127.0.0.1:9100"})
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1:9200", c.listenAddr, "a flag wins over both")
	require.Empty(t, c.conflicts)

	// run logs the conflict before anything can fail (here: a key too short
	// for sidecar.New), and never the values.
	var out, errOut bytes.Buffer
	code := run(context.Background(), nil, env(map[string]string{
		"DYN_SIDECAR_CONNECT_TIMEOUT_MS": "2500", "DYN_PD_DIAL_TIMEOUT_MS": "4000", "DYN_PD_HINT_KEY": "short",
	}), &out, &errOut)
	require.Equal(t, 2, code)
	require.Contains(t, errOut.String(), "level=WARN")
	require.Contains(t, errOut.String(), "used=DYN_SIDECAR_CONNECT_TIMEOUT_MS ignored=DYN_PD_DIAL_TIMEOUT_MS")
	require.NotContains(t, errOut.String(), "4000")
}

func conflictNames(c *config) []string {
	var out []string
	for _, x := range c.conflicts {
		out = append(out, x.Used+">"+x.Ignored)
	}
	return out
}

// syncBuffer is a log sink safe for concurrent writes and the test's reads.
type syncBuffer = logtest.Buffer

// The binary starts from Dynamo's variable names alone (a deployment written
// for Dynamo's sidecar), serves on DYN_SIDECAR_PORT in front of the engine on
// DYN_DECODE_ENGINE_PORT, and stops on its context. Only the metrics
// listener, which Dynamo's sidecar does not have, is moved off its default
// port, by flag.
func TestStartsFromDynamoNames(t *testing.T) {
	engine, err := fakeengine.New(fakeengine.Options{})
	require.NoError(t, err)
	defer func() { require.NoError(t, engine.Close()) }()
	esrv := httptest.NewServer(engine.Handler())
	defer esrv.Close()
	_, enginePort, err := net.SplitHostPort(esrv.Listener.Addr().String())
	require.NoError(t, err)

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	// DYN_SIDECAR_PORT takes no port 0: take a free one, and try again in the
	// unlikely case another process takes it first.
	for attempt := 0; ; attempt++ {
		port := strconv.Itoa(freePort(t))
		vars := map[string]string{
			"DYN_SIDECAR_PORT":               port,
			"DYN_DECODE_ENGINE_PORT":         enginePort,
			"DYN_SIDECAR_CONNECT_TIMEOUT_MS": "2000",
			"DYN_SIDECAR_READ_TIMEOUT_MS":    "60000",
			"DYN_SIDECAR_DRAIN_TIMEOUT_MS":   "2000",
		}
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		var errOut syncBuffer
		done := make(chan int, 1)
		go func() { done <- run(ctx, []string{"--metrics-addr", "127.0.0.1:0"}, env(vars), io.Discard, &errOut) }()
		code, served := waitServed(client, "http://127.0.0.1:"+port, done)
		if !served && code == 1 && strings.Contains(errOut.String(), "address already in use") && attempt < 2 {
			cancel()
			continue
		}
		require.True(t, served, "the sidecar never proxied to the engine (exit %d): %s", code, errOut.String())
		require.Regexp(t, `listen=\S+:`+port+` `, errOut.String(), "all interfaces, Dynamo's port")
		require.Contains(t, errOut.String(), "decode=http://127.0.0.1:"+enginePort)
		require.NotContains(t, errOut.String(), "level=WARN")
		cancel()
		require.Zero(t, <-done, errOut.String())
		return
	}
}

// waitServed polls base until it proxies /v1/models to the engine (served)
// or the binary exits (its code), for at most 10 s; -1 while it runs.
func waitServed(client *http.Client, base string, done <-chan int) (int, bool) {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case code := <-done:
			return code, false
		case <-deadline:
			return -1, false
		case <-tick.C:
		}
		resp, err := client.Get(base + "/v1/models")
		if err != nil {
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK && strings.Contains(string(body), fakeengine.DefaultModel) {
			return -1, true
		}
	}
}

// freePort returns a TCP port nothing listens on right now.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// Dynamo's backend selector: sglang selects SGLang's protocol; its
// unavailable (P/D off, 501 for every hint) has no equivalent here and is
// refused at start, as is any other value.
func TestConfigDynamoBackend(t *testing.T) {
	c, err := load(t, nil, map[string]string{"DYN_SIDECAR_PD_BACKEND": "sglang"})
	require.NoError(t, err)
	require.Equal(t, sidecar.ProtocolSGLang, c.sidecar.Protocol)
	_, err = load(t, nil, map[string]string{"DYN_SIDECAR_PD_BACKEND": "unavailable"})
	require.ErrorContains(t, err, "always runs P/D")
	require.ErrorContains(t, err, "DYN_SIDECAR_PD_BACKEND")
	_, err = load(t, nil, map[string]string{"DYN_SIDECAR_PD_BACKEND": "vllm"})
	require.ErrorContains(t, err, `"vllm" is neither sglang nor unavailable`)
}
