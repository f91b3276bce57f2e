//go:build e2e

package e2ekube

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
)

// Bounds of the EPP's asynchronous behaviour.
const (
	startTimeout     = 30 * time.Second // process up, discovery synced
	reconcileTimeout = 15 * time.Second // an API change reaches routing
	requestTimeout   = 10 * time.Second
	poll             = 25 * time.Millisecond
)

// eppConfig is what a test chooses of the EPP's configuration.
type eppConfig struct {
	ns, pool  string
	fleet     *fleet
	tokenizer string            // base URL
	topology  string            // "" (aggregated) or "disaggregated"
	extra     map[string]string // further environment
}

// roleLabel is the role label the tests use (the EPP's default, set anyway).
const roleLabel = "nvidia.com/dynamo-worker-role"

// env is the EPP's whole environment: nothing is inherited from the test
// process except PATH and HOME, so a developer's DYN_* cannot leak in.
func (c eppConfig) env(kubeconfig string) map[string]string {
	m := map[string]string{
		"PATH": os.Getenv("PATH"), "HOME": os.Getenv("HOME"),
		"KUBECONFIG":                    kubeconfig,
		"POD_NAMESPACE":                 c.ns,
		"DYN_EPP_INFERENCE_POOL_NAME":   c.pool,
		"DYN_MODEL_NAME":                model,
		"DYN_KV_CACHE_BLOCK_SIZE":       strconv.Itoa(blockSize),
		"DYN_EPP_TOKENIZER_SERVICE_URL": c.tokenizer,
		"DYN_EPP_KV_EVENT_PORT":         strconv.Itoa(c.fleet.pubPort),
		"DYN_EPP_KV_EVENT_REPLAY_PORT":  strconv.Itoa(c.fleet.replayPort),
		"DYN_EPP_WORKER_ROLE_LABEL":     roleLabel,
		"DYN_SECURE_SERVING":            "false",
		// Port 0: the EPP logs the addresses it bound ("epp listening").
		"DYN_EPP_EXTPROC_ADDR": "127.0.0.1:0",
		"DYN_EPP_HEALTH_ADDR":  "127.0.0.1:0",
		"DYN_EPP_METRICS_ADDR": "127.0.0.1:0",
	}
	if c.topology != "" {
		m["DYN_EPP_TOPOLOGY_MODE"] = c.topology
	}
	for k, v := range c.extra {
		m[k] = v
	}
	return m
}

// eppProc is one running EPP subprocess and the Envoy-like client driving it.
type eppProc struct {
	*eppproc.Process
	t *testing.T

	extproc, metricsAddr string
	conn                 *grpc.ClientConn
	client               *extproctest.Client
	httpc                *http.Client
}

// startEPP runs the EPP binary with the EPP identity's kubeconfig, waits for
// its listening addresses and connects a client. It does not wait for
// discovery; see waitServing. The process is stopped in t.Cleanup.
func startEPP(t *testing.T, hh *harness, c eppConfig) *eppProc {
	t.Helper()
	return startEPPEnv(t, hh, c.env(hh.eppKubeconfig))
}

