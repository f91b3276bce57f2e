package kvevents

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvselect/kvselect/catalog"
)

// SourceConfig names one engine publisher the feed dials: one (worker, data-parallel
// rank) and its endpoints. With data parallelism each rank publishes on its own port
// (vLLM adds the rank to the configured port), so each rank is its own source.
type SourceConfig struct {
	// Worker is the worker rank the batches belong to. Worker.WorkerID must be non-empty
	// and Worker.Rank >= 0.
	Worker catalog.WorkerRank
	// Endpoint is the engine's PUB endpoint, "tcp://host:port" (port 1-65535) or
	// "ipc://path". Required.
	Endpoint string
	// ReplayEndpoint is the engine's replay ROUTER endpoint, same syntax. Optional:
	// without it gaps cannot be repaired and the source is marked degraded instead.
	ReplayEndpoint string
}

func (c SourceConfig) validate() error {
	var errs []error
	if c.Worker.WorkerID == "" {
		errs = append(errs, fmt.Errorf("%w: Worker.WorkerID is empty", ErrInvalidSource))
	}
	if c.Worker.Rank < 0 {
		errs = append(errs, fmt.Errorf("%w: Worker.Rank %d < 0", ErrInvalidSource, c.Worker.Rank))
	}
	if err := validateEndpoint(c.Endpoint, false); err != nil {
		errs = append(errs, fmt.Errorf("%w: Endpoint: %w", ErrInvalidSource, err))
	}
	if c.ReplayEndpoint != "" {
		if err := validateEndpoint(c.ReplayEndpoint, false); err != nil {
			errs = append(errs, fmt.Errorf("%w: ReplayEndpoint: %w", ErrInvalidSource, err))
		}
	}
	return joinErrs(errs)
}

// source is one worker rank's pipeline: for a dial source a receive goroutine (SUB
// socket, reconnect loop) feeding a bounded queue, and an apply goroutine draining it
// through a sequencer. A bound source has only the apply goroutine; its binding's
// receive goroutine fills the queue.
type source struct {
	feed  *Feed
	wr    catalog.WorkerRank
	cfg   SourceConfig // Endpoint is the bound address for a bound source
	bound bool

	st    counters
	queue chan item

	// resetFirst makes the apply goroutine call ResetSource before anything else: the
	// source replaced one with another endpoint, whose state must not survive.
	resetFirst bool

	stopped       atomic.Bool        // set before cancel: producers stop using the source
	resyncPending atomic.Bool        // a resync marker is queued and not yet handled
	cancel        context.CancelFunc // nil until started
	wg            sync.WaitGroup     // this source's goroutines

	// resume is the pending ResumeSource call (source_start.go), guarded by
	// resumeMu; resumeKick wakes the apply goroutine for it.
	resumeMu   sync.Mutex
	resume     *resumeReq
	resumeKick chan struct{}
}

func newSource(f *Feed, cfg SourceConfig, bound bool) *source {
	return &source{
		feed:  f,
		wr:    cfg.Worker,
		cfg:   cfg,
		bound: bound,
		queue: make(chan item, f.opts.QueueLen),

		resumeKick: make(chan struct{}, 1),
	}
}

// start launches the source's goroutines under parent. fwg is the feed's WaitGroup;
// the caller guarantees it is not being waited on with a zero count.
func (s *source) start(parent context.Context, fwg *sync.WaitGroup) {
	ctx, cancel := context.WithCancel(parent)
	s.cancel = cancel
	seq := &sequencer{src: s.wr, h: s.feed.opts.Handler, st: &s.st, maxJump: s.feed.opts.maxSeqJump, note: s.feed.notice}
	if s.cfg.ReplayEndpoint != "" {
		ep := s.cfg.ReplayEndpoint
		seq.replay = func(ctx context.Context, start uint64, yield func(frame)) error {
			return s.feed.replay(ctx, ep, start, &s.st, yield)
		}
	}
	n := 1
	if !s.bound {
		n = 2
	}
	fwg.Add(n)
	s.wg.Add(n)
	go func() {
		defer fwg.Done()
		defer s.wg.Done()
		s.applyLoop(ctx, seq)
	}()
	if !s.bound {
		go func() {
			defer fwg.Done()
			defer s.wg.Done()
			s.recvLoop(ctx)
		}()
	}
}

// stop cancels the source and waits until its goroutines have exited: after stop
// returns, no Handler call for this source is running or will start.
func (s *source) stop() {
	s.stopped.Store(true)
	if s.cancel != nil {
		s.cancel()
	}
	s.wg.Wait()
	s.st.connected.Store(false)
	s.dropResume()
}

