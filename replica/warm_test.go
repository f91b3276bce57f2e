package replica_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/internal/logtest"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/selection"
)

// engines is a set of fake engines (real ZeroMQ PUB and replay ROUTER on
// loopback) and the workers that name them. Their replay buffers are short,
// so a replica that joins late cannot rebuild their caches from replays: only
// a warm start gives it its peers' index.
type engines struct {
	t       testing.TB
	es      []*fakeengine.Engine
	workers []catalog.Worker
	rng     *rand.Rand
}

func newEngines(t testing.TB, n int) *engines {
	t.Helper()
	g := &engines{t: t, rng: rand.New(rand.NewPCG(9, 9))}
	for i := range n {
		e, err := fakeengine.New(fakeengine.Options{BlockSize: 4, CapacityBlocks: 128, EnableReplay: true, ReplayBuffer: 64})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		require.NoError(t, e.Start(ctx))
		cancel()
		t.Cleanup(func() { _ = e.Close() })
		g.es = append(g.es, e)
		g.workers = append(g.workers, catalog.Worker{
			ID: fmt.Sprintf("e%d", i), Endpoint: fmt.Sprintf("127.0.0.%d:8000", i+1), DPSize: 1, BlockSize: 4,
			TotalKVBlocks: 128, MaxNumBatchedTokens: 1 << 16,
			KVEventEndpoints: map[int]string{0: e.PubEndpoint()}, ReplayEndpoint: e.ReplayEndpoint(),
		})
	}
	return g
}

func (g *engines) prompt() []uint32 {
	grp := g.rng.IntN(8)
	p := make([]uint32, 0, 96)
	for i := range 8 + 4*grp {
		p = append(p, uint32(grp*1000+i))
	}
	for range g.rng.IntN(40) + 1 {
		p = append(p, uint32(g.rng.IntN(60)+10000))
	}
	return p
}

// service builds a service with KV events following every engine, observed
// by r (when set), and waits until it has heard every engine live.
func (g *engines) service(r *replica.Replicator) *selection.SelectionService {
	g.t.Helper()
	b := selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).
		EventFeed(selection.FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond})
	if r != nil {
		b = b.Observe(r)
	}
	svc, err := b.Build(context.Background())
	require.NoError(g.t, err)
	g.t.Cleanup(func() { _ = svc.Close() })
	for _, w := range g.workers {
		_, err := svc.Workers().Upsert(w)
		require.NoError(g.t, err)
	}
	// A PUB drops what it sends before a subscription reaches it and cannot
	// tell its subscribers apart: publish until svc has heard every engine
	// (what it missed meanwhile it replays).
	require.Eventually(g.t, func() bool {
		st := svc.Events().Sources()
		heard := len(st) == len(g.es)
		for i, e := range g.es {
			if !heard || st[i].Received == 0 {
				heard = false
				_, err := e.Serve(fakeengine.Request{Tokens: g.prompt()})
				require.NoError(g.t, err)
			}
		}
		return heard
	}, 10*time.Second, 5*time.Millisecond)
	return svc
}

// route sends n requests through svc: pick and book, the chosen engine
// serves the prompt (and publishes what it stored and evicted), free.
func (g *engines) route(svc *selection.SelectionService, n int) {
	g.t.Helper()
	for range n {
		p := g.prompt()
		res, err := svc.SelectAndReserve(context.Background(), selection.Request{Tokens: p})
		require.NoError(g.t, err)
		var i int
		_, err = fmt.Sscanf(res.WorkerID, "e%d", &i)
		require.NoError(g.t, err)
		_, err = g.es[i].Serve(fakeengine.Request{Tokens: p})
		require.NoError(g.t, err)
		require.NoError(g.t, svc.Reservations().Free(res.ReservationID))
	}
}

// converge waits until svc applied every batch every engine numbered.
func (g *engines) converge(svc *selection.SelectionService) {
	g.t.Helper()
	require.Eventually(g.t, func() bool {
		st := svc.Events().Sources()
		if len(st) != len(g.es) {
			return false
		}
		for i, e := range g.es {
			if x := st[i]; x.Applied == 0 || x.Watermark != e.NextSeq()-1 || x.Queued > 0 {
				return false
			}
		}
		return true
	}, 20*time.Second, 2*time.Millisecond)
}

func indexOf(t testing.TB, svc *selection.SelectionService) []byte {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, svc.Events().WriteSnapshot(&buf))
	return buf.Bytes()
}

// warmNode is a replica with KV events: its Replicator (not started until
// start) and its service.
type warmNode struct {
	r   *replica.Replicator
	svc *selection.SelectionService
}

