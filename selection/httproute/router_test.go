package httproute_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/selection/httproute"
	"github.com/kvselect/kvselect/tokenize"
)

func TestNewValidatesOptions(t *testing.T) {
	_, err := httproute.New(httproute.Options{MaxBodyBytes: -1, Scheme: "ftp"})
	require.ErrorIs(t, err, httproute.ErrInvalidOptions)
	for _, want := range []string{"Service is nil", "Tokenizer is nil", "MaxBodyBytes -1", `Scheme "ftp"`} {
		require.ErrorContains(t, err, want)
	}
	svc, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).ExternalEvents().Build(context.Background())
	require.NoError(t, err)
	defer svc.Close()
	opts := httproute.Options{Service: httproute.Single(svc), Tokenizer: byteTokens}
	r, err := httproute.New(opts)
	require.NoError(t, err)
	r.CloseIdleConnections()
	require.Zero(t, opts.MaxBodyBytes, "New must not write defaults into the caller's options")
	require.Empty(t, opts.Scheme)
}

// The first response body byte completes the prefill; the response headers,
// which an SSE engine sends before its prefill is done, do not. Reading the
// answer to its end finds the booking already freed.
func TestPrefillCompleteAtFirstBodyByteNotHeaders(t *testing.T) {
	release, finish := make(chan struct{}), make(chan struct{})
	ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseHeaders(w)
		if wait(r, release) {
			sse(w, "first")
			if wait(r, finish) {
				sse(w, "[DONE]")
			}
		}
	})
	env := newEnv(t, envOptions{workers: []string{ep}})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	body := chatBody("default", "hello there")
	resp, err := env.post(ctx, t, body)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))

	l := env.load(t, "", "w0")
	require.Equal(t, 1, l.ActiveRequests)
	require.EqualValues(t, len(body), l.ActivePrefillTokens, "headers alone must not complete the prefill")
	require.Zero(t, env.router.Stats().FirstBytes)

	close(release)
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "data: first\n", line)
	l = env.load(t, "", "w0")
	require.Equal(t, 1, l.ActiveRequests, "still streaming")
	require.Zero(t, l.ActivePrefillTokens, "the first body byte completes the prefill")
	require.EqualValues(t, 1, env.router.Stats().FirstBytes)

	close(finish)
	rest, err := io.ReadAll(br)
	require.NoError(t, err)
	require.Equal(t, "\ndata: [DONE]\n\n", string(rest))
	env.requireIdle(t, "") // no wait: the end of the answer comes after the booking's
	require.EqualValues(t, 1, env.router.Stats().Ended)
}

// Every SSE event reaches the client as the engine sends it: the engine sends
// the next one only once the client has seen the last.
func TestSSEFlushedPerEvent(t *testing.T) {
	const events = 5
	ack := make(chan struct{})
	ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseHeaders(w)
		for i := range events {
			sse(w, fmt.Sprint("token ", i))
			select {
			case <-ack:
			case <-r.Context().Done():
				return
			}
		}
	})
	env := newEnv(t, envOptions{workers: []string{ep}})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := env.post(ctx, t, chatBody("", "stream please"))
	require.NoError(t, err)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for i := range events {
		line, err := br.ReadString('\n')
		require.NoError(t, err, "event %d never arrived: not flushed", i)
		require.Equal(t, fmt.Sprintf("data: token %d\n", i), line)
		_, _ = br.ReadString('\n')
		ack <- struct{}{}
	}
	_, err = io.ReadAll(br)
	require.NoError(t, err)
	env.requireIdle(t, "")
}

// A JSON answer with a Content-Length is settled when its last byte is read
// from the engine, before it reaches the client.
func TestDoneAtEndOfSizedAnswer(t *testing.T) {
	ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", "17")
		_, _ = io.WriteString(w, `{"choices":[1,2]}`)
	})
	env := newEnv(t, envOptions{workers: []string{ep}})
	resp, err := env.post(context.Background(), t, chatBody("", "json please"))
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, `{"choices":[1,2]}`, string(b))
	require.EqualValues(t, 17, resp.ContentLength)
	env.requireIdle(t, "")
	st := env.router.Stats()
	require.EqualValues(t, 1, st.Ended)
	require.EqualValues(t, 1, st.FirstBytes)
}

