package replica_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/clocktest"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/replica/internal/replicatest"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

func TestOptionsValidation(t *testing.T) {
	bus := newHub().member()
	for _, tc := range []struct {
		name string
		o    replica.Options
		want string
	}{
		{"no bus", replica.Options{}, "Bus is nil"},
		{"bad id", replica.Options{Bus: bus, ID: "a.b"}, "ID"},
		{"long id", replica.Options{Bus: bus, ID: strings.Repeat("x", replica.MaxIDLen+1)}, "ID"},
		{"bad subject", replica.Options{Bus: bus, Subject: "a..b"}, "Subject"},
		{"wildcard subject", replica.Options{Bus: bus, Subject: "a.*"}, "Subject"},
		{"negative interval", replica.Options{Bus: bus, BatchInterval: -1}, "BatchInterval"},
		{"batch slower than heartbeat", replica.Options{Bus: bus, BatchInterval: 2 * time.Second}, "BatchInterval"},
		{"short peer timeout", replica.Options{Bus: bus, PeerTimeout: 1500 * time.Millisecond}, "PeerTimeout"},
		{"batch max", replica.Options{Bus: bus, BatchMax: replica.MaxBatchMax + 1}, "BatchMax"},
		{"pending below batch", replica.Options{Bus: bus, BatchMax: 10, PendingMax: 5}, "PendingMax"},
		{"short sync timeout", replica.Options{Bus: bus, SyncTimeout: 1500 * time.Millisecond}, "SyncTimeout"},
		{"small messages", replica.Options{Bus: bus, MaxMessageBytes: 100}, "MaxMessageBytes"},
		{"two problems", replica.Options{ID: "?"}, "Bus is nil; ID"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := replica.New(tc.o)
			require.ErrorIs(t, err, replica.ErrInvalidOptions)
			require.ErrorContains(t, err, tc.want)
		})
	}
	o := replica.Options{Bus: bus}
	r, err := replica.New(o)
	require.NoError(t, err)
	require.Len(t, r.ID(), 16, "a random 64-bit hex id")
	require.Empty(t, o.ID, "New does not write into the caller's options")
	st := r.Stats()
	require.Equal(t, r.ID(), st.ID)
	require.NotZero(t, st.Epoch)
	require.NoError(t, r.Close())
	require.ErrorIs(t, r.Close(), replica.ErrClosed)
}

func TestStartAndClose(t *testing.T) {
	h := newHub()
	r, err := replica.New(replica.Options{Bus: h.member(), ID: "a"})
	require.NoError(t, err)
	require.ErrorIs(t, r.Flush(), replica.ErrNotStarted)
	cfg := selection.DefaultConfig(16)
	cfg.UseKVEvents = false
	svc, err := selection.NewSelectionServiceBuilder(cfg).Observe(r).Build(context.Background())
	require.NoError(t, err)
	defer svc.Close()
	require.NoError(t, r.Start(svc))
	require.ErrorIs(t, r.Start(svc), replica.ErrStarted)
	require.NoError(t, r.Flush())
	require.NoError(t, r.Close())
	require.ErrorIs(t, r.Start(svc), replica.ErrClosed)
	require.ErrorIs(t, r.Flush(), replica.ErrClosed)
	h.mu.RLock()
	defer h.mu.RUnlock()
	for subj, subs := range h.subs {
		require.Empty(t, subs, "Close unsubscribes from %s", subj)
	}
	require.Empty(t, h.resps, "Close stops the snapshot responder")
}

