package eppproc

import (
	"context"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// sh starts a shell script as the process, with only PATH and X in its
// environment.
func sh(t *testing.T, script string) *Process {
	t.Helper()
	bin, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh:", err)
	}
	p, err := Start(context.Background(), bin, map[string]string{"PATH": os.Getenv("PATH"), "X": "x1"}, "-c", script)
	require.NoError(t, err)
	t.Cleanup(func() { p.Stop(syscall.SIGKILL, time.Second) })
	return p
}

func TestProcessLogAndStop(t *testing.T) {
	p := sh(t, `echo "plain $X $HOME"; echo '{"msg":"epp listening","extproc":"127.0.0.1:1","metrics":"127.0.0.1:2"}'; exec sleep 60`)
	addrs, ok := p.WaitListening(5 * time.Second)
	require.True(t, ok)
	require.Equal(t, Addrs{ExtProc: "127.0.0.1:1", Metrics: "127.0.0.1:2"}, addrs)
	require.Equal(t, "plain x1 ", p.Logs().Lines()[0], "exactly the given environment")
	_, ok = p.WaitLog(50*time.Millisecond, MsgIs("never"))
	require.False(t, ok, "times out")
	require.False(t, p.Exited())
	require.NoError(t, p.Err())

	p.Stop(syscall.SIGTERM, 5*time.Second)
	require.True(t, p.Exited())
	require.Error(t, p.Err(), "ended by a signal")
	p.Stop(syscall.SIGTERM, 5*time.Second) // idempotent
}

func TestWaitLogReturnsOnExit(t *testing.T) {
	p := sh(t, `echo '{"msg":"bye"}'; exit 3`)
	start := time.Now()
	_, ok := p.WaitLog(time.Minute, MsgIs("never"))
	require.False(t, ok)
	require.Less(t, time.Since(start), 30*time.Second, "does not wait out the timeout")
	<-p.Done()
	require.ErrorContains(t, p.Err(), "exit status 3")
	rec, ok := p.WaitLog(time.Minute, MsgIs("bye"))
	require.True(t, ok, "what it wrote before exiting is kept")
	require.Equal(t, "bye", rec.Msg())
}

func TestStopKillsAfterTimeout(t *testing.T) {
	p := sh(t, `trap '' TERM; echo '{"msg":"ready"}'; while :; do sleep 0.05; done`)
	_, ok := p.WaitLog(5*time.Second, MsgIs("ready"))
	require.True(t, ok)
	p.Stop(syscall.SIGTERM, 200*time.Millisecond)
	require.True(t, p.Exited())
	require.ErrorContains(t, p.Err(), "killed")
}