// A client that goes away mid-stream frees its booking, and the engine's
// request is cancelled.
func TestDoneOnClientCancelMidStream(t *testing.T) {
	engineGone := make(chan struct{})
	ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseHeaders(w)
		sse(w, "first")
		<-r.Context().Done() // never ends by itself
		close(engineGone)
	})
	env := newEnv(t, envOptions{workers: []string{ep}})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := env.post(ctx, t, chatBody("", "a long story"))
	require.NoError(t, err)
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "data: first\n", line)
	require.Equal(t, 1, env.load(t, "", "w0").ActiveRequests)
	cancel()
	resp.Body.Close()
	env.waitServed(t, 1)
	<-engineGone
	env.requireIdle(t, "")
	st := env.router.Stats()
	require.EqualValues(t, 1, st.Canceled, "%+v", st)
	require.Zero(t, st.MarkedFailed, "a client's cancel is not the worker's failure")
}

// A client that goes away while the engine is still prefilling (no response
// headers yet) frees its booking too.
func TestDoneOnClientCancelBeforeHeaders(t *testing.T) {
	arrived := make(chan struct{})
	ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		close(arrived)
		<-r.Context().Done()
	})
	env := newEnv(t, envOptions{workers: []string{ep}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		resp, err := env.post(ctx, t, chatBody("", "slow prefill"))
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	<-arrived
	require.Equal(t, 1, env.load(t, "", "w0").ActiveRequests)
	cancel()
	require.ErrorIs(t, <-errc, context.Canceled)
	env.waitServed(t, 1)
	env.requireIdle(t, "")
	require.EqualValues(t, 1, env.router.Stats().Canceled)
	require.Zero(t, env.router.Stats().MarkedFailed)
}

// A worker that refuses the connection gets a 502 JSON error, and is marked
// failed.
func TestConnectErrorMarksFailedAndFrees(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	dead := ln.Addr().String()
	require.NoError(t, ln.Close())
	env := newEnv(t, envOptions{workers: []string{dead}})
	resp, err := env.post(context.Background(), t, chatBody("", "anyone?"))
	require.NoError(t, err)
	require.Equal(t, http.StatusBadGateway, resp.StatusCode)
	e := readError(t, resp)
	require.Equal(t, "upstream_error", e.Error.Type)
	require.NotContains(t, e.Error.Message, dead, "server errors do not describe the deployment")
	env.requireIdle(t, "")
	st := env.router.Stats()
	require.EqualValues(t, 1, st.UpstreamErrors)
	require.EqualValues(t, 1, st.MarkedFailed)
	require.EqualValues(t, 1, st.Failed)
	require.EqualValues(t, 1, env.svc.Stats().Failures)
}

// An engine's failure status goes to the client as it is and, when
// FailureStatus says so, marks the worker failed.
func TestFailureStatusMarksFailed(t *testing.T) {
	for _, tc := range []struct {
		status int
		marked bool
	}{
		{http.StatusInternalServerError, true},
		{http.StatusServiceUnavailable, true},
		{http.StatusNotImplemented, false},
		{http.StatusBadRequest, false},
		{http.StatusTooManyRequests, false},
	} {
		t.Run(fmt.Sprint(tc.status), func(t *testing.T) {
			ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(tc.status)
				_, _ = fmt.Fprintf(w, `{"error":{"message":"engine says %d","type":"x","code":%d}}`, tc.status, tc.status)
			})
			env := newEnv(t, envOptions{workers: []string{ep}})
			resp, err := env.post(context.Background(), t, chatBody("", "hi"))
			require.NoError(t, err)
			require.Equal(t, tc.status, resp.StatusCode)
			e := readError(t, resp)
			require.Equal(t, fmt.Sprintf("engine says %d", tc.status), e.Error.Message, "the engine's answer is passed through")
			env.requireIdle(t, "")
			st := env.router.Stats()
			if tc.marked {
				require.EqualValues(t, 1, st.MarkedFailed)
				require.EqualValues(t, 1, env.svc.Stats().Failures)
			} else {
				require.Zero(t, st.MarkedFailed)
				require.Zero(t, env.svc.Stats().Failures)
			}
			require.Zero(t, st.FirstBytes, "an error answer is no first output")
			require.Zero(t, env.svc.Stats().PrefillCompleted)
		})
	}
}

