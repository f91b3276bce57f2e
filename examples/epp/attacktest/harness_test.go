package attacktest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

// Bounds of every wait. Nothing legitimate takes near these on loopback.
const (
	startTimeout = 20 * time.Second // process up, discovery synced
	waitTimeout  = 10 * time.Second // a counter moves, an event is applied
	poll         = 20 * time.Millisecond
	model        = fakeengine.DefaultModel
	blockSize    = fakeengine.DefaultBlockSize
	role         = "aggregated" // the EPP's selection service in aggregated mode
)

// worker is one entry of the static workers file (discovery/static.go).
type worker struct {
	ID            string `json:"id"`
	Endpoint      string `json:"endpoint"`
	KVEvents      string `json:"kv_events_endpoint,omitempty"`
	TotalKVBlocks int    `json:"total_kv_blocks,omitempty"`
}

// eppConfig is what a test chooses of the EPP's configuration.
type eppConfig struct {
	workers   []worker
	tokenizer string            // base URL
	bind      bool              // DYN_EPP_KV_EVENT_BIND on a free loopback port
	extra     map[string]string // further environment
}

// eppProc is one running EPP subprocess and the clients driving it.
type eppProc struct {
	*eppproc.Process
	t *testing.T

	extproc, metricsAddr string
	bindPort             int // with eppConfig.bind
	httpc                *http.Client
	conn                 *grpc.ClientConn
	client               *extproctest.Client
}

// startEPP writes the workers file, starts the EPP with every listener on
// 127.0.0.1 and waits until discovery has synced. The EPP logs the addresses
// it bound for port 0 ("epp listening"), so only the bind port, which it does
// not log, is picked beforehand by listening on 127.0.0.1:0 and closing: if
// another process takes that port in between, the EPP exits at once and the
// start is retried with a new port. The process is stopped in t.Cleanup.
func startEPP(t *testing.T, c eppConfig) *eppProc {
	t.Helper()
	dir := t.TempDir()
	raw, err := json.Marshal(map[string]any{"workers": c.workers})
	require.NoError(t, err)
	path := filepath.Join(dir, "workers.json")
	require.NoError(t, os.WriteFile(path, raw, 0o600))
	for attempt := 1; ; attempt++ {
		env := map[string]string{
			"DYN_MODEL_NAME":                model,
			"DYN_KV_CACHE_BLOCK_SIZE":       strconv.Itoa(blockSize),
			"DYN_EPP_TOKENIZER_SERVICE_URL": c.tokenizer,
			"DYN_EPP_WORKERS_FILE":          path,
			"DYN_SECURE_SERVING":            "false",
			"DYN_EPP_EXTPROC_ADDR":          "127.0.0.1:0",
			"DYN_EPP_HEALTH_ADDR":           "127.0.0.1:0",
			"DYN_EPP_METRICS_ADDR":          "127.0.0.1:0",
		}
		bindPort := 0
		if c.bind {
			bindPort = freePort(t)
			env["DYN_EPP_KV_EVENT_BIND"] = fmt.Sprintf("tcp://127.0.0.1:%d", bindPort)
		}
		for k, v := range c.extra {
			env[k] = v
		}
		p := launch(t, env)
		addrs, ok := p.WaitListening(startTimeout)
		if !ok {
			if c.bind && attempt < 3 {
				t.Logf("EPP start %d exited (%v), the bind port %d was probably taken: retrying", attempt, p.Err(), bindPort)
				continue
			}
			require.FailNow(t, "the EPP never listened", "exit: %v\n%s", p.Err(), p.Output())
		}
		p.bindPort = bindPort
		p.extproc, p.metricsAddr = addrs.ExtProc, addrs.Metrics
		require.NotEmpty(t, p.extproc)
		require.NotEmpty(t, p.metricsAddr)
		if _, ok := p.WaitLog(startTimeout, eppproc.MsgIs("discovery synced; serving")); !ok {
			require.FailNow(t, "discovery never synced", "exit: %v", p.Err())
		}
		p.conn, err = grpc.NewClient(p.extproc, grpc.WithTransportCredentials(insecure.NewCredentials()))
		require.NoError(t, err)
		p.client, err = extproctest.NewClient(p.conn, extproctest.Options{})
		require.NoError(t, err)
		return p
	}
}

// launch starts the binary with exactly env and registers its stop.
func launch(t *testing.T, env map[string]string) *eppProc {
	t.Helper()
	// The context is a last resort: cleanup stops the process long before.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel) // runs after the stop below
	proc, err := eppproc.Start(ctx, eppBinary, env)
	require.NoError(t, err)
	p := &eppProc{Process: proc, t: t, httpc: &http.Client{Timeout: waitTimeout}}
	t.Cleanup(func() {
		p.stop()
		p.Report(t)
	})
	return p
}

// stop closes the clients and ends the process with SIGTERM (SIGKILL after
// 10 s). Idempotent.
func (p *eppProc) stop() {
	if p.conn != nil {
		_ = p.conn.Close()
		p.conn = nil
	}
	p.httpc.CloseIdleConnections()
	p.Stop(syscall.SIGTERM, 10*time.Second)
}

// alive asserts the process is still running and answers /metrics.
func (p *eppProc) alive() {
	p.t.Helper()
	require.False(p.t, p.Exited(), "the EPP exited: %v", p.Err())
	require.NoError(p.t, p.Signal(syscall.Signal(0)), "the EPP process is gone")
	_, err := p.scrape()
	require.NoError(p.t, err, "/metrics does not answer")
}

// eventually polls cond until it holds, failing after timeout or as soon as
// the process exits.
func (p *eppProc) eventually(what string, timeout time.Duration, cond func() bool) {
	p.t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(poll)
	defer tick.Stop()
	for !cond() {
		select {
		case <-p.Done():
			require.FailNow(p.t, what, "the EPP exited: %v", p.Err())
		case <-deadline.C:
			require.FailNow(p.t, what, "not within %v", timeout)
		case <-tick.C:
		}
	}
}

