package tokenize_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/tokenize"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// seen is one request a fake backend received.
type seen struct {
	Method, Path string
	Header       http.Header
	Body         []byte
}

// backend is an httptest server on 127.0.0.1 that records every request and
// answers with handle.
type backend struct {
	*httptest.Server
	calls atomic.Int64
	mu    sync.Mutex
	reqs  []seen
}

func newBackend(t *testing.T, handle http.HandlerFunc) *backend {
	t.Helper()
	b := &backend{}
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		b.calls.Add(1)
		b.mu.Lock()
		b.reqs = append(b.reqs, seen{Method: r.Method, Path: r.URL.Path, Header: r.Header.Clone(), Body: body})
		b.mu.Unlock()
		handle(w, r)
	}))
	t.Cleanup(b.Close)
	return b
}

func (b *backend) last(t *testing.T) seen {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	require.NotEmpty(t, b.reqs, "backend received no request")
	return b.reqs[len(b.reqs)-1]
}

// reply writes a fixed status and body.
func reply(status int, body string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, body)
	}
}

func newClient(t *testing.T, opts tokenize.Options) *tokenize.Client {
	t.Helper()
	c, err := tokenize.New(opts)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

// renderAnswer is a vLLM GenerateRequest with the given ids.
func renderAnswer(ids []uint32) string {
	b, _ := json.Marshal(map[string]any{
		"request_id":      "chatcmpl-1",
		"token_ids":       ids,
		"features":        nil,
		"sampling_params": map[string]any{"max_tokens": 16, "temperature": 0.0},
		"model":           "m",
		"stream":          false,
		"priority":        0,
	})
	return string(b)
}

func seq(n int, start uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = start + uint32(i)
	}
	return out
}

// chatBody is a chat completions body whose content is s.
func chatBody(s string) []byte {
	return []byte(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}],"max_tokens":16}`, s))
}

func newTestServer(h http.Handler) *httptest.Server { return httptest.NewServer(h) }

// closedURL returns a loopback URL on which nothing listens.
func closedURL(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.NotFoundHandler())
	u := srv.URL
	srv.Close()
	return u
}

func contains(t *testing.T, err error, parts ...string) {
	t.Helper()
	for _, p := range parts {
		require.True(t, strings.Contains(err.Error(), p), "error %q lacks %q", err, p)
	}
}
