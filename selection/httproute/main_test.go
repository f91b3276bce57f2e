package httproute_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/clocktest"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/selection/httproute"
	"github.com/kvselect/kvselect/tokenize"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testTimeout bounds every exchange of a test, so a missing flush or settle
// fails the test instead of hanging it.
const testTimeout = 10 * time.Second

// tokenizerFunc adapts a function to tokenize.Tokenizer.
type tokenizerFunc func(ctx context.Context, req tokenize.Request) (tokenize.Result, error)

func (f tokenizerFunc) Tokenize(ctx context.Context, req tokenize.Request) (tokenize.Result, error) {
	return f(ctx, req)
}

// byteTokens is a tokenizer whose ids are the body's bytes: bodies that share
// leading bytes share leading blocks.
var byteTokens = tokenizerFunc(func(_ context.Context, req tokenize.Request) (tokenize.Result, error) {
	toks := make([]uint32, len(req.Body))
	for i, c := range req.Body {
		toks[i] = uint32(c)
	}
	return tokenize.Result{Tokens: toks, PromptCount: 1}, nil
})

// chatBody is a small chat request; its length is the prompt's token count
// with byteTokens.
func chatBody(model, content string) string {
	return fmt.Sprintf(`{"model":%q,"stream":true,"messages":[{"role":"user","content":%q}]}`, model, content)
}

// testEnv is a selection service with one worker per upstream, a Router in
// front of them, a gateway server for the Router and a client.
type testEnv struct {
	svc    *selection.SelectionService
	clock  *clocktest.Clock
	router *httproute.Router
	gw     *httptest.Server
	// served receives one value each time the gateway's handler returns
	// (normally or panicking): the request's booking is settled by then.
	served chan struct{}
	client *http.Client
}

type envOptions struct {
	model   string // of every worker; "" is the default model
	router  httproute.Options
	expiry  time.Duration
	workers []string // endpoints, one worker each (ids w0, w1, ...)
	classes []selection.Class
}

func newEnv(t *testing.T, o envOptions) *testEnv {
	t.Helper()
	env := &testEnv{clock: clocktest.New(time.Unix(1_000_000, 0)), served: make(chan struct{}, 4096)}
	cfg := selection.DefaultConfig(4)
	cfg.ActiveRequestExpiry = o.expiry
	cfg.Classes = o.classes
	svc, err := selection.NewSelectionServiceBuilder(cfg).ExternalEvents().Clock(env.clock.Now).SweepInterval(-1).
		Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	env.svc = svc
	for i, ep := range o.workers {
		rec, err := svc.Workers().Upsert(catalog.Worker{ID: fmt.Sprintf("w%d", i), Model: o.model, Endpoint: ep, DPSize: 1})
		require.NoError(t, err)
		require.Equal(t, catalog.Schedulable, rec.Lifecycle, "%+v", rec)
	}
	opts := o.router
	if opts.Service == nil {
		opts.Service = httproute.Single(svc)
	}
	if opts.Tokenizer == nil {
		opts.Tokenizer = byteTokens
	}
	env.router, err = httproute.New(opts)
	require.NoError(t, err)
	t.Cleanup(env.router.CloseIdleConnections)
	env.gw = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() { env.served <- struct{}{} }()
		env.router.ServeHTTP(w, r)
	}))
	env.gw.Config.ErrorLog = log.New(io.Discard, "", 0) // panics are part of the tests
	env.gw.Start()
	t.Cleanup(env.gw.Close)
	env.client = &http.Client{Transport: &http.Transport{}}
	t.Cleanup(env.client.CloseIdleConnections)
	return env
}

// upstream starts an engine stand-in and returns its host:port. Like an
// engine, it reads the whole request body before h runs (the server notices
// a closed connection, and cancels the request's context, only then).
func upstream(t *testing.T, h http.HandlerFunc) string {
	t.Helper()
	s := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		h(w, r)
	}))
	s.Config.ErrorLog = log.New(io.Discard, "", 0)
	s.Start()
	t.Cleanup(s.Close)
	return s.Listener.Addr().String()
}

// post sends a chat request through the gateway.
func (env *testEnv) post(ctx context.Context, t *testing.T, body string, hdr ...string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, env.gw.URL+"/v1/chat/completions", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return env.client.Do(req)
}

// waitServed waits until n more gateway handlers have returned.
func (env *testEnv) waitServed(t *testing.T, n int) {
	t.Helper()
	timer := time.NewTimer(testTimeout)
	defer timer.Stop()
	for range n {
		select {
		case <-env.served:
		case <-timer.C:
			require.FailNow(t, "the gateway's handler did not return")
		}
	}
}

// load returns worker id's load.
func (env *testEnv) load(t *testing.T, model, id string) selection.WorkerLoad {
	t.Helper()
	for _, l := range env.svc.Loads(model) {
		if l.WorkerID == id {
			return l
		}
	}
	require.FailNow(t, "no such worker", id)
	return selection.WorkerLoad{}
}

// requireIdle checks that no load and no booking is left, that the service's
// counters add up, and that the Router settled every booking it made.
func (env *testEnv) requireIdle(t *testing.T, model string) {
	t.Helper()
	for _, l := range env.svc.Loads(model) {
		require.Zero(t, l.ActiveRequests, "%+v", l)
		require.Zero(t, l.ActiveBlocks, "%+v", l)
		require.Zero(t, l.ActivePrefillTokens, "%+v", l)
	}
	st := env.svc.Stats()
	require.Zero(t, st.Ledger.Active, "%+v", st.Ledger)
	require.Equal(t, st.Bookings, st.Frees+st.Expired+st.Dropped, "%+v", st)
	rs := env.router.Stats()
	require.Equal(t, rs.Booked, rs.Done, "%+v", rs)
	require.Equal(t, rs.Done, rs.Ended+rs.Canceled+rs.Failed+rs.Aborted, "%+v", rs)
	require.Equal(t, st.Bookings, rs.Booked, "service bookings and Router bookings")
}

// apiError is the OpenAI error object the Router answers with.
type apiError struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	} `json:"error"`
}

// readError reads and closes an error answer.
func readError(t *testing.T, resp *http.Response) apiError {
	t.Helper()
	defer resp.Body.Close()
	require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	var e apiError
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&e))
	require.Equal(t, resp.StatusCode, e.Error.Code)
	require.NotEmpty(t, e.Error.Message)
	require.NotEmpty(t, e.Error.Type)
	return e
}

// sse writes one server-sent event and flushes it.
func sse(w http.ResponseWriter, data string) {
	_, _ = fmt.Fprintf(w, "data: %s\n\n", data)
	_ = http.NewResponseController(w).Flush()
}

func sseHeaders(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	_ = http.NewResponseController(w).Flush()
}

// wait blocks until ch is closed or the request ends; false for the latter.
func wait(r *http.Request, ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	case <-r.Context().Done():
		return false
	}
}
