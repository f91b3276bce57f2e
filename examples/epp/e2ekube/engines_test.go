//go:build e2e

package e2ekube

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

// model is the model name of every engine and of the EPP; blockSize the KV
// block size both use.
const (
	model     = "e2e-model"
	blockSize = 16
)

// lastIP numbers the loopback addresses handed to pods: 127.0.0.2, .3, ...
// Each address is used once per test binary run, so a test never meets a
// socket a previous test left in TIME_WAIT.
var lastIP atomic.Int32

func nextIP(t *testing.T) string {
	n := lastIP.Add(1) + 1
	require.LessOrEqual(t, n, int32(254), "out of loopback addresses")
	return fmt.Sprintf("127.0.0.%d", n)
}

// podKind is what serves a pod's target port.
type podKind uint8

const (
	// plainPod: a fake engine (aggregated serving).
	plainPod podKind = iota
	// prefillPod: a fake engine that serves prefill legs only (PDRolePrefill),
	// pulled from over HTTP by the decode engines.
	prefillPod
	// decodePod: a decode sidecar (examples/pdsidecar/sidecar, vLLM NIXL), in
	// front of the pod's fake engine on a port of its own, as in a pod whose
	// sidecar owns the port the pool targets. The engine serves legs of either
	// kind (PDRoleAny, vLLM's kv_both), so a decode pod relabelled prefill
	// serves prefill legs through its sidecar's pass-through.
	decodePod
)

// fleet is the set of fake engines behind one pool: pod i listens on ips[i],
// all on the same three ports (HTTP, the pool's target port; KV-event PUB;
// replay ROUTER), like pods of one Deployment. Each engine's HTTP API is
// served through a probe that counts the orchestration headers reaching it.
type fleet struct {
	port, pubPort, replayPort int
	ips                       []string
	kinds                     []podKind
	engines                   []*fakeengine.Engine
	sidecars                  []*sidecar.Sidecar // by pod; nil but for decode pods
	headers                   []*headerProbe     // by pod: what reached its engine

	servers []*http.Server
	served  []chan struct{} // closed when the server's Serve returns
}

// endpoint is pod i's HTTP host:port, the worker endpoint of its pod: its
// engine, or its sidecar.
func (f *fleet) endpoint(i int) string { return net.JoinHostPort(f.ips[i], strconv.Itoa(f.port)) }

// requests is how many completion requests engine i has served as its pod's
// destination: all it served less the prefill legs it ran for another pod's
// sidecar.
func (f *fleet) requests(i int) uint64 {
	st := f.engines[i].HTTPStats()
	return st.Requests - st.PrefillLegs
}

// byEndpoint maps a host:port back to the engine index, -1 when unknown.
func (f *fleet) byEndpoint(ep string) int {
	for i := range f.ips {
		if f.endpoint(i) == ep {
			return i
		}
	}
	return -1
}

// startFleet starts n plain engines (see startPods).
func startFleet(t *testing.T, n int) *fleet {
	t.Helper()
	return startPods(t, make([]podKind, n)...)
}

// startPods starts a pod of each kind on fresh loopback addresses sharing
// three port numbers. Ports are picked on 127.0.0.1 and may be taken on one of
// the new addresses meanwhile; the whole fleet is then retried on new ports.
func startPods(t *testing.T, kinds ...podKind) *fleet {
	t.Helper()
	ips := make([]string, len(kinds))
	for i := range ips {
		ips[i] = nextIP(t)
	}
	var lastErr error
	for range 10 {
		ports, err := freePorts(3)
		require.NoError(t, err)
		f := &fleet{port: ports[0], pubPort: ports[1], replayPort: ports[2], ips: ips, kinds: kinds}
		if lastErr = f.start(); lastErr == nil {
			t.Cleanup(f.close)
			return f
		}
		f.close()
	}
	require.NoError(t, lastErr, "no port triple free on %v", ips)
	return nil
}