func newWarmNode(t testing.TB, g *engines, bus replica.Bus, id string, mod func(*replica.Options)) *warmNode {
	t.Helper()
	o := replica.Options{Bus: bus, ID: id, HeartbeatInterval: 50 * time.Millisecond, MaxMessageBytes: replica.MinMessageBytes}
	if mod != nil {
		mod(&o)
	}
	r, err := replica.New(o)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() }) // before the service's Close (cleanups run last first)
	n := &warmNode{r: r, svc: g.service(r)}
	return n
}

func (n *warmNode) start(t testing.TB) {
	t.Helper()
	require.NoError(t, n.r.Start(n.svc))
}

func waitSynced(t testing.TB, ns ...*warmNode) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, n := range ns {
		require.NoError(t, n.r.WaitSynced(ctx), "%s never synced", n.r.ID())
	}
}

// TestWarmStartJoinerEqualsPeer is the acceptance test: a replica that joins
// after 5,000 requests routed through its peer (whose engines can replay only
// their last 64 batches, so a cold replica cannot rebuild their caches) has,
// when it reports itself synced, an index equal to the peer's byte for byte:
// every model, every rank's blocks with their tiers, engine hashes and
// prefix chains, and each source's last batch.
func TestWarmStartJoinerEqualsPeer(t *testing.T) {
	g := newEngines(t, 4)
	h := newHub()
	a := newWarmNode(t, g, h.member(), "a", nil)
	a.start(t)
	waitSynced(t, a)
	require.True(t, a.r.Stats().Warm.Done)
	g.route(a.svc, 5000)
	g.converge(a.svc)

	b := newWarmNode(t, g, h.member(), "b", nil)
	g.converge(b.svc)
	require.NotEqual(t, indexOf(t, a.svc), indexOf(t, b.svc), "the joiner rebuilt its index cold: the test proves nothing")
	// Building b published on the engines until b heard them all: let a
	// apply those batches too, so that it holds what b replays after the cut.
	g.converge(a.svc)
	b.start(t)
	waitSynced(t, b)
	require.Equal(t, indexOf(t, a.svc), indexOf(t, b.svc), "the joiner's index when it reports synced")

	w := b.r.Stats().Warm
	require.True(t, w.Loaded)
	require.Equal(t, "a", w.From)
	require.Equal(t, 4, w.Resumed)
	require.Zero(t, w.Skipped)
	require.Greater(t, w.Bytes, int64(replica.MinMessageBytes), "the snapshot took several chunks")
	require.Zero(t, w.ChunksRefused)
	as := a.r.Stats().Warm
	require.EqualValues(t, 1, as.Served)
	require.GreaterOrEqual(t, as.ChunksServed, uint64(w.Bytes/replica.MinMessageBytes))
	for _, st := range b.svc.Events().Sources() {
		require.EqualValues(t, 1, st.Resumes, "%v", st.Worker)
		require.False(t, st.Degraded, "%v", st.Worker)
	}
}

// TestWarmStartAllCold: replicas that all start at once find no serving peer
// at first (each asks the others, which are not synced and say so at once)
// and all become synced, none waiting for WarmTimeout: no deadlock. One that
// asks after another has just synced cold may load its (cold) index; at
// least one starts cold.
func TestWarmStartAllCold(t *testing.T) {
	g := newEngines(t, 2)
	h := newHub()
	var ns []*warmNode
	for _, id := range []string{"a", "b", "c"} {
		ns = append(ns, newWarmNode(t, g, h.member(), id, nil))
	}
	for _, n := range ns {
		n.start(t)
	}
	// Each books at once, so that its first batch goes out within
	// BatchInterval and every peer hears it well inside the one
	// HeartbeatInterval it listens before asking (heartbeats alone could
	// land after it, and nobody would ask anybody).
	for _, n := range ns {
		res, err := n.svc.SelectAndReserve(context.Background(), selection.Request{Tokens: make([]uint32, 32)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = n.svc.Reservations().Free(res.ReservationID) })
		require.NoError(t, n.r.Flush())
	}
	waitSynced(t, ns...)
	refusedNotServing, cold := uint64(0), uint64(0)
	for _, n := range ns {
		w := n.r.Stats().Warm
		require.True(t, w.Done)
		require.Zero(t, w.Timeouts)
		if !w.Loaded {
			require.EqualValues(t, 1, w.Cold, n.r.ID())
		}
		cold += w.Cold
		refusedNotServing += w.ServeRefused["not_serving"]
	}
	require.Positive(t, cold, "someone must start cold")
	require.Positive(t, refusedNotServing, "no replica asked a peer: the test proves nothing")
}

// blockIndex is a Bus whose index requests never get an answer: each waits
// until its context ends, as for a peer that hangs.
type blockIndex struct {
	replica.Bus
	asked atomic.Int32
}