// A worker that cuts its answer mid-stream is marked failed; the client's
// answer is aborted, and the booking freed.
func TestUpstreamCutMidStreamMarksFailed(t *testing.T) {
	ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseHeaders(w)
		sse(w, "first")
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close() // mid-chunk: the proxy's read fails
		}
	})
	env := newEnv(t, envOptions{workers: []string{ep}})
	resp, err := env.post(context.Background(), t, chatBody("", "crash"))
	require.NoError(t, err)
	_, err = io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Error(t, err, "the client must see the answer cut short")
	env.waitServed(t, 1)
	env.requireIdle(t, "")
	st := env.router.Stats()
	require.EqualValues(t, 1, st.Failed, "%+v", st)
	require.EqualValues(t, 1, st.MarkedFailed)
	require.EqualValues(t, 1, st.FirstBytes)
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

type panicBody struct{ v any }

func (b panicBody) Read([]byte) (int, error) { panic(b.v) }
func (panicBody) Close() error               { return nil }

// A panic anywhere in the proxy path (the transport, the response body) frees
// the booking and goes on to net/http, which aborts the answer.
func TestDoneOnPanicInProxyPath(t *testing.T) {
	for _, tc := range []struct {
		name string
		rt   roundTripFunc
	}{
		{"transport, ErrAbortHandler", func(*http.Request) (*http.Response, error) { panic(http.ErrAbortHandler) }},
		{"transport, a bug", func(*http.Request) (*http.Response, error) { panic("transport bug") }},
		{"body, a bug", func(r *http.Request) (*http.Response, error) {
			return &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"text/event-stream"}},
				Body: panicBody{"body bug"}, ContentLength: -1, Request: r}, nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := newEnv(t, envOptions{workers: []string{"127.0.0.1:9"}, router: httproute.Options{Transport: tc.rt}})
			resp, err := env.post(context.Background(), t, chatBody("", "boom"))
			if err == nil {
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			require.Error(t, err, "the answer must be aborted")
			env.waitServed(t, 1)
			env.requireIdle(t, "")
			require.EqualValues(t, 1, env.router.Stats().Aborted)
		})
	}
}

func TestBodyTooLarge(t *testing.T) {
	env := newEnv(t, envOptions{workers: []string{"127.0.0.1:9"}, router: httproute.Options{MaxBodyBytes: 64}})
	big := chatBody("", strings.Repeat("x", 100))
	for _, sized := range []bool{true, false} {
		var body io.Reader = strings.NewReader(big)
		if !sized {
			body = io.MultiReader(body) // no length known: sent chunked
		}
		req, err := http.NewRequest(http.MethodPost, env.gw.URL+"/v1/chat/completions", body)
		require.NoError(t, err)
		resp, err := env.client.Do(req)
		require.NoError(t, err)
		require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode, "sized %v", sized)
		e := readError(t, resp)
		require.Contains(t, e.Error.Message, "limit is 64")
	}
	resp, err := env.post(context.Background(), t, chatBody("", "")[:60]) // 60 bytes fit, but are no JSON object
	require.NoError(t, err)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	readError(t, resp)
	require.Zero(t, env.svc.Stats().Bookings)
	require.EqualValues(t, 3, env.router.Stats().Rejected)
}

// When the tokenizer fails (not the request's fault), the request is routed
// on load alone and served: counted, logged, settled like any other; the
// request's own faults are still refused.
func TestDegradedWithoutTokenizer(t *testing.T) {
	var calls atomic.Int64
	down := tokenizerFunc(func(_ context.Context, req tokenize.Request) (tokenize.Result, error) {
		calls.Add(1)
		if strings.Contains(string(req.Body), "bad") {
			return tokenize.Result{}, fmt.Errorf("%w: no messages", tokenize.ErrBadRequest)
		}
		return tokenize.Result{}, fmt.Errorf("%w: connection refused", tokenize.ErrUnavailable)
	})
	var logs logBuffer
	env := newEnv(t, envOptions{workers: []string{okUpstream(t)}, router: httproute.Options{Tokenizer: down, Logger: logs.logger()}})
	for range 3 {
		resp, err := env.post(context.Background(), t, chatBody("", "a prompt the tokenizer cannot see"))
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		_, _ = io.Copy(io.Discard, resp.Body)
		require.NoError(t, resp.Body.Close())
		env.waitServed(t, 1)
	}
	resp, err := env.post(context.Background(), t, chatBody("", "bad"))
	require.NoError(t, err)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	readError(t, resp)
	env.waitServed(t, 1)
	st := env.router.Stats()
	require.EqualValues(t, 3, st.Degraded)
	require.EqualValues(t, 3, st.Booked)
	require.EqualValues(t, 1, st.Rejected)
	require.EqualValues(t, 4, calls.Load())
	logs.mu.Lock()
	text := logs.buf.String()
	logs.mu.Unlock()
	require.Equal(t, 1, strings.Count(text, "tokenizer failed; routing on load alone"), "one line per 10 s:\n%s", text)
	env.requireIdle(t, "")
}