// rss is the EPP's resident set size in bytes.
func (p *eppProc) rss() int64 {
	p.t.Helper()
	n, err := rssBytes(p.Pid())
	require.NoError(p.t, err)
	return n
}

// --- metrics ----------------------------------------------------------------

type labels map[string]string

func (p *eppProc) scrape() ([]eppproc.Sample, error) { return eppproc.Scrape(p.httpc, p.metricsAddr) }

// metric sums the series of name whose labels include want; -1 when no
// series matches (the series does not exist yet).
func (p *eppProc) metric(name string, want labels) float64 {
	p.t.Helper()
	ss, err := p.scrape()
	require.NoError(p.t, err)
	sum, found := eppproc.Sum(ss, name, want)
	if !found {
		return -1
	}
	return sum
}

// count is metric with a missing series read as 0.
func (p *eppProc) count(name string, want labels) float64 {
	return max(p.metric(name, want), 0)
}

// refused is kvselect_kv_event_peers_refused_total for one reason.
func (p *eppProc) refused(reason string) float64 {
	return p.count("kvselect_kv_event_peers_refused_total", labels{"role": role, "reason": reason})
}

// source reads one KV-event source counter of a worker (rank 0).
func (p *eppProc) source(name, workerID string) float64 {
	return p.count(name, labels{"role": role, "worker": workerID, "rank": "0"})
}

// applied is kvselect_kv_events_applied_total of a worker.
func (p *eppProc) applied(workerID string) float64 {
	return p.source("kvselect_kv_events_applied_total", workerID)
}

// skipped is kvselect_kv_events_skipped_total of a worker for one reason.
func (p *eppProc) skipped(workerID, reason string) float64 {
	return p.count("kvselect_kv_events_skipped_total", labels{"role": role, "worker": workerID, "reason": reason})
}

// --- engines ----------------------------------------------------------------

// freePort returns a loopback port that was free a moment ago (listen on
// 127.0.0.1:0, close). Another process may take it before it is used; callers
// retry their bind when that happens.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	return port
}

// boundEngine starts a fake engine whose PUB binds (the EPP dials it), with
// its HTTP API on when http is set. It is closed in t.Cleanup.
func boundEngine(t *testing.T, http bool) *fakeengine.Engine {
	t.Helper()
	e, err := fakeengine.New(fakeengine.Options{EnableHTTP: http})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// dialEngine is a fake engine for the bind listener: its HTTP API's listener
// is opened first, so its topic can name that endpoint,
// kv@127.0.0.1:<port>@model, and the workers file can list it; Dial, not
// Start, dials its PUB into the EPP's bind port.
type dialEngine struct {
	opts     fakeengine.Options
	endpoint string // 127.0.0.1:<HTTP port>, the worker's endpoint
	*fakeengine.Engine
}

func newDialEngine(t *testing.T) *dialEngine {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() }) // the engine closes it too once started
	ep := ln.Addr().String()
	return &dialEngine{endpoint: ep, opts: fakeengine.Options{
		EnableHTTP: true, HTTPListener: ln, PubMode: fakeengine.PubDial,
		Topic: "kv@" + ep + "@" + model,
	}}
}

// dial starts the engine, its PUB dialing the bind port.
func (d *dialEngine) dial(t *testing.T, bindPort int) {
	t.Helper()
	o := d.opts
	o.PubEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", bindPort)
	e, err := fakeengine.New(o)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() { _ = e.Close() })
	d.Engine = e
}

// tokenSeq makes every flow's prompt unique, so each Serve stores new blocks.
var tokenSeq atomic.Uint32

// uniqueTokens returns n tokens no other call returns.
func uniqueTokens(n int) []uint32 {
	base := tokenSeq.Add(uint32(n)) - uint32(n) + 1_000_000
	out := make([]uint32, n)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

// flow checks that the engine's events reach the EPP's index: it waits for the
// engine's subscriber (a PUB drops what it sends before), serves a new prompt
// of four blocks and waits until kvselect_kv_events_applied_total of the
// worker grows. It returns the counter's new value.
func flow(t *testing.T, p *eppProc, e *fakeengine.Engine, workerID string) float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	require.NoError(t, e.WaitSubscribed(ctx), "the EPP never subscribed to %s", workerID)
	before := p.applied(workerID)
	res, err := e.Serve(fakeengine.Request{Tokens: uniqueTokens(4 * blockSize)})
	require.NoError(t, err)
	require.True(t, res.Published)
	var now float64
	p.eventually(fmt.Sprintf("events of %s applied", workerID), waitTimeout, func() bool {
		now = p.applied(workerID)
		return now > before
	})
	return now
}

// chatBody is a chat completion request for the fake model.
func chatBody(t *testing.T, prompt string) []byte {
	t.Helper()
	b, err := json.Marshal(map[string]any{"model": model, "max_tokens": 1,
		"messages": []map[string]string{{"role": "user", "content": prompt}}})
	require.NoError(t, err)
	return b
}

// pick runs the ext_proc request phase of one chat request.
func (p *eppProc) pick(ctx context.Context, prompt string) (extproctest.Decision, error) {
	return p.client.Do(ctx, extproctest.HTTPRequest{
		Path: "/v1/chat/completions", Headers: http.Header{"Content-Type": {"application/json"}},
		Body: chatBody(p.t, prompt),
	})
}

// --- logs -------------------------------------------------------------------

// errClosedByPeer reports whether err is how a TCP read ends when the other
// side closed or reset the connection.
func errClosedByPeer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, net.ErrClosed)
}