func (b *blockIndex) Request(ctx context.Context, subject string, data []byte) ([]byte, error) {
	if strings.Contains(subject, ".index.") {
		b.asked.Add(1)
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return b.Bus.Request(ctx, subject, data)
}

// syncBuffer is a log sink safe for concurrent writes and the test's reads.
type syncBuffer = logtest.Buffer

// TestWarmStartPeerNeverAnswers: a serving peer whose index never arrives
// holds the joiner back only for WarmTimeout; it then starts cold, says so at
// WARN, and reports itself synced.
func TestWarmStartPeerNeverAnswers(t *testing.T) {
	g := newEngines(t, 2)
	h := newHub()
	a := newWarmNode(t, g, h.member(), "a", nil)
	a.start(t)
	waitSynced(t, a)
	g.route(a.svc, 50)

	var logs syncBuffer
	bus := &blockIndex{Bus: h.member()}
	b := newWarmNode(t, g, bus, "b", func(o *replica.Options) {
		o.WarmTimeout = 400 * time.Millisecond
		o.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	began := time.Now()
	b.start(t)
	require.False(t, b.r.Synced())
	waitSynced(t, b)
	require.GreaterOrEqual(t, time.Since(began), 400*time.Millisecond, "synced before the warm start gave up")
	w := b.r.Stats().Warm
	require.EqualValues(t, 1, w.Timeouts)
	require.False(t, w.Loaded)
	require.EqualValues(t, 1, bus.asked.Load())
	require.Contains(t, logs.String(), "warm start timed out")
	require.Contains(t, logs.String(), "level=WARN")
}

// damage is a Bus that alters the chunks a joiner receives: f gets each one
// (with its number, from 0) and returns what the joiner receives. Answers to
// releases are left alone.
type damage struct {
	replica.Bus
	n atomic.Int32
	f func(i int, resp []byte) []byte
}

func (d *damage) Request(ctx context.Context, subject string, data []byte) ([]byte, error) {
	resp, err := d.Bus.Request(ctx, subject, data)
	// An index request: "KVSR", version, type, requester (length byte and
	// ID), flags (bit 0 release).
	if err != nil || !strings.Contains(subject, ".index.") || data[7+int(data[6])]&1 != 0 {
		return resp, err
	}
	return d.f(int(d.n.Add(1)-1), bytes.Clone(resp)), nil
}

// TestWarmStartRefusesDamagedChunks: a chunk damaged in transit (a flipped
// byte, a torn end) is refused and counted, asked again, and the transfer
// completes with an index equal to the peer's; a peer whose every chunk is
// damaged is given up after a few tries, counted, and so is the next one;
// the joiner then starts cold.
func TestWarmStartRefusesDamagedChunks(t *testing.T) {
	g := newEngines(t, 2)
	h := newHub()
	a := newWarmNode(t, g, h.member(), "a", nil)
	a.start(t)
	waitSynced(t, a)
	g.route(a.svc, 600)
	g.converge(a.svc)

	b := newWarmNode(t, g, &damage{Bus: h.member(), f: func(i int, resp []byte) []byte {
		switch i {
		case 1:
			resp[len(resp)/2] ^= 0x40 // a flipped byte in the data
		case 2:
			resp = resp[:len(resp)-7] // torn: the chunk asked again
		}
		return resp
	}}, "b", nil)
	// Building b published on the engines until b heard them all: let a
	// apply those batches too, so that it holds what b replays after the cut.
	g.converge(a.svc)
	b.start(t)
	waitSynced(t, b)
	w := b.r.Stats().Warm
	require.True(t, w.Loaded)
	require.EqualValues(t, 2, w.ChunksRefused)
	require.Equal(t, indexOf(t, a.svc), indexOf(t, b.svc))

	c := newWarmNode(t, g, &damage{Bus: h.member(), f: func(i int, resp []byte) []byte {
		if i > 0 {
			resp[len(resp)-1] ^= 1 // every chunk after the first: a bad checksum
		}
		return resp
	}}, "c", nil)
	c.start(t)
	waitSynced(t, c)
	w = c.r.Stats().Warm
	require.False(t, w.Loaded)
	require.EqualValues(t, 2, w.TransfersFailed, "a and b, both serving, both given up")
	require.EqualValues(t, 2*4, w.ChunksRefused, "per peer: refused, then asked again 3 times")
	require.EqualValues(t, 1, w.Cold)
}

// TestWarmStartOptions: the warm start's options are validated.
func TestWarmStartOptions(t *testing.T) {
	h := newHub()
	for _, o := range []replica.Options{
		{Bus: h.member(), WarmTimeout: -time.Second},
		{Bus: h.member(), HeartbeatInterval: time.Second, WarmTimeout: 2 * time.Second},
		{Bus: h.member(), MaxIndexBytes: -1},
		{Bus: h.member(), MaxIndexBytes: 100},
	} {
		_, err := replica.New(o)
		require.ErrorIs(t, err, replica.ErrInvalidOptions)
	}
}
