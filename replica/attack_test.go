package replica_test

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/selection"
)

// The attacks of this file are what a hostile publisher on the bus (a rogue
// route into the mesh, a stolen credential) can send: messages under a real
// replica's ID and epoch, a flood of valid bookings, a snapshot responder
// that answers just in time, forever.

// opsSubject is where replica id publishes its batches.
func opsSubject(id string) string { return replica.DefaultSubject + ".ops." + id }

// forge publishes raw bytes on replica id's stream from a member of its
// own: the bus lets it (no permissions), as a rogue route into a NATS mesh
// without a secret would.
func forge(t *testing.T, h *hub, id string, data []byte) {
	t.Helper()
	require.NoError(t, h.member().Publish(opsSubject(id), data))
}

// heartbeatsPass waits until n has sent k more heartbeats: each is one
// HeartbeatInterval of n's own clock, and every peer's watchdog has run in
// between.
func heartbeatsPass(t *testing.T, n *node, k uint64) {
	t.Helper()
	from := n.r.Stats().Heartbeats
	eventually(t, func() bool { return n.r.Stats().Heartbeats >= from+k }, "heartbeats")
}

// repairs is a replica's snapshots begun: taken, failed or in flight.
func repairs(n *node) uint64 {
	st := n.r.Stats()
	return st.Gaps + st.Resyncs
}

// One heartbeat under a real replica's ID and epoch claiming sequence number
// 2^62 must cost at most a few repairs, not a snapshot loop (every snapshot
// ends below the claimed number, which used to start the next at once).
func TestForgedSequenceDoesNotLoop(t *testing.T) {
	h := newHub()
	a, b, c := newNode(t, h, "a", nil), newNode(t, h, "b", nil), newNode(t, h, "c", nil)
	rng := rand.New(rand.NewPCG(27, 1))
	for range 4 {
		a.book(t, rng, 3)
	}
	requireConverged(t, a, b, c)
	before := []uint64{repairs(b), repairs(c)}
	st := a.r.Stats()

	forge(t, h, st.ID, replica.ForgeBatch(st.ID, st.Epoch, 1<<62))
	heartbeatsPass(t, a, 10)
	a.book(t, rng, 2)
	requireConverged(t, a, b, c)
	heartbeatsPass(t, a, 10)
	for i, n := range []*node{b, c} {
		require.LessOrEqual(t, repairs(n)-before[i], uint64(3), "repairs after one forged heartbeat")
		require.Positive(t, n.r.Stats().Refused["implausible_seq"])
	}
}

// A forged sequence number within reach of the real one (a few batches
// ahead, so believable) costs a repair, whose snapshot contradicts it: it is
// forgotten, not chased. Repeated, the repairs back off.
func TestForgedNearSequenceRepairsBackOff(t *testing.T) {
	h := newHub()
	a, b := newNode(t, h, "a", nil), newNode(t, h, "b", nil)
	rng := rand.New(rand.NewPCG(27, 2))
	a.book(t, rng, 3)
	requireConverged(t, a, b)
	st := a.r.Stats()
	before := repairs(b)

	forge(t, h, st.ID, replica.ForgeBatch(st.ID, st.Epoch, st.Seq+100))
	heartbeatsPass(t, a, 6)
	requireConverged(t, a, b)
	require.LessOrEqual(t, repairs(b)-before, uint64(2), "one forged heartbeat, one repair (and at most one more)")

	// Again after each repair, 8 times: the repairs back off instead of
	// following each message.
	for i := range 8 {
		forge(t, h, st.ID, replica.ForgeBatch(st.ID, st.Epoch, a.r.Stats().Seq+100+uint64(i)))
		eventually(t, func() bool { return !peerSyncing(b, "a") || b.r.Stats().RepairBackoffs > 0 }, "repaired or backing off")
		if b.r.Stats().RepairBackoffs > 0 {
			break
		}
	}
	require.Positive(t, b.r.Stats().RepairBackoffs)
	a.book(t, rng, 2)
	require.Eventually(t, func() bool { return views(a, b) == "" }, 20*time.Second, time.Millisecond,
		"the real stream is followed again once the forger stops")
}

// peerSyncing reports whether n is taking a snapshot of its peer id.
func peerSyncing(n *node, id string) bool {
	for _, p := range n.r.Peers() {
		if p.ID == id {
			return p.Syncing
		}
	}
	return false
}

