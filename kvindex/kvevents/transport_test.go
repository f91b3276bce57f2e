package kvevents

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

// waitFor bounds every wait for asynchronous network delivery in these tests.
const waitFor = 10 * time.Second

// payloadFor is the payload the test publisher sends with seq: the batchRecorder checks that
// every applied batch carries its own payload.
func payloadFor(seq uint64) []byte { return []byte("payload-" + strconv.FormatUint(seq, 10)) }

// batchRecorder is a Handler that models the index as "the set of seqs applied since the
// last reset" per source, checks the Handler contract (no overlapping calls for one
// source, payload matches seq) and lets tests wait for progress.
type batchRecorder struct {
	t *testing.T

	mu      sync.Mutex
	applied map[catalog.WorkerRank][]uint64 // since the last reset, in call order
	resets  map[catalog.WorkerRank]int
	calls   int
	changed chan struct{} // closed and replaced on every call

	inFlight sync.Map // catalog.WorkerRank -> *atomic.Int32

	// gate, when non-nil, blocks HandleBatch until it is closed (a slow consumer);
	// entered is closed on the first blocked call.
	gate    chan struct{}
	entered chan struct{}
	once    sync.Once
}

func newBatchRecorder(t *testing.T) *batchRecorder {
	return &batchRecorder{
		t:       t,
		applied: make(map[catalog.WorkerRank][]uint64),
		resets:  make(map[catalog.WorkerRank]int),
		changed: make(chan struct{}),
	}
}

func (r *batchRecorder) enter(src catalog.WorkerRank) func() {
	v, _ := r.inFlight.LoadOrStore(src, new(atomic.Int32))
	n := v.(*atomic.Int32)
	if n.Add(1) != 1 {
		r.t.Errorf("overlapping Handler calls for %v", src)
	}
	return func() { n.Add(-1) }
}

func (r *batchRecorder) HandleBatch(src catalog.WorkerRank, seq uint64, payload []byte) {
	defer r.enter(src)()
	if string(payload) != string(payloadFor(seq)) {
		r.t.Errorf("%v seq %d: payload %q", src, seq, payload)
	}
	if r.gate != nil {
		r.once.Do(func() { close(r.entered) })
		<-r.gate
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.applied[src] = append(r.applied[src], seq)
	r.bump()
}

func (r *batchRecorder) ResetSource(src catalog.WorkerRank) {
	defer r.enter(src)()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.applied[src] = nil
	r.resets[src]++
	r.bump()
}

func (r *batchRecorder) bump() {
	r.calls++
	close(r.changed)
	r.changed = make(chan struct{})
}

// state returns the seqs applied to src since its last reset and its reset count.
func (r *batchRecorder) state(src catalog.WorkerRank) ([]uint64, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.applied[src]), r.resets[src]
}

// waitUntil waits until cond (evaluated under the batchRecorder's lock) holds.
func (r *batchRecorder) waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(waitFor)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		ok, ch := cond(), r.changed
		r.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-ch:
		case <-deadline.C:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// waitLast waits until the last seq applied to src (since its last reset) is seq.
func (r *batchRecorder) waitLast(t *testing.T, src catalog.WorkerRank, seq uint64) {
	t.Helper()
	r.waitUntil(t, fmt.Sprintf("%v to apply seq %d", src, seq), func() bool {
		a := r.applied[src]
		return len(a) > 0 && a[len(a)-1] == seq
	})
}

// seqRange returns [from, to] as a slice.
func seqRange(from, to uint64) []uint64 {
	var out []uint64
	for s := from; s <= to; s++ {
		out = append(out, s)
	}
	return out
}

// testEngine is a tiny vLLM-like publisher: a PUB socket and, optionally, a replay
// ROUTER that serves its buffered batches. It is independent of internal/fakeengine.
type testEngine struct {
	t     *testing.T
	topic []byte
	pub   zmq4.Socket
	addr  string // tcp://127.0.0.1:port of the PUB (bind mode: the address dialed)

	router     zmq4.Socket
	replayAddr string
	stopReplay context.CancelFunc
	wg         sync.WaitGroup

	mu  sync.Mutex
	buf []uint64 // seqs the replay server holds, oldest first
	// replayTopic selects the v0.26 reply layout [topic, seq, payload]; false sends
	// the older [seq, payload].
	replayTopic bool
	// replayMax, when > 0, truncates every replay after that many batches.
	replayMax int
	requests  []uint64 // start seqs asked for
	next      uint64
}

type engineOpts struct {
	topic       string
	replay      bool
	replayTopic bool
	listen      string // PUB bind endpoint; default tcp://127.0.0.1:0
	dial        string // when set, the PUB dials this endpoint instead of binding
}