// push hands one item to the apply goroutine. When the queue is full it waits up to
// overflowWait (FeedOptions) for room (the apply goroutine may merely be waiting for a
// CPU), unless an overflow is already pending (the apply goroutine has not even reached
// the last resync marker: it is stuck). Then everything queued is dropped and a resync
// marker takes its place, followed by the incoming batch: memory stays bounded and the
// apply goroutine resets the source before applying anything newer.
func (s *source) push(ctx context.Context, it item) {
	select {
	case s.queue <- it:
		return
	default:
	}
	if !s.resyncPending.Load() {
		t := time.NewTimer(s.feed.opts.overflowWait)
		select {
		case s.queue <- it:
			t.Stop()
			return
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
	s.resyncPending.Store(true)
	var dropped uint64
drain:
	for {
		select {
		case old := <-s.queue:
			if old.kind == itemBatch {
				dropped++
			}
		default:
			break drain
		}
	}
	s.st.overflows.Add(1)
	s.st.dropped.Add(dropped)
	// Only producers send and the queue was just emptied, so both sends succeed unless
	// the queue holds a single slot; then the batch is dropped too (the resync covers it).
	select {
	case s.queue <- item{kind: itemResync}:
	default:
	}
	select {
	case s.queue <- it:
	default:
		s.st.dropped.Add(1)
	}
}

// applyLoop is the only goroutine that calls the Handler for this source.
func (s *source) applyLoop(ctx context.Context, seq *sequencer) {
	if s.resetFirst {
		seq.reset()
	}
	// With a replay endpoint, start from the engine's buffered history rather than
	// waiting for its next batch: a router that starts (or restarts) next to a
	// warm, idle engine learns what it caches at once. Live batches wait in the
	// queue meanwhile and those the replay covered are dropped as stale. An
	// engine with nothing buffered (or not up yet) ends or fails the replay at
	// once; either way the first live batch then drives the source as usual.
	// A resume (ResumeSource before Run) takes the place of that replay.
	if !s.runResume(ctx, seq) && seq.replay != nil {
		seq.replayFrom(ctx, 0, 0)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.resumeKick:
			s.runResume(ctx, seq)
		case it := <-s.queue:
			if it.kind == itemResync {
				s.resyncPending.Store(false)
			}
			seq.handle(ctx, it)
		}
	}
}

// recvLoop dials the publisher, reads until the connection fails, and dials again with
// exponential backoff, until ctx is done. go-zeromq gives up dialing on its own, so this
// loop is the reconnect logic.
func (s *source) recvLoop(ctx context.Context) {
	bo := s.feed.newBackoff()
	connectedBefore := false
	failures := 0 // consecutive failed attempts: only the first is logged at info level
	for ctx.Err() == nil {
		sctx, scancel := context.WithCancel(ctx)
		sock := zmq4.NewSub(sctx, s.feed.socketOptions()...)
		err := sock.Dial(s.feed.dialEndpoint(s.cfg.Endpoint))
		if err == nil {
			err = sock.SetOption(zmq4.OptionSubscribe, "")
		}
		if err == nil {
			if connectedBefore {
				s.st.reconnects.Add(1)
			}
			connectedBefore = true
			failures = 0
			bo.reset()
			s.st.connected.Store(true)
			s.feed.logf("kvevents: %v: connected to %s", s.wr, s.cfg.Endpoint)
			err = s.readLoop(ctx, sock)
			s.st.connected.Store(false)
		}
		closeSocket(sock)
		scancel()
		if ctx.Err() != nil {
			return
		}
		d := bo.next()
		failures++
		if failures == 1 {
			s.feed.logf("kvevents: %v: %s: %v; retrying in %v (further failures are logged at debug level)", s.wr, s.cfg.Endpoint, err, d)
		} else {
			s.feed.debugf("kvevents: %v: %s: attempt %d: %v; retrying in %v", s.wr, s.cfg.Endpoint, failures, err, d)
		}
		if !s.feed.sleep(ctx, d) {
			return
		}
	}
}

// readLoop reads live messages until the socket reports an error.
func (s *source) readLoop(ctx context.Context, sock zmq4.Socket) error {
	for {
		msg, err := sock.Recv()
		if err != nil {
			return err
		}
		if msg.Type == zmq4.CmdMsg {
			continue // a ZMTP command (PING), not a message
		}
		f, err := parseLiveFrames(msg.Frames)
		if err != nil {
			s.st.framesSkipped.Add(1)
			s.feed.drop("bad_frames", s.wr.String(), "error", err)
			continue
		}
		s.deliver(ctx, f)
	}
}

// deliver queues one live batch. zmq4 allocates a fresh buffer for every frame it
// reads, so the payload is handed over without a copy.
func (s *source) deliver(ctx context.Context, f frame) {
	s.st.received.Add(1)
	s.st.lastSeq.Store(f.Seq)
	s.push(ctx, item{seq: f.Seq, payload: f.Payload})
}

func (s *source) stats() SourceStats {
	out := SourceStats{Worker: s.wr, Endpoint: s.cfg.Endpoint, Bound: s.bound, Queued: len(s.queue)}
	s.st.snapshot(&out)
	return out
}
