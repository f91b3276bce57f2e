package sidecar_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testTimeout bounds every network wait; pollInterval is the period of
// require.Eventually checks of engine-side counters.
const (
	testTimeout  = 10 * time.Second
	pollInterval = 2 * time.Millisecond
)

// seen is one request an engine received.
type seen struct {
	path   string
	header http.Header
}

// headerLog records the requests an engine's servers receive.
type headerLog struct {
	mu  sync.Mutex
	got []seen
}

func (l *headerLog) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l.mu.Lock()
		l.got = append(l.got, seen{path: r.URL.Path, header: r.Header.Clone()})
		l.mu.Unlock()
		h.ServeHTTP(w, r)
	})
}

func (l *headerLog) all() []seen {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]seen(nil), l.got...)
}

// engine is a fake engine on a real loopback socket (and, in SGLang prefill
// mode, its bootstrap server on another).
type engine struct {
	e             *fakeengine.Engine
	log           *headerLog
	addr          string // host:port of the OpenAI API
	bootstrapPort int
}

func startEngine(t *testing.T, o fakeengine.Options) *engine {
	t.Helper()
	if o.KVHoldTimeout == 0 {
		o.KVHoldTimeout = testTimeout
	}
	if o.KVWaitTimeout == 0 {
		o.KVWaitTimeout = testTimeout
	}
	e, err := fakeengine.New(o)
	require.NoError(t, err)
	log := &headerLog{}
	srv := httptest.NewServer(log.wrap(e.Handler()))
	t.Cleanup(func() {
		srv.Close()
		require.NoError(t, e.Close())
	})
	eng := &engine{e: e, log: log, addr: srv.Listener.Addr().String()}
	if o.PDRole == fakeengine.PDRolePrefill {
		bs := httptest.NewServer(log.wrap(e.BootstrapHandler()))
		t.Cleanup(bs.Close)
		eng.bootstrapPort = port(t, bs.Listener.Addr().String())
	}
	return eng
}

func port(t *testing.T, hostPort string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(hostPort)
	require.NoError(t, err)
	n, err := strconv.Atoi(p)
	require.NoError(t, err)
	return n
}

// rig is a sidecar on a loopback socket in front of a decode engine, with two
// prefill engines; hints point at the second.
type rig struct {
	sc       *sidecar.Sidecar
	base     string
	client   *http.Client
	prefills [2]*engine
	decode   *engine
}

func (r *rig) hint() string { return r.prefills[1].addr }

func newRig(t *testing.T, proto sidecar.Protocol, so sidecar.Options, po, do fakeengine.Options) *rig {
	t.Helper()
	r := &rig{}
	for i := range r.prefills {
		o := po
		o.PDRole, o.EngineID = fakeengine.PDRolePrefill, "prefill-"+strconv.Itoa(i)
		r.prefills[i] = startEngine(t, o)
	}
	do.PDRole, do.EngineID = fakeengine.PDRoleDecode, "decode"
	r.decode = startEngine(t, do)
	so.Protocol = proto
	so.DecodeURL = "http://" + r.decode.addr
	if so.SGLangBootstrapPort == 0 {
		so.SGLangBootstrapPort = r.prefills[1].bootstrapPort
	}
	sc, err := sidecar.New(so)
	require.NoError(t, err)
	r.sc = sc
	front := httptest.NewServer(sc)
	tr := &http.Transport{Proxy: nil, DisableCompression: true}
	r.base, r.client = front.URL, &http.Client{Transport: tr, Timeout: testTimeout}
	t.Cleanup(func() {
		front.Close()
		sc.Close()
		tr.CloseIdleConnections()
	})
	return r
}

// newRequest builds a POST of body with headers.
func (r *rig) newRequest(t *testing.T, ctx context.Context, path, body string, headers http.Header) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.base+path, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for k, vv := range headers {
		for _, v := range vv {
			req.Header.Add(k, v)
		}
	}
	return req
}

