package kvevents

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex/kvevents/internal/zmtpguard"
)

// Errors returned by the Feed.
var (
	// ErrInvalidSource wraps every problem found in a SourceConfig or BindConfig.
	ErrInvalidSource = errors.New("kvevents: invalid source config")
	// ErrUnknownSource is returned by RemoveSource for a worker rank the feed does
	// not have; the call is a harmless no-op.
	ErrUnknownSource = errors.New("kvevents: unknown source")
	// ErrFeedRunning is returned by a second call to Run.
	ErrFeedRunning = errors.New("kvevents: feed already running")
	// ErrFeedStopped is returned by every method that would start something once Run
	// has returned: a Feed runs once.
	ErrFeedStopped = errors.New("kvevents: feed stopped")
)

// Defaults applied by NewFeed to zero FeedOptions fields.
const (
	DefaultQueueLen     = 4096
	DefaultReconnectMin = 100 * time.Millisecond
	DefaultReconnectMax = 5 * time.Second
)

// The transport's fixed limits (the defaults of the unexported FeedOptions
// fields, which only tests change).
const (
	defaultOverflowWait         = 100 * time.Millisecond
	defaultDialTimeout          = 5 * time.Second
	defaultReplayIdleTimeout    = 2 * time.Second
	defaultReplayTimeout        = 2 * time.Minute
	defaultMaxConcurrentReplays = 8
	defaultMaxBoundSources      = 4096
	defaultMaxFrameBytes        = 64 << 20
	defaultHandshakeTimeout     = 5 * time.Second
	defaultMaxPeers             = 256
	defaultMaxSeqJump           = 100_000
	// suspectConfirm is how many consecutive batches far ahead (see maxSeqJump)
	// confirm that a stream really moved on.
	suspectConfirm = 3
)

// FeedOptions configures a Feed. The zero value of every field except Handler means
// its documented default; negative values are errors.
type FeedOptions struct {
	// Handler receives every source's batches. Required.
	Handler Handler
	// QueueLen is the number of batches a source may hold between its socket and its
	// Handler calls (live batches also wait there while a replay runs). When it is
	// full the queue is dropped and the source resynchronised. Default 4096.
	QueueLen int
	// ReconnectMin and ReconnectMax bound the exponential backoff between dial
	// attempts of a source (jittered in [d/2, d]). Defaults 100 ms and 5 s;
	// ReconnectMin must not exceed ReconnectMax.
	ReconnectMin, ReconnectMax time.Duration
	// Logger receives connection notices and, rate-limited per kind, warnings of
	// lost, suspect and dropped batches, restarts, overflows and refused peers.
	// Nil: no logging; the counters in Stats carry the same information.
	Logger *slog.Logger

	// The transport's limits. Production uses the defaults; tests set smaller
	// ones. Zero means the default, negative is an error.

	// overflowWait is how long a source's receiver waits for room in a full queue
	// before dropping it and resynchronising, so a consumer that was briefly starved
	// of CPU does not cost a resync (while it waits, the engine's socket buffers
	// absorb the burst). It is not waited again until the resync has been handled.
	// A bind listener waits on behalf of one source, delaying the others. Default
	// 100 ms.
	overflowWait time.Duration
	// dialTimeout bounds one TCP connect. Default 5 s.
	dialTimeout time.Duration
	// replayIdleTimeout is how long a replay may wait for the next reply (the Handler's
	// time is not counted). Default 2 s.
	replayIdleTimeout time.Duration
	// replayTimeout bounds a whole replay exchange. Default 2 min; must not be below
	// replayIdleTimeout.
	replayTimeout time.Duration
	// maxConcurrentReplays limits the replays running at once across the feed, so a
	// network blip does not make every engine serve its whole buffer at once. Default 8.
	maxConcurrentReplays int
	// maxBoundSources limits how many worker ranks bind listeners may create from
	// topics (each has a queue and a goroutine). Messages for further ranks are
	// counted as unattributed. Default 4096.
	maxBoundSources int
	// maxFrameBytes is the largest ZMQ frame a peer may send (an engine's batch
	// payload is one frame); larger ones close the connection before any of it
	// is read. Default 64 MiB. Every connection, dialed or bound, runs through a
	// ZMTP guard (internal/zmtpguard) that checks the greeting, the READY, every
	// frame header and every command before the ZMQ library sees a byte, and
	// closes the connection on any violation (counted by reason in Refused).
	maxFrameBytes int64
	// handshakeTimeout bounds a peer's ZMTP greeting and READY, on dialed and
	// accepted connections. A bind listener shakes hands with each engine on a
	// goroutine of its own, so a silent peer delays no one. Default 5 s.
	handshakeTimeout time.Duration
	// maxPeers is the most connections a bind listener holds at once (in
	// handshake or open); more are closed at once and counted. Default 256.
	maxPeers int
	// maxSeqJump is how far ahead of a source's watermark a live batch may be
	// numbered and still be taken as a gap. A batch further ahead is suspect (a
	// forged or corrupt sequence number): it is dropped and counted
	// (SourceStats.Suspect) and moves nothing, unless suspectConfirm batches in a
	// row confirm it by numbering on from it, in which case the stream really
	// moved on and the source is reset and starts over from there. Default
	// 100000 (ten times vLLM's replay buffer).
	maxSeqJump uint64
}

