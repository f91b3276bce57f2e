package replica_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/replica/internal/replicatest"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
}

// node is one replica under test: its service and its Replicator.
type node struct {
	svc *selection.SelectionService
	r   *replica.Replicator
	bus *member
}

var testWorkers = []string{"w1", "w2", "w3", "w4"}

// newNode builds a service (approximate mode, 16-token blocks, the test
// workers) with a Replicator on hub, started. mod edits the options.
func newNode(t testing.TB, h *hub, id string, mod func(*replica.Options)) *node {
	t.Helper()
	return newNodeWith(t, h, id, nil, mod)
}

// newNodeWith is newNode with the Replicator's Bus wrapped by wrap (when
// set), node.bus staying the hub member underneath, and the service's
// configuration edited by cfgMods.
func newNodeWith(t testing.TB, h *hub, id string, wrap func(*member) replica.Bus, mod func(*replica.Options), cfgMods ...func(*selection.Config)) *node {
	t.Helper()
	n := &node{bus: h.member()}
	var bus replica.Bus = n.bus
	if wrap != nil {
		bus = wrap(n.bus)
	}
	o := replica.Options{Bus: bus, ID: id, HeartbeatInterval: 50 * time.Millisecond}
	if mod != nil {
		mod(&o)
	}
	r, err := replica.New(o)
	require.NoError(t, err)
	cfg := selection.DefaultConfig(16)
	cfg.UseKVEvents = false
	for _, m := range cfgMods {
		m(&cfg)
	}
	svc, err := selection.NewSelectionServiceBuilder(cfg).Observe(r).Build(context.Background())
	require.NoError(t, err)
	for i, w := range testWorkers {
		_, err := svc.Workers().Upsert(catalog.Worker{ID: w, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1, MaxNumBatchedTokens: 8192})
		require.NoError(t, err)
	}
	require.NoError(t, r.Start(svc))
	n.svc, n.r = svc, r
	t.Cleanup(n.close)
	return n
}

func (n *node) close() {
	_ = n.r.Close()
	_ = n.svc.Close()
}

// book books a request of blocks full blocks (random tokens) and returns its
// id.
func (n *node) book(t testing.TB, rng *rand.Rand, blocks int) reservation.ID {
	t.Helper()
	toks := make([]uint32, blocks*16+3)
	for i := range toks {
		toks[i] = rng.Uint32N(32000)
	}
	res, err := n.svc.SelectAndReserve(context.Background(), selection.Request{Tokens: toks})
	require.NoError(t, err)
	return reservation.ID(string(res.ReservationID))
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
func requireConverged(t testing.TB, nodes ...*node) {
	t.Helper()
	ns := asNodes(nodes)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Empty(c, replicatest.Converged(ns...))
	}, 5*time.Second, 2*time.Millisecond)
}

// activeRequests sums the active requests of every worker of n's service.
func activeRequests(n *node) int {
	s := 0
	for _, l := range n.svc.Loads("") {
		s += l.ActiveRequests
	}
	return s
}