// post sends body to the sidecar and returns the answer with its whole body.
func (r *rig) post(t *testing.T, path, body string, headers http.Header) (*http.Response, []byte) {
	t.Helper()
	resp, err := r.client.Do(r.newRequest(t, context.Background(), path, body, headers))
	require.NoError(t, err)
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, data
}

// hinted is a header set with the hint.
func hinted(hint string) http.Header {
	h := http.Header{}
	h.Set(sidecar.HeaderPrefiller, hint)
	return h
}

// messages of the chat requests; prompt of the completions requests. Both
// span several 16-token blocks.
var (
	messages = []fakeengine.Message{
		{Role: "system", Content: "You are a careful assistant. Answer briefly, cite sources, never invent facts, and say so when unsure."},
		{Role: "user", Content: "Which three rivers are the longest in Europe, and how long is each one?"},
	}
	prompt = "Summarise the history of the printing press in Europe, from movable type to the rotary press, in four short paragraphs."
)

// request returns the path, body and prompt length of a chat or completions
// request.
func request(t *testing.T, chat, stream bool, extra map[string]any) (string, string, int) {
	t.Helper()
	m := map[string]any{"model": fakeengine.DefaultModel, "max_tokens": 5}
	path, n := "/v1/completions", len(fakeengine.CompletionTokens(prompt))
	if chat {
		var msgs []map[string]string
		for _, msg := range messages {
			msgs = append(msgs, map[string]string{"role": msg.Role, "content": msg.Content})
		}
		m["messages"], path, n = msgs, "/v1/chat/completions", len(fakeengine.ApplyChatTemplate(messages))
	} else {
		m["prompt"] = prompt
	}
	if stream {
		m["stream"], m["stream_options"] = true, map[string]any{"include_usage": true}
	}
	for k, v := range extra {
		m[k] = v
	}
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return path, string(b), n
}

// sseEvents returns the data of each event of an SSE body.
func sseEvents(t *testing.T, body []byte) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(strings.NewReader(string(body)))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, v)
		}
	}
	require.NoError(t, sc.Err())
	return out
}

// errorCode returns error.code of an OpenAI error answer.
func errorCode(t *testing.T, data []byte) string {
	t.Helper()
	var e struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    string `json:"code"`
		} `json:"error"`
	}
	require.NoError(t, json.Unmarshal(data, &e), "%s", data)
	require.NotEmpty(t, e.Error.Message)
	require.NotEmpty(t, e.Error.Type)
	return e.Error.Code
}

// orchestration are headers the gateway or EPP sets, which no engine may get.
var orchestration = map[string]string{
	"X-Gateway-Destination-Endpoint":        "10.9.9.9:8000",
	"X-Gateway-Destination-Endpoint-Served": "10.9.9.9:8000",
	"X-Gateway-Inference-Objective":         "premium",
	"X-Kvselect-Trace":                      "secret",
	sidecar.HeaderSignature:                 "v1.1.AAAAAAAAAAA.AAAA",
}

// requireNoOrchestration fails when any engine received an orchestration
// header, and checks the client's own headers reached every completion leg.
func (r *rig) requireNoOrchestration(t *testing.T) {
	t.Helper()
	legs := 0
	for _, eng := range []*engine{r.prefills[0], r.prefills[1], r.decode} {
		for _, s := range eng.log.all() {
			for name := range s.header {
				n := strings.ToLower(name)
				require.False(t, n == sidecar.HeaderPrefiller || strings.HasPrefix(n, "x-kvselect-") ||
					strings.HasPrefix(n, "x-gateway-"), "%s reached %s", name, s.path)
			}
			if strings.HasPrefix(s.path, "/v1/") {
				legs++
				require.Equal(t, "req-42", s.header.Get("X-Request-Id"), "the client's own headers reach %s", s.path)
			}
		}
	}
	require.Positive(t, legs)
}

// withOrchestration returns the hint plus every orchestration header and the
// client's own X-Request-Id.
func withOrchestration(hint string) http.Header {
	h := hinted(hint)
	for k, v := range orchestration {
		h.Set(k, v)
	}
	h.Set("X-Request-Id", "req-42")
	return h
}
