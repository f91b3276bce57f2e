package httproute_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/selection/httproute"
	"github.com/kvselect/kvselect/tokenize"
)

// logBuffer collects a Router's JSON log; safe for concurrent use.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// refusals returns the "request refused" lines, decoded.
func (b *logBuffer) refusals(t *testing.T) []map[string]any {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(b.buf.String()), "\n") {
		var m map[string]any
		if line == "" || json.Unmarshal([]byte(line), &m) != nil || m["msg"] != "httproute: request refused" {
			continue
		}
		out = append(out, m)
	}
	return out
}

func (b *logBuffer) logger() *slog.Logger { return slog.New(slog.NewJSONHandler(b, nil)) }

// okUpstream answers every request with a small JSON completion.
func okUpstream(t *testing.T) string {
	return upstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[]}`)
	})
}

// slowRequest opens a connection to addr and sends the headers of a chat
// request declaring length body bytes, then sent (the start of the body). The
// connection is closed in t.Cleanup and every read on it is bounded by
// testTimeout.
func slowRequest(t *testing.T, addr string, length int, sent string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, testTimeout)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(testTimeout)))
	_, err = fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", length, sent)
	require.NoError(t, err)
	return c
}

// eventually polls cond until it holds, failing after testTimeout.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(testTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-deadline.C:
			require.FailNow(t, what, "not within %v", testTimeout)
		case <-tick.C:
		}
	}
}

func TestNewValidatesBounds(t *testing.T) {
	_, err := httproute.New(httproute.Options{Service: nil, MaxInflight: -1, MaxPromptTokens: -2})
	require.ErrorIs(t, err, httproute.ErrInvalidOptions)
	require.ErrorContains(t, err, "MaxInflight -1")
	require.ErrorContains(t, err, "MaxPromptTokens -2")
	require.Equal(t, http.StatusServiceUnavailable, httproute.HTTPStatus(fmt.Errorf("x: %w", httproute.ErrOverloaded)))
	require.Equal(t, http.StatusRequestTimeout, httproute.HTTPStatus(fmt.Errorf("x: %w", httproute.ErrBodyTimeout)))
	require.Equal(t, http.StatusRequestEntityTooLarge, httproute.HTTPStatus(fmt.Errorf("x: %w", tokenize.ErrPromptTooLong)))
}

// Past MaxInflight requests being read, a request is answered 503 at once,
// with its reason, its connection closed; the refusals are counted and logged
// once per interval. The requests in their slots go on, and their slots free.
func TestMaxInflightAnswers503(t *testing.T) {
	var logs logBuffer
	env := newEnv(t, envOptions{workers: []string{okUpstream(t)},
		router: httproute.Options{MaxInflight: 2, Logger: logs.logger()}})
	body := chatBody("", "held in its slot while its body trickles in")
	addr := env.gw.Listener.Addr().String()
	slow := []net.Conn{slowRequest(t, addr, len(body), body[:10]), slowRequest(t, addr, len(body), body[:10])}
	eventually(t, "two requests in their slots", func() bool { return env.router.Inflight() == 2 })

	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	for range 3 {
		resp, err := env.post(ctx, t, chatBody("", "one too many"))
		require.NoError(t, err)
		require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
		require.True(t, resp.Close, "the connection of a refused body is closed")
		e := readError(t, resp)
		require.Equal(t, "service_unavailable_error", e.Error.Type)
		require.Contains(t, e.Error.Message, "too many requests in flight")
	}
	st := env.router.Stats()
	require.EqualValues(t, 3, st.Overloaded)
	require.EqualValues(t, 3, st.Rejected)
	lines := logs.refusals(t)
	require.Len(t, lines, 1, "rate-limited: one line per reason per interval")
	require.Equal(t, "overloaded", lines[0]["reason"])
	require.EqualValues(t, 503, lines[0]["status"])

	for _, c := range slow {
		_, err := io.WriteString(c, body[10:])
		require.NoError(t, err)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		require.NoError(t, err)
		got, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, string(got))
	}
	require.Zero(t, env.router.Inflight())
	resp, err := env.post(ctx, t, chatBody("", "a free slot again"))
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	env.waitServed(t, 6)
	env.requireIdle(t, "")
}

// A body that does not arrive whole within BodyTimeout is answered 408 and
// its connection closed, Content-Length or chunked; the answer comes after the
// deadline, not long after.
func TestSlowBodyAnswered408AndClosed(t *testing.T) {
	const timeout = 300 * time.Millisecond
	var logs logBuffer
	env := newEnv(t, envOptions{workers: []string{okUpstream(t)},
		router: httproute.Options{BodyTimeout: timeout, Logger: logs.logger()}})
	addr := env.gw.Listener.Addr().String()
	chunked := func() net.Conn {
		c, err := net.DialTimeout("tcp", addr, testTimeout)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		require.NoError(t, c.SetDeadline(time.Now().Add(testTimeout)))
		_, err = io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")
		require.NoError(t, err)
		return c
	}
	for i, open := range []func() net.Conn{
		func() net.Conn { return slowRequest(t, addr, 1000, `{"model":`) },
		func() net.Conn { return slowRequest(t, addr, 8_000_000, strings.Repeat(" ", 80)) },
		chunked,
	} {
		start := time.Now()
		c := open()
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		require.NoError(t, err, "case %d", i)
		elapsed := time.Since(start)
		require.Equal(t, http.StatusRequestTimeout, resp.StatusCode, "case %d", i)
		require.True(t, resp.Close, "case %d: Connection: close", i)
		e := readError(t, resp)
		require.Contains(t, e.Error.Message, "BodyTimeout")
		require.GreaterOrEqual(t, elapsed, timeout, "case %d", i)
		_, err = br.ReadByte()
		require.ErrorIs(t, err, io.EOF, "case %d: the gateway closes the connection", i)
		t.Logf("case %d: 408 after %v", i, elapsed.Round(time.Millisecond))
	}
	require.EqualValues(t, 3, env.router.Stats().BodyTimeouts)
	require.Zero(t, env.router.Inflight())
	lines := logs.refusals(t)
	require.Len(t, lines, 1)
	require.Equal(t, "body_timeout", lines[0]["reason"])
	env.waitServed(t, 3)
}

// The body's deadline is lifted once it is in: an answer that takes longer
// than BodyTimeout is streamed whole.
func TestBodyTimeoutDoesNotCutTheAnswer(t *testing.T) {
	const timeout = 100 * time.Millisecond
	ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseHeaders(w)
		sse(w, "first")
		select { // a long generation, well past the body's deadline
		case <-time.After(4 * timeout):
		case <-r.Context().Done():
			return
		}
		sse(w, "[DONE]")
	})
	env := newEnv(t, envOptions{workers: []string{ep}, router: httproute.Options{BodyTimeout: timeout}})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := env.post(ctx, t, chatBody("", "a long answer"))
	require.NoError(t, err)
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, "data: first\n\ndata: [DONE]\n\n", string(got))
	env.waitServed(t, 1)
	env.requireIdle(t, "")
	require.EqualValues(t, 1, env.router.Stats().Ended)
}

// readSignal wraps a request body and reports its second Read: by then the
// Router has made its buffer and holds the bytes that came first.
type readSignal struct {
	io.ReadCloser
	reads   int
	waiting chan<- struct{}
}

func (r *readSignal) Read(p []byte) (int, error) {
	if r.reads++; r.reads == 2 {
		r.waiting <- struct{}{}
	}
	return r.ReadCloser.Read(p)
}

// A body's buffer follows the bytes that arrive, not the Content-Length: 50
// requests declaring 8 MB and sending 80 bytes cost far less than 50 x 1 MiB.
// An honest large body is still read whole.
func TestBodyBufferFollowsTheBytesThatArrive(t *testing.T) {
	const conns = 50
	env := newEnv(t, envOptions{workers: []string{okUpstream(t)}})
	waiting := make(chan struct{}, conns)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = &readSignal{ReadCloser: r.Body, waiting: waiting}
		env.router.ServeHTTP(w, r)
	}))
	defer srv.Close()
	addr := srv.Listener.Addr().String()

	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	held := make([]net.Conn, conns)
	for i := range held {
		held[i] = slowRequest(t, addr, 8_000_000, strings.Repeat(" ", 80))
	}
	for range conns {
		select {
		case <-waiting:
		case <-time.After(testTimeout):
			require.FailNow(t, "the Router never waited for more of a body")
		}
	}
	runtime.ReadMemStats(&after)
	allocated := after.TotalAlloc - before.TotalAlloc
	t.Logf("%d bodies declaring 8 MB, 80 bytes sent: %d KiB allocated (%d KiB each)", conns, allocated>>10, allocated/conns>>10)
	require.Less(t, allocated, uint64(conns*128<<10), "a buffer must not follow the declared length")
	for _, c := range held {
		_ = c.Close()
	}
	eventually(t, "the held requests left", func() bool { return env.router.Inflight() == 0 })

	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := env.post(ctx, t, chatBody("", strings.Repeat("long prompt ", 20_000)))
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	env.waitServed(t, 1)
}

// A prompt over MaxPromptTokens is answered 413 with its reason, whether the
// Router finds it or the Tokenizer refuses it.
func TestPromptTokensBound(t *testing.T) {
	var logs logBuffer
	env := newEnv(t, envOptions{workers: []string{okUpstream(t)},
		router: httproute.Options{MaxPromptTokens: 100, Logger: logs.logger()}})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	short := chatBody("", "hi") // byteTokens: one token a byte
	require.Less(t, len(short), 100)
	resp, err := env.post(ctx, t, short)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)

	resp, err = env.post(ctx, t, chatBody("", strings.Repeat("x", 100)))
	require.NoError(t, err)
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
	require.False(t, resp.Close, "the body was read: the connection is kept")
	e := readError(t, resp)
	require.Equal(t, "invalid_request_error", e.Error.Type)
	require.Contains(t, e.Error.Message, "MaxPromptTokens")

	refusing := tokenizerFunc(func(context.Context, tokenize.Request) (tokenize.Result, error) {
		return tokenize.Result{}, fmt.Errorf("%w: the answer holds more", tokenize.ErrPromptTooLong)
	})
	env2 := newEnv(t, envOptions{workers: []string{okUpstream(t)}, router: httproute.Options{Tokenizer: refusing}})
	resp, err = env2.post(ctx, t, short)
	require.NoError(t, err)
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
	readError(t, resp)

	require.EqualValues(t, 1, env.router.Stats().PromptsTooLong)
	require.EqualValues(t, 1, env2.router.Stats().PromptsTooLong)
	lines := logs.refusals(t)
	require.Len(t, lines, 1)
	require.Equal(t, "prompt_too_long", lines[0]["reason"])
	require.EqualValues(t, 413, lines[0]["status"])
	env.waitServed(t, 2)
	env2.waitServed(t, 1)
	env.requireIdle(t, "")
}