// Errors before the upstream are OpenAI error objects with the reference
// EPP's status mapping: the tokenizer's classes first, then selection's.
func TestErrorsBeforeUpstream(t *testing.T) {
	failWith := func(err error) tokenize.Tokenizer {
		return tokenizerFunc(func(context.Context, tokenize.Request) (tokenize.Result, error) { return tokenize.Result{}, err })
	}
	for _, tc := range []struct {
		name   string
		tok    tokenize.Tokenizer
		method string
		body   string
		status int
		typ    string
		msg    string // part of the client's message
	}{
		{"tokenizer bad request", failWith(fmt.Errorf("%w: no messages", tokenize.ErrBadRequest)), "", "", 400, "invalid_request_error", "no messages"},
		{"tokenizer unavailable", failWith(fmt.Errorf("%w: connection refused 10.1.2.3", tokenize.ErrUnavailable)), "", "", 503, "service_unavailable_error", "tokenizer"},
		{"tokenizer timeout", failWith(fmt.Errorf("%w: %w", tokenize.ErrTimeout, context.DeadlineExceeded)), "", "", 504, "upstream_error", "timed out"},
		{"tokenizer upstream", failWith(fmt.Errorf("%w: status 500", tokenize.ErrUpstream)), "", "", 502, "upstream_error", "tokenizer"},
		{"no worker of the model", nil, "", chatBody("other-model", "hi"), 503, "service_unavailable_error", "no worker is available for this model (unknown_model)"},
		{"not JSON", nil, "", "[1,2]", 400, "invalid_request_error", "not a JSON object"},
		{"model not a string", nil, "", `{"model":7}`, 400, "invalid_request_error", `"model" must be a string`},
		{"GET", nil, http.MethodGet, "", 405, "invalid_request_error", "GET"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := newEnv(t, envOptions{workers: []string{"127.0.0.1:9"}, router: httproute.Options{Tokenizer: tc.tok, NoDegrade: true}})
			body, method := tc.body, tc.method
			if body == "" {
				body = chatBody("", "hi")
			}
			if method == "" {
				method = http.MethodPost
			}
			req, err := http.NewRequest(method, env.gw.URL+"/v1/chat/completions", strings.NewReader(body))
			require.NoError(t, err)
			resp, err := env.client.Do(req)
			require.NoError(t, err)
			require.Equal(t, tc.status, resp.StatusCode)
			e := readError(t, resp)
			require.Equal(t, tc.typ, e.Error.Type)
			require.Contains(t, e.Error.Message, tc.msg)
			require.NotContains(t, e.Error.Message, "10.1.2.3")
			if tc.status == 405 {
				require.Equal(t, "POST", resp.Header.Get("Allow"))
			}
			require.Zero(t, env.svc.Stats().Bookings)
		})
	}
}

func TestHTTPStatus(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want int
	}{
		{nil, 200},
		{httproute.ErrBodyTooLarge, 413},
		{fmt.Errorf("x: %w", httproute.ErrBadRequest), 400},
		{httproute.ErrMethodNotAllowed, 405},
		{fmt.Errorf("%w: %w", tokenize.ErrCanceled, context.Canceled), 499},
		{fmt.Errorf("%w: x", tokenize.ErrClosed), 503},
		{fmt.Errorf("%w: x", selection.ErrOverloaded), 429},
		{fmt.Errorf("%w: x", selection.ErrBadRequest), 400},
		{context.Canceled, 499},
		{context.DeadlineExceeded, 504},
		{errors.New("other"), 500},
	} {
		require.Equal(t, tc.want, httproute.HTTPStatus(tc.err), "%v", tc.err)
	}
}