func newTestEngine(t *testing.T, o engineOpts) *testEngine {
	t.Helper()
	e := &testEngine{t: t, topic: []byte(o.topic), replayTopic: o.replayTopic}
	e.pub = zmq4.NewPub(context.Background(), zmq4.WithLogger(discardLog))
	if o.dial != "" {
		require.NoError(t, e.pub.Dial(o.dial))
		e.addr = o.dial
	} else {
		ep := o.listen
		if ep == "" {
			ep = "tcp://127.0.0.1:0"
		}
		require.NoError(t, e.pub.Listen(ep))
		e.addr = "tcp://" + e.pub.Addr().String()
	}
	if o.replay {
		ctx, cancel := context.WithCancel(context.Background())
		e.stopReplay = cancel
		e.router = zmq4.NewRouter(ctx, zmq4.WithLogger(discardLog))
		require.NoError(t, e.router.Listen("tcp://127.0.0.1:0"))
		e.replayAddr = "tcp://" + e.router.Addr().String()
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			e.serveReplay(ctx)
		}()
	}
	t.Cleanup(e.close)
	return e
}

func (e *testEngine) close() {
	e.mu.Lock()
	pub := e.pub
	e.pub = nil
	e.mu.Unlock()
	if pub != nil {
		_ = pub.Close()
	}
	if e.router != nil {
		e.stopReplay()
		closeSocket(e.router)
		e.wg.Wait()
	}
}

// waitSubscribed waits until a subscriber's subscription reached the PUB, so nothing
// published afterwards is dropped by the PUB's topic filter.
func (e *testEngine) waitSubscribed(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		return len(e.pub.(zmq4.Topics).Topics()) > 0
	}, waitFor, time.Millisecond, "no subscriber reached the publisher")
}

// publish sends n batches with the next seqs; the ones in drop are buffered for replay
// but not sent.
func (e *testEngine) publish(t *testing.T, n int, drop ...uint64) {
	t.Helper()
	for range n {
		e.mu.Lock()
		seq := e.next
		e.next++
		e.buf = append(e.buf, seq)
		e.mu.Unlock()
		if slices.Contains(drop, seq) {
			continue
		}
		msg := zmq4.NewMsgFrom(e.topic, seq8(seq), payloadFor(seq))
		require.NoError(t, e.pub.SendMulti(msg))
	}
}

// restart models an engine restart: sequence back to 0 and an empty replay buffer.
func (e *testEngine) restart() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.next, e.buf = 0, nil
}

// trim drops buffered batches below seq (the replay ring rolled over).
func (e *testEngine) trim(seq uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.buf = slices.DeleteFunc(e.buf, func(s uint64) bool { return s < seq })
}

func (e *testEngine) replayRequests() []uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.requests)
}

func (e *testEngine) serveReplay(ctx context.Context) {
	for {
		msg, err := e.router.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			continue
		}
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 0 || len(msg.Frames[2]) != 8 {
			continue // malformed request: ignored, as vLLM does
		}
		id := msg.Frames[0]
		start := seqOf(msg.Frames[2])
		e.mu.Lock()
		e.requests = append(e.requests, start)
		var seqs []uint64
		for _, s := range e.buf {
			if s >= start && (e.replayMax == 0 || len(seqs) < e.replayMax) {
				seqs = append(seqs, s)
			}
		}
		withTopic := e.replayTopic
		e.mu.Unlock()
		reply := func(seq []byte, payload []byte) {
			frames := [][]byte{id, {}}
			if withTopic {
				frames = append(frames, e.topic)
			}
			frames = append(frames, seq, payload)
			_ = e.router.Send(zmq4.NewMsgFrom(frames...))
		}
		for _, s := range seqs {
			reply(seq8(s), payloadFor(s))
		}
		reply(seq8(replayEndSeq), []byte{})
	}
}

func seqOf(b []byte) uint64 {
	f, err := parseLiveFrames([][]byte{nil, b, nil})
	if err != nil {
		return 0
	}
	return f.Seq
}

// testOpts are feed options with tiny timeouts, so failure paths finish quickly.
func testOpts(h Handler) FeedOptions {
	return FeedOptions{
		Handler:           h,
		ReconnectMin:      5 * time.Millisecond,
		ReconnectMax:      50 * time.Millisecond,
		dialTimeout:       time.Second,
		overflowWait:      time.Millisecond,
		replayIdleTimeout: time.Second,
		replayTimeout:     5 * time.Second,
	}
}

// runFeed starts f.Run in the background and, at cleanup, cancels it and checks that it
// returned context.Canceled.
func runFeed(t *testing.T, f *Feed) context.CancelFunc {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.ErrorIs(t, err, context.Canceled)
		case <-time.After(waitFor):
			t.Errorf("Run did not return after cancel")
		}
	})
	return cancel
}

// waitStats waits until the source's stats satisfy cond.
func waitStats(t *testing.T, f *Feed, wr catalog.WorkerRank, what string, cond func(SourceStats) bool) SourceStats {
	t.Helper()
	var last SourceStats
	require.Eventually(t, func() bool {
		st, ok := f.SourceStats(wr)
		last = st
		return ok && cond(st)
	}, waitFor, time.Millisecond, "waiting for %s; last stats %+v", what, &last)
	return last
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	return port
}
