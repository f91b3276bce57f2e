package kvevents

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

func TestNewFeedValidation(t *testing.T) {
	h := newBatchRecorder(t)
	cases := []struct {
		name string
		opts FeedOptions
	}{
		{"nil handler", FeedOptions{}},
		{"negative queue", FeedOptions{Handler: h, QueueLen: -1}},
		{"backoff min > max", FeedOptions{Handler: h, ReconnectMin: time.Second, ReconnectMax: time.Millisecond}},
		{"min above default max", FeedOptions{Handler: h, ReconnectMin: time.Minute}},
		{"negative idle", FeedOptions{Handler: h, replayIdleTimeout: -time.Second}},
		{"total below idle", FeedOptions{Handler: h, replayIdleTimeout: time.Minute, replayTimeout: time.Second}},
		{"negative replays", FeedOptions{Handler: h, maxConcurrentReplays: -2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f, err := NewFeed(tc.opts)
			require.ErrorIs(t, err, ErrInvalidOptions)
			require.Nil(t, f)
		})
	}
	f, err := NewFeed(FeedOptions{Handler: h})
	require.NoError(t, err)
	require.Equal(t, DefaultQueueLen, f.opts.QueueLen)
	require.Equal(t, DefaultReconnectMin, f.opts.ReconnectMin)
	require.Equal(t, DefaultReconnectMax, f.opts.ReconnectMax)
	require.Equal(t, defaultReplayIdleTimeout, f.opts.replayIdleTimeout)
	require.Equal(t, defaultReplayTimeout, f.opts.replayTimeout)
}

func TestAddSourceValidation(t *testing.T) {
	f, err := NewFeed(FeedOptions{Handler: newBatchRecorder(t)})
	require.NoError(t, err)
	w := catalog.WorkerRank{WorkerID: "w"}
	for _, cfg := range []SourceConfig{
		{Worker: catalog.WorkerRank{}, Endpoint: "tcp://10.0.0.5:5557"},
		{Worker: catalog.WorkerRank{WorkerID: "w", Rank: -1}, Endpoint: "tcp://10.0.0.5:5557"},
		{Worker: w, Endpoint: ""},
		{Worker: w, Endpoint: "10.0.0.5:5557"},
		{Worker: w, Endpoint: "udp://10.0.0.5:5557"},
		{Worker: w, Endpoint: "tcp://10.0.0.5"},
		{Worker: w, Endpoint: "tcp://10.0.0.5:0"},
		{Worker: w, Endpoint: "tcp://*:5557"},
		{Worker: w, Endpoint: "tcp://10.0.0.5:99999"},
		{Worker: w, Endpoint: "tcp://10.0.0.5:5557", ReplayEndpoint: "tcp://:5558"},
	} {
		require.ErrorIs(t, f.AddSource(cfg), ErrInvalidSource, "%+v", cfg)
	}
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: "tcp://10.0.0.5:5557", ReplayEndpoint: "tcp://10.0.0.5:5558"}))
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: "ipc:///tmp/kv.sock"}))
	require.ErrorIs(t, f.RemoveSource(catalog.WorkerRank{WorkerID: "other"}), ErrUnknownSource)
	require.NoError(t, f.RemoveSource(w))
	require.ErrorIs(t, f.RemoveSource(w), ErrUnknownSource)
}

func TestTopicWorker(t *testing.T) {
	cases := []struct {
		topic string
		want  string
		ok    bool
	}{
		{"kv@10.0.0.1:8000@meta-llama/Llama-3.1-8B", "10.0.0.1:8000", true},
		{"kv@10.0.0.1@m", "10.0.0.1", true},
		{"kv@10.0.0.1:8000@org/model@v2", "10.0.0.1:8000", true},
		{"kv@[fd00::1]:8000@m", "[fd00::1]:8000", true},
		{"kv@10.0.0.1:8000@", "10.0.0.1:8000", true},
		{"kv@@m", "", false},
		{"kv@10.0.0.1", "", false},
		{"", "", false},
		{"vllm", "", false},
		{"xx@10.0.0.1@m", "", false},
	}
	for _, tc := range cases {
		wr, ok := TopicWorker(tc.topic)
		require.Equal(t, tc.ok, ok, tc.topic)
		require.Equal(t, catalog.WorkerRank{WorkerID: tc.want}, wr, tc.topic)
	}
}

