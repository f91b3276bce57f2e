package customepp

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// TestMain fails the package when a test leaves a goroutine behind (the fake
// engines' ZMQ library leaves one by design).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
}

// The custom EPP's policy: the seams it sets on its service.

// tenantKey carries, in a request's context, the tenant its x-tenant header
// named: how values the EPP reads from headers reach the seams.
type tenantKey struct{}

// notCordoned keeps the workers an operator has not cordoned.
var notCordoned = selection.FilterFunc(func(_ context.Context, _ *selection.Request, c *selection.Scored) bool {
	return c.Labels["example.com/cordoned"] != "true"
})

// gpuPrice makes an A10 costlier than an H100, in the cost's own unit.
var gpuPrice = selection.CostTermFunc(func(_ context.Context, _ *selection.Request, c *selection.Scored) float64 {
	if c.Labels["example.com/gpu"] != "a10" {
		return 0
	}
	if c.Predicted {
		return 0.5 // seconds
	}
	return 64 // blocks
})

// byTenant admits the tenants it knows, the interactive one in a higher
// tier of the admission queue, and refuses the others.
var byTenant = selection.ClassifierFunc(func(ctx context.Context, req *selection.Request) selection.Admission {
	switch ctx.Value(tenantKey{}) {
	case "interactive":
		return selection.Admission{Priority: selection.Priority{Tier: 1}}
	case "batch":
		return selection.Admission{Priority: req.Priority}
	}
	return selection.Admission{Refuse: "unknown_tenant"}
})

// customEPP is the custom Endpoint Picker: its service and the ext_proc
// server around its Picker.
type customEPP struct {
	svc *selection.SelectionService
	srv *extproc.Server
}

// newCustomEPP builds the EPP over the workers of a workers file; without
// gpu it leaves the cost term out (the control).
func newCustomEPP(workersFile []byte, gpu bool) (*customEPP, error) {
	b := selection.NewSelectionServiceBuilder(selection.DefaultConfig(16)).
		ExternalEvents(). // no KV events: a load-only policy, enough to show the seams
		Rand(rand.NewPCG(11, 11)).
		Filter("cordoned", notCordoned).
		Classifier(byTenant)
	if gpu {
		b.CostTerm("gpu", gpuPrice)
	}
	svc, err := b.Build(context.Background())
	if err != nil {
		return nil, err
	}
	ws, err := discovery.ParseWorkers(workersFile, discovery.Defaults{Model: "fake-model", BlockSize: 16})
	if err == nil {
		for _, w := range ws {
			if _, err = svc.Workers().Upsert(w); err != nil {
				break
			}
		}
	}
	e := &customEPP{svc: svc}
	if err == nil {
		e.srv, err = extproc.NewServer(extproc.Options{
			Picker: extproc.PickerFunc(e.pick), Status: selection.HTTPStatus, Reason: selection.RefusalReason,
		})
	}
	if err != nil {
		_ = svc.Close()
		return nil, err
	}
	e.srv.SetReady(true)
	return e, nil
}

// pick books the request on the service and hands the booking to the
// server, which settles it as the response passes.
func (e *customEPP) pick(ctx context.Context, req extproc.PickRequest) (extproc.Pick, error) {
	ctx = context.WithValue(ctx, tenantKey{}, req.Headers["x-tenant"])
	b, err := e.svc.Book(ctx, selection.Request{Model: "fake-model", ISL: tokenize.EstimateTokens(req.Body)})
	if err != nil {
		return extproc.Pick{}, err
	}
	return extproc.Pick{Destination: b.Endpoint, Settle: settler{b}}, nil
}

// settler settles a booking as the ext_proc server reports the response.
type settler struct{ b *selection.Booking }

func (s settler) FirstByte() { _ = s.b.PrefillComplete() }
func (s settler) Done()      { _ = s.b.Done() }

// rig is the EPP served on loopback, the fake engines it routes to, and an
// Envoy.
type rig struct {
	epp     *customEPP
	engines map[string]*fakeengine.Engine // by worker id
	envoy   *extproctest.Client
	httpc   *http.Client
}

