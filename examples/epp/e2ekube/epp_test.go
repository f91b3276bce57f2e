//go:build e2e

package e2ekube

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/examples/epp/internal/epplog"
	"github.com/kvselect/kvselect/internal/extproctest"
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
func (c eppConfig) env(kubeconfig string) []string {
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
	out := make([]string, 0, len(m))
	for k, v := range m {
		out = append(out, k+"="+v)
	}
	return out
}

// eppProc is one running EPP subprocess and the Envoy-like client driving it.
type eppProc struct {
	t       *testing.T
	cmd     *exec.Cmd
	logs    *epplog.Sink
	done    chan struct{} // closed when the process has exited and been reaped
	exitErr error         // set before done is closed

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
	p := &eppProc{t: t, logs: &epplog.Sink{}, done: make(chan struct{}), httpc: &http.Client{Timeout: requestTimeout}}
	p.cmd = exec.Command(hh.eppBinary)
	p.cmd.Env = c.env(hh.eppKubeconfig)
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	p.cmd.SysProcAttr = childAttr()
	require.NoError(t, p.cmd.Start())
	go func() { // owned by p: stop waits for done
		p.exitErr = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.stop()
		for _, line := range p.logs.Lines() {
			if strings.Contains(line, "WARNING: DATA RACE") {
				t.Errorf("the EPP reported a data race")
				break
			}
		}
		if t.Failed() {
			t.Logf("EPP pid %d log (%s):\n%s", p.cmd.Process.Pid, p.exitErr, strings.Join(p.logs.Lines(), "\n"))
		}
	})
	rec := p.waitLog(startTimeout, "the EPP never listened", func(r epplog.Record) bool { return r.Msg() == "epp listening" })
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
func (p *eppProc) waitServing() epplog.Record {
	p.t.Helper()
	return p.waitLog(startTimeout, "discovery never synced", func(r epplog.Record) bool { return r.Msg() == "discovery synced; serving" })
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
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// exited reports whether the process has ended.
func (p *eppProc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// waitLog waits (bounded) for a log record matching match and returns the
// first one; it fails at once when the process has exited.
func (p *eppProc) waitLog(timeout time.Duration, what string, match func(epplog.Record) bool) epplog.Record {
	p.t.Helper()
	var found epplog.Record
	require.Eventually(p.t, func() bool {
		if recs := p.logs.Find(match); len(recs) > 0 {
			found = recs[0]
			return true
		}
		return p.exited()
	}, timeout, poll, what)
	if found.M == nil { // the process exited: done is closed, exitErr is set
		require.FailNow(p.t, what, "the EPP exited: %v", p.exitErr)
	}
	return found
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
	require.Eventually(p.t, func() bool { return !p.exited() && cond() }, reconcileTimeout, poll, what)
	p.t.Logf("%-48s reconciled in %v", what, time.Since(start).Round(time.Millisecond))
}

// --- metrics ----------------------------------------------------------------

// sample is one Prometheus series value.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

// metrics scrapes the EPP's /metrics (text format).
func (p *eppProc) metrics() []sample {
	p.t.Helper()
	resp, err := p.httpc.Get("http://" + p.metricsAddr + "/metrics")
	require.NoError(p.t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(p.t, err)
	require.Equal(p.t, http.StatusOK, resp.StatusCode)
	var out []sample
	for _, line := range strings.Split(string(raw), "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		s, ok := parseSample(line)
		require.True(p.t, ok, "metrics line %q", line)
		out = append(out, s)
	}
	return out
}

// parseSample reads `name{k="v",...} value`; label values here never hold
// quotes or commas.
func parseSample(line string) (sample, bool) {
	sp := strings.LastIndexByte(line, ' ')
	if sp < 0 {
		return sample{}, false
	}
	v, err := strconv.ParseFloat(line[sp+1:], 64)
	if err != nil {
		return sample{}, false
	}
	s := sample{name: line[:sp], labels: map[string]string{}, value: v}
	if i := strings.IndexByte(s.name, '{'); i >= 0 {
		body := strings.TrimSuffix(s.name[i+1:], "}")
		s.name = s.name[:i]
		for _, kv := range strings.Split(body, ",") {
			k, val, ok := strings.Cut(kv, "=")
			if !ok {
				continue
			}
			s.labels[k] = strings.Trim(val, `"`)
		}
	}
	return s, true
}

// workers is the kvselect_workers gauge of a role and lifecycle.
func (p *eppProc) workers(role, lifecycle string) int {
	p.t.Helper()
	for _, s := range p.metrics() {
		if s.name == "kvselect_workers" && s.labels["role"] == role && s.labels["lifecycle"] == lifecycle {
			return int(s.value)
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
		if s.name == "kvselect_kv_event_batches_total" {
			out[s.labels["role"]] = append(out[s.labels["role"]], s.labels["worker"])
		}
	}
	return out
}

// counter sums a counter over the series matching labels.
func (p *eppProc) counter(name string, labels map[string]string) float64 {
	p.t.Helper()
	var sum float64
	for _, s := range p.metrics() {
		if s.name != name {
			continue
		}
		match := true
		for k, v := range labels {
			if s.labels[k] != v {
				match = false
			}
		}
		if match {
			sum += s.value
		}
	}
	return sum
}

// --- logs -------------------------------------------------------------------