func TestFeedInOrder(t *testing.T) {
	rec := newBatchRecorder(t)
	f, err := NewFeed(testOpts(rec))
	require.NoError(t, err)
	eng := newTestEngine(t, engineOpts{topic: "kv@a@m"})
	w := catalog.WorkerRank{WorkerID: "a", Rank: 1}
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr}))
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr}), "same config again is a no-op")
	runFeed(t, f)
	eng.waitSubscribed(t)
	eng.publish(t, 200)
	rec.waitLast(t, w, 199)

	applied, resets := rec.state(w)
	require.Equal(t, seqRange(0, 199), applied)
	require.Zero(t, resets)
	// The recorder sees a batch before the feed counts it as applied.
	st := waitStats(t, f, w, "all applied", func(s SourceStats) bool { return s.Applied == 200 })
	require.True(t, st.Connected)
	require.False(t, st.Degraded)
	require.Equal(t, uint64(200), st.Received)
	require.Equal(t, uint64(200), st.Applied)
	require.Equal(t, uint64(199), st.LastSeq)
	require.Equal(t, uint64(199), st.Watermark)
	require.Zero(t, st.Gaps+st.LostBatches+st.FramesSkipped+st.Overflows+st.Restarts)
	require.Len(t, f.Stats(), 1)
}

func TestFeedDialsBeforePublisherExists(t *testing.T) {
	rec := newBatchRecorder(t)
	f, err := NewFeed(testOpts(rec))
	require.NoError(t, err)
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t))
	w := catalog.WorkerRank{WorkerID: "late"}
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: ep}))
	runFeed(t, f)
	st, _ := f.SourceStats(w)
	require.False(t, st.Connected)

	// The publisher appears after the feed started dialing.
	eng := newTestEngine(t, engineOpts{listen: ep})
	eng.waitSubscribed(t)
	eng.publish(t, 10)
	rec.waitLast(t, w, 9)
	waitStats(t, f, w, "connected", func(s SourceStats) bool { return s.Connected })

	// It goes away and comes back on the same port (same engine, same sequence): the
	// feed reconnects and the batches published while it was away are counted lost
	// (no replay endpoint).
	eng.close()
	waitStats(t, f, w, "disconnected", func(s SourceStats) bool { return !s.Connected })
	eng2 := newTestEngine(t, engineOpts{listen: ep})
	eng2.next = 15
	eng2.waitSubscribed(t)
	eng2.publish(t, 5)
	rec.waitLast(t, w, 19)
	st = waitStats(t, f, w, "reconnect counted", func(s SourceStats) bool { return s.Reconnects >= 1 })
	require.True(t, st.Degraded)
	require.Equal(t, uint64(5), st.LostBatches)
	applied, _ := rec.state(w)
	require.Equal(t, append(seqRange(0, 9), seqRange(15, 19)...), applied)
}

func TestFeedGapReplay(t *testing.T) {
	for _, withTopic := range []bool{false, true} {
		t.Run(fmt.Sprintf("topic frame %v", withTopic), func(t *testing.T) {
			rec := newBatchRecorder(t)
			f, err := NewFeed(testOpts(rec))
			require.NoError(t, err)
			eng := newTestEngine(t, engineOpts{topic: "t", replay: true, replayTopic: withTopic})
			w := catalog.WorkerRank{WorkerID: "w"}
			require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr, ReplayEndpoint: eng.replayAddr}))
			runFeed(t, f)
			eng.waitSubscribed(t)
			waitBootstrap(t, f, w)
			eng.publish(t, 30, 10, 11, 12, 13, 14)
			rec.waitLast(t, w, 29)
			eng.publish(t, 20, 30)
			rec.waitLast(t, w, 49)

			applied, resets := rec.state(w)
			require.Equal(t, seqRange(0, 49), applied, "every seq exactly once, in order")
			require.Zero(t, resets)
			st := waitStats(t, f, w, "replays counted", func(s SourceStats) bool { return s.ReplaysOK+s.ReplaysFailed == 3 && s.Applied == 50 })
			require.False(t, st.Degraded)
			require.Equal(t, uint64(2), st.Gaps)
			require.Equal(t, uint64(3), st.ReplaysOK, "the start-up replay and one per gap")
			require.Zero(t, st.ReplaysFailed+st.LostBatches)
			require.Equal(t, uint64(50), st.Applied)
			require.Equal(t, []uint64{0, 10, 30}, eng.replayRequests())
		})
	}
}

