package replica_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/replica"
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
		_, err := svc.UpsertWorker(catalog.Worker{ID: w, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1, MaxNumBatchedTokens: 8192})
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
func (n *node) book(t testing.TB, rng *rand.Rand, blocks int) string {
	t.Helper()
	toks := make([]uint32, blocks*16+3)
	for i := range toks {
		toks[i] = rng.Uint32N(32000)
	}
	res, err := n.svc.SelectAndReserve(context.Background(), selection.Request{Tokens: toks})
	require.NoError(t, err)
	return res.ReservationID
}

// views reports how the nodes' views differ, "" when they agree entry by
// entry: every node's loads are the same, and every node holds exactly each
// peer's live local bookings.
func views(nodes ...*node) string {
	want := nodes[0].svc.Loads("")
	for _, n := range nodes[1:] {
		if got := n.svc.Loads(""); !slices.Equal(got, want) {
			return fmt.Sprintf("loads of %s %v, of %s %v", nodes[0].r.ID(), want, n.r.ID(), got)
		}
	}
	for _, a := range nodes {
		local := a.r.LocalIDs()
		for _, b := range nodes {
			if a == b {
				continue
			}
			if got := b.r.RemoteIDs(a.r.ID()); !slices.Equal(got, local) && !(len(got) == 0 && len(local) == 0) {
				return fmt.Sprintf("%s holds %d bookings of %s, which has %d", b.r.ID(), len(got), a.r.ID(), len(local))
			}
		}
	}
	return ""
}

// behind reports a node that has not applied a peer's last batch yet (or
// is taking a snapshot of it), "" when none. Equal views are not enough: a
// node behind a peer's stream may hold, by chance, what the peer holds now
// (nothing, say) and go on applying the batches it has yet to see.
func behind(nodes ...*node) string {
	for _, a := range nodes {
		st := a.r.Stats()
		for _, b := range nodes {
			if a == b {
				continue
			}
			peers := b.r.Peers()
			i := slices.IndexFunc(peers, func(p replica.Peer) bool { return p.ID == st.ID })
			if i < 0 {
				return fmt.Sprintf("%s does not follow %s yet", b.r.ID(), st.ID)
			}
			if p := peers[i]; p.Epoch != st.Epoch || p.Seq != st.Seq || p.Syncing {
				return fmt.Sprintf("%s follows %s at %d/%d (syncing %v), which is at %d/%d",
					b.r.ID(), st.ID, p.Epoch, p.Seq, p.Syncing, st.Epoch, st.Seq)
			}
		}
	}
	return ""
}

// requireConverged waits until every node has published what it has pending,
// every node has applied each peer's last batch, and the nodes' views agree
// (see views).
func requireConverged(t testing.TB, nodes ...*node) {
	t.Helper()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for _, n := range nodes {
			_ = n.r.Flush()
		}
		if !assert.Empty(c, behind(nodes...)) {
			return
		}
		assert.Empty(c, views(nodes...))
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