// A forged restart (a real replica's ID, a newer epoch) makes the others
// ask the replica itself; its snapshot's epoch wins, and its bookings and
// stream are followed again.
func TestForgedEpochIsContradicted(t *testing.T) {
	h := newHub()
	a, b := newNode(t, h, "a", nil), newNode(t, h, "b", nil)
	rng := rand.New(rand.NewPCG(27, 3))
	a.book(t, rng, 3)
	requireConverged(t, a, b)
	st := a.r.Stats()

	forge(t, h, st.ID, replica.ForgeBatch(st.ID, st.Epoch+1, 5))
	eventually(t, func() bool { return b.r.Stats().Refused["implausible_epoch"] > 0 }, "the snapshot contradicts the epoch")
	a.book(t, rng, 2)
	requireConverged(t, a, b)
	require.Len(t, b.r.RemoteIDs("a"), 2)
}

// A peer may hold at most MaxPeerBookings bookings and MaxPeerBlocks blocks
// in a replica's service; more are refused by name, and what is held is
// freed with the peer.
func TestPeerBookingsBounded(t *testing.T) {
	h := newHub()
	b := newNode(t, h, "b", func(o *replica.Options) { o.MaxPeerBookings, o.MaxPeerBlocks = 50, 400 })
	forged := func(i, blocks int) replica.ForgedBooking {
		hs := make([]uint64, blocks)
		for k := range hs {
			hs[k] = uint64(i)<<20 | uint64(k)
		}
		return replica.ForgedBooking{ID: fmt.Sprintf("f%05d", i), Worker: catalog.WorkerRank{WorkerID: testWorkers[i%len(testWorkers)]},
			Hashes: hs, LeaseMS: 1 << 31 / 2}
	}
	// 200 bookings of one block, in order, in batches of 10: 50 held.
	var seq uint64
	for i := 0; i < 200; i += 10 {
		var bs []replica.ForgedBooking
		for k := range 10 {
			bs = append(bs, forged(i+k, 1))
		}
		seq++
		forge(t, h, "x", replica.ForgeBatch("x", 7, seq, bs...))
	}
	eventually(t, func() bool { return len(b.r.RemoteIDs("x")) == 50 }, "50 bookings held")
	require.Equal(t, uint64(150), b.r.Stats().Refused["peer_full"])

	// Another peer of fat bookings: 400 blocks hold 3 of 120.
	for i := range 5 {
		forge(t, h, "y", replica.ForgeBatch("y", 7, uint64(i+1), forged(1000+i, 120)))
	}
	eventually(t, func() bool { return len(b.r.RemoteIDs("y")) == 3 }, "3 bookings of 120 blocks held")
	active := 0
	for _, l := range b.svc.Loads("") {
		active += l.ActiveRequests
	}
	require.Equal(t, 53, active, "only what was held counts as load")
}

// A snapshot responder that answers each page just in time, forever, holds
// one snapshot taker: every other peer's repair goes on. Here a replica cut
// off while its peer booked, once back, has re-learnt the peer's bookings
// within a second, while the slow peer's snapshot is still being paged.
func TestSlowSnapshotResponderBlocksNoOne(t *testing.T) {
	h := newHub()
	opts := func(o *replica.Options) { o.SnapshotTimeout = time.Second }
	a, b := newNode(t, h, "a", opts), newNode(t, h, "b", opts)

	// The slow peer: it heartbeats past its start, so a takes a snapshot of
	// it, and it answers one entry a page, 800 ms a page, with more to come.
	slow := h.member()
	var pages atomic.Int64
	stop, err := slow.Respond(replica.DefaultSubject+".snapshot.slow", func(req []byte) []byte {
		n := pages.Add(1)
		select {
		case <-time.After(800 * time.Millisecond): // the attack: just under the page timeout
		case <-t.Context().Done():
		}
		return replica.ForgePage("slow", 9, 1, true, replica.ForgedBooking{
			ID: fmt.Sprintf("s%08d", n), Worker: catalog.WorkerRank{WorkerID: "w1"}, Hashes: []uint64{uint64(n)}, LeaseMS: 60000})
	})
	require.NoError(t, err)
	t.Cleanup(stop)
	require.NoError(t, slow.Publish(opsSubject("slow"), replica.ForgeBatch("slow", 9, 1)))
	eventually(t, func() bool { return pages.Load() >= 1 }, "a snapshot of the slow peer is under way")

	rng := rand.New(rand.NewPCG(27, 4))
	a.bus.setDown(true)
	var booked []string
	for range 5 {
		booked = append(booked, string(b.book(t, rng, 2)))
	}
	require.NoError(t, b.r.Flush())
	require.Empty(t, a.r.RemoteIDs("b"))
	healed := time.Now()
	a.bus.setDown(false)
	eventually(t, func() bool { return len(a.r.RemoteIDs("b")) == len(booked) }, "b's bookings re-learnt")
	took := time.Since(healed)
	require.Less(t, took, time.Second, "re-learning a healed peer")
	require.Positive(t, pages.Load())
	t.Logf("healed peer re-learnt in %v while the slow peer had served %d pages", took, pages.Load())
}