// newRig starts three fake engines: h100-a (an H100), a10-b (an A10) and
// h100-c (an H100, cordoned), and the custom EPP over them.
func newRig(t *testing.T, gpu bool) *rig {
	t.Helper()
	r := &rig{engines: map[string]*fakeengine.Engine{}}
	var file strings.Builder
	file.WriteString("workers:\n")
	for _, w := range []struct{ id, gpu, cordoned string }{{"h100-a", "h100", "false"}, {"a10-b", "a10", "false"}, {"h100-c", "h100", "true"}} {
		eng, err := fakeengine.New(fakeengine.Options{BlockSize: 16, EnableHTTP: true, Model: "fake-model"})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = eng.Start(ctx)
		cancel()
		require.NoError(t, err)
		t.Cleanup(func() { _ = eng.Close() })
		r.engines[w.id] = eng
		fmt.Fprintf(&file, "  - id: %s\n    endpoint: %q\n    labels: {example.com/gpu: %s, example.com/cordoned: %q}\n", w.id, eng.HTTPEndpoint(), w.gpu, w.cordoned)
	}
	var err error
	r.epp, err = newCustomEPP([]byte(file.String()), gpu)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.epp.svc.Close() })

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(r.epp.srv.GRPCServerOptions()...)
	r.epp.srv.Register(gs)
	served := make(chan struct{})
	go func() { defer close(served); _ = gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-served })
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	r.envoy, err = extproctest.NewClient(conn, extproctest.Options{})
	require.NoError(t, err)
	r.httpc = &http.Client{Timeout: 10 * time.Second}
	t.Cleanup(r.httpc.CloseIdleConnections)
	return r
}

// chat sends one chat request through Envoy to the engine the EPP picks.
func (r *rig) chat(t *testing.T, tenant string) extproctest.Response {
	t.Helper()
	h := http.Header{"Content-Type": {"application/json"}}
	if tenant != "" {
		h.Set("X-Tenant", tenant)
	}
	body := `{"model":"fake-model","max_tokens":4,"messages":[{"role":"user","content":"which worker serves me?"}]}`
	resp, err := r.envoy.Roundtrip(context.Background(), extproctest.HTTPRequest{Path: "/v1/chat/completions", Body: []byte(body), Headers: h},
		extproctest.HTTPForward(r.httpc))
	require.NoError(t, err)
	return resp
}

// served returns how many completion requests each engine answered.
func (r *rig) served() map[string]uint64 {
	out := map[string]uint64{}
	for id, eng := range r.engines {
		out[id] = eng.HTTPStats().Requests
	}
	return out
}

// TestCustomEPPSeams routes requests of both tenants through the custom EPP:
// the cordoned worker never serves (the filter, which counts its
// exclusions), the A10 serves none while the term prices it (and some
// without it: the term moved the picks), and an unknown tenant is refused
// with 429 and the classifier's reason, before anything is booked.
func TestCustomEPPSeams(t *testing.T) {
	const n = 24
	for _, gpu := range []bool{true, false} {
		t.Run(fmt.Sprint("gpu-term=", gpu), func(t *testing.T) {
			r := newRig(t, gpu)
			for i := range n {
				resp := r.chat(t, []string{"interactive", "batch"}[i%2])
				require.Equal(t, http.StatusOK, resp.StatusCode, "%s", resp.Body)
			}
			got := r.served()
			require.Zero(t, got["h100-c"], "the cordoned worker served")
			require.EqualValues(t, n, got["h100-a"]+got["a10-b"])
			if gpu {
				require.Zero(t, got["a10-b"], "the A10 served although H100 capacity was free")
			} else {
				require.NotZero(t, got["a10-b"], "without the term the A10 shares the load")
			}
			st := r.epp.svc.Stats()
			require.EqualValues(t, n, st.Filtered["cordoned"], "one exclusion per decision")

			resp := r.chat(t, "stranger")
			require.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
			require.Contains(t, string(resp.Body), "(classifier:unknown_tenant)")
			resp = r.chat(t, "")
			require.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
			st = r.epp.svc.Stats()
			require.EqualValues(t, 2, st.ClassifierRefusals)
			require.EqualValues(t, n, st.Bookings, "a refused request books nothing")
			require.Equal(t, got, r.served(), "a refused request reaches no engine")
		})
	}
}
