package sidecar_test

import (
	"bufio"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/internal/logtest"
)

// stalled is what a client that sent a request head and part of its body,
// then stalled, got back: the bytes until the server closed the connection,
// or the error that ended the wait.
type stalled struct {
	answer string
	err    error
}

// stall sends head and part on a fresh connection to addr, stalls, and reads
// until the server closes the connection, at most within.
func stall(addr, head, part string, within time.Duration) stalled {
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		return stalled{err: err}
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, head+part); err != nil {
		return stalled{err: err}
	}
	if err := conn.SetReadDeadline(time.Now().Add(within)); err != nil {
		return stalled{err: err}
	}
	b, err := io.ReadAll(conn)
	return stalled{answer: string(b), err: err}
}

// Every client that stalls in its body gets its answer (408 past the body
// deadline; 502 for a bad hint and 413 for a declared size over the bound,
// without waiting for the body) and a closed connection, within the body
// deadline plus a second. net/http would otherwise read the rest of the body
// before answering, with no deadline: the client never got its 408 and the
// connection stayed open.
func TestStalledBodiesAreAnsweredAndClosed(t *testing.T) {
	const (
		timeout = 250 * time.Millisecond
		clients = 8
	)
	sc, err := sidecar.New(sidecar.Options{DecodeURL: "http://" + hangUp(t), BodyReadTimeout: timeout, MaxRequestBytes: 4096})
	require.NoError(t, err)
	defer sc.Close()
	front := httptest.NewServer(sc)
	defer front.Close()
	addr := front.Listener.Addr().String()

	head := func(path string, lines ...string) string {
		return "POST " + path + " HTTP/1.1\r\nHost: " + addr + "\r\nContent-Type: application/json\r\n" +
			strings.Join(lines, "\r\n") + "\r\n\r\n"
	}
	const hint = sidecar.HeaderPrefiller + ": 10.0.0.7:8000"
	for _, tc := range []struct {
		name, head, part string
		status           int
		code             string
	}{
		{"P/D body stalls", head("/v1/completions", hint, "Content-Length: 2048"), `{"prompt":"`, 408, "request_timeout"},
		{"P/D chunked body stalls", head("/v1/chat/completions", hint, "Transfer-Encoding: chunked"), "b\r\n{\"prompt\":\"\r\n", 408, "request_timeout"},
		{"bad hint, body stalls", head("/v1/completions", sidecar.HeaderPrefiller+": 169.254.169.254:80", "Content-Length: 2048"), `{"prompt":"`, 502, "invalid_epp_metadata"},
		{"P/D body declared too large, stalls", head("/v1/completions", hint, "Content-Length: 8192"), `{"prompt":"`, 413, "request_too_large"},
		{"pass-through body declared too large, stalls", head("/v1/completions", "Content-Length: 8192"), `{"prompt":"`, 413, "request_too_large"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			results := make(chan stalled, clients)
			var wg sync.WaitGroup
			for range clients {
				wg.Go(func() { results <- stall(addr, tc.head, tc.part, timeout+time.Second) })
			}
			wg.Wait()
			close(results)
			for res := range results {
				require.NoError(t, res.err, "the answer and the close came within the deadline plus a second; got %q", res.answer)
				resp, err := http.ReadResponse(bufio.NewReader(strings.NewReader(res.answer)), nil)
				require.NoError(t, err, "%q", res.answer)
				require.Equal(t, tc.status, resp.StatusCode)
				require.True(t, resp.Close, "Connection: close")
				data, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				require.Equal(t, tc.code, errorCode(t, data))
			}
		})
	}
	st := sc.Stats()
	require.Equal(t, uint64(2*clients), st.Refused[sidecar.RefusedBodyTimeout])
	require.Equal(t, uint64(2*clients), st.Refused[sidecar.RefusedBodyTooLarge])
	require.Equal(t, uint64(clients), st.BadHints[sidecar.HintForbiddenAddress])
}

// syncBuffer is a log sink safe for concurrent writes and the test's reads.
type syncBuffer = logtest.Buffer

// cannedServer answers every request on a loopback listener with answer's
// bytes as they are, then closes the connection: a service that is no
// engine.
func cannedServer(t *testing.T, answer string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			if req, err := http.ReadRequest(bufio.NewReader(conn)); err == nil {
				_, _ = io.Copy(io.Discard, req.Body)
				_, _ = io.WriteString(conn, answer)
			}
			conn.Close()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
	})
	return ln.Addr().String()
}

// A failed prefill leg is answered with a fixed phrase per failure: nothing
// the hinted address sent (a service's banner quoted in a transport error, a
// status line, a body) reaches the client, so the sidecar cannot be used to
// read what listens where. The detail goes to the log.
func TestPrefillFailuresAnswerFixedPhrases(t *testing.T) {
	var logs syncBuffer
	decode := startEngine(t, fakeengine.Options{PDRole: fakeengine.PDRoleDecode})
	sc, err := sidecar.New(sidecar.Options{DecodeURL: "http://" + decode.addr, PrefillTimeout: 300 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	defer sc.Close()
	front := httptest.NewServer(sc)
	defer front.Close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: testTimeout}

	// An engine that never answers. (It reads the body first: net/http notices
	// a client that went away only then.)
	silent := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		<-r.Context().Done()
	}))
	defer silent.Close()
	type answer struct{ code, message string }
	ask := func(target string) answer {
		path, body, _ := request(t, false, false, nil)
		req, err := http.NewRequest(http.MethodPost, front.URL+path, strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set(sidecar.HeaderPrefiller, target)
		resp, err := client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		data, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.Equal(t, http.StatusBadGateway, resp.StatusCode, "%s", data)
		for _, leak := range []string{"SECRET", "SSH", target} {
			require.NotContains(t, string(data), leak)
		}
		var e struct {
			Error struct{ Code, Message string }
		}
		require.NoError(t, json.Unmarshal(data, &e))
		return answer{e.Error.Code, e.Error.Message}
	}

	unreachable := ask(hangUp(t))
	require.Equal(t, "prefill_upstream_unavailable", unreachable.code)
	banner := ask(cannedServer(t, "SSH-2.0-OpenSSH_9.6 SECRET-BANNER\r\n"))
	require.Equal(t, unreachable, banner, "a banner is answered like a closed connection")
	require.Contains(t, logs.String(), "SECRET-BANNER", "the detail is logged")

	status := ask(cannedServer(t, "HTTP/1.1 503 SECRET-REASON\r\nContent-Length: 13\r\n\r\nSECRET-DETAIL"))
	require.Equal(t, "prefill_upstream_error", status.code)
	require.Contains(t, logs.String(), "SECRET-REASON")
	other := ask(cannedServer(t, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
	require.Equal(t, status, other, "every error status is answered alike")

	handoff := ask(cannedServer(t, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\nSECRET-DETAIL"))
	require.Equal(t, "invalid_prefill_handoff", handoff.code)
	timeout := ask(silent.Listener.Addr().String())
	require.Equal(t, "prefill_upstream_timeout", timeout.code)

	messages := map[string]bool{}
	for _, a := range []answer{unreachable, status, handoff, timeout} {
		messages[a.message] = true
	}
	require.Len(t, messages, 4, "one phrase per failure: %v", messages)
}
