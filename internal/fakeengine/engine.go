package fakeengine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
)

// LeakyZMQFunction names a goroutine that github.com/go-zeromq/zmq4 v0.17.0 starts
// for every PUB socket and never stops (its Close does not close the socket's send
// queue). Tests that use goleak together with an Engine must ignore it:
//
//	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
const LeakyZMQFunction = "github.com/go-zeromq/zmq4.(*pubMWriter).run"

// subscribePollInterval is how often WaitSubscribed looks at the PUB socket.
const subscribePollInterval = 2 * time.Millisecond

type lifecycle uint8

const (
	stateNew lifecycle = iota
	stateStarted
	stateClosed
)

// Request is one simulated inference request. It is a plain value; Serve does not
// keep or modify its Tokens.
type Request struct {
	// Tokens is the prompt. Only complete blocks are cached; a partial tail block
	// is ignored, as in vLLM.
	Tokens []uint32
	// LoRAName and CacheSalt isolate the request's blocks: they are part of the
	// engine's block hashes and appear in the events (lora_name, extra_keys).
	LoRAName  string
	CacheSalt string
}

// Result says what Serve did. It is a plain value.
type Result struct {
	// CachedBlocks is the number of leading blocks that were already cached (hits).
	CachedBlocks int
	// StoredBlocks is the number of blocks added after the hits. It is smaller
	// than the request's remaining blocks only when the request does not fit in
	// the cache.
	StoredBlocks int
	// EvictedBlocks is the number of blocks evicted to make room.
	EvictedBlocks int
	// Published reports whether a batch was numbered (false when the request
	// changed nothing: every block a hit, or no complete block). Seq is its
	// sequence number.
	Published bool
	Seq       uint64
}

// CachedBlock is one block of the prefix cache, as listed by Snapshot. It is a
// copy that the caller owns.
type CachedBlock struct {
	Hash       uint64
	ParentHash uint64 // meaningful when HasParent
	HasParent  bool
	Tokens     []uint32
	LoRAName   string
	CacheSalt  string
}

// Stats are the engine's counters, a consistent copy taken by Engine.Stats.
type Stats struct {
	// NextSeq is the sequence number the next batch will get.
	NextSeq uint64
	// Batches counts numbered batches (since New, across restarts).
	Batches uint64
	// LiveSent counts batches handed to the PUB socket, corrupted ones included.
	LiveSent uint64
	// LiveDropped counts batches withheld by DropNext.
	LiveDropped uint64
	// LiveCorrupted counts batches sent garbled by CorruptNext.
	LiveCorrupted uint64
	// LiveUnsent counts batches numbered before Start (kept for replay only).
	LiveUnsent uint64
	// RawSent counts SendFrames messages.
	RawSent uint64
	// ReplayRequests counts well-formed replay requests received.
	ReplayRequests uint64
	// ReplayMalformed counts requests ignored because of their shape.
	ReplayMalformed uint64
	// ReplayDropped counts well-formed requests ignored because of DropReplay.
	ReplayDropped uint64
	// ReplaysAnswered counts replies completed up to the end marker.
	ReplaysAnswered uint64
	// ReplayBatchesSent counts batches sent in replay replies.
	ReplayBatchesSent uint64
	// Restarts counts Restart calls.
	Restarts uint64
	// Evictions counts evicted blocks.
	Evictions uint64
	// Blocks is the number of cached blocks.
	Blocks int
	// Buffered is the number of batches in the replay buffer; BufferedOldest and
	// BufferedNewest are their sequence range when Buffered > 0.
	Buffered       int
	BufferedOldest uint64
	BufferedNewest uint64
}

// Engine is a vLLM-like test engine: an LRU prefix cache whose changes are
// published as KV-cache event batches over a ZMQ PUB socket, with an optional
// ROUTER replay server, fault injection and an optional OpenAI-compatible HTTP
// API (see Handler).
//
// Engine is safe for concurrent use. Its state is guarded by one mutex; batches
// are numbered and handed to the PUB socket under it, so sequence order equals
// publish order. Start and Close are also serialised with each other.
type Engine struct {
	opts   Options
	format Format
	topic  []byte
	hasher blockHasher

	lifeMu sync.Mutex // serialises Start and Close
	wg     sync.WaitGroup

	mu          sync.Mutex
	state       lifecycle
	cache       lruCache
	ring        replayRing
	seq         uint64
	dropNext    int
	corruptNext int
	dropReplay  bool
	stats       Stats
	pub         zmq4.Socket
	router      zmq4.Socket
	cancel      context.CancelFunc
	pubEP       string
	replayEP    string
	httpSrv     *httpServer // nil unless started with EnableHTTP
	httpEP      string

	web httpState // the HTTP API's handler and counters; see http.go

	runner *modelRunner // SleepTTFT: the scheduler model's real-time stepper (timing.go); nil otherwise
}

