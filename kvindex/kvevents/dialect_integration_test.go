package kvevents

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/kvindex"
)

// These tests run every fake-engine dialect over real ZeroMQ sockets into a Feed,
// an IndexHandler and a real index, and require the index to end up holding what
// the engine's cache holds, with nothing skipped but what the dialect makes the
// handler skip by design.

const (
	dialectBlock    = 16
	dialectCapacity = 64
)

// dialectRig is one engine's stream into one index.
type dialectRig struct {
	t       *testing.T
	ix      *kvindex.Index
	handler *IndexHandler
	feed    *Feed
	prompts [][]uint32
	rng     *rand.Rand
}

func newDialectRig(t *testing.T) *dialectRig {
	t.Helper()
	ix, err := kvindex.New(kvindex.Options{BlockSize: dialectBlock})
	require.NoError(t, err)
	h, err := NewIndexHandler(ix, HandlerOptions{BlockSize: dialectBlock})
	require.NoError(t, err)
	feed, err := NewFeed(FeedOptions{
		Handler:      h,
		ReconnectMin: time.Millisecond, ReconnectMax: 20 * time.Millisecond,
		replayIdleTimeout: 2 * time.Second, replayTimeout: 10 * time.Second,
	})
	require.NoError(t, err)
	runFeed(t, feed)
	return &dialectRig{t: t, ix: ix, handler: h, feed: feed, rng: rand.New(rand.NewPCG(16, 64))}
}