// A batch published on one replica's subject under another's ID is refused:
// a broker that lets each replica publish only on its own subject (NATS
// permissions) thereby keeps any one of them from speaking for another.
func TestOriginMustMatchSubject(t *testing.T) {
	h := newHub()
	a, b := newNode(t, h, "a", nil), newNode(t, h, "b", nil)
	rng := rand.New(rand.NewPCG(27, 5))
	a.book(t, rng, 2)
	requireConverged(t, a, b)
	st := a.r.Stats()
	forge(t, h, "x", replica.ForgeBatch(st.ID, st.Epoch, st.Seq+1, replica.ForgedBooking{
		ID: "forged", Worker: catalog.WorkerRank{WorkerID: "w1"}, Hashes: []uint64{1}, LeaseMS: 60000}))
	require.Equal(t, uint64(1), b.r.Stats().Refused["origin_mismatch"])
	require.NotContains(t, b.r.RemoteIDs("a"), "forged")
	require.Empty(t, b.r.RemoteIDs("x"))
}

// payloadBus is a hub member whose broker bound (PayloadLimiter) the test
// sets: 0 while "never connected".
type payloadBus struct {
	*member
	max atomic.Int64
}

func (b *payloadBus) MaxPayload() int { return int(b.max.Load()) }

// A replica started while its broker was unreachable sends messages within
// the broker's limit once it connects, not within the default it started
// with; one given an explicit MaxMessageBytes keeps it when the broker
// allows more.
func TestMessageBoundFollowsBroker(t *testing.T) {
	h := newHub()
	var pb *payloadBus
	wrap := func(m *member) replica.Bus { pb = &payloadBus{member: m}; return pb }
	a := newNodeWith(t, h, "a", wrap, nil)
	require.Equal(t, replica.DefaultMaxMessageBytes, a.r.Stats().MaxMessageBytes, "nothing known yet")
	a.bus.setDown(true)
	pb.max.Store(64 << 10)
	a.bus.setDown(false)
	require.Equal(t, 64<<10, a.r.Stats().MaxMessageBytes)
	pb.max.Store(8 << 20)
	a.bus.setDown(true)
	a.bus.setDown(false)
	require.Equal(t, 8<<20, a.r.Stats().MaxMessageBytes, "left to its default, the bound is the broker's")

	var pc *payloadBus
	wrapC := func(m *member) replica.Bus { pc = &payloadBus{member: m}; return pc }
	c := newNodeWith(t, h, "c", wrapC, func(o *replica.Options) { o.MaxMessageBytes = 256 << 10 })
	pc.max.Store(8 << 20)
	c.bus.setDown(true)
	c.bus.setDown(false)
	require.Equal(t, 256<<10, c.r.Stats().MaxMessageBytes, "an explicit bound is kept")
	pc.max.Store(64 << 10)
	c.bus.setDown(true)
	c.bus.setDown(false)
	require.Equal(t, 64<<10, c.r.Stats().MaxMessageBytes, "and lowered to the broker's")
}

// Output growth counts against a peer's block bound: a forger that books
// within it cannot grow its bookings past it one output block at a time.
func TestPeerOutputGrowthBounded(t *testing.T) {
	h := newHub()
	b := newNode(t, h, "b", func(o *replica.Options) { o.MaxPeerBlocks = 10 })
	forge(t, h, "x", replica.ForgeBatch("x", 7, 1, replica.ForgedBooking{ID: "g", Worker: catalog.WorkerRank{WorkerID: "w1"},
		Hashes: []uint64{1, 2, 3, 4, 5, 6, 7, 8}, LeaseMS: 60000}))
	for seq := uint64(2); seq < 12; seq++ {
		forge(t, h, "x", replica.ForgeSettle("x", 7, seq, "g", selection.SettleOutputBlock))
	}
	eventually(t, func() bool { return b.r.Stats().Refused["peer_full"] == 8 }, "8 output blocks refused")
	blocks := 0
	for _, l := range b.svc.Loads("") {
		blocks += l.ActiveBlocks
	}
	require.Equal(t, 10, blocks, "8 booked and 2 grown, no more")
}
