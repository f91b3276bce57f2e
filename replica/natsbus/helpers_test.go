package natsbus_test

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/replica/internal/replicatest"
	"github.com/kvselect/kvselect/replica/natsbus"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

// startServer runs an embedded NATS server on a random loopback port until
// the test ends.
func startServer(t testing.TB) *server.Server {
	t.Helper()
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true})
	require.NoError(t, err)
	s.Start()
	require.True(t, s.ReadyForConnections(10*time.Second), "nats server did not start")
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	return s
}

// connect dials url with the options replicas use, tuned for tests
// (reconnect quickly, never give up).
func connect(t testing.TB, url, name string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond),
		nats.ReconnectJitter(0, 0), nats.DontRandomize(), nats.IgnoreDiscoveredServers(), nats.NoCallbacksAfterClientClose())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

// node is one replica under test: its service, its Replicator, its
// connection.
type node struct {
	svc *selection.SelectionService
	r   *replica.Replicator
	nc  *nats.Conn
}

var testWorkers = []string{"w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8"}

// newNode connects to url and builds a service (approximate mode, 16-token
// blocks, the test workers) with a Replicator on it, started. wrap, when set,
// wraps the Bus; mod edits the options.
func newNode(t testing.TB, url, id string, wrap func(replica.Bus) replica.Bus, mod func(*replica.Options)) *node {
	t.Helper()
	return newNodeOn(t, connect(t, url, id), id, wrap, mod)
}

// newNodeOn is newNode on a connection the caller made; the node's cleanup
// closes it.
func newNodeOn(t testing.TB, nc *nats.Conn, id string, wrap func(replica.Bus) replica.Bus, mod func(*replica.Options)) *node {
	t.Helper()
	nb, err := natsbus.New(nc)
	require.NoError(t, err)
	var bus replica.Bus = nb
	if wrap != nil {
		bus = wrap(nb)
	}
	o := replica.Options{Bus: bus, ID: id, HeartbeatInterval: 50 * time.Millisecond, PeerTimeout: 250 * time.Millisecond,
		SnapshotTimeout: time.Second, MaxMessageBytes: int(nc.MaxPayload())}
	if mod != nil {
		mod(&o)
	}
	r, err := replica.New(o)
	require.NoError(t, err)
	cfg := selection.DefaultConfig(16)
	cfg.UseKVEvents = false
	svc, err := selection.NewSelectionServiceBuilder(cfg).Observe(r).Build(context.Background())
	require.NoError(t, err)
	for i, w := range testWorkers {
		_, err := svc.Workers().Upsert(catalog.Worker{ID: w, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1, MaxNumBatchedTokens: 8192})
		require.NoError(t, err)
	}
	require.NoError(t, r.Start(svc))
	n := &node{svc: svc, r: r, nc: nc}
	t.Cleanup(func() {
		_ = r.Close()
		_ = svc.Close()
		nc.Close()
	})
	return n
}

// book books a request of blocks full blocks of random tokens.
func (n *node) book(t testing.TB, rng *rand.Rand, blocks int) reservation.ID {
	toks := make([]uint32, blocks*16+5)
	for i := range toks {
		toks[i] = rng.Uint32N(32000)
	}
	res, err := n.svc.SelectAndReserve(context.Background(), selection.Request{Tokens: toks})
	if err != nil {
		t.Errorf("book on %s: %v", n.r.ID(), err)
	}
	return res.ReservationID
}

func (n *node) free(t testing.TB, id reservation.ID) {
	if err := n.svc.Reservations().Free(id); err != nil {
		t.Errorf("free on %s: %v", n.r.ID(), err)
	}
}

func activeRequests(n *node) int {
	s := 0
	for _, l := range n.svc.Loads("") {
		s += l.ActiveRequests
	}
	return s
}

// views reports how the nodes' views differ, "" when they agree
// (replicatest.Views).
func views(nodes ...*node) string { return replicatest.Views(asNodes(nodes)...) }

func asNodes(nodes []*node) []replicatest.Node {
	out := make([]replicatest.Node, len(nodes))
	for i, n := range nodes {
		out[i] = replicatest.Node{Svc: n.svc, R: n.r}
	}
	return out
}

// requireConverged waits until every node has published what it has pending,
// every node has applied each peer's last batch, and the nodes' views agree
// (replicatest.Converged).
func requireConverged(t testing.TB, timeout time.Duration, nodes ...*node) {
	t.Helper()
	ns := asNodes(nodes)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Empty(c, replicatest.Converged(ns...))
	}, timeout, 2*time.Millisecond)
}

// notifyBus tells, after every delivered message, that a node's view may
// have changed (its callback has returned).
type notifyBus struct {
	*natsbus.Bus
	ch chan struct{}
}

func (b *notifyBus) Subscribe(subject string, fn func(string, []byte)) (func(), error) {
	return b.Bus.Subscribe(subject, func(subj string, data []byte) {
		fn(subj, data)
		select {
		case b.ch <- struct{}{}:
		default:
		}
	})
}

// lossyBus loses the publishes drop chooses (Publish still succeeds).
type lossyBus struct {
	*natsbus.Bus
	drop func(data []byte) bool
}

func (b *lossyBus) Publish(subject string, data []byte) error {
	if b.drop(data) {
		return nil
	}
	return b.Bus.Publish(subject, data)
}

// proxy is a loopback TCP relay to a NATS server that the test can cut
// (every connection closed, new ones refused) and heal.
type proxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	cut    bool
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

func newProxy(t testing.TB, target string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *proxy) url() string { return "nats://" + p.ln.Addr().String() }

func (p *proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.cut {
			p.mu.Unlock()
			_ = c.Close()
			continue
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			p.mu.Unlock()
			_ = c.Close()
			continue
		}
		p.conns[c], p.conns[up] = struct{}{}, struct{}{}
		p.mu.Unlock()
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, src)
			_ = dst.Close()
			_ = src.Close()
		}
		p.wg.Go(func() { pipe(up, c) })
		p.wg.Go(func() { pipe(c, up) })
	}
}

// setCut cuts (true) or heals the relay.
func (p *proxy) setCut(cut bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = cut
	if cut {
		for c := range p.conns {
			_ = c.Close()
		}
		clear(p.conns)
	}
}

func (p *proxy) close() {
	_ = p.ln.Close()
	p.setCut(true)
	p.wg.Wait()
}