// startDialectEngine starts a fake engine speaking d, with replay, on loopback.
func startDialectEngine(t *testing.T, d fakeengine.Dialect, mod func(*fakeengine.Options)) *fakeengine.Engine {
	t.Helper()
	o := d.Apply(fakeengine.Options{BlockSize: dialectBlock, CapacityBlocks: dialectCapacity, EnableReplay: true})
	if mod != nil {
		mod(&o)
	}
	e, err := fakeengine.New(o)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// serve sends n requests: one of four shared prefixes (1 to 4 blocks), then a
// unique tail of 1 to 6 blocks, mostly with a partial block, or now and then a
// prompt served before again (a hit, possibly of blocks evicted since).
func (r *dialectRig) serve(e *fakeengine.Engine, n int) {
	r.t.Helper()
	for range n {
		var p []uint32
		if len(r.prompts) > 0 && r.rng.IntN(5) == 0 {
			p = r.prompts[r.rng.IntN(len(r.prompts))]
		} else {
			group := r.rng.IntN(4)
			for i := range (group + 1) * dialectBlock {
				p = append(p, uint32(group*1000+i))
			}
			for range r.rng.IntN(6*dialectBlock) + dialectBlock {
				p = append(p, uint32(r.rng.IntN(5000)+10000))
			}
			r.prompts = append(r.prompts, p)
		}
		_, err := e.Serve(fakeengine.Request{Tokens: p})
		require.NoError(r.t, err)
	}
}

// converge waits until the handler has handled every batch the engine numbered,
// each exactly once, and returns the source's stats. The handler counts a
// batch (Batches, LastSeq) as it starts on it, before its events are applied;
// the source counts it (Applied) and takes it as its watermark once
// HandleBatch has returned; and a snapshot of the source's counters reads
// them one by one, so one taken as the last batches land may show the new
// watermark beside an older Applied: wait until all agree, then the counts
// are final.
func (r *dialectRig) converge(e *fakeengine.Engine, w catalog.WorkerRank) SourceStats {
	r.t.Helper()
	first, last := e.Options().FirstSeq, e.NextSeq()-1
	var st SourceStats
	var hs HandlerStats
	require.Eventually(r.t, func() bool {
		var ok bool
		st, ok = r.feed.SourceStats(w)
		hs = r.handler.Stats(w)
		return ok && st.Applied > 0 && st.Watermark == last && st.Queued == 0 && hs.LastSeq == last && hs.Batches == st.Applied
	}, waitFor, time.Millisecond, "feed never applied seq %d, each batch once; source %+v, handler %+v", last, &st, &hs)
	require.Equal(r.t, last-first+1, hs.Batches, "every batch handled once")
	return st
}

// check requires the index to agree with the engine on every prompt served and on
// the number of blocks held.
func (r *dialectRig) check(e *fakeengine.Engine, w catalog.WorkerRank) {
	r.t.Helper()
	hasher, err := kvindex.NewHasher(dialectBlock, kvindex.HashOptions{})
	require.NoError(r.t, err)
	for i, p := range r.prompts {
		got := 0
		for _, m := range r.ix.FindMatches(hasher.SeqHashes(p), kvindex.MatchOptions{Candidates: []catalog.WorkerRank{w}}) {
			require.Equal(r.t, w, m.Worker)
			got = m.Device
		}
		require.Equal(r.t, e.HeldPrefix(p, "", ""), got, "prompt %d (%d tokens)", i, len(p))
	}
	st := r.ix.Stats()
	require.Equal(r.t, e.Blocks(), st.Entries, "index entries vs engine blocks")
	require.Equal(r.t, 1, st.WorkerRanks)
	require.Zero(r.t, st.DroppedUnknownParent)
	require.Zero(r.t, st.UnknownRemoves)
	require.Zero(r.t, st.Rejected)
}

// checkSkips requires that nothing was skipped, except the mirror group's events
// of a hybrid model.
func (r *dialectRig) checkSkips(e *fakeengine.Engine, w catalog.WorkerRank) {
	r.t.Helper()
	hs := r.handler.Stats(w)
	require.Zero(r.t, hs.DecodeErrors)
	require.Zero(r.t, hs.StoresRejected)
	var want [NumSkipReasons]uint64
	if e.Options().HybridGroups {
		require.Positive(r.t, hs.Skipped[SkipNonMainGroup], "the mirror group is skipped")
		want[SkipNonMainGroup] = hs.Skipped[SkipNonMainGroup]
	}
	require.Equal(r.t, want, hs.Skipped, "skips by reason")
}

func TestDialectIntegrationDial(t *testing.T) {
	for _, d := range fakeengine.Dialects() {
		t.Run(d.String(), func(t *testing.T) {
			r := newDialectRig(t)
			e := startDialectEngine(t, d, nil)
			w := catalog.WorkerRank{WorkerID: "pod-" + d.String()}
			// Batches published before the feed subscribes come from the first
			// replay.
			r.serve(e, 8)
			require.NoError(t, r.feed.AddSource(SourceConfig{Worker: w, Endpoint: e.PubEndpoint(), ReplayEndpoint: e.ReplayEndpoint()}))
			require.NoError(t, e.WaitSubscribed(context.Background()))
			r.serve(e, 40)
			st := r.converge(e, w)
			require.Positive(t, e.Stats().Evictions, "the workload evicts")
			r.check(e, w)
			r.checkSkips(e, w)
			require.False(t, st.Degraded)
			require.Zero(t, st.Gaps)
			require.Zero(t, st.LostBatches)
			require.Zero(t, st.FramesSkipped)
			require.Zero(t, st.ReplaysFailed)
		})
	}
}

// TestDialectIntegrationBind has the engine dial into a bind listener, attributed
// by topic, and repairs a gap of dropped live batches by replay.
func TestDialectIntegrationBind(t *testing.T) {
	for _, d := range []fakeengine.Dialect{fakeengine.DialectTRTLLM, fakeengine.DialectExternal} {
		t.Run(d.String(), func(t *testing.T) {
			r := newDialectRig(t)
			w := catalog.WorkerRank{WorkerID: "bound-" + d.String(), Rank: 0}
			topic := fmt.Sprintf("kv@10.1.0.%d:8000@fake-model", d)
			var replay atomic.Pointer[string]
			addr, err := r.feed.Bind(BindConfig{
				Endpoint: "tcp://127.0.0.1:0",
				Attribute: func(tp string) (catalog.WorkerRank, bool) {
					return w, tp == topic
				},
				ReplayEndpoint: func(got catalog.WorkerRank) (string, bool) {
					ep := replay.Load()
					if got != w || ep == nil {
						return "", false
					}
					return *ep, true
				},
			})
			require.NoError(t, err)
			e := startDialectEngine(t, d, func(o *fakeengine.Options) {
				o.PubMode, o.PubEndpoint, o.Topic = fakeengine.PubDial, "tcp://"+addr.String(), topic
			})
			ep := e.ReplayEndpoint()
			replay.Store(&ep)
			require.NoError(t, e.WaitSubscribed(context.Background()))

			r.serve(e, 15)
			r.converge(e, w)
			e.DropNext(4)
			r.serve(e, 25)
			st := r.converge(e, w)
			require.Positive(t, e.Stats().Evictions, "the workload evicts")
			require.True(t, st.Bound)
			require.Positive(t, st.Gaps, "the dropped batches open a gap")
			require.Positive(t, st.ReplaysOK)
			require.Zero(t, st.ReplaysFailed)
			require.Zero(t, st.LostBatches)
			require.False(t, st.Degraded)
			r.check(e, w)
			r.checkSkips(e, w)
		})
	}
}
