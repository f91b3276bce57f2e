package extproc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

	"github.com/kvselect/kvselect/examples/internal/extproctest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// Sentinels of the fake picker, mapped by testStatus like the EPP's router
// maps selection, roles and tokenize errors.
var (
	errNoEndpoints      = errors.New("fake: no endpoints")
	errNoMatch          = errors.New("fake: no subset member eligible")
	errOverloaded       = errors.New("fake: overloaded")
	errBadBody          = errors.New("fake: malformed body")
	errTokenizerFailed  = errors.New("fake: tokenizer upstream 5xx")
	errTokenizerTimeout = errors.New("fake: tokenizer timeout")
)

func testStatus(err error) int {
	switch {
	case errors.Is(err, errNoEndpoints), errors.Is(err, errNoMatch):
		return http.StatusServiceUnavailable
	case errors.Is(err, errOverloaded):
		return http.StatusTooManyRequests
	case errors.Is(err, errBadBody):
		return http.StatusBadRequest
	case errors.Is(err, errTokenizerFailed):
		return http.StatusBadGateway
	case errors.Is(err, errTokenizerTimeout):
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// fakeSettler counts the calls it gets (the server promises exactly one Done
// and at most one FirstByte, so raw counts are checked).
type fakeSettler struct {
	first, done atomic.Int32
}

func (s *fakeSettler) FirstByte() { s.first.Add(1) }
func (s *fakeSettler) Done()      { s.done.Add(1) }

// fakePicker records calls and hands out a fakeSettler per successful pick.
type fakePicker struct {
	decide func(ctx context.Context, req PickRequest) (Pick, error)

	mu       sync.Mutex
	calls    []PickRequest
	settlers []*fakeSettler
}

// routeTo returns a picker that always picks dest.
func routeTo(dest string) *fakePicker {
	return &fakePicker{decide: func(context.Context, PickRequest) (Pick, error) { return Pick{Destination: dest}, nil }}
}

func failWith(err error) *fakePicker {
	return &fakePicker{decide: func(context.Context, PickRequest) (Pick, error) { return Pick{}, err }}
}

func (p *fakePicker) Pick(ctx context.Context, req PickRequest) (Pick, error) {
	body := append([]byte(nil), req.Body...)
	if req.Body == nil {
		body = nil
	}
	rec := req
	rec.Body = body
	p.mu.Lock()
	p.calls = append(p.calls, rec)
	p.mu.Unlock()
	pk, err := p.decide(ctx, req)
	if err != nil {
		return pk, err
	}
	s := &fakeSettler{}
	pk.Settle = s
	p.mu.Lock()
	p.settlers = append(p.settlers, s)
	p.mu.Unlock()
	return pk, nil
}

func (p *fakePicker) Calls() []PickRequest {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]PickRequest(nil), p.calls...)
}

func (p *fakePicker) Settlers() []*fakeSettler {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*fakeSettler(nil), p.settlers...)
}

// fakeRecorder counts what the server reports.
type fakeRecorder struct {
	mu          sync.Mutex
	outcomes    map[int]int
	picks       int
	mismatches  int
	maxInflight int
	inflight    int
}

func newFakeRecorder() *fakeRecorder { return &fakeRecorder{outcomes: map[int]int{}} }

func (r *fakeRecorder) Outcome(s int) {
	r.mu.Lock()
	r.outcomes[s]++
	r.mu.Unlock()
}

func (r *fakeRecorder) PickLatency(time.Duration) {
	r.mu.Lock()
	r.picks++
	r.mu.Unlock()
}

func (r *fakeRecorder) ServedMismatch() {
	r.mu.Lock()
	r.mismatches++
	r.mu.Unlock()
}

func (r *fakeRecorder) Inflight(n int) {
	r.mu.Lock()
	r.inflight = n
	r.maxInflight = max(r.maxInflight, n)
	r.mu.Unlock()
}

type recStats struct {
	outcomes    map[int]int
	picks       int
	mismatches  int
	maxInflight int
	inflight    int
}

func (r *fakeRecorder) snapshot() recStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := recStats{outcomes: map[int]int{}, picks: r.picks, mismatches: r.mismatches,
		maxInflight: r.maxInflight, inflight: r.inflight}
	for k, v := range r.outcomes {
		out.outcomes[k] = v
	}
	return out
}

// harness is an ext_proc server on an in-memory gRPC connection plus a driver.
type harness struct {
	srv    *Server
	client *extproctest.Client
	conn   *grpc.ClientConn
}

// startGRPC serves srv on lis until the test ends.
func startGRPC(t testing.TB, srv *Server, lis net.Listener) {
	t.Helper()
	g := grpc.NewServer(srv.GRPCServerOptions()...)
	srv.Register(g)
	srv.RegisterHealth(g)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = g.Serve(lis)
	}()
	t.Cleanup(func() {
		g.Stop()
		<-served
	})
}

func newHarness(t testing.TB, opts Options) *harness {
	t.Helper()
	if opts.Status == nil {
		opts.Status = testStatus
	}
	srv, err := NewServer(opts)
	require.NoError(t, err)
	lis := bufconn.Listen(1 << 20)
	startGRPC(t, srv, lis)
	conn, err := grpc.NewClient("passthrough:///epp",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20), grpc.MaxCallSendMsgSize(16<<20)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	client, err := extproctest.NewClient(conn, extproctest.Options{})
	require.NoError(t, err)
	return &harness{srv: srv, client: client, conn: conn}
}

// backend is an upstream model server on 127.0.0.1:0 that records the
// headers it received and answers with a body sent in several flushed chunks.
type backend struct {
	*httptest.Server
	name string

	mu      sync.Mutex
	headers []http.Header
	bodies  [][]byte
}

func newBackend(t testing.TB, name string) *backend {
	t.Helper()
	b := &backend{name: name}
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		b.mu.Lock()
		b.headers = append(b.headers, r.Header.Clone())
		b.bodies = append(b.bodies, body)
		b.mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		fl, _ := w.(http.Flusher)
		for i := range 3 {
			if _, err := fmt.Fprintf(w, "data: %s chunk %d\n\n", name, i); err != nil {
				return
			}
			if fl != nil {
				fl.Flush()
			}
		}
	}))
	t.Cleanup(b.Close)
	return b
}

// addr is the backend's host:port.
func (b *backend) addr() string { return b.Listener.Addr().String() }

func (b *backend) lastHeaders() http.Header {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.headers) == 0 {
		return nil
	}
	return b.headers[len(b.headers)-1]
}

func (b *backend) requests() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.headers)
}

func expectedBody(name string) string {
	return fmt.Sprintf("data: %s chunk 0\n\ndata: %s chunk 1\n\ndata: %s chunk 2\n\n", name, name, name)
}

// forwardClient is an HTTP client for forwarding to backends; its idle
// connections are closed at the end of the test.
func forwardClient(t testing.TB) *http.Client {
	t.Helper()
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}
