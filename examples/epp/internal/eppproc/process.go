package eppproc

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// poll is how often WaitLog looks at the log.
const poll = 20 * time.Millisecond

// Build compiles examples/epp into dir/epp, with the race detector when race
// is set, and returns the binary's path. The go command's output goes to
// stderr.
func Build(ctx context.Context, dir string, race bool) (string, error) {
	bin := filepath.Join(dir, "epp")
	args := []string{"build", "-o", bin}
	if race {
		args = append(args, "-race")
	}
	build := exec.CommandContext(ctx, "go", append(args, "github.com/kvselect/kvselect/examples/epp")...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return "", fmt.Errorf("eppproc: go build: %w", err)
	}
	return bin, nil
}

// Process is one running EPP. Its zero value is not usable; see Start.
type Process struct {
	cmd  *exec.Cmd
	logs *Sink
	done chan struct{} // closed once the process has exited and been reaped
	err  error         // Wait's result, set before done is closed
}

// Start runs bin with args and exactly env: nothing is inherited from the test
// process, so a developer's DYN_* cannot leak in. Stdout and stderr both go
// to Logs. On Linux the kernel kills the process when the test process dies
// without stopping it (a panic, a test timeout). ctx kills it too (see
// exec.CommandContext). The caller must Stop it.
func Start(ctx context.Context, bin string, env map[string]string, args ...string) (*Process, error) {
	p := &Process{logs: &Sink{}, done: make(chan struct{})}
	p.cmd = exec.CommandContext(ctx, bin, args...)
	p.cmd.Env = make([]string, 0, len(env))
	for k, v := range env {
		p.cmd.Env = append(p.cmd.Env, k+"="+v)
	}
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	p.cmd.SysProcAttr = childAttr()
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("eppproc: start %s: %w", bin, err)
	}
	go func() { // owned by p: Stop waits for done
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Logs is everything the process wrote, stdout and stderr.
func (p *Process) Logs() *Sink { return p.logs }

// Pid is the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Signal sends sig to the process; signal 0 checks that it still exists.
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Done is closed once the process has exited and been reaped; by then every
// line it wrote is in Logs.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err is how the process ended (exec.Cmd.Wait's error); nil until Done is
// closed, and nil after a clean exit.
func (p *Process) Err() error {
	select {
	case <-p.done:
		return p.err
	default:
		return nil
	}
}

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Stop sends sig (unless the process has already exited), kills the process
// when it is still running after timeout, and waits until it is reaped.
// Idempotent.
func (p *Process) Stop(sig os.Signal, timeout time.Duration) {
	if p.Exited() {
		return
	}
	_ = p.cmd.Process.Signal(sig)
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// WaitLog waits, for at most timeout, for a JSON log record matching match
// and returns the first one; false when the time ran out or the process
// exited without writing one.
func (p *Process) WaitLog(timeout time.Duration, match func(Record) bool) (Record, bool) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(poll)
	defer tick.Stop()
	for {
		exited := p.Exited() // before Find: once exited, the log is complete
		if recs := p.logs.Find(match); len(recs) > 0 {
			return recs[0], true
		}
		if exited {
			return Record{}, false
		}
		select {
		case <-p.done:
		case <-deadline.C:
			return Record{}, false
		case <-tick.C:
		}
	}
}

// Addrs are the addresses the EPP bound, as its "epp listening" record
// gives them ("" for one it did not log).
type Addrs struct {
	ExtProc, Health, Metrics string
}

// WaitListening waits, for at most timeout, for the "epp listening" record;
// false as for WaitLog.
func (p *Process) WaitListening(timeout time.Duration) (Addrs, bool) {
	rec, ok := p.WaitLog(timeout, MsgIs("epp listening"))
	return Addrs{ExtProc: rec.Str("extproc"), Health: rec.Str("health"), Metrics: rec.Str("metrics")}, ok
}

// Report is for a test's cleanup, once the process is stopped: it fails t
// when the process's output holds a data race report (a binary built with
// -race), and logs the whole output when t has failed.
func (p *Process) Report(t testing.TB) {
	t.Helper()
	for _, line := range p.logs.Lines() {
		if strings.Contains(line, "WARNING: DATA RACE") {
			t.Errorf("the EPP reported a data race")
			break
		}
	}
	if t.Failed() {
		t.Logf("EPP pid %d (exit: %v) log:\n%s", p.Pid(), p.Err(), p.Output())
	}
}

// Output is every line the process wrote so far, joined by newlines.
func (p *Process) Output() string { return strings.Join(p.logs.Lines(), "\n") }