// New validates opts, applies defaults and returns an engine that has not started:
// it holds no socket and no goroutine until Start. It returns an error wrapping
// ErrInvalidOptions that lists every invalid field.
func New(opts Options) (*Engine, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	e := &Engine{
		opts:   o,
		format: o.format(),
		topic:  []byte(o.Topic),
		hasher: blockHasher{scheme: o.HashScheme, seed: o.HashSeed, blockSize: o.BlockSize},
		cache:  newLRUCache(o.CapacityBlocks),
		ring:   replayRing{capacity: o.ReplayBuffer},
		seq:    o.FirstSeq,
	}
	e.web.handler = e.newHandler()
	if o.SleepTTFT {
		if e.runner, err = newModelRunner(o.Timing); err != nil {
			return nil, fmt.Errorf("%w: Timing: %w", ErrInvalidOptions, err)
		}
	}
	return e, nil
}

// Start creates the sockets: it binds (or dials, in PubDial mode, retrying up to
// DialAttempts times) the PUB socket, binds the ROUTER when EnableReplay is set,
// listens on HTTPAddr (or serves on HTTPListener) when EnableHTTP is set, and starts the replay and HTTP
// goroutines. ctx bounds the start only (the dial retries);
// the engine runs until Close. A failed Start releases what it created and may be
// retried. It returns ErrAlreadyStarted, ErrClosed or an error wrapping ErrSocket.
func (e *Engine) Start(ctx context.Context) error {
	e.lifeMu.Lock()
	defer e.lifeMu.Unlock()
	e.mu.Lock()
	state := e.state
	e.mu.Unlock()
	switch state {
	case stateStarted:
		return ErrAlreadyStarted
	case stateClosed:
		return ErrClosed
	}

	sockCtx, cancel := context.WithCancel(context.Background())
	quiet := zmq4.WithLogger(log.New(io.Discard, "", 0))
	pub := zmq4.NewPub(sockCtx, quiet, zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(time.Second))
	fail := func(err error, socks ...zmq4.Socket) error {
		for _, s := range socks {
			_ = s.Close()
		}
		cancel()
		return err
	}

	var pubEP string
	switch e.opts.PubMode {
	case PubDial:
		if err := e.dial(ctx, pub); err != nil {
			return fail(err, pub)
		}
		pubEP = e.opts.PubEndpoint
	default:
		if err := pub.Listen(e.opts.PubEndpoint); err != nil {
			return fail(fmt.Errorf("%w: bind PUB %s: %w", ErrSocket, e.opts.PubEndpoint, err), pub)
		}
		pubEP = boundEndpoint(e.opts.PubEndpoint, pub)
	}

	var router zmq4.Socket
	var replayEP string
	if e.opts.EnableReplay {
		router = zmq4.NewRouter(sockCtx, quiet)
		if err := router.Listen(e.opts.ReplayEndpoint); err != nil {
			return fail(fmt.Errorf("%w: bind ROUTER %s: %w", ErrSocket, e.opts.ReplayEndpoint, err), router, pub)
		}
		replayEP = boundEndpoint(e.opts.ReplayEndpoint, router)
	}

	var hs *httpServer
	if e.opts.EnableHTTP {
		var err error
		if hs, err = listenHTTP(ctx, e.opts.HTTPListener, e.opts.HTTPAddr, e.web.handler); err != nil {
			if router != nil {
				return fail(err, router, pub)
			}
			return fail(err, pub)
		}
	}

	e.mu.Lock()
	e.state = stateStarted
	e.pub, e.router, e.cancel = pub, router, cancel
	e.pubEP, e.replayEP = pubEP, replayEP
	e.httpSrv = hs
	if hs != nil {
		e.httpEP = hs.addr
	}
	e.mu.Unlock()

	if hs != nil {
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			hs.serve()
		}()
	}

	if router != nil {
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			e.serveReplay(sockCtx, router)
		}()
	}
	if e.runner != nil {
		e.runner.start()
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			e.runner.run()
		}()
	}
	return nil
}

