package kvevents

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/go-zeromq/zmq4"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex/kvevents/internal/zmtpguard"
)

// BindConfig configures a bind listener: a SUB socket the feed binds, which engines
// dial into (vLLM connects its PUB instead of binding when its endpoint names a
// concrete host). Messages are attributed to worker ranks by topic; each attributed
// rank becomes a bound source with its own queue, sequence tracking and apply goroutine.
type BindConfig struct {
	// Endpoint is where to bind: "tcp://host:port" ("*" or an empty host for all
	// interfaces; port 0 for any free port, see the address Bind returns) or
	// "ipc://path". Required.
	Endpoint string
	// Attribute maps a message topic to the worker rank it belongs to; false drops the
	// message (counted in BindStats.Unattributed). It is called from the listener's
	// goroutine, once per new topic (results are cached). Nil uses TopicWorker, whose
	// ranks are 0; engines with data parallelism need an Attribute that knows the
	// rank (vLLM offsets each rank's endpoint port by the rank, so rank r of every
	// engine dials the listener on base port + r).
	Attribute func(topic string) (catalog.WorkerRank, bool)
	// ReplayEndpoint optionally maps a worker rank to its replay ROUTER endpoint ("" or
	// false: none). Without it, gaps of bound sources are not repaired and the source
	// is marked degraded.
	ReplayEndpoint func(catalog.WorkerRank) (string, bool)
	// Admit decides whether a peer that connects (tcp endpoints) may speak at all,
	// by its IP address; an error closes the connection before any of its bytes
	// is read (counted as not_admitted in Feed.Refused). Nil admits every peer:
	// then anyone who reaches the port can publish as any worker.
	Admit func(peer net.IP) error
	// Peer decides whether a message with topic may come from peer (tcp
	// endpoints), for example whether the topic's worker is the one at that
	// address; an error drops the message (topic_refused). Nil accepts every
	// topic from every admitted peer.
	Peer func(peer net.IP, topic string) error

	// rank replaces the rank TopicWorker gives when Attribute is nil. Set by
	// tests.
	rank int
}

// excerptTopic is a topic for a log line: at most 128 bytes, quoted.
func excerptTopic(t []byte) string {
	if len(t) > 128 {
		t = t[:128]
	}
	return strconv.Quote(string(t))
}

// ipOf returns the IP of a TCP peer address, or nil.
func ipOf(a net.Addr) net.IP {
	if ta, ok := a.(*net.TCPAddr); ok {
		return ta.IP
	}
	return nil
}

// admitBy adapts BindConfig.Admit to the guard's policy (nil stays nil).
func admitBy(admit func(net.IP) error) func(net.Addr) error {
	if admit == nil {
		return nil
	}
	return func(a net.Addr) error { return admit(ipOf(a)) }
}

// peerTopic adapts BindConfig.Peer to the guard's message policy.
func peerTopic(peer func(net.IP, string) error) func(net.Addr, []byte) error {
	if peer == nil {
		return nil
	}
	return func(a net.Addr, topic []byte) error { return peer(ipOf(a), string(topic)) }
}

// TopicWorker parses the topic convention "kv@<host>[:port]@<model>" used by llm-d
// and its guides: the worker is the text between the first and the second '@' and must
// be non-empty; the model is everything after the second '@' and may itself contain
// '@'. The returned rank is 0. It reports false for any other topic.
func TopicWorker(topic string) (catalog.WorkerRank, bool) {
	rest, ok := strings.CutPrefix(topic, "kv@")
	if !ok {
		return catalog.WorkerRank{}, false
	}
	worker, _, ok := strings.Cut(rest, "@")
	if !ok || worker == "" {
		return catalog.WorkerRank{}, false
	}
	return catalog.WorkerRank{WorkerID: worker}, true
}

// maxTopicCache bounds a listener's topic-to-source cache; topics beyond it are
// attributed on every message.
const maxTopicCache = 4096

// binding is one bind listener.
type binding struct {
	feed      *Feed
	cfg       BindConfig
	attribute func(string) (catalog.WorkerRank, bool)
	sock      zmq4.Socket
	guard     *zmtpguard.Transport // tcp endpoints: the listener's ZMTP guard
	addr      net.Addr
	sockCtx   context.Context    // the socket's context
	cancel    context.CancelFunc // cancels sockCtx
	running   atomic.Bool        // the receive goroutine was started
	wg        sync.WaitGroup

	received, framesSkipped, unattributed atomic.Uint64
}