// Bookings, prefills, renewals and frees made on one replica reach the
// others, in order, and nothing else does.
func TestReplicatesBookingsAndSettlements(t *testing.T) {
	h := newHub()
	a, b, c := newNode(t, h, "a", nil), newNode(t, h, "b", nil), newNode(t, h, "c", nil)
	rng := rand.New(rand.NewPCG(1, 1))
	var ids []string
	for range 5 {
		ids = append(ids, string(a.book(t, rng, 8)))
	}
	ids = append(ids, string(b.book(t, rng, 3)))
	require.NoError(t, a.svc.Reservations().PrefillComplete(reservation.ID(ids[0])))
	require.NoError(t, a.svc.Reservations().Renew(reservation.ID(ids[1])))
	require.NoError(t, a.svc.Reservations().Free(reservation.ID(ids[2])))
	requireConverged(t, a, b, c)
	require.Equal(t, 5, activeRequests(c))
	require.Len(t, c.r.RemoteIDs("a"), 4)
	require.Len(t, c.r.RemoteIDs("b"), 1)

	for _, id := range append(ids[:2:2], ids[3:5]...) {
		require.NoError(t, a.svc.Reservations().Free(reservation.ID(id)))
	}
	require.NoError(t, b.svc.Reservations().Free(reservation.ID(ids[5])))
	requireConverged(t, a, b, c)
	for _, n := range []*node{a, b, c} {
		require.Zero(t, activeRequests(n))
		st := n.r.Stats()
		require.Zero(t, st.Gaps, n.r.ID())
		require.Zero(t, st.SnapshotsTaken, "no snapshot was needed")
		require.Empty(t, st.Refused, n.r.ID())
	}
	st := c.svc.Stats()
	require.Equal(t, uint64(6), st.RemoteBookings)
	require.Zero(t, st.Bookings, "c booked nothing itself")
}

// A lost batch is a gap: the receiver takes a snapshot and its view is exact
// again.
func TestGapTakesSnapshot(t *testing.T) {
	h := newHub()
	a, b := newNode(t, h, "a", nil), newNode(t, h, "b", nil)
	rng := rand.New(rand.NewPCG(2, 2))
	keep := a.book(t, rng, 4)
	requireConverged(t, a, b)

	var lost sync.Once
	a.bus.dropIf(func(data []byte) bool {
		dropped := false
		if len(data) > 64 { // a batch with ops, not a heartbeat
			lost.Do(func() { dropped = true })
		}
		return dropped
	})
	missed := a.book(t, rng, 4)
	require.NoError(t, a.r.Flush())
	require.NotContains(t, b.r.RemoteIDs("a"), missed, "the batch was lost")
	require.NoError(t, a.svc.Reservations().Free(reservation.ID(keep)))
	requireConverged(t, a, b)
	require.Equal(t, []reservation.ID{missed}, b.r.RemoteIDs("a"))
	st := b.r.Stats()
	require.Positive(t, st.Gaps)
	require.Positive(t, st.SnapshotsTaken)
	require.Positive(t, a.r.Stats().SnapshotsServed)
}

// A replica that joins late takes a snapshot of each running peer, paged
// when it exceeds a message, and then follows their streams.
func TestLateJoinerTakesPagedSnapshot(t *testing.T) {
	h := newHub()
	small := func(o *replica.Options) { o.MaxMessageBytes = replica.MinMessageBytes }
	a, b := newNode(t, h, "a", small), newNode(t, h, "b", small)
	rng := rand.New(rand.NewPCG(3, 3))
	for i := range 120 {
		n := a
		if i%3 == 0 {
			n = b
		}
		n.book(t, rng, 40) // ~360 bytes per entry: ~10 per 4 KiB page
	}
	requireConverged(t, a, b)
	c := newNode(t, h, "c", small)
	requireConverged(t, a, b, c)
	st := c.r.Stats()
	require.Equal(t, uint64(2), st.SnapshotsTaken)
	require.Equal(t, 120, st.RemoteBookings)
	require.Greater(t, a.r.Stats().PagesServed, uint64(5), "the snapshot was paged")
	// The joiner's own bookings reach the others without a snapshot.
	c.book(t, rng, 2)
	requireConverged(t, a, b, c)
}