func (o *FeedOptions) withDefaults() (FeedOptions, error) {
	out := *o
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOptions}, args...)...))
	}
	if out.Handler == nil {
		bad("Handler is nil")
	}
	defInt := func(name string, v *int, def int) {
		switch {
		case *v < 0:
			bad("%s %d < 0", name, *v)
		case *v == 0:
			*v = def
		}
	}
	defDur := func(name string, v *time.Duration, def time.Duration) {
		switch {
		case *v < 0:
			bad("%s %v < 0", name, *v)
		case *v == 0:
			*v = def
		}
	}
	if out.maxSeqJump == 0 {
		out.maxSeqJump = defaultMaxSeqJump
	}
	switch {
	case out.maxFrameBytes < 0:
		bad("maxFrameBytes %d < 0", out.maxFrameBytes)
	case out.maxFrameBytes == 0:
		out.maxFrameBytes = defaultMaxFrameBytes
	}
	defInt("maxPeers", &out.maxPeers, defaultMaxPeers)
	defDur("handshakeTimeout", &out.handshakeTimeout, defaultHandshakeTimeout)
	defInt("QueueLen", &out.QueueLen, DefaultQueueLen)
	defInt("maxConcurrentReplays", &out.maxConcurrentReplays, defaultMaxConcurrentReplays)
	defInt("maxBoundSources", &out.maxBoundSources, defaultMaxBoundSources)
	defDur("ReconnectMin", &out.ReconnectMin, DefaultReconnectMin)
	defDur("ReconnectMax", &out.ReconnectMax, DefaultReconnectMax)
	defDur("dialTimeout", &out.dialTimeout, defaultDialTimeout)
	defDur("overflowWait", &out.overflowWait, defaultOverflowWait)
	defDur("replayIdleTimeout", &out.replayIdleTimeout, defaultReplayIdleTimeout)
	defDur("replayTimeout", &out.replayTimeout, defaultReplayTimeout)
	if out.ReconnectMin > 0 && out.ReconnectMax > 0 && out.ReconnectMin > out.ReconnectMax {
		bad("ReconnectMin %v > ReconnectMax %v", out.ReconnectMin, out.ReconnectMax)
	}
	if out.replayIdleTimeout > 0 && out.replayTimeout > 0 && out.replayTimeout < out.replayIdleTimeout {
		bad("replayTimeout %v < replayIdleTimeout %v", out.replayTimeout, out.replayIdleTimeout)
	}
	return out, joinErrs(errs)
}

type feedState uint8

const (
	feedIdle feedState = iota
	feedRunning
	feedStopped
)

// Feed owns the transport of KV events from many engine publishers to one Handler: per
// source a SUB socket with its own reconnect loop, a bounded queue and one goroutine
// that calls the Handler in sequence order, plus optional bind listeners that engines
// dial into.
//
// A Feed is safe for concurrent use: AddSource, RemoveSource, Bind, Stats and
// BindStats may be called from any goroutine, before and during Run. Create
// it with NewFeed; the zero Feed is not usable. Run may be called once.
type Feed struct {
	opts      FeedOptions
	replaySem chan struct{}
	guard     *zmtpguard.Transport // the dial side's ZMTP guard
	notices   notices

	// life serialises the calls that start or stop sources (AddSource, RemoveSource,
	// Bind, Run's start and shutdown), so a source's Handler calls never
	// overlap with its replacement's. It is held while waiting for goroutines to exit.
	life sync.Mutex

	// mu guards the fields below; it is held for map operations only.
	mu       sync.Mutex
	state    feedState
	runCtx   context.Context
	sources  map[catalog.WorkerRank]*source
	removing map[catalog.WorkerRank]struct{} // bound ranks being forgotten
	nBound   int
	binds    []*binding

	wg sync.WaitGroup // every goroutine the feed starts
}

// NewFeed validates opts, applies defaults and returns an idle Feed. It starts nothing.
// Every problem found is reported, each wrapping ErrInvalidOptions (declared with the
// decoder's options).
func NewFeed(opts FeedOptions) (*Feed, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	f := &Feed{
		opts:      o,
		replaySem: make(chan struct{}, o.maxConcurrentReplays),
		sources:   make(map[catalog.WorkerRank]*source),
		removing:  make(map[catalog.WorkerRank]struct{}),
	}
	f.guard, err = zmtpguard.Register(f.guardLimits(), zmtpguard.Policy{Refused: f.refused})
	if err != nil {
		return nil, fmt.Errorf("%w: ZMTP guard: %w", ErrInvalidOptions, err)
	}
	return f, nil
}