// dial connects the PUB socket to the configured endpoint, retrying with a fixed
// backoff because go-zeromq gives up after one attempt here.
func (e *Engine) dial(ctx context.Context, pub zmq4.Socket) error {
	var err error
	for attempt := 1; ; attempt++ {
		if err = pub.Dial(e.opts.PubEndpoint); err == nil {
			return nil
		}
		if attempt >= e.opts.DialAttempts {
			return fmt.Errorf("%w: dial PUB %s: %d attempts: %w", ErrSocket, e.opts.PubEndpoint, attempt, err)
		}
		t := time.NewTimer(e.opts.DialBackoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w: dial PUB %s: %w (last error: %w)", ErrSocket, e.opts.PubEndpoint, ctx.Err(), err)
		case <-t.C:
		}
	}
}

// boundEndpoint returns the endpoint a socket actually listens on (the real port
// for "tcp://host:0").
func boundEndpoint(configured string, s zmq4.Socket) string {
	if a := s.Addr(); a != nil && strings.HasPrefix(configured, "tcp://") {
		return "tcp://" + a.String()
	}
	return configured
}

// Close stops the engine: it stops the HTTP server (in-flight requests are
// answered 503 or cut short), closes the sockets, stops the scheduler model
// (SleepTTFT) and waits for the replay, HTTP and model goroutines.
// It is idempotent; calls after the first return nil. After Close, Serve and the
// Publish methods return ErrClosed; the cache and truth methods keep working.
func (e *Engine) Close() error {
	e.lifeMu.Lock()
	defer e.lifeMu.Unlock()
	e.mu.Lock()
	if e.state == stateClosed {
		e.mu.Unlock()
		return nil
	}
	wasStarted := e.state == stateStarted
	e.state = stateClosed
	pub, router, cancel, hs := e.pub, e.router, e.cancel, e.httpSrv
	e.pub, e.router, e.cancel, e.httpSrv = nil, nil, nil, nil
	e.mu.Unlock()
	if !wasStarted {
		return nil
	}
	var errs []error
	if hs != nil {
		if err := hs.close(); err != nil {
			errs = append(errs, fmt.Errorf("close HTTP server: %w", err))
		}
	}
	// A connection the peer already closed reports net.ErrClosed when go-zeromq
	// closes it again; that is not a failure to shut down.
	if router != nil {
		if err := router.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, fmt.Errorf("close ROUTER: %w", err))
		}
	}
	if err := pub.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
		errs = append(errs, fmt.Errorf("close PUB: %w", err))
	}
	cancel()
	if e.runner != nil {
		e.runner.halt()
	}
	e.wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", ErrSocket, err)
	}
	return nil
}

// PubEndpoint returns the address of the PUB socket: the bound address (with the
// real port) in PubBind mode, the dialled one in PubDial mode; "" before Start.
func (e *Engine) PubEndpoint() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.pubEP
}

// ReplayEndpoint returns the bound address of the replay ROUTER; "" before Start or
// when replay is disabled.
func (e *Engine) ReplayEndpoint() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.replayEP
}

// Topic returns the topic frame of live messages.
func (e *Engine) Topic() string { return e.opts.Topic }

// BlockSize returns the tokens per block.
func (e *Engine) BlockSize() int { return e.opts.BlockSize }

// DPRank returns the data-parallel rank written into batches.
func (e *Engine) DPRank() int { return e.opts.DPRank }

// Options returns the engine's options with defaults applied.
func (e *Engine) Options() Options { return e.opts }