// When the publisher cannot keep up, ops are dropped from the stream, never
// from the snapshot: the next batch asks the peers to resynchronise.
func TestOverflowAsksResync(t *testing.T) {
	h := newHub()
	a := newNode(t, h, "a", func(o *replica.Options) { o.BatchMax, o.PendingMax = 4, 8 })
	b := newNode(t, h, "b", nil)
	rng := rand.New(rand.NewPCG(4, 4))
	release := a.bus.hold(t)
	var ids []string
	for range 40 {
		ids = append(ids, string(a.book(t, rng, 2)))
	}
	for _, id := range ids[:10] {
		require.NoError(t, a.svc.Reservations().Free(reservation.ID(id)))
	}
	require.Positive(t, a.r.Stats().Overflow)
	release()
	requireConverged(t, a, b)
	require.Len(t, b.r.RemoteIDs("a"), 30)
	require.Positive(t, b.r.Stats().Resyncs)
}

// A peer heard from no more is dropped with its bookings once PeerTimeout
// has passed since its last message, and not before: on the replicas'
// clock (Options.Now, moved by hand here), whatever the scheduling.
func TestSilentPeerDropped(t *testing.T) {
	h := newHub()
	clk := clocktest.New(time.Unix(1_000_000, 0))
	const hb, timeout = 10 * time.Millisecond, 60 * time.Millisecond
	short := func(o *replica.Options) { o.HeartbeatInterval, o.PeerTimeout, o.Now = hb, timeout, clk.Now }
	a, b := newNode(t, h, "a", short), newNode(t, h, "b", short)
	rng := rand.New(rand.NewPCG(5, 5))
	for range 3 {
		a.book(t, rng, 4)
	}
	requireConverged(t, a, b)
	a.bus.down.Store(true) // gone without a word: no watcher told
	dropped := func() bool { return activeRequests(b) == 0 }
	clk.Advance(timeout - time.Millisecond)
	require.Never(t, dropped, 10*hb, time.Millisecond, "dropped before PeerTimeout")
	// A delivery under way when a went down may still land and restart its
	// silence: move the clock on until b drops a, and judge the moment
	// against a's last message as b saw it.
	last, ok := replicatest.LastHeardUntil(clk.Advance, b.r, "a", dropped)
	require.True(t, ok, "a kept past PeerTimeout")
	require.GreaterOrEqual(t, clk.Now().Sub(last), timeout, "dropped before PeerTimeout after its last message")
	require.Empty(t, b.r.Peers())
	require.Equal(t, uint64(1), b.r.Stats().DroppedPeers)

	a.bus.down.Store(false) // back: it rejoins as an unknown peer past its start
	requireConverged(t, a, b)
	require.Len(t, b.r.RemoteIDs("a"), 3)
}

// A replica restarted with the same ID is a new epoch: its old bookings are
// dropped at once.
func TestRestartedPeerIsNewEpoch(t *testing.T) {
	h := newHub()
	a, b := newNode(t, h, "a", nil), newNode(t, h, "b", nil)
	rng := rand.New(rand.NewPCG(6, 6))
	a.book(t, rng, 4)
	requireConverged(t, a, b)
	old := b.r.Peers()[0].Epoch
	a.close()
	a2 := newNode(t, h, "a", nil)
	id := a2.book(t, rng, 2)
	require.Eventually(t, func() bool {
		ids := b.r.RemoteIDs("a")
		return len(ids) == 1 && ids[0] == id
	}, 5*time.Second, time.Millisecond)
	require.Greater(t, b.r.Peers()[0].Epoch, old)
	require.Equal(t, 1, activeRequests(b))
}