// Run starts every source and bind listener added so far, and those added later,
// until ctx is done. It then stops them, closes every socket (including those bound
// before Run) and returns ctx.Err() only after every goroutine the feed started has
// exited. Pending batches in the queues are discarded. A second call returns
// ErrFeedRunning (or ErrFeedStopped once the first has returned).
func (f *Feed) Run(ctx context.Context) error {
	f.life.Lock()
	f.mu.Lock()
	switch f.state {
	case feedRunning:
		f.mu.Unlock()
		f.life.Unlock()
		return ErrFeedRunning
	case feedStopped:
		f.mu.Unlock()
		f.life.Unlock()
		return ErrFeedStopped
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	f.state, f.runCtx = feedRunning, runCtx
	for _, s := range f.sources {
		s.start(runCtx, &f.wg)
	}
	for _, b := range f.binds {
		b.start(runCtx, &f.wg)
	}
	f.mu.Unlock()
	f.life.Unlock()

	<-ctx.Done()

	f.life.Lock()
	defer f.life.Unlock()
	f.mu.Lock()
	f.state = feedStopped
	binds := f.binds
	srcs := slices.Collect(maps.Values(f.sources))
	f.mu.Unlock()
	cancel()
	for _, b := range binds {
		b.stop()
	}
	for _, s := range srcs {
		s.stop()
	}
	f.wg.Wait()
	return ctx.Err()
}

// AddSource registers a publisher to dial. Before Run it is only recorded; during Run
// it starts at once. Adding the same config again is a no-op. Adding a different
// config for a worker rank that already has one restarts that source: the old one is
// stopped (AddSource waits for its Handler calls to finish), then the new one calls
// Handler.ResetSource before its first batch, since its engine's history is unrelated
// to the old one. Errors: ErrInvalidSource (wrapped, one per problem), ErrFeedStopped.
func (f *Feed) AddSource(cfg SourceConfig) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	f.life.Lock()
	defer f.life.Unlock()
	f.mu.Lock()
	if f.state == feedStopped {
		f.mu.Unlock()
		return ErrFeedStopped
	}
	old := f.sources[cfg.Worker]
	if old != nil && !old.bound && old.cfg == cfg {
		f.mu.Unlock()
		return nil
	}
	if old != nil {
		delete(f.sources, cfg.Worker)
		if old.bound {
			f.nBound--
		}
	}
	f.mu.Unlock()
	if old != nil {
		old.stop() // outside mu: Stats and bind listeners keep working meanwhile
	}
	s := newSource(f, cfg, false)
	s.resetFirst = old != nil
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.state == feedStopped { // Run cannot stop while we hold life; kept for clarity
		return ErrFeedStopped
	}
	f.sources[cfg.Worker] = s
	if f.state == feedRunning {
		s.start(f.runCtx, &f.wg)
	}
	return nil
}

// RemoveSource stops the source of wr (dialed or created by a bind listener) and waits
// until its goroutines have exited: when it returns, no Handler call for wr is running
// or will follow. It removes nothing from the index: the Handler keeps what it was
// given (Handler.ResetSource clears it). Do not call it from inside a Handler method
// (it would wait for itself). A missing wr returns ErrUnknownSource.
//
// A worker rank that a bind listener attributes messages to again after its removal is
// created again, from scratch.
func (f *Feed) RemoveSource(wr catalog.WorkerRank) error {
	f.life.Lock()
	defer f.life.Unlock()
	f.mu.Lock()
	s := f.sources[wr]
	if s == nil {
		f.mu.Unlock()
		return fmt.Errorf("%w: %v", ErrUnknownSource, wr)
	}
	delete(f.sources, wr)
	if s.bound {
		f.nBound--
		// Keep bind listeners from re-creating wr until the old source has stopped.
		f.removing[wr] = struct{}{}
	}
	f.mu.Unlock()
	s.stop()
	if s.bound {
		f.mu.Lock()
		delete(f.removing, wr)
		f.mu.Unlock()
	}
	return nil
}

// Stats returns a snapshot of every source's counters, ordered by worker then rank.
// It reads atomics only; the sources' goroutines never wait for it.
func (f *Feed) Stats() []SourceStats {
	f.mu.Lock()
	srcs := slices.Collect(maps.Values(f.sources))
	f.mu.Unlock()
	out := make([]SourceStats, 0, len(srcs))
	for _, s := range srcs {
		out = append(out, s.stats())
	}
	slices.SortFunc(out, func(a, b SourceStats) int { return a.Worker.Compare(b.Worker) })
	return out
}