// startEPPEnv is startEPP with exactly env.
func startEPPEnv(t *testing.T, hh *harness, env map[string]string) *eppProc {
	t.Helper()
	proc, err := eppproc.Start(context.Background(), hh.eppBinary, env)
	require.NoError(t, err)
	p := &eppProc{Process: proc, t: t, httpc: &http.Client{Timeout: requestTimeout}}
	t.Cleanup(func() {
		p.stop()
		p.Report(t)
	})
	rec := p.waitLog(startTimeout, "the EPP never listened", eppproc.MsgIs("epp listening"))
	p.extproc, p.metricsAddr = rec.Str("extproc"), rec.Str("metrics")
	require.NotEmpty(t, p.extproc)
	require.NotEmpty(t, p.metricsAddr)
	conn, err := grpc.NewClient(p.extproc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	p.conn = conn
	p.client, err = extproctest.NewClient(conn, extproctest.Options{})
	require.NoError(t, err)
	return p
}

// waitServing waits for the first synced discovery snapshot.
func (p *eppProc) waitServing() eppproc.Record {
	p.t.Helper()
	return p.waitLog(startTimeout, "discovery never synced", eppproc.MsgIs("discovery synced; serving"))
}

// stop ends the process with SIGTERM (SIGKILL after 15 s) and closes the
// client. Idempotent.
func (p *eppProc) stop() { p.end(syscall.SIGTERM) }

// kill ends the process with SIGKILL, like a crash or an OOM kill.
func (p *eppProc) kill() { p.end(syscall.SIGKILL) }

func (p *eppProc) end(sig syscall.Signal) {
	if p.conn != nil {
		_ = p.conn.Close()
		p.conn = nil
	}
	p.httpc.CloseIdleConnections()
	p.Stop(sig, 15*time.Second)
}

// waitLog waits (bounded) for a log record matching match and returns the
// first one; it fails at once when the process has exited.
func (p *eppProc) waitLog(timeout time.Duration, what string, match func(eppproc.Record) bool) eppproc.Record {
	p.t.Helper()
	rec, ok := p.WaitLog(timeout, match)
	if !ok {
		if p.Exited() {
			require.FailNow(p.t, what, "the EPP exited: %v", p.Err())
		}
		require.FailNow(p.t, what, "not within %v", timeout)
	}
	return rec
}

// request sends one chat completion through the Envoy-like client and, when
// routed, on to the chosen engine over HTTP.
type request struct {
	prompt  string
	subset  []string    // subset hint (nil: none)
	headers http.Header // extra client headers
}

func (p *eppProc) send(r request) extproctest.Response {
	p.t.Helper()
	body, err := json.Marshal(map[string]any{"model": model, "max_tokens": 4,
		"messages": []map[string]string{{"role": "user", "content": r.prompt}}})
	require.NoError(p.t, err)
	hdr := http.Header{"Content-Type": {"application/json"}}
	for k, vs := range r.headers {
		hdr[k] = vs
	}
	req := extproctest.HTTPRequest{Path: "/v1/chat/completions", Headers: hdr, Body: body}
	if r.subset != nil {
		req.SubsetHint = r.subset
	}
	ctx, cancel := context.WithTimeout(context.Background(), requestTimeout)
	defer cancel()
	resp, err := p.client.Roundtrip(ctx, req, extproctest.HTTPForward(p.httpc))
	require.NoError(p.t, err)
	return resp
}

// servedBy sends a request restricted to ep (a subset hint naming only it)
// and reports whether ep served it; any other outcome but a 503 fails.
func (p *eppProc) servedBy(ep string) bool {
	p.t.Helper()
	resp := p.send(request{prompt: "probe " + ep, subset: []string{ep}})
	if resp.StatusCode == http.StatusServiceUnavailable && resp.Decision.Status == http.StatusServiceUnavailable {
		return false
	}
	require.Equal(p.t, http.StatusOK, resp.StatusCode, "%s", resp.Body)
	require.Equal(p.t, ep, resp.Served)
	return true
}

// eventually waits (bounded by reconcileTimeout) for cond and logs how long
// the reconcile took.
func (p *eppProc) eventually(what string, cond func() bool) {
	p.t.Helper()
	start := time.Now()
	require.Eventually(p.t, func() bool { return !p.Exited() && cond() }, reconcileTimeout, poll, what)
	p.t.Logf("%-48s reconciled in %v", what, time.Since(start).Round(time.Millisecond))
}

// --- metrics ----------------------------------------------------------------

// metrics scrapes the EPP's /metrics.
func (p *eppProc) metrics() []eppproc.Sample {
	p.t.Helper()
	ss, err := eppproc.Scrape(p.httpc, p.metricsAddr)
	require.NoError(p.t, err)
	return ss
}

// workers is the kvselect_workers gauge of a role and lifecycle.
func (p *eppProc) workers(role, lifecycle string) int {
	p.t.Helper()
	for _, s := range p.metrics() {
		if s.Name == "kvselect_workers" && s.Labels["role"] == role && s.Labels["lifecycle"] == lifecycle {
			return int(s.Value)
		}
	}
	return -1
}

// eventSources lists, per role, the worker ids that have a KV-event source
// (a kvselect_kv_event_batches_total series).
func (p *eppProc) eventSources() map[string][]string {
	p.t.Helper()
	out := map[string][]string{}
	for _, s := range p.metrics() {
		if s.Name == "kvselect_kv_event_batches_total" {
			out[s.Labels["role"]] = append(out[s.Labels["role"]], s.Labels["worker"])
		}
	}
	return out
}

// counter sums a counter over the series matching labels (0 when none does).
func (p *eppProc) counter(name string, labels map[string]string) float64 {
	p.t.Helper()
	sum, _ := eppproc.Sum(p.metrics(), name, labels)
	return sum
}
