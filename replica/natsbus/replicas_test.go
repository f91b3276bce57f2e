package natsbus_test

import (
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/clocktest"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/replica/internal/replicatest"
	"github.com/kvselect/kvselect/reservation"
)

// Every booking and every free of a replica reaches both of its peers, one
// at a time, each within a few batch intervals (BenchmarkBookingReachesPeers
// measures how long).
func TestBookingReachesPeers(t *testing.T) {
	srv := startServer(t)
	p := newPeerRig(t, srv.ClientURL())
	for range 100 {
		p.roundTrip(t)
	}
	require.Empty(t, views(p.a, p.b, p.c))
}

// BenchmarkBookingReachesPeers is the time from a booking on one replica to
// its being in both peers' loads, over a real NATS server on loopback:
// p50-ns and p99-ns over b.N bookings (each freed, and the free seen, before
// the next). Each booking follows the previous free's batch by less than
// BatchInterval, so it waits for the next batch: the slow case.
func BenchmarkBookingReachesPeers(b *testing.B) {
	srv := startServer(b)
	p := newPeerRig(b, srv.ClientURL())
	lat := make([]time.Duration, 0, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		lat = append(lat, p.roundTrip(b))
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
}

// peerRig is three replicas on one NATS server, the two peers telling when
// a message they took may have changed their view.
type peerRig struct {
	a, b, c *node
	notify  chan struct{}
	rng     *rand.Rand
}

func newPeerRig(t testing.TB, url string) *peerRig {
	p := &peerRig{notify: make(chan struct{}, 1), rng: rand.New(rand.NewPCG(1, 1))}
	watch := func(b replica.Bus) replica.Bus { return &notifyBus{Bus: b.(*natsBus), ch: p.notify} }
	p.a = newNode(t, url, "a", nil, nil)
	p.b = newNode(t, url, "b", watch, nil)
	p.c = newNode(t, url, "c", watch, nil)
	return p
}

// roundTrip books on a, waits until both peers hold it, frees it, waits
// until neither does, and returns how long the booking took to reach both.
func (p *peerRig) roundTrip(t testing.TB) time.Duration {
	waitFor := func(cond func() bool) {
		deadline := time.After(5 * time.Second)
		for !cond() {
			select {
			case <-p.notify:
			case <-deadline:
				t.Fatalf("peers never caught up: b %d, c %d", activeRequests(p.b), activeRequests(p.c))
			}
		}
	}
	start := time.Now()
	id := p.a.book(t, p.rng, 4)
	waitFor(func() bool { return activeRequests(p.b) == 1 && activeRequests(p.c) == 1 })
	took := time.Since(start)
	p.a.free(t, id)
	waitFor(func() bool { return activeRequests(p.b) == 0 && activeRequests(p.c) == 0 })
	return took
}

// 10,000 bookings and frees at full speed from goroutines on three
// replicas: afterwards every replica's loads are zero and equal, and no
// replica holds a peer's booking.
func TestTenThousandBookings(t *testing.T) {
	srv := startServer(t)
	// Six goroutines booking flat out keep both cores busy, so the
	// receivers' goroutines wait their turn: a PeerTimeout of a few hundred
	// milliseconds would take that for silence (the default is 4 s).
	patient := func(o *replica.Options) { o.HeartbeatInterval, o.PeerTimeout = 100*time.Millisecond, 2*time.Second }
	nodes := []*node{
		newNode(t, srv.ClientURL(), "a", nil, patient),
		newNode(t, srv.ClientURL(), "b", nil, patient),
		newNode(t, srv.ClientURL(), "c", nil, patient),
	}
	const total, workers = 10000, 6
	start := time.Now()
	var booked atomic.Int64
	var wg sync.WaitGroup
	for g := range workers {
		wg.Go(func() {
			n := nodes[g%len(nodes)]
			rng := rand.New(rand.NewPCG(uint64(g), 2))
			var held []reservation.ID
			count := total / workers
			if g < total%workers {
				count++
			}
			for range count {
				held = append(held, n.book(t, rng, 1+rng.IntN(16)))
				booked.Add(1)
				if rng.IntN(4) == 0 {
					_ = n.svc.Reservations().PrefillComplete(held[len(held)-1])
				}
				for len(held) > 16 || (len(held) > 0 && rng.IntN(2) == 0) {
					k := rng.IntN(len(held))
					n.free(t, held[k])
					held = slices.Delete(held, k, k+1)
				}
			}
			for _, id := range held {
				n.free(t, id)
			}
		})
	}
	wg.Wait()
	booking := time.Since(start)
	requireConverged(t, 10*time.Second, nodes...)
	settled := time.Since(start)
	var gaps, snaps, overflow uint64
	for _, n := range nodes {
		require.Zero(t, activeRequests(n), n.r.ID())
		for _, l := range n.svc.Loads("") {
			require.Zero(t, l.ActiveBlocks, l)
			require.Zero(t, l.ActivePrefillTokens, l)
		}
		st := n.r.Stats()
		require.Zero(t, st.RemoteBookings, n.r.ID())
		gaps, snaps, overflow = gaps+st.Gaps, snaps+st.SnapshotsTaken, overflow+st.Overflow
	}
	t.Logf("%d bookings and frees on 3 replicas in %v; all views zero and equal after %v (gaps %d, snapshots %d, overflow %d)",
		booked.Load(), booking, settled, gaps, snaps, overflow)
	require.Equal(t, int64(total), booked.Load())
}

// A replica gone without a goodbye (its connection closed, its Replicator
// still running) has its bookings dropped by the others once PeerTimeout has
// passed since its last message, and not before, on the replicas' clock
// (moved by hand here, so scheduling cannot move the verdict).
func TestSilentReplicaDropped(t *testing.T) {
	srv := startServer(t)
	clk := clocktest.New(time.Unix(1_000_000, 0))
	const hb, timeout = 20 * time.Millisecond, 100 * time.Millisecond
	short := func(o *replica.Options) { o.HeartbeatInterval, o.PeerTimeout, o.Now = hb, timeout, clk.Now }
	a := newNode(t, srv.ClientURL(), "a", nil, short)
	b := newNode(t, srv.ClientURL(), "b", nil, short)
	c := newNode(t, srv.ClientURL(), "c", nil, short)
	rng := rand.New(rand.NewPCG(3, 3))
	for range 5 {
		c.book(t, rng, 4)
	}
	a.book(t, rng, 2)
	requireConverged(t, 5*time.Second, a, b, c)
	c.nc.Close()
	dropped := func() bool { return activeRequests(a) == 1 && activeRequests(b) == 1 }
	clk.Advance(timeout - time.Millisecond)
	require.Never(t, dropped, 10*hb, time.Millisecond, "dropped before PeerTimeout")
	// A message c sent before its connection closed may still arrive and
	// restart its silence: move the clock on until the others drop c, and
	// judge the moment against c's last message as a saw it.
	last, ok := replicatest.LastHeardUntil(clk.Advance, a.r, "c", dropped)
	require.True(t, ok, "c kept past PeerTimeout")
	require.GreaterOrEqual(t, clk.Now().Sub(last), timeout, "dropped before PeerTimeout after its last message")
	require.Equal(t, uint64(1), a.r.Stats().DroppedPeers)
	require.Nil(t, b.r.RemoteIDs("c"))
	require.Empty(t, views(a, b))
}

// One batch lost on its way: the receivers see the gap at the next message,
// take a snapshot, and agree again entry by entry.
func TestLostBatchRepairedBySnapshot(t *testing.T) {
	srv := startServer(t)
	var lose atomic.Bool
	lossy := func(b replica.Bus) replica.Bus {
		return &lossyBus{Bus: b.(*natsBus), drop: func(data []byte) bool {
			return len(data) > 64 && lose.CompareAndSwap(true, false) // a batch with ops
		}}
	}
	a := newNode(t, srv.ClientURL(), "a", lossy, nil)
	b := newNode(t, srv.ClientURL(), "b", nil, nil)
	c := newNode(t, srv.ClientURL(), "c", nil, nil)
	rng := rand.New(rand.NewPCG(4, 4))
	var ids []reservation.ID
	for range 10 {
		ids = append(ids, a.book(t, rng, 3))
	}
	requireConverged(t, 5*time.Second, a, b, c)
	lose.Store(true)
	lost := a.book(t, rng, 3)
	require.NoError(t, a.r.Flush())
	require.False(t, lose.Load(), "the batch was lost")
	a.free(t, ids[0])
	a.free(t, ids[1])
	requireConverged(t, 5*time.Second, a, b, c)
	require.Contains(t, c.r.RemoteIDs("a"), lost)
	for _, n := range []*node{b, c} {
		st := n.r.Stats()
		require.Positive(t, st.Gaps, n.r.ID())
		require.Positive(t, st.SnapshotsTaken, n.r.ID())
	}
	// One per receiver, or more: a subscription reaches the server
	// asynchronously, so a replica just started may miss a first batch too.
	require.GreaterOrEqual(t, a.r.Stats().SnapshotsServed, uint64(2))
}

// One replica's connection is cut while all three keep booking and freeing;
// it is degraded meanwhile, and once the link heals the views agree again
// entry by entry. The short cut heals through the reconnection resync, the
// long one after the peers dropped each other.
func TestPartitionHeals(t *testing.T) {
	for _, long := range []bool{false, true} {
		name := "short"
		if long {
			name = "long"
		}
		t.Run(name, func(t *testing.T) {
			srv := startServer(t)
			px := newProxy(t, srv.Addr().String())
			a := newNode(t, srv.ClientURL(), "a", nil, nil)
			b := newNode(t, srv.ClientURL(), "b", nil, nil)
			c := newNode(t, px.url(), "c", nil, nil)
			nodes := []*node{a, b, c}
			rng := rand.New(rand.NewPCG(5, 5))
			held := map[*node][]reservation.ID{}
			churn := func(rounds int) {
				for range rounds {
					for _, n := range nodes {
						held[n] = append(held[n], n.book(t, rng, 1+rng.IntN(6)))
						if len(held[n]) > 3 {
							k := rng.IntN(len(held[n]))
							n.free(t, held[n][k])
							held[n] = slices.Delete(held[n], k, k+1)
						}
					}
				}
			}
			churn(10)
			requireConverged(t, 5*time.Second, nodes...)

			px.setCut(true)
			require.Eventually(t, func() bool { return c.r.Stats().Degraded }, 5*time.Second, time.Millisecond)
			churn(20)
			if long { // until the peers have given up on each other
				require.Eventually(t, func() bool {
					return len(c.r.Peers()) == 0 && slices.IndexFunc(a.r.Peers(), func(p replica.Peer) bool { return p.ID == "c" }) < 0
				}, 5*time.Second, time.Millisecond)
				churn(10)
			}
			require.NotEmpty(t, views(nodes...), "the partition shows")
			px.setCut(false)
			require.Eventually(t, func() bool { return !c.r.Stats().Degraded }, 5*time.Second, time.Millisecond)
			churn(5)
			requireConverged(t, 5*time.Second, nodes...)
			st := c.r.Stats()
			t.Logf("c: disconnects %d, snapshots taken %d, gaps %d; a: snapshots served %d, dropped peers %d",
				st.Disconnects, st.SnapshotsTaken, st.Gaps, a.r.Stats().SnapshotsServed, a.r.Stats().DroppedPeers)
			require.Positive(t, st.Disconnects)
			require.Positive(t, st.SnapshotsTaken)
		})
	}
}
