package kvevents_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/kvindex/kvevents"
)

// These tests run the whole path over real ZeroMQ sockets on loopback: a fake
// vLLM engine publishes the changes of its LRU prefix cache, the feed receives
// them, the handler decodes and applies them, and the index must end up holding
// exactly what the engine's cache holds.

const itBlock = 4

type rig struct {
	t       *testing.T
	ix      *kvindex.Index
	handler *kvevents.IndexHandler
	feed    *kvevents.Feed
	cancel  context.CancelFunc
	done    chan error
	prompts [][]uint32
	rng     *rand.Rand
}

func newRig(t *testing.T, wrap func(kvevents.Handler) kvevents.Handler, queueLen int) *rig {
	t.Helper()
	ix, err := kvindex.New(kvindex.Options{BlockSize: itBlock})
	require.NoError(t, err)
	h, err := kvevents.NewIndexHandler(ix, kvevents.HandlerOptions{BlockSize: itBlock})
	require.NoError(t, err)
	var handler kvevents.Handler = h
	if wrap != nil {
		handler = wrap(h)
	}
	feed, err := kvevents.NewFeed(kvevents.WithReplayTimeouts(kvevents.FeedOptions{
		Handler: handler, QueueLen: queueLen,
		ReconnectMin: time.Millisecond, ReconnectMax: 20 * time.Millisecond,
	}, 2*time.Second, 10*time.Second))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	r := &rig{t: t, ix: ix, handler: h, feed: feed, cancel: cancel, done: make(chan error, 1), rng: rand.New(rand.NewPCG(7, 7))}
	go func() { r.done <- feed.Run(ctx) }()
	t.Cleanup(r.stop)
	return r
}

func (r *rig) stop() {
	if r.cancel == nil {
		return
	}
	r.cancel()
	<-r.done
	r.cancel = nil
}