// TestFeedStartReplaysAnIdleEngine: a feed that starts next to a warm engine
// that publishes nothing more (a router restart during a lull) learns the
// engine's buffered history at once, without waiting for a live batch.
func TestFeedStartReplaysAnIdleEngine(t *testing.T) {
	rec := newBatchRecorder(t)
	f, err := NewFeed(testOpts(rec))
	require.NoError(t, err)
	eng := newTestEngine(t, engineOpts{replay: true})
	w := catalog.WorkerRank{WorkerID: "w"}
	eng.publish(t, 12) // before the feed exists; nobody receives these live
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr, ReplayEndpoint: eng.replayAddr}))
	runFeed(t, f)
	rec.waitLast(t, w, 11)
	applied, resets := rec.state(w)
	require.Equal(t, seqRange(0, 11), applied)
	require.Zero(t, resets)
	st := waitStats(t, f, w, "start-up replay", func(s SourceStats) bool { return s.ReplaysOK == 1 })
	require.False(t, st.Degraded)
	require.Zero(t, st.Received, "nothing arrived live")
	require.Equal(t, []uint64{0}, eng.replayRequests())
}

// waitBootstrap waits until the source's start-up replay has ended, so that
// what the test publishes next arrives live.
func waitBootstrap(t *testing.T, f *Feed, w catalog.WorkerRank) {
	t.Helper()
	waitStats(t, f, w, "start-up replay", func(s SourceStats) bool { return s.ReplaysOK+s.ReplaysFailed >= 1 })
}

func TestFeedJoinMidStreamReplaysFromZero(t *testing.T) {
	rec := newBatchRecorder(t)
	f, err := NewFeed(testOpts(rec))
	require.NoError(t, err)
	eng := newTestEngine(t, engineOpts{replay: true, replayTopic: true})
	w := catalog.WorkerRank{WorkerID: "w"}
	// History the feed never saw live.
	eng.publish(t, 20)
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr, ReplayEndpoint: eng.replayAddr}))
	runFeed(t, f)
	eng.waitSubscribed(t)
	eng.publish(t, 5)
	rec.waitLast(t, w, 24)
	applied, _ := rec.state(w)
	require.Equal(t, seqRange(0, 24), applied)
	st := waitStats(t, f, w, "replay counted", func(s SourceStats) bool { return s.ReplaysOK+s.ReplaysFailed > 0 })
	require.False(t, st.Degraded)
	require.Equal(t, []uint64{0}, eng.replayRequests())
}

func TestFeedReplayIncomplete(t *testing.T) {
	cases := []struct {
		name    string
		prepare func(e *testEngine)
		applied []uint64
		lost    uint64
	}{
		// The engine's buffer no longer holds 10-12: the replay starts at 13.
		{"started late", func(e *testEngine) { e.trim(13) }, append(seqRange(0, 9), seqRange(13, 29)...), 3},
		// The replay ends after two batches: 12-14 never arrive.
		{"truncated", func(e *testEngine) { e.mu.Lock(); e.replayMax = 2; e.mu.Unlock() }, append(seqRange(0, 11), seqRange(15, 29)...), 3},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rec := newBatchRecorder(t)
			f, err := NewFeed(testOpts(rec))
			require.NoError(t, err)
			eng := newTestEngine(t, engineOpts{replay: true})
			w := catalog.WorkerRank{WorkerID: "w"}
			require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr, ReplayEndpoint: eng.replayAddr}))
			runFeed(t, f)
			eng.waitSubscribed(t)
			waitBootstrap(t, f, w)
			eng.publish(t, 15, 10, 11, 12, 13, 14)
			tc.prepare(eng)
			eng.publish(t, 15)
			rec.waitLast(t, w, 29)
			applied, _ := rec.state(w)
			require.Equal(t, tc.applied, applied)
			st := waitStats(t, f, w, "replay counted", func(s SourceStats) bool { return s.ReplaysOK+s.ReplaysFailed == 2 })
			require.True(t, st.Degraded)
			require.Equal(t, tc.lost, st.LostBatches)
			require.Equal(t, uint64(1), st.ReplaysFailed)
			require.Equal(t, uint64(1), st.ReplaysOK, "the start-up replay of an empty buffer")
		})
	}
}