func (f *fleet) start() error {
	var lc net.ListenConfig
	for i, ip := range f.ips {
		front, err := lc.Listen(context.Background(), "tcp", f.endpoint(i))
		if err != nil {
			return err
		}
		back := front // where the engine's HTTP API listens
		if f.kinds[i] == decodePod {
			if back, err = lc.Listen(context.Background(), "tcp", net.JoinHostPort(ip, "0")); err != nil {
				_ = front.Close()
				return err
			}
		}
		opts := fakeengine.Options{
			BlockSize: blockSize, CapacityBlocks: 512, Model: model, OutputTokens: 4,
			PubEndpoint:  "tcp://" + net.JoinHostPort(ip, strconv.Itoa(f.pubPort)),
			EnableReplay: true, ReplayEndpoint: "tcp://" + net.JoinHostPort(ip, strconv.Itoa(f.replayPort)),
			EngineID: "engine@" + ip, AdvertiseAddr: back.Addr().String(),
		}
		if f.kinds[i] == prefillPod {
			opts.PDRole = fakeengine.PDRolePrefill
		}
		e, err := fakeengine.New(opts)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err = e.Start(ctx)
			cancel()
			if err != nil {
				_ = e.Close()
			}
		}
		if err != nil {
			_ = front.Close()
			if back != front {
				_ = back.Close()
			}
			return fmt.Errorf("engine on %s: %w", ip, err)
		}
		probe := &headerProbe{}
		f.engines, f.headers = append(f.engines, e), append(f.headers, probe)
		f.serve(back, probe.wrap(e.Handler()))
		var sc *sidecar.Sidecar
		if f.kinds[i] == decodePod {
			// FallbackFail (the default): a failed prefill leg is a 502, never
			// hidden by a local prefill.
			if sc, err = sidecar.New(sidecar.Options{DecodeURL: "http://" + back.Addr().String()}); err != nil {
				_ = front.Close()
				return err
			}
			f.serve(front, sc)
		}
		f.sidecars = append(f.sidecars, sc)
	}
	return nil
}

// serve serves h on lis until close.
func (f *fleet) serve(lis net.Listener, h http.Handler) {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	f.servers, f.served = append(f.servers, srv), append(f.served, done)
}

// close stops the servers (gracefully, then not), the sidecars and the
// engines, and waits for them.
func (f *fleet) close() {
	for i, srv := range f.servers {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := srv.Shutdown(ctx); err != nil {
			_ = srv.Close()
		}
		cancel()
		<-f.served[i]
	}
	f.servers, f.served = nil, nil
	for _, sc := range f.sidecars {
		if sc != nil {
			sc.Close()
		}
	}
	for _, e := range f.engines {
		_ = e.Close()
	}
}

// podLegs is what one pod's engine and sidecar (zero without one) counted.
type podLegs struct {
	engine  fakeengine.HTTPStats
	sidecar sidecar.Stats
}

// legs snapshots every pod's counters.
func (f *fleet) legs() []podLegs {
	out := make([]podLegs, len(f.engines))
	for i, e := range f.engines {
		out[i].engine = e.HTTPStats()
		if f.sidecars[i] != nil {
			out[i].sidecar = f.sidecars[i].Stats()
		}
	}
	return out
}

// headerProbe counts the requests that reached an engine carrying an
// orchestration header: the prefill hint and its signature, the EPP's and the
// gateway's routing headers, Dynamo's. A decode sidecar strips them on every
// leg; an engine a request reaches without one gets them.
type headerProbe struct {
	mu    sync.Mutex
	n     int
	first string // the first one seen, "name: value"
}

func (p *headerProbe) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for name, vs := range r.Header {
			if isOrchestration(name) {
				p.mu.Lock()
				p.n++
				if p.first == "" {
					p.first = name + ": " + strings.Join(vs, ", ")
				}
				p.mu.Unlock()
				break
			}
		}
		h.ServeHTTP(w, r)
	})
}

// seen returns how many requests carried an orchestration header, and the
// first such header.
func (p *headerProbe) seen() (int, string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n, p.first
}

// isOrchestration is wider than the sidecar's own list: any x-gateway-*,
// x-prefiller-*, x-kvselect-* or x-dynamo-* header.
func isOrchestration(name string) bool {
	n := strings.ToLower(name)
	for _, prefix := range []string{"x-gateway-", "x-prefiller-", "x-kvselect-", "x-dynamo-"} {
		if strings.HasPrefix(n, prefix) {
			return true
		}
	}
	return false
}

// freePorts returns n distinct ports that were free on 127.0.0.1.
func freePorts(n int) ([]int, error) {
	ls := make([]net.Listener, 0, n)
	defer func() {
		for _, l := range ls {
			_ = l.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// startTokenizer starts the engine the EPP tokenizes with (its render
// endpoint). It is not a pod, so pods may come and go without breaking
// tokenization.
func startTokenizer(t *testing.T) string {
	t.Helper()
	e, err := fakeengine.New(fakeengine.Options{BlockSize: blockSize, Model: model, EnableHTTP: true})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() { _ = e.Close() })
	return "http://" + e.HTTPEndpoint()
}