// A request in flight renews its booking's lease, so a long answer (here one
// that is not streamed: nothing arrives until its end) does not expire
// mid-flight; with renewal off it does.
func TestRenewKeepsLongRequestBooked(t *testing.T) {
	for _, renew := range []bool{true, false} {
		t.Run(fmt.Sprint("renew=", renew), func(t *testing.T) {
			arrived, release := make(chan struct{}), make(chan struct{})
			ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
				close(arrived)
				if wait(r, release) {
					_, _ = io.WriteString(w, `{"choices":[]}`)
				}
			})
			interval := 2 * time.Millisecond // of the wall clock; the lease runs on the service's fake clock
			if !renew {
				interval = -1
			}
			env := newEnv(t, envOptions{workers: []string{ep}, expiry: time.Minute,
				router: httproute.Options{RenewInterval: interval}})
			answer := make(chan string, 1)
			go func() {
				resp, err := env.post(context.Background(), t, chatBody("", "a long answer"))
				if err != nil {
					answer <- err.Error()
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				answer <- string(b)
			}()
			<-arrived
			// renewals waits for n more renewals than counted now: the first
			// may have read the clock before the caller moved it.
			renewals := func(n uint64) {
				want := env.router.Stats().Renewals + n
				tick := time.NewTicker(time.Millisecond)
				defer tick.Stop()
				deadline := time.Now().Add(testTimeout)
				for env.router.Stats().Renewals < want {
					require.False(t, time.Now().After(deadline), "no renewal")
					<-tick.C
				}
			}
			if renew {
				renewals(2)
				env.clock.Advance(50 * time.Second)
				renewals(2) // the lease now ends 110 s after the booking, or later
				env.clock.Advance(50 * time.Second)
				require.Zero(t, env.svc.Reservations().Expire())
				require.Equal(t, 1, env.load(t, "", "w0").ActiveRequests)
			} else {
				env.clock.Advance(100 * time.Second)
				require.Equal(t, 1, env.svc.Reservations().Expire(), "without renewal the lease passes mid-flight")
				require.Zero(t, env.router.Stats().Renewals)
			}
			close(release)
			require.Equal(t, `{"choices":[]}`, <-answer)
			env.waitServed(t, 1)
			env.requireIdle(t, "")
		})
	}
}

// Without Options.Model the body's model is the selection model; Prepare can
// map a vLLM adapter name to its base model; Options.Model overrides both.
func TestModelFromBodyAndPrepare(t *testing.T) {
	served := func(name string) string {
		return upstream(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, name) })
	}
	env := newEnv(t, envOptions{})
	for _, w := range []catalog.Worker{
		{ID: "a", Model: "m1", Endpoint: served("engine-a"), DPSize: 1},
		{ID: "b", Model: "m2", Endpoint: served("engine-b"), DPSize: 1},
	} {
		_, err := env.svc.Workers().Upsert(w)
		require.NoError(t, err)
	}
	var (
		mu       sync.Mutex
		tokModel string
		seen     httproute.RequestInfo
	)
	tok := tokenizerFunc(func(ctx context.Context, req tokenize.Request) (tokenize.Result, error) {
		mu.Lock()
		tokModel = req.Model
		mu.Unlock()
		return byteTokens(ctx, req)
	})
	// get sends body through a Router made with opts and returns the answer.
	get := func(opts httproute.Options, body string) (string, int) {
		t.Helper()
		opts.Service, opts.Tokenizer = httproute.Single(env.svc), tok
		r, err := httproute.New(opts)
		require.NoError(t, err)
		defer r.CloseIdleConnections()
		gw := httptest.NewServer(r)
		defer gw.Close()
		resp, err := env.client.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(b), resp.StatusCode
	}
	got, _ := get(httproute.Options{}, chatBody("m2", "hi"))
	require.Equal(t, "engine-b", got)
	mu.Lock()
	require.Empty(t, tokModel, "the tokenizer reads the body's model itself")
	mu.Unlock()
	got, _ = get(httproute.Options{Model: "m1"}, chatBody("m2", "hi"))
	require.Equal(t, "engine-a", got)
	mu.Lock()
	require.Equal(t, "m1", tokModel)
	mu.Unlock()

	prepare := func(r *http.Request, info httproute.RequestInfo, req *selection.Request) error {
		mu.Lock()
		seen = info
		mu.Unlock()
		if info.Model == "m2-adapter" {
			req.Model, req.LoRAName = "m2", info.Model
		}
		return nil
	}
	got, _ = get(httproute.Options{Prepare: prepare}, `{"model":"m2-adapter","prompt_cache_key":"conv-1","prompt":"x"}`)
	require.Equal(t, "engine-b", got)
	mu.Lock()
	require.Equal(t, httproute.RequestInfo{Model: "m2-adapter", SessionID: "conv-1"}, seen)
	mu.Unlock()
	reject := func(*http.Request, httproute.RequestInfo, *selection.Request) error {
		return fmt.Errorf("%w: adapter not allowed", selection.ErrBadRequest)
	}
	got, status := get(httproute.Options{Prepare: reject}, chatBody("m1", "hi"))
	require.Equal(t, http.StatusBadRequest, status)
	require.Contains(t, got, "adapter not allowed")
	require.Contains(t, got, `"invalid_request_error"`)

	st := env.svc.Stats()
	require.EqualValues(t, 3, st.Bookings)
	require.Equal(t, st.Bookings, st.Frees)
	for _, m := range []string{"m1", "m2"} {
		for _, l := range env.svc.Loads(m) {
			require.Zero(t, l.ActiveRequests, "%+v", l)
		}
	}
}