func TestFeedReplayUnreachable(t *testing.T) {
	rec := newBatchRecorder(t)
	f, err := NewFeed(testOpts(rec))
	require.NoError(t, err)
	eng := newTestEngine(t, engineOpts{})
	w := catalog.WorkerRank{WorkerID: "w"}
	dead := fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t))
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr, ReplayEndpoint: dead}))
	runFeed(t, f)
	eng.waitSubscribed(t)
	eng.publish(t, 10, 3, 4)
	rec.waitLast(t, w, 9)
	st, _ := f.SourceStats(w)
	require.True(t, st.Degraded)
	require.Equal(t, uint64(2), st.LostBatches)
	require.Equal(t, uint64(2), st.ReplaysFailed, "the start-up replay and the gap's")
}

func TestFeedGapWithoutReplayIsDegraded(t *testing.T) {
	rec := newBatchRecorder(t)
	f, err := NewFeed(testOpts(rec))
	require.NoError(t, err)
	eng := newTestEngine(t, engineOpts{})
	w := catalog.WorkerRank{WorkerID: "w"}
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr}))
	runFeed(t, f)
	eng.waitSubscribed(t)
	eng.publish(t, 20, 5, 6, 7)
	rec.waitLast(t, w, 19)
	applied, _ := rec.state(w)
	require.Equal(t, append(seqRange(0, 4), seqRange(8, 19)...), applied)
	st, _ := f.SourceStats(w)
	require.True(t, st.Degraded)
	require.Equal(t, uint64(3), st.LostBatches)
	require.Equal(t, uint64(1), st.Gaps)
	require.Zero(t, st.ReplaysOK+st.ReplaysFailed)
}

func TestFeedSequenceBackwardsResets(t *testing.T) {
	rec := newBatchRecorder(t)
	f, err := NewFeed(testOpts(rec))
	require.NoError(t, err)
	eng := newTestEngine(t, engineOpts{})
	w := catalog.WorkerRank{WorkerID: "w"}
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr}))
	runFeed(t, f)
	eng.waitSubscribed(t)
	eng.publish(t, 10)
	rec.waitLast(t, w, 9)
	eng.restart()
	eng.publish(t, 3)
	rec.waitUntil(t, "reset then 0-2", func() bool {
		return rec.resets[w] == 1 && len(rec.applied[w]) == 3
	})
	applied, resets := rec.state(w)
	require.Equal(t, seqRange(0, 2), applied, "only the new engine's batches remain")
	require.Equal(t, 1, resets)
	st, _ := f.SourceStats(w)
	require.Equal(t, uint64(1), st.Restarts)
	require.False(t, st.Degraded)
}

func TestFeedOverflowResyncs(t *testing.T) {
	for _, withReplay := range []bool{true, false} {
		t.Run(fmt.Sprintf("replay %v", withReplay), func(t *testing.T) {
			rec := newBatchRecorder(t)
			rec.gate, rec.entered = make(chan struct{}), make(chan struct{})
			opts := testOpts(rec)
			opts.QueueLen = 8
			f, err := NewFeed(opts)
			require.NoError(t, err)
			eng := newTestEngine(t, engineOpts{replay: withReplay})
			w := catalog.WorkerRank{WorkerID: "w"}
			cfg := SourceConfig{Worker: w, Endpoint: eng.addr}
			if withReplay {
				cfg.ReplayEndpoint = eng.replayAddr
			}
			require.NoError(t, f.AddSource(cfg))
			runFeed(t, f)
			eng.waitSubscribed(t)
			if withReplay {
				waitBootstrap(t, f, w)
			}

			// The Handler blocks on batch 0 while 300 more arrive.
			eng.publish(t, 300)
			<-rec.entered
			st := waitStats(t, f, w, "all received", func(s SourceStats) bool { return s.Received == 300 })
			require.GreaterOrEqual(t, st.Overflows, uint64(1))
			require.LessOrEqual(t, st.Queued, 8, "the queue stays bounded")
			require.Greater(t, st.Dropped, uint64(250))
			close(rec.gate)

			rec.waitLast(t, w, 299)
			applied, resets := rec.state(w)
			require.Equal(t, 1, resets, "one reset for the overflow")
			if withReplay {
				// The last batch may come from the replay: wait for its accounting.
				st = waitStats(t, f, w, "replay counted", func(s SourceStats) bool { return s.ReplaysOK+s.ReplaysFailed == 2 })
			} else {
				st, _ = f.SourceStats(w)
			}
			if withReplay {
				require.Equal(t, seqRange(0, 299), applied, "replay from 0 rebuilt everything")
				require.False(t, st.Degraded)
				require.Equal(t, uint64(2), st.ReplaysOK, "the start-up replay and the resync's")
			} else {
				require.True(t, st.Degraded)
				require.NotEmpty(t, applied)
				first := applied[0]
				require.Equal(t, seqRange(first, 299), applied, "contiguous from the resync point")
				require.Equal(t, first, st.LostBatches)
			}
		})
	}
}