// Serve simulates one request against the prefix cache and publishes at most one
// batch describing the change: a BlockRemoved for the evicted blocks (if any),
// then one BlockStored for the whole newly stored run (if any), whose parent is
// the last hit block (no parent, spelled as RootParent says, when the run starts
// at the first block); with HybridGroups each of them is followed by its mirror
// in group MirrorGroup. A request that changes nothing publishes nothing. Before
// Start the batch is numbered and kept for replay but not sent live. It returns
// ErrClosed after Close, or an error wrapping ErrSocket when the PUB socket
// refuses the batch (the cache change stands).
func (e *Engine) Serve(req Request) (Result, error) {
	hashes := e.hasher.appendHashes(nil, req.Tokens, req.LoRAName, req.CacheSalt)

	e.mu.Lock()
	defer e.mu.Unlock()
	if e.state == stateClosed {
		return Result{}, ErrClosed
	}
	r := e.cache.serve(hashes, req.Tokens, e.opts.BlockSize, req.LoRAName, req.CacheSalt)
	e.stats.Evictions += uint64(len(r.evicted))
	res := Result{CachedBlocks: r.hits, StoredBlocks: r.stored, EvictedBlocks: len(r.evicted)}

	hybrid := e.opts.HybridGroups
	var events []Event
	if len(r.evicted) > 0 {
		ev := Event{Kind: BlockRemoved, BlockHashes: r.evicted, Medium: MediumGPU, HasGroup: hybrid}
		events = append(events, ev)
		if hybrid {
			events = append(events, mirrorEvent(ev))
		}
	}
	if r.stored > 0 {
		ev := Event{
			Kind:        BlockStored,
			BlockHashes: hashes[r.hits : r.hits+r.stored],
			TokenIDs:    r.tokens,
			BlockSize:   e.opts.BlockSize,
			LoRAName:    req.LoRAName,
			Medium:      MediumGPU,
			ExtraKeys:   extraKeys(r.hits, r.hits+r.stored, req.LoRAName, req.CacheSalt),
		}
		if r.hits > 0 {
			ev.ParentHash, ev.HasParent = hashes[r.hits-1], true
		}
		if hybrid {
			ev.HasGroup, ev.SpecKind = true, specKindFullAttention
			events = append(events, ev, mirrorEvent(ev))
		} else {
			events = append(events, ev)
		}
	}
	if len(events) == 0 {
		return res, nil
	}
	seq, err := e.publishLocked(e.encodeLocked(events))
	res.Published, res.Seq = true, seq
	return res, err
}

// ResetPrefixCache empties the cache and publishes a batch with one
// AllBlocksCleared event, like vLLM's reset_prefix_cache. It returns the batch's
// sequence number.
func (e *Engine) ResetPrefixCache() (uint64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.state == stateClosed {
		return 0, ErrClosed
	}
	e.cache.clear()
	return e.publishLocked(e.encodeLocked([]Event{{Kind: AllBlocksCleared}}))
}