// Cut off, a replica keeps routing on what it has and says it is degraded;
// reconnected, it resynchronises both ways.
func TestPartitionHeals(t *testing.T) {
	h := newHub()
	a, b, c := newNode(t, h, "a", nil), newNode(t, h, "b", nil), newNode(t, h, "c", nil)
	rng := rand.New(rand.NewPCG(7, 7))
	var live []reservation.ID
	for range 6 {
		live = append(live, a.book(t, rng, 3), c.book(t, rng, 3))
	}
	requireConverged(t, a, b, c)
	c.bus.setDown(true)
	require.True(t, c.r.Stats().Degraded)
	for i := range 6 { // both sides go on booking and freeing
		require.NoError(t, a.svc.Reservations().Free(live[2*i]))
		require.NoError(t, c.svc.Reservations().Free(live[2*i+1]))
		a.book(t, rng, 2)
		b.book(t, rng, 2)
		c.book(t, rng, 2)
	}
	require.NotEmpty(t, views(a, b, c), "the partition shows")
	c.bus.setDown(false)
	require.False(t, c.r.Stats().Degraded)
	requireConverged(t, a, b, c)
	require.Equal(t, uint64(1), c.r.Stats().Disconnects)
	require.Equal(t, 18, activeRequests(a))
}

// A peer's booking on a worker this replica does not know is refused and
// counted, and so are its settling calls.
func TestRefusesUnknownWorker(t *testing.T) {
	h := newHub()
	a, b := newNode(t, h, "a", nil), newNode(t, h, "b", nil)
	_, err := b.svc.Workers().Delete("w4")
	require.NoError(t, err)
	res, err := a.svc.SelectAndReserve(context.Background(), selection.Request{Tokens: make([]uint32, 64), Allowed: []string{"w4"}})
	require.NoError(t, err)
	require.NoError(t, a.svc.Reservations().Free(res.ReservationID))
	require.NoError(t, a.r.Flush())
	st := b.r.Stats()
	require.Equal(t, map[string]uint64{"not_found": 1, "unknown_id": 1}, st.Refused)
	require.Zero(t, activeRequests(b))
}

// Two replicas configured with one ID see each other's batches as their own
// from another epoch: counted and logged, never applied.
func TestIDClash(t *testing.T) {
	h := newHub()
	a, a2 := newNode(t, h, "a", nil), newNode(t, h, "a", nil)
	a.book(t, rand.New(rand.NewPCG(8, 8)), 2)
	require.NoError(t, a.r.Flush())
	require.Positive(t, a2.r.Stats().IDClashes)
	require.Zero(t, activeRequests(a2))
}

// Close frees the peers' bookings it booked: nobody would settle them.
func TestCloseFreesPeerBookings(t *testing.T) {
	h := newHub()
	a, b := newNode(t, h, "a", nil), newNode(t, h, "b", nil)
	a.book(t, rand.New(rand.NewPCG(9, 9)), 2)
	requireConverged(t, a, b)
	require.Equal(t, 1, activeRequests(b))
	require.NoError(t, b.r.Close())
	require.Zero(t, activeRequests(b))
	require.Equal(t, 1, activeRequests(a))
}

// Many goroutines book and free on three replicas while one in fifty
// batches is lost: the views end exact and empty.
func TestConcurrentLossyStream(t *testing.T) {
	h := newHub()
	nodes := []*node{newNode(t, h, "a", nil), newNode(t, h, "b", nil), newNode(t, h, "c", nil)}
	var dropped sync.Map
	for i, n := range nodes {
		rng := rand.New(rand.NewPCG(uint64(i), 10))
		var mu sync.Mutex
		n.bus.dropIf(func(data []byte) bool {
			mu.Lock()
			defer mu.Unlock()
			if len(data) > 64 && rng.IntN(50) == 0 {
				dropped.Store(fmt.Sprint(n, rng.Uint64()), true)
				return true
			}
			return false
		})
	}
	var wg sync.WaitGroup
	for g := range 6 {
		wg.Go(func() {
			n := nodes[g%3]
			rng := rand.New(rand.NewPCG(uint64(g), 11))
			var held []reservation.ID
			for range 400 {
				held = append(held, n.book(t, rng, 1+rng.IntN(8)))
				if len(held) > 8 || rng.IntN(2) == 0 {
					k := rng.IntN(len(held))
					require.NoError(t, n.svc.Reservations().Free(reservation.ID(held[k])))
					held = append(held[:k], held[k+1:]...)
				}
			}
			for _, id := range held {
				require.NoError(t, n.svc.Reservations().Free(reservation.ID(id)))
			}
		})
	}
	wg.Wait()
	requireConverged(t, nodes...)
	gaps := uint64(0)
	for _, n := range nodes {
		require.Zero(t, activeRequests(n))
		gaps += n.r.Stats().Gaps
	}
	t.Logf("gaps repaired: %d", gaps)
}