func TestFeedBindMode(t *testing.T) {
	rec := newBatchRecorder(t)
	var logs syncLog
	opts := testOpts(rec)
	opts.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	f, err := NewFeed(opts)
	require.NoError(t, err)
	addr, err := f.Bind(BindConfig{Endpoint: "tcp://127.0.0.1:0", rank: 2})
	require.NoError(t, err)
	ep := "tcp://" + addr.String()
	runFeed(t, f)

	a := newTestEngine(t, engineOpts{dial: ep, topic: "kv@10.0.0.1:8000@org/model@v2"})
	b := newTestEngine(t, engineOpts{dial: ep, topic: "kv@10.0.0.2:8000@m"})
	stray := newTestEngine(t, engineOpts{dial: ep, topic: "not-a-kv-topic"})
	for _, e := range []*testEngine{a, b, stray} {
		e.waitSubscribed(t)
	}
	a.publish(t, 20, 7)
	b.publish(t, 10)
	stray.publish(t, 4)

	wa := catalog.WorkerRank{WorkerID: "10.0.0.1:8000", Rank: 2}
	wb := catalog.WorkerRank{WorkerID: "10.0.0.2:8000", Rank: 2}
	rec.waitLast(t, wa, 19)
	rec.waitLast(t, wb, 9)
	applied, _ := rec.state(wb)
	require.Equal(t, seqRange(0, 9), applied)
	applied, _ = rec.state(wa)
	require.Equal(t, append(seqRange(0, 6), seqRange(8, 19)...), applied)

	sa, ok := f.SourceStats(wa)
	require.True(t, ok)
	require.True(t, sa.Bound)
	require.Equal(t, ep, sa.Endpoint)
	require.True(t, sa.Degraded, "a gap in bind mode without replay degrades the source")
	require.Equal(t, uint64(1), sa.LostBatches)
	require.Eventually(t, func() bool {
		bs := f.BindStats()
		return len(bs) == 1 && bs[0].Unattributed == 4
	}, waitFor, time.Millisecond)
	bs := f.BindStats()
	require.Equal(t, addr.String(), bs[0].Addr)
	require.Equal(t, uint64(33), bs[0].Received)
	// The stray messages are said once, not dropped in silence.
	require.Equal(t, 1, strings.Count(logs.String(), "kind=unattributed_topic"), logs.String())
	require.Contains(t, logs.String(), `not-a-kv-topic`)

	// A removed bound source is created again from scratch by its next message.
	require.NoError(t, f.RemoveSource(wb))
	_, ok = f.SourceStats(wb)
	require.False(t, ok)
	b.publish(t, 1)
	st := waitStats(t, f, wb, "bound source re-created", func(s SourceStats) bool { return s.Applied == 1 })
	require.True(t, st.Degraded, "it starts mid-stream without history")
}

func TestFeedBindCustomAttribution(t *testing.T) {
	rec := newBatchRecorder(t)
	f, err := NewFeed(testOpts(rec))
	require.NoError(t, err)
	w := catalog.WorkerRank{WorkerID: "pod-a", Rank: 3}
	addr, err := f.Bind(BindConfig{Endpoint: "tcp://127.0.0.1:0", Attribute: func(topic string) (catalog.WorkerRank, bool) {
		return w, topic == "A"
	}})
	require.NoError(t, err)
	runFeed(t, f)
	e := newTestEngine(t, engineOpts{dial: "tcp://" + addr.String(), topic: "A"})
	e.waitSubscribed(t)
	e.publish(t, 5)
	rec.waitLast(t, w, 4)
}