// PublishEvents numbers and publishes one batch holding events, encoded in the
// engine's format, without touching the cache model (so HeldPrefix no longer
// describes what a consumer should believe). Events are checked: known kind,
// BlockSize >= 1 and len(TokenIDs) == len(BlockHashes)*BlockSize for
// BlockStored, ExtraKeys nil or one entry per block; use PublishPayload with
// AppendBatch for malformed events. Faults (DropNext, CorruptNext) apply.
func (e *Engine) PublishEvents(events ...Event) (uint64, error) {
	for i := range events {
		if err := checkEvent(&events[i]); err != nil {
			return 0, fmt.Errorf("%w: event %d: %s", ErrInvalidArgument, i, err)
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.state == stateClosed {
		return 0, ErrClosed
	}
	return e.publishLocked(e.encodeLocked(events))
}

func checkEvent(ev *Event) error {
	switch ev.Kind {
	case BlockStored:
		if ev.BlockSize < 1 {
			return fmt.Errorf("BlockStored block size %d < 1", ev.BlockSize)
		}
		if len(ev.TokenIDs) != len(ev.BlockHashes)*ev.BlockSize {
			return fmt.Errorf("BlockStored has %d tokens for %d blocks of %d", len(ev.TokenIDs), len(ev.BlockHashes), ev.BlockSize)
		}
		if ev.ExtraKeys != nil && len(ev.ExtraKeys) != len(ev.BlockHashes) {
			return fmt.Errorf("BlockStored has %d extra-key entries for %d blocks", len(ev.ExtraKeys), len(ev.BlockHashes))
		}
	case BlockRemoved, AllBlocksCleared:
	default:
		return fmt.Errorf("unknown kind %d", uint8(ev.Kind))
	}
	return nil
}

// PublishPayload numbers and publishes payload as a batch exactly as given (it may
// be anything, valid msgpack or not). The engine keeps payload; the caller must not
// modify it afterwards. Faults apply.
func (e *Engine) PublishPayload(payload []byte) (uint64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.state == stateClosed {
		return 0, ErrClosed
	}
	return e.publishLocked(payload)
}

// SendFrames sends one live message made of frames exactly as given, with no
// sequence number assigned and nothing buffered: for malformed-frame tests (two
// frames, a 7-byte seq, ...). The first frame is matched against subscriptions like
// a topic. It returns ErrNotStarted before Start, ErrClosed after Close, or an
// error wrapping ErrInvalidArgument when frames is empty.
func (e *Engine) SendFrames(frames ...[]byte) error {
	if len(frames) == 0 {
		return fmt.Errorf("%w: SendFrames needs at least one frame", ErrInvalidArgument)
	}
	own := make([][]byte, len(frames))
	for i, f := range frames {
		own[i] = slices.Clone(f)
		if own[i] == nil {
			own[i] = []byte{}
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	switch e.state {
	case stateNew:
		return ErrNotStarted
	case stateClosed:
		return ErrClosed
	}
	if err := e.pub.SendMulti(zmq4.NewMsgFrom(own...)); err != nil {
		return fmt.Errorf("%w: send raw frames: %w", ErrSocket, err)
	}
	e.stats.RawSent++
	return nil
}

// encodeLocked encodes events as a batch stamped with the clock and the rank.
func (e *Engine) encodeLocked(events []Event) []byte {
	now := e.opts.Now()
	b := Batch{
		Timestamp: float64(now.Unix()) + float64(now.Nanosecond())/1e9,
		Events:    events,
		DPRank:    e.opts.DPRank,
		HasDPRank: !e.opts.OmitDPRank,
	}
	return AppendBatch(nil, b, e.format)
}

// publishLocked numbers payload, keeps it for replay and sends it live unless the
// engine has not started or a fault withholds it. Caller holds e.mu.
func (e *Engine) publishLocked(payload []byte) (uint64, error) {
	seq := e.seq
	e.seq++
	e.stats.Batches++
	e.ring.push(replayEntry{seq: seq, payload: payload})
	if e.state != stateStarted {
		e.stats.LiveUnsent++
		return seq, nil
	}
	if e.dropNext > 0 {
		e.dropNext--
		e.stats.LiveDropped++
		return seq, nil
	}
	live := payload
	if e.corruptNext > 0 {
		e.corruptNext--
		e.stats.LiveCorrupted++
		live = corrupt(payload)
	}
	var seqb [8]byte
	binary.BigEndian.PutUint64(seqb[:], seq)
	if err := e.pub.SendMulti(zmq4.NewMsgFrom(e.topic, seqb[:], live)); err != nil {
		return seq, fmt.Errorf("%w: publish seq %d: %w", ErrSocket, seq, err)
	}
	e.stats.LiveSent++
	return seq, nil
}

// mirrorSalt separates the mirror group's block hashes from the main group's.
const mirrorSalt uint64 = 0x6d69_7272_6f72_2d31 // "mirror-1"

// mirrorHash is the block hash of group MirrorGroup that mirrors main-group hash h.
func mirrorHash(h uint64) uint64 { return splitmix64(h ^ mirrorSalt) }

// mirrorEvent returns ev as published for group MirrorGroup: the same tokens and
// extra keys, mirrored hashes, the sliding-window spec on stored runs.
func mirrorEvent(ev Event) Event {
	m := ev
	m.BlockHashes = make([]uint64, len(ev.BlockHashes))
	for i, h := range ev.BlockHashes {
		m.BlockHashes[i] = mirrorHash(h)
	}
	if m.HasParent {
		m.ParentHash = mirrorHash(ev.ParentHash)
	}
	m.GroupIdx, m.HasGroup = MirrorGroup, true
	if ev.Kind == BlockStored {
		m.SpecKind, m.SlidingWindow = MirrorSpecKind, MirrorSlidingWindow
	}
	return m
}

// corrupt returns a garbled copy of payload: its first byte becomes 0xc1, the one
// msgpack type byte that is never valid, so no decoder can read it.
func corrupt(payload []byte) []byte {
	if len(payload) == 0 {
		return []byte{0xc1}
	}
	out := slices.Clone(payload)
	out[0] = 0xc1
	return out
}

// DropNext makes the next n batches skip the live socket: they are numbered and
// kept for replay, so a consumer sees a sequence gap. n <= 0 cancels pending drops.
func (e *Engine) DropNext(n int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.dropNext = max(n, 0)
}

// CorruptNext garbles the live copy of the next n batches (see corrupt); the replay
// buffer keeps the good copy. n <= 0 cancels pending corruptions.
func (e *Engine) CorruptNext(n int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.corruptNext = max(n, 0)
}

// Restart simulates an engine restart: the sequence goes back to FirstSeq, the
// cache and the replay buffer are emptied, and no AllBlocksCleared is published
// (vLLM does not send one either). Sockets, endpoints and pending faults are
// kept, so consumers stay connected and only see the sequence go backwards.
func (e *Engine) Restart() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.seq = e.opts.FirstSeq
	e.cache.clear()
	e.ring.clear()
	e.stats.Restarts++
}

// DropReplay makes the replay server ignore (true) or answer (false) well-formed
// requests, like an engine whose replay endpoint is unresponsive.
func (e *Engine) DropReplay(drop bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.dropReplay = drop
}

// TruncateReplay forgets buffered batches with seq < before, like an engine whose
// buffer has rolled over: a replay asked from an older seq then starts later than
// asked.
func (e *Engine) TruncateReplay(before uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.ring.dropBefore(before)
}

// BlockHashes returns the engine's hashes of the complete blocks of tokens, as
// Serve computes them in the HashScheme and publishes them for the main group
// (and as a consumer decodes them, whatever the HashFormat).
func (e *Engine) BlockHashes(tokens []uint32, lora, salt string) []uint64 {
	return e.hasher.appendHashes(nil, tokens, lora, salt)
}

// HeldPrefix returns the number of leading complete blocks of tokens (with this
// LoRA name and cache salt) that are in the cache now. It does not touch the LRU
// order. This is the truth a consumer's index should converge to.
func (e *Engine) HeldPrefix(tokens []uint32, lora, salt string) int {
	hashes := e.hasher.appendHashes(nil, tokens, lora, salt)
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cache.heldPrefix(hashes)
}

// Blocks returns the number of cached blocks.
func (e *Engine) Blocks() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cache.len()
}

// Snapshot lists the cached blocks from the most to the least recently used. A
// block's parent always appears before it. The returned values are copies.
func (e *Engine) Snapshot() []CachedBlock {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]CachedBlock, 0, e.cache.len())
	for b := e.cache.head; b != nil; b = b.next {
		out = append(out, CachedBlock{
			Hash:       b.hash,
			ParentHash: b.parent,
			HasParent:  b.hasParent,
			Tokens:     slices.Clone(b.tokens),
			LoRAName:   b.lora,
			CacheSalt:  b.salt,
		})
	}
	return out
}