// Bind binds a SUB socket for engines to dial into and returns the bound address
// (useful with port 0). The socket is bound at once, before or during Run, so the
// address can be handed to engines; messages are read once Run is running. Run closes
// the socket when it returns; a Feed whose Run is never called keeps it open, so call
// Run (even with a cancelled context) on a Feed you bound. Errors: ErrInvalidSource,
// ErrFeedStopped, or the bind failure.
func (f *Feed) Bind(cfg BindConfig) (net.Addr, error) {
	if err := validateEndpoint(cfg.Endpoint, true); err != nil {
		return nil, fmt.Errorf("%w: Endpoint: %w", ErrInvalidSource, err)
	}
	if cfg.rank < 0 {
		return nil, fmt.Errorf("%w: rank %d < 0", ErrInvalidSource, cfg.rank)
	}
	b := &binding{feed: f, cfg: cfg, attribute: cfg.Attribute}
	if b.attribute == nil {
		rank := cfg.rank
		b.attribute = func(topic string) (catalog.WorkerRank, bool) {
			wr, ok := TopicWorker(topic)
			wr.Rank = rank
			return wr, ok
		}
	}
	f.life.Lock()
	defer f.life.Unlock()
	f.mu.Lock()
	stopped := f.state == feedStopped
	f.mu.Unlock()
	if stopped {
		return nil, ErrFeedStopped
	}
	listenAt := cfg.Endpoint
	if strings.HasPrefix(cfg.Endpoint, "tcp://") {
		var err error
		b.guard, err = zmtpguard.Register(f.guardLimits(), zmtpguard.Policy{
			Admit:   admitBy(cfg.Admit),
			Message: peerTopic(cfg.Peer),
			Refused: f.refused,
		})
		if err != nil {
			return nil, fmt.Errorf("%w: ZMTP guard: %w", ErrInvalidOptions, err)
		}
		listenAt = b.guard.Endpoint(cfg.Endpoint)
	}
	ctx, cancel := context.WithCancel(context.Background())
	b.sockCtx, b.cancel = ctx, cancel
	b.sock = zmq4.NewSub(ctx, f.socketOptions()...)
	err := b.sock.SetOption(zmq4.OptionSubscribe, "")
	if err == nil {
		err = b.sock.Listen(listenAt)
	}
	if err != nil {
		closeSocket(b.sock)
		cancel()
		return nil, fmt.Errorf("kvevents: bind %s: %w", cfg.Endpoint, err)
	}
	b.addr = b.sock.Addr()
	f.mu.Lock()
	defer f.mu.Unlock()
	f.binds = append(f.binds, b)
	if f.state == feedRunning {
		b.start(f.runCtx, &f.wg)
	}
	return b.addr, nil
}

// BindStats returns a snapshot of every bind listener's counters, in Bind order.
func (f *Feed) BindStats() []BindStats {
	f.mu.Lock()
	binds := append([]*binding(nil), f.binds...)
	f.mu.Unlock()
	out := make([]BindStats, len(binds))
	for i, b := range binds {
		out[i] = BindStats{
			Endpoint:      b.cfg.Endpoint,
			Addr:          b.addr.String(),
			Received:      b.received.Load(),
			FramesSkipped: b.framesSkipped.Load(),
			Unattributed:  b.unattributed.Load(),
		}
	}
	return out
}

// start launches the receive goroutine; the socket closes when parent is done.
func (b *binding) start(parent context.Context, fwg *sync.WaitGroup) {
	b.running.Store(true)
	fwg.Add(1)
	b.wg.Add(1)
	go func() {
		defer fwg.Done()
		defer b.wg.Done()
		b.recvLoop(parent)
	}()
}

// stop closes the socket and waits for the receive goroutine.
func (b *binding) stop() {
	b.cancel()
	b.wg.Wait()
	if !b.running.Load() {
		closeSocket(b.sock) // never started: nobody else closes it
	}
}

func (b *binding) recvLoop(ctx context.Context) {
	defer closeSocket(b.sock)
	stop := context.AfterFunc(ctx, b.cancel)
	defer stop()
	cache := make(map[string]*source)
	for {
		msg, err := b.sock.Recv()
		if err != nil {
			if ctx.Err() != nil || b.sockCtx.Err() != nil {
				return
			}
			continue // one engine's connection ended; the listener goes on
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		fr, err := parseLiveFrames(msg.Frames)
		if err != nil {
			b.framesSkipped.Add(1)
			b.feed.drop("bad_frames", b.cfg.Endpoint, "error", err)
			continue
		}
		b.received.Add(1)
		s := cache[string(fr.Topic)]
		if s == nil || s.stopped.Load() {
			delete(cache, string(fr.Topic))
			s = b.sourceFor(string(fr.Topic))
			if s == nil {
				b.unattributed.Add(1)
				b.feed.drop("unattributed_topic", b.cfg.Endpoint, "topic", excerptTopic(fr.Topic))
				continue
			}
			if len(cache) < maxTopicCache {
				cache[string(fr.Topic)] = s
			}
		}
		s.deliver(ctx, fr) // may wait up to overflowWait for a slow source
	}
}

// sourceFor attributes a topic and returns (creating and starting it if needed) the
// bound source of its worker rank, or nil.
func (b *binding) sourceFor(topic string) *source {
	wr, ok := b.attribute(topic)
	if !ok || wr.WorkerID == "" || wr.Rank < 0 {
		return nil
	}
	cfg := SourceConfig{Worker: wr, Endpoint: b.endpoint()}
	if b.cfg.ReplayEndpoint != nil {
		if ep, ok := b.cfg.ReplayEndpoint(wr); ok && validateEndpoint(ep, false) == nil {
			cfg.ReplayEndpoint = ep
		}
	}
	f := b.feed
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.state != feedRunning {
		return nil
	}
	if s := f.sources[wr]; s != nil {
		if !s.bound {
			return nil // a dialed source owns this rank; mixing streams breaks sequencing
		}
		return s
	}
	if _, busy := f.removing[wr]; busy || f.nBound >= f.opts.maxBoundSources {
		return nil
	}
	s := newSource(f, cfg, true)
	s.st.connected.Store(true)
	f.sources[wr] = s
	f.nBound++
	s.start(f.runCtx, &f.wg)
	return s
}

// endpoint names the bound address the way SourceStats reports it.
func (b *binding) endpoint() string {
	if b.addr != nil && b.addr.Network() == "tcp" {
		return "tcp://" + b.addr.String()
	}
	return b.cfg.Endpoint
}