func TestFeedRemoveAndReplaceWhileRunning(t *testing.T) {
	rec := newBatchRecorder(t)
	f, err := NewFeed(testOpts(rec))
	require.NoError(t, err)
	runFeed(t, f)
	e1 := newTestEngine(t, engineOpts{})
	w := catalog.WorkerRank{WorkerID: "w"}
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: e1.addr}))
	e1.waitSubscribed(t)
	e1.publish(t, 5)
	rec.waitLast(t, w, 4)

	// A new endpoint for the same worker rank: the old source stops, the new one
	// resets the worker before its first batch.
	e2 := newTestEngine(t, engineOpts{})
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: e2.addr}))
	e2.waitSubscribed(t)
	require.Eventually(t, func() bool { return len(e1.pub.(interface{ Topics() []string }).Topics()) == 0 },
		waitFor, time.Millisecond, "the old connection is closed")
	e2.publish(t, 3)
	rec.waitUntil(t, "new engine applied", func() bool { return len(rec.applied[w]) == 3 })
	applied, resets := rec.state(w)
	require.Equal(t, seqRange(0, 2), applied)
	require.Equal(t, 1, resets)

	// RemoveSource keeps the index.
	require.NoError(t, f.RemoveSource(w))
	_, ok := f.SourceStats(w)
	require.False(t, ok)
	require.Eventually(t, func() bool { return len(e2.pub.(interface{ Topics() []string }).Topics()) == 0 },
		waitFor, time.Millisecond, "the connection is closed")
	_, resets = rec.state(w)
	require.Equal(t, 1, resets, "RemoveSource does not reset")

}

func TestFeedRunOnce(t *testing.T) {
	rec := newBatchRecorder(t)
	f, err := NewFeed(testOpts(rec))
	require.NoError(t, err)
	// Sources and binds registered before Run are served and cleaned up by it.
	eng := newTestEngine(t, engineOpts{})
	w := catalog.WorkerRank{WorkerID: "w"}
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr}))
	_, err = f.Bind(BindConfig{Endpoint: "tcp://127.0.0.1:0"})
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	eng.waitSubscribed(t)
	require.ErrorIs(t, f.Run(ctx), ErrFeedRunning)
	cancel()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(waitFor):
		t.Fatal("Run did not return")
	}
	require.ErrorIs(t, f.Run(context.Background()), ErrFeedStopped)
	require.ErrorIs(t, f.AddSource(SourceConfig{Worker: w, Endpoint: eng.addr}), ErrFeedStopped)
	_, err = f.Bind(BindConfig{Endpoint: "tcp://127.0.0.1:0"})
	require.ErrorIs(t, err, ErrFeedStopped)
	st, ok := f.SourceStats(w)
	require.True(t, ok)
	require.False(t, st.Connected)
}

func TestFeedBindThenRunCancelled(t *testing.T) {
	f, err := NewFeed(testOpts(newBatchRecorder(t)))
	require.NoError(t, err)
	_, err = f.Bind(BindConfig{Endpoint: "tcp://127.0.0.1:0"})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, f.Run(ctx), context.Canceled, "a cancelled Run still closes the bound socket")
}

// A peer that accepts TCP but never speaks ZMTP must not block RemoveSource or Run's
// shutdown (go-zeromq reads the greeting without a deadline).
func TestFeedStopsDuringStalledHandshake(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	accepted := make(chan net.Conn, 4)
	acceptDone := make(chan struct{})
	go func() {
		defer close(acceptDone)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	t.Cleanup(func() {
		_ = l.Close()
		<-acceptDone
		close(accepted)
		for c := range accepted {
			_ = c.Close()
		}
	})

	f, err := NewFeed(testOpts(newBatchRecorder(t)))
	require.NoError(t, err)
	w := catalog.WorkerRank{WorkerID: "mute"}
	require.NoError(t, f.AddSource(SourceConfig{Worker: w, Endpoint: "tcp://" + l.Addr().String()}))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	var c net.Conn
	select {
	case c = <-accepted: // the feed is now stuck in the handshake
	case <-time.After(waitFor):
		t.Fatal("the feed never dialed")
	}
	accepted <- c // closed at cleanup
	removed := make(chan error, 1)
	go func() { removed <- f.RemoveSource(w) }()
	select {
	case err := <-removed:
		require.NoError(t, err)
	case <-time.After(waitFor):
		t.Fatal("RemoveSource blocked on a stalled handshake")
	}
	cancel()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(waitFor):
		t.Fatal("Run blocked on a stalled handshake")
	}
}

// syncLog is a log sink safe for the feed's goroutines.
type syncLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *syncLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *syncLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