// NextSeq returns the sequence number the next batch will get.
func (e *Engine) NextSeq() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.seq
}

// Stats returns a snapshot of the counters.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := e.stats
	s.NextSeq = e.seq
	s.Blocks = e.cache.len()
	s.Buffered = e.ring.n
	s.BufferedOldest, s.BufferedNewest, _ = e.ring.oldestNewest()
	return s
}

// Subscribed reports whether at least one connected SUB has a subscription that
// matches the engine's topic, i.e. whether a batch published now would be
// delivered to it. It is false before Start and after Close. With several
// subscribers it cannot tell which one subscribed.
func (e *Engine) Subscribed() bool {
	e.mu.Lock()
	pub := e.pub
	e.mu.Unlock()
	if pub == nil {
		return false
	}
	tp, ok := pub.(zmq4.Topics)
	if !ok {
		return false
	}
	for _, t := range tp.Topics() {
		if strings.HasPrefix(e.opts.Topic, t) {
			return true
		}
	}
	return false
}

// WaitSubscribed polls Subscribed until it is true (nil), ctx is done (ctx.Err()
// wrapped), or the engine is not running (ErrNotStarted, ErrClosed). It is the cure for ZMQ's slow
// joiner: a PUB drops what it sends before the subscription arrives.
func (e *Engine) WaitSubscribed(ctx context.Context) error {
	t := time.NewTicker(subscribePollInterval)
	defer t.Stop()
	for {
		if e.Subscribed() {
			return nil
		}
		e.mu.Lock()
		state := e.state
		e.mu.Unlock()
		switch state {
		case stateNew:
			return ErrNotStarted
		case stateClosed:
			return ErrClosed
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("fakeengine: waiting for a subscriber: %w", ctx.Err())
		case <-t.C:
		}
	}
}
