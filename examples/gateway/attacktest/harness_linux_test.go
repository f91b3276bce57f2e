package attacktest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Bounds of the harness's waits.
const (
	buildTimeout = 5 * time.Minute  // the one build (a cold cache on a loaded machine)
	startTimeout = 20 * time.Second // the gateway listening
	stopTimeout  = 15 * time.Second // SIGTERM to exit (its shutdown grace is 10 s)
	poll         = 20 * time.Millisecond
)

// gatewayBinary is the binary TestMain built.
var gatewayBinary string

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "kvselect-gateway-attacktest-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "attacktest:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	gatewayBinary = filepath.Join(dir, "gateway")
	args := []string{"build", "-o", gatewayBinary}
	if raceBuild {
		args = append(args, "-race")
	}
	build := exec.CommandContext(ctx, "go", append(args, "github.com/kvselect/kvselect/examples/gateway")...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintf(os.Stderr, "attacktest: FAIL: cannot build the gateway: %v\n", err)
		return 1
	}
	return m.Run()
}

// lines collects a process's output, one line at a time; safe for concurrent
// use (exec copies stdout and stderr from goroutines of its own).
type lines struct {
	mu      sync.Mutex
	partial []byte
	all     []string
}

func (l *lines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.partial = append(l.partial, p...)
	for {
		i := bytes.IndexByte(l.partial, '\n')
		if i < 0 {
			return len(p), nil
		}
		l.all = append(l.all, string(l.partial[:i]))
		l.partial = l.partial[i+1:]
	}
}

// record returns the first JSON log record whose msg is msg.
func (l *lines) record(msg string) (map[string]any, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.all {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && m["msg"] == msg {
			return m, true
		}
	}
	return nil, false
}

func (l *lines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.all, "\n")
}

// gatewayProc is one running gateway.
type gatewayProc struct {
	t    *testing.T
	cmd  *exec.Cmd
	out  *lines
	done chan struct{} // closed once the process is reaped
	err  error         // Wait's result, set before done is closed
	addr string        // the API's host:port
}

// startGateway writes a workers file (one worker nobody listens for), starts
// the gateway with exactly the environment given plus the test's own
// settings, and waits until it listens. It is stopped in t.Cleanup.
func startGateway(t *testing.T, extra map[string]string) *gatewayProc {
	t.Helper()
	path := filepath.Join(t.TempDir(), "workers.json")
	require.NoError(t, os.WriteFile(path, []byte(`{"workers":[{"id":"e0","endpoint":"127.0.0.1:1"}]}`), 0o600))
	env := map[string]string{
		"GATEWAY_ADDR":                  "127.0.0.1:0",
		"DYN_EPP_METRICS_ADDR":          "127.0.0.1:0",
		"DYN_EPP_WORKERS_FILE":          path,
		"DYN_EPP_TOKENIZER_SERVICE_URL": "http://127.0.0.1:1",
		"DYN_ROUTER_USE_KV_EVENTS":      "false",
	}
	for k, v := range extra {
		env[k] = v
	}
	// A last resort: the cleanup stops the process long before.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	g := &gatewayProc{t: t, out: &lines{}, done: make(chan struct{})}
	g.cmd = exec.CommandContext(ctx, gatewayBinary)
	for k, v := range env {
		g.cmd.Env = append(g.cmd.Env, k+"="+v)
	}
	g.cmd.Stdout, g.cmd.Stderr = g.out, g.out
	g.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, g.cmd.Start())
	go func() { // owned by g: stop waits for done
		g.err = g.cmd.Wait()
		close(g.done)
	}()
	t.Cleanup(func() {
		g.stop()
		if strings.Contains(g.out.String(), "WARNING: DATA RACE") {
			t.Errorf("the gateway reported a data race")
		}
		if t.Failed() {
			t.Logf("gateway pid %d (exit: %v) log:\n%s", g.cmd.Process.Pid, g.err, g.out)
		}
	})
	rec := g.waitLog("gateway listening", startTimeout)
	g.addr, _ = rec["addr"].(string)
	require.NotEmpty(t, g.addr)
	return g
}

// waitLog waits for a log record whose msg is msg.
func (g *gatewayProc) waitLog(msg string, timeout time.Duration) map[string]any {
	g.t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(poll)
	defer tick.Stop()
	for {
		if rec, ok := g.out.record(msg); ok {
			return rec
		}
		select {
		case <-g.done:
			require.FailNow(g.t, "the gateway exited", "waiting for %q: %v", msg, g.err)
		case <-deadline.C:
			require.FailNow(g.t, "no log record", "%q within %v", msg, timeout)
		case <-tick.C:
		}
	}
}

// exited reports whether the process has ended.
func (g *gatewayProc) exited() bool {
	select {
	case <-g.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM, kills the process if it is still running after
// stopTimeout, and waits until it is reaped. Idempotent.
func (g *gatewayProc) stop() {
	if g.exited() {
		return
	}
	_ = g.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(stopTimeout)
	defer t.Stop()
	select {
	case <-g.done:
	case <-t.C:
		_ = g.cmd.Process.Kill()
		<-g.done
	}
}

// memory reads a field of /proc/<pid>/status in bytes: VmRSS (resident now)
// or VmHWM (the resident peak).
func (g *gatewayProc) memory(field string) int64 {
	g.t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", g.cmd.Process.Pid))
	require.NoError(g.t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), field+":")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		require.NoError(g.t, err, "%s %q", field, rest)
		return kb << 10
	}
	require.NoError(g.t, sc.Err())
	require.FailNow(g.t, "no such field in /proc/<pid>/status", field)
	return 0
}
