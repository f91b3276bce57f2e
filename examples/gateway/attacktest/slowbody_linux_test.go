package attacktest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// answer is what one slow connection got.
type answer struct {
	status  int           // 0: no answer
	closed  time.Duration // from the last byte sent to the gateway's close
	err     error         // a read that failed other than at the close
	refusal string        // the OpenAI error's message, for the log
}

// A thousand connections declare 8 MB bodies and send 80 bytes each: the
// gateway stays under 400 MB of resident memory, and answers each one 408 and
// closes it within its body deadline plus slack. It still answers afterwards
// and stops cleanly.
func TestSlowBodiesAreBoundedAndClosed(t *testing.T) {
	const (
		conns       = 1000
		declared    = 8_000_000
		sent        = 80
		bodyTimeout = 2 * time.Second
		// slack covers a loaded two-core machine and a -race build: the
		// gateway answers 1,000 expiring deadlines at once.
		slack    = 4 * time.Second
		rssBound = 400 << 20
	)
	g := startGateway(t, map[string]string{"GATEWAY_BODY_TIMEOUT": bodyTimeout.String()})
	rss0 := g.memory("VmRSS")

	head := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		declared, strings.Repeat(" ", sent))
	answers := make(chan answer, conns)
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait) // every reader ends at its connection's deadline at the latest
	start := time.Now()
	for i := range conns {
		c, err := net.DialTimeout("tcp", g.addr, 10*time.Second)
		require.NoError(t, err, "connection %d", i)
		_, err = io.WriteString(c, head)
		sentAt := time.Now()
		if err != nil {
			_ = c.Close()
			require.NoError(t, err, "connection %d", i)
		}
		require.NoError(t, c.SetDeadline(sentAt.Add(bodyTimeout+slack)))
		wg.Add(1)
		go func() { // owned by wg: ends at the connection's deadline at the latest
			defer wg.Done()
			defer c.Close()
			answers <- readAnswer(c, sentAt)
		}()
	}
	t.Logf("%d connections open in %v", conns, time.Since(start).Round(time.Millisecond))

	var rssPeak int64
	tick := time.NewTicker(poll)
	defer tick.Stop()
	statuses := map[int]int{}
	var slowest time.Duration
	failed, examples := 0, []string{}
	for got := 0; got < conns; {
		select {
		case a := <-answers:
			got++
			statuses[a.status]++
			slowest = max(slowest, a.closed)
			if a.status != http.StatusRequestTimeout || a.err != nil {
				if failed++; len(examples) < 3 {
					examples = append(examples, fmt.Sprintf("status %d after %v: %v %s", a.status, a.closed.Round(time.Millisecond), a.err, a.refusal))
				}
			}
		case <-tick.C:
			rssPeak = max(rssPeak, g.memory("VmRSS"))
		}
	}
	hwm := g.memory("VmHWM")
	t.Logf("answers %v; slowest close %v after its last byte; RSS %d MiB before, sampled peak %d MiB, VmHWM %d MiB",
		statuses, slowest.Round(time.Millisecond), rss0>>20, rssPeak>>20, hwm>>20)
	assert.Less(t, hwm, int64(rssBound), "the gateway's resident peak")
	require.Zero(t, failed, "connections not answered 408 and closed within %v, of %d; for example %q",
		bodyTimeout+slack, conns, examples)

	// Still serving, and it stops cleanly.
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get("http://" + g.addr + "/health")
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.False(t, g.exited(), "the gateway exited: %v", g.err)
	g.stop()
	require.NoError(t, g.err, "the gateway's exit")
}

// readAnswer reads the gateway's answer on c and then waits for its close.
func readAnswer(c net.Conn, sentAt time.Time) answer {
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return answer{closed: time.Since(sentAt), err: fmt.Errorf("no answer: %w", err)}
	}
	a := answer{status: resp.StatusCode}
	body, _ := io.ReadAll(resp.Body)
	a.refusal = string(body)
	if !resp.Close {
		a.err = errors.New("no Connection: close")
	}
	_, err = io.Copy(io.Discard, br)
	a.closed = time.Since(sentAt)
	switch {
	case err == nil, errors.Is(err, syscall.ECONNRESET):
		// Closed (io.Copy reads to EOF), or reset with data unread.
	case a.err == nil:
		a.err = fmt.Errorf("not closed: %w", err)
	}
	return a
}