// Routing headers a client could forge never reach the worker; the session
// header does, and the worker sees the standard forwarding headers.
func TestUpstreamRequestHeaders(t *testing.T) {
	got := make(chan *http.Request, 1)
	var body string
	ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		body = string(b)
		got <- r
	})
	env := newEnv(t, envOptions{workers: []string{ep}})
	sent := chatBody("", "headers")
	resp, err := env.post(context.Background(), t, sent,
		"X-Gateway-Destination-Endpoint", "10.9.9.9:80", "X-Dynamo-Worker-Instance-Id", "evil",
		"X-Prefiller-Host-Port", "10.9.9.9:81", "Connection", "X-Hop", "X-Hop", "1", "X-Session-Id", "s-1")
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	r := <-got
	require.Equal(t, sent, body)
	require.EqualValues(t, len(sent), r.ContentLength)
	require.Equal(t, ep, r.Host)
	require.Equal(t, "/v1/chat/completions", r.URL.Path)
	for _, h := range []string{"X-Gateway-Destination-Endpoint", "X-Dynamo-Worker-Instance-Id", "X-Prefiller-Host-Port", "X-Hop"} {
		require.Empty(t, r.Header.Get(h), h)
	}
	require.Equal(t, "s-1", r.Header.Get("X-Session-Id"))
	require.Equal(t, "127.0.0.1", r.Header.Get("X-Forwarded-For"))
	env.requireIdle(t, "")
}

// Many concurrent requests, some cancelled by their client at random points
// and some failed by their worker: every booking is settled exactly once, and
// the loads return to zero.
func TestConcurrentMixedRequestsSettleEverything(t *testing.T) {
	handler := func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.Header.Get("X-Fault"), "500") {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		sseHeaders(w)
		for i := range 4 {
			sse(w, fmt.Sprint(i))
		}
	}
	env := newEnv(t, envOptions{workers: []string{upstream(t, handler), upstream(t, handler)}})
	const n, inflight = 300, 8
	rng := rand.New(rand.NewPCG(7, 7))
	type plan struct {
		cancelAfter int // lines read before cancelling; -1 reads to the end
		fault       bool
	}
	plans := make([]plan, n)
	for i := range plans {
		plans[i] = plan{cancelAfter: -1}
		switch x := rng.IntN(10); {
		case x < 3:
			plans[i].cancelAfter = rng.IntN(4)
		case x == 3:
			plans[i].fault = true
		}
	}
	var wg sync.WaitGroup
	work := make(chan int)
	errs := make(chan error, n)
	for range inflight {
		wg.Go(func() {
			for i := range work {
				p := plans[i]
				ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
				hdr := []string{"X-Fault", ""}
				if p.fault {
					hdr[1] = "500"
				}
				resp, err := env.post(ctx, t, chatBody("", fmt.Sprintf("request %d of a shared story", i%5)), hdr...)
				if err != nil {
					errs <- err
					cancel()
					continue
				}
				br := bufio.NewReader(resp.Body)
				for k := 0; p.cancelAfter < 0 || k < p.cancelAfter; k++ {
					if _, err := br.ReadString('\n'); err != nil {
						break
					}
				}
				cancel()
				resp.Body.Close()
			}
		})
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	env.waitServed(t, n)
	env.requireIdle(t, "")
	st := env.router.Stats()
	require.EqualValues(t, n, st.Booked, "%+v", st)
	require.Positive(t, st.Canceled+st.Ended)
	require.Equal(t, st.FailureStatuses, st.MarkedFailed)
	t.Logf("%+v", st)
}