// The publisher goes idle when an interval gathers nothing and the next op
// wakes it: with heartbeats out of the way, every booking still arrives
// within a few batch intervals, whatever the pause before it.
func TestPublisherWakesFromIdle(t *testing.T) {
	h := newHub()
	slowBeat := func(o *replica.Options) { o.HeartbeatInterval = time.Minute }
	a, b := newNode(t, h, "a", slowBeat), newNode(t, h, "b", slowBeat)
	rng := rand.New(rand.NewPCG(12, 12))
	for i := range 40 {
		id := a.book(t, rng, 1)
		require.Eventually(t, func() bool { return activeRequests(b) == 1 }, time.Second, 100*time.Microsecond, "booking %d", i)
		if i%4 == 0 { // sometimes a burst: the publisher stays awake between its batches
			for range 5 {
				require.NoError(t, a.svc.Reservations().Free(reservation.ID(a.book(t, rng, 1))))
			}
		}
		require.NoError(t, a.svc.Reservations().Free(reservation.ID(id)))
		require.Eventually(t, func() bool { return activeRequests(b) == 0 }, time.Second, 100*time.Microsecond, "free %d", i)
	}
	require.Zero(t, a.r.Stats().Heartbeats, "every batch went without a heartbeat's help")
}

// The Replicator tells its service of the peers it hears (selection.Peers):
// a lone replica's same-instant bookings price no peer's, and once two
// peers are heard its second booking of a run prices theirs; once they are
// gone, none again.
func TestTellsTheServiceOfItsPeers(t *testing.T) {
	h := newHub()
	clk := clocktest.New(time.Unix(1_000_000, 0)) // the services' clock: the instant never moves
	var nodes []*node
	for _, id := range []string{"b", "a", "c"} {
		n := &node{bus: h.member()}
		r, err := replica.New(replica.Options{Bus: n.bus, ID: id, HeartbeatInterval: 20 * time.Millisecond})
		require.NoError(t, err)
		cfg := selection.DefaultConfig(16)
		cfg.UseKVEvents = false
		svc, err := selection.NewSelectionServiceBuilder(cfg).Observe(r).Clock(clk.Now).Build(context.Background())
		require.NoError(t, err)
		for i, w := range testWorkers {
			_, err := svc.Workers().Upsert(catalog.Worker{ID: w, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1})
			require.NoError(t, err)
		}
		n.svc, n.r = svc, r
		t.Cleanup(n.close)
		nodes = append(nodes, n)
	}
	b := nodes[0]
	require.NoError(t, b.r.Start(b.svc))
	rng := rand.New(rand.NewPCG(7, 7))
	b.book(t, rng, 4)
	b.book(t, rng, 4)
	require.Zero(t, b.svc.Stats().Spread, "no peer heard")

	for _, n := range nodes[1:] {
		require.NoError(t, n.r.Start(n.svc))
	}
	require.Eventually(t, func() bool { return len(b.r.Peers()) == 2 }, 5*time.Second, time.Millisecond)
	b.book(t, rng, 4)
	require.Zero(t, b.svc.Stats().Spread, "a run's first booking prices none")
	b.book(t, rng, 4)
	require.EqualValues(t, 1, b.svc.Stats().Spread, "the run's second booking priced its peers'")

	for _, n := range nodes[1:] {
		n.close()
	}
	require.Eventually(t, func() bool { return len(b.r.Peers()) == 0 }, 10*time.Second, time.Millisecond)
	b.book(t, rng, 4)
	b.book(t, rng, 4)
	require.EqualValues(t, 1, b.svc.Stats().Spread, "no peer left")
}