func newEngine(t *testing.T, mod func(*fakeengine.Options)) *fakeengine.Engine {
	t.Helper()
	o := fakeengine.Options{BlockSize: itBlock, CapacityBlocks: 48, EnableReplay: true}
	if mod != nil {
		mod(&o)
	}
	e, err := fakeengine.New(o)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// serve sends n requests drawn from a few shared prefixes, with partial blocks,
// and remembers them for checking.
func (r *rig) serve(e *fakeengine.Engine, n int) {
	for range n {
		group := r.rng.IntN(4)
		p := make([]uint32, 0, 64)
		for i := range 8 + group*2 { // shared system prompt of the group
			p = append(p, uint32(group*1000+i))
		}
		for range r.rng.IntN(24) + 1 {
			p = append(p, uint32(r.rng.IntN(50)+10000))
		}
		_, err := e.Serve(fakeengine.Request{Tokens: p})
		require.NoError(r.t, err)
		r.prompts = append(r.prompts, p)
	}
}

// converge waits until the feed has applied every batch the engine numbered.
func (r *rig) converge(e *fakeengine.Engine, w catalog.WorkerRank) kvevents.SourceStats {
	r.t.Helper()
	var st kvevents.SourceStats
	want := e.NextSeq() - 1
	require.Eventually(r.t, func() bool {
		var ok bool
		st, ok = r.feed.SourceStats(w)
		return ok && st.Applied > 0 && st.Watermark == want && st.Queued == 0
	}, 20*time.Second, 2*time.Millisecond, "feed never applied seq %d", want)
	return st
}

// check requires that the index agrees with the engine's cache on every prompt
// served and on the total number of blocks.
func (r *rig) check(e *fakeengine.Engine, w catalog.WorkerRank) {
	r.t.Helper()
	h, err := kvindex.NewHasher(itBlock, kvindex.HashOptions{})
	require.NoError(r.t, err)
	for _, p := range r.prompts {
		got := 0
		for _, m := range r.ix.FindMatches(h.SeqHashes(p), kvindex.MatchOptions{Candidates: []catalog.WorkerRank{w}}) {
			got = m.Device
		}
		require.Equal(r.t, e.HeldPrefix(p, "", ""), got, "prompt %v", p)
	}
	require.Equal(r.t, e.Blocks(), r.ix.Stats().Entries, "index entries vs engine blocks")
}

func TestIntegrationDialReplayRestart(t *testing.T) {
	for _, enc := range []fakeengine.Encoding{fakeengine.EncodingMap, fakeengine.EncodingArray} {
		t.Run(enc.String(), func(t *testing.T) {
			r := newRig(t, nil, 0)
			e := newEngine(t, func(o *fakeengine.Options) { o.Encoding = enc })
			w := catalog.WorkerRank{WorkerID: "pod-a"}
			// Batches published before the feed subscribes are recovered by the
			// first replay (the feed starts at seq 0 or replays from it).
			r.serve(e, 10)
			require.NoError(t, r.feed.AddSource(kvevents.SourceConfig{Worker: w, Endpoint: e.PubEndpoint(), ReplayEndpoint: e.ReplayEndpoint()}))
			require.NoError(t, e.WaitSubscribed(context.Background()))
			r.serve(e, 40)
			r.converge(e, w)
			r.check(e, w)

			// Lost batches: the gap is repaired by replay, exactly.
			e.DropNext(5)
			r.serve(e, 30)
			st := r.converge(e, w)
			r.check(e, w)
			require.False(t, st.Degraded)
			require.Positive(t, st.ReplaysOK)

			// The engine restarts: its cache is empty and its sequence starts over;
			// stale blocks must be gone once the feed sees the new stream.
			e.Restart()
			r.serve(e, 20)
			st = r.converge(e, w)
			require.Positive(t, st.Restarts)
			r.check(e, w)
		})
	}
}

func TestIntegrationNoReplayIsDegraded(t *testing.T) {
	r := newRig(t, nil, 0)
	e := newEngine(t, func(o *fakeengine.Options) { o.EnableReplay = false })
	w := catalog.WorkerRank{WorkerID: "pod-b"}
	require.NoError(t, r.feed.AddSource(kvevents.SourceConfig{Worker: w, Endpoint: e.PubEndpoint()}))
	require.NoError(t, e.WaitSubscribed(context.Background()))
	r.serve(e, 20)
	st := r.converge(e, w)
	require.False(t, st.Degraded)
	r.check(e, w)
	e.DropNext(3)
	r.serve(e, 10)
	st = r.converge(e, w)
	require.True(t, st.Degraded)
	require.EqualValues(t, 3, st.LostBatches)
	// Without replay the lost batches stay lost: the index may keep blocks whose
	// removal was lost, which is what Degraded tells the owner. It is not
	// cleared, since every later store would then have an unknown parent. The
	// next engine restart brings it back in line.
	e.Restart()
	r.prompts = nil
	r.serve(e, 10)
	st = r.converge(e, w)
	require.False(t, st.Degraded)
	r.check(e, w)
}

func TestIntegrationBindMode(t *testing.T) {
	r := newRig(t, nil, 0)
	addr, err := r.feed.Bind(kvevents.BindConfig{Endpoint: "tcp://127.0.0.1:0"})
	require.NoError(t, err)
	var engines []*fakeengine.Engine
	for i := range 2 {
		e := newEngine(t, func(o *fakeengine.Options) {
			o.PubMode = fakeengine.PubDial
			o.PubEndpoint = "tcp://" + addr.String()
			o.Topic = fmt.Sprintf("kv@10.0.0.%d:8000@org/model@v2", i+1)
			o.EnableReplay = false
		})
		require.NoError(t, e.WaitSubscribed(context.Background()))
		engines = append(engines, e)
	}
	for i, e := range engines {
		w := catalog.WorkerRank{WorkerID: fmt.Sprintf("10.0.0.%d:8000", i+1)}
		r.prompts = nil
		r.serve(e, 25)
		r.converge(e, w)
	}
	// Each worker rank holds exactly its own engine's blocks.
	require.Equal(t, engines[0].Blocks()+engines[1].Blocks(), r.ix.Stats().Entries)
	require.Equal(t, 2, r.ix.Stats().WorkerRanks)
}

// gate is a Handler that blocks every HandleBatch until it is opened, to make a
// source's queue overflow.
type gate struct {
	kvevents.Handler
	mu   sync.Mutex
	open chan struct{}
}

func (g *gate) HandleBatch(src catalog.WorkerRank, seq uint64, payload []byte) {
	g.mu.Lock()
	ch := g.open
	g.mu.Unlock()
	<-ch
	g.Handler.HandleBatch(src, seq, payload)
}

func TestIntegrationFloodResyncs(t *testing.T) {
	g := &gate{open: make(chan struct{})}
	r := newRig(t, func(h kvevents.Handler) kvevents.Handler { g.Handler = h; return g }, 8)
	e := newEngine(t, nil)
	w := catalog.WorkerRank{WorkerID: "pod-c"}
	require.NoError(t, r.feed.AddSource(kvevents.SourceConfig{Worker: w, Endpoint: e.PubEndpoint(), ReplayEndpoint: e.ReplayEndpoint()}))
	require.NoError(t, e.WaitSubscribed(context.Background()))
	r.serve(e, 200) // far more than the queue of 8 while the handler is stuck
	require.Eventually(t, func() bool {
		st, _ := r.feed.SourceStats(w)
		return st.Overflows > 0
	}, 20*time.Second, 2*time.Millisecond)
	st, _ := r.feed.SourceStats(w)
	require.LessOrEqual(t, st.Queued, 8)
	close(g.open)
	r.serve(e, 5)
	r.converge(e, w)
	r.check(e, w)
}