// A session's requests (x-session-id) go to the worker its first one got,
// while requests without one spread; a session header over
// selection.MaxSessionIDLen bytes is answered 400 and books nothing.
func TestSessionHeaderPinsWorker(t *testing.T) {
	var mu sync.Mutex
	served := map[string]int{}
	var eps []string
	for i := range 3 {
		name := fmt.Sprint("w", i)
		eps = append(eps, upstream(t, func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			served[name]++
			mu.Unlock()
			_, _ = io.WriteString(w, "{}")
		}))
	}
	env := newEnv(t, envOptions{workers: eps})
	send := func(prompt string, hdr ...string) {
		t.Helper()
		resp, err := env.post(context.Background(), t, chatBody("", prompt), hdr...)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	for i := range 12 {
		send(fmt.Sprintf("turn %d of a conversation about topic %d", i, i*7), httproute.HeaderSessionID, "conv-1")
	}
	mu.Lock()
	require.Len(t, served, 1, "one session, one worker: %v", served)
	clear(served)
	mu.Unlock()
	for i := range 12 {
		send(fmt.Sprintf("unrelated request %d about %d", i, i*13))
	}
	mu.Lock()
	require.Greater(t, len(served), 1, "requests without a session spread: %v", served)
	mu.Unlock()
	require.EqualValues(t, 11, env.svc.Stats().SessionHits)

	resp, err := env.post(context.Background(), t, chatBody("", "hi"), httproute.HeaderSessionID, strings.Repeat("s", selection.MaxSessionIDLen+1))
	require.NoError(t, err)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	require.Contains(t, readError(t, resp).Error.Message, "longer than 256")
	env.requireIdle(t, "")
}

// A stream that keeps sending outlives twice the lease; its data lines grow
// the booking one block per block size of tokens; once it falls silent it is
// no longer renewed and expires at its lease.
func TestStreamRenewsOnProgressGrowsAndExpiresWhenStalled(t *testing.T) {
	next, end := make(chan struct{}), make(chan struct{})
	ep := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseHeaders(w)
		for {
			select {
			case <-next:
				sse(w, "tok")
			case <-end:
				sse(w, "[DONE]")
				return
			case <-r.Context().Done():
				return
			}
		}
	})
	env := newEnv(t, envOptions{workers: []string{ep}, expiry: time.Minute,
		router: httproute.Options{RenewInterval: 2 * time.Millisecond, OutputGrowth: true}})
	resp, err := env.post(context.Background(), t, chatBody("", "write a long story"))
	require.NoError(t, err)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	event := func() {
		t.Helper()
		next <- struct{}{}
		line, err := br.ReadString('\n')
		require.NoError(t, err)
		require.Equal(t, "data: tok\n", line)
		_, _ = br.ReadString('\n')
	}
	// waitStat waits for two more counts of f: the second tick began after
	// the first ended, so after whatever happened before the call.
	waitStat := func(f func(httproute.Stats) uint64) {
		t.Helper()
		want := f(env.router.Stats()) + 2
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		deadline := time.Now().Add(testTimeout)
		for f(env.router.Stats()) < want {
			require.False(t, time.Now().After(deadline), "counter never moved")
			<-tick.C
		}
	}
	stalls := func(s httproute.Stats) uint64 { return s.Stalls }

	event()
	blocks := env.load(t, "", "w0").ActiveBlocks
	for range 4 { // 160 s of the service's clock: over twice the lease
		event()
		waitStat(stalls) // the event's progress has been renewed, at the clock's now
		env.clock.Advance(40 * time.Second)
		require.Zero(t, env.svc.Reservations().Expire(), "a stream that sends was expired")
	}
	for range 3 { // 8 tokens in all, two blocks of 4
		event()
	}
	require.Equal(t, blocks+2, env.load(t, "", "w0").ActiveBlocks, "the output grows the booking")

	waitStat(stalls) // silent now: ticks renew nothing
	renewed := env.router.Stats().Renewals
	waitStat(stalls)
	require.Equal(t, renewed, env.router.Stats().Renewals, "a silent stream was renewed")
	env.clock.Advance(61 * time.Second)
	require.Equal(t, 1, env.svc.Reservations().Expire(), "a stalled stream expires at its lease")
	close(end)
	_, _ = io.ReadAll(br)
	resp.Body.Close()
	env.waitServed(t, 1)
	env.requireIdle(t, "")
}
