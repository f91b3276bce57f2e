package tokenize

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/dgraph-io/ristretto/v2"
	"golang.org/x/sync/singleflight"
)

// Defaults applied by NewCache to zero CacheOptions fields.
const (
	DefaultCacheMaxBytes    = 64 << 20
	DefaultCacheCallTimeout = 2 * DefaultTimeout
	DefaultCacheMaxCalls    = 1024
)

// entryOverhead is the cost charged per cached entry on top of its token and
// feature bytes: the entry struct, ristretto's item and its map slot.
const entryOverhead = 160

// CacheOptions configure a Cache. The zero value of every field means the
// documented default; NewCache copies the struct.
type CacheOptions struct {
	// MaxBytes bounds the memory held by cached entries. An entry costs what it
	// holds: 4 bytes per token, its features and cache salt, its copy of the
	// request (body, model, path; kept so that a hit is exact, not a hash
	// match) and a fixed overhead of 160 bytes. Default DefaultCacheMaxBytes
	// (64 MiB); negative is an error.
	MaxBytes int64
	// TTL, when positive, expires an entry that long after it was stored.
	// Default 0: entries live until evicted. Negative is an error.
	TTL time.Duration
	// Protocol and Model are part of every key. Protocol defaults to the inner
	// tokenizer's Protocol() when it has that method (a *Client does). Set them
	// when several caches could ever be merged or persisted; within one Cache
	// they keep keys apart from other deployments' by construction.
	Protocol string
	Model    string
	// CallTimeout bounds one upstream call. A call is shared by every caller that
	// asks for the same request while it runs, so it is detached from the
	// cancellation of the caller that started it (each caller still stops
	// waiting when its own context ends) and bounded by this instead. Keep it at
	// least the inner Client's Timeout. Default DefaultCacheCallTimeout (10 s);
	// negative is an error.
	CallTimeout time.Duration
	// MaxCalls bounds the upstream calls in progress, detached ones included (a
	// call whose callers all left still runs until it ends or CallTimeout
	// passes, holding a copy of its request body). A miss that would start one
	// more is refused at once with ErrUnavailable (503), so a hanging tokenizer
	// costs at most MaxCalls goroutines and bodies. Default
	// DefaultCacheMaxCalls (1024); negative is an error.
	MaxCalls int
	// ShareResults makes Tokenize return the cached Tokens and Features slices
	// themselves instead of copies: no allocation on a hit, but the caller must
	// treat the Result as read-only (a write would change the answer for every
	// later hit). Default false: every Result is the caller's own copy.
	ShareResults bool
	// Logger receives a debug record when an upstream call fails after every
	// caller waiting for it has left (nobody else sees that error). Default: none.
	Logger *slog.Logger
}

// Cache is a Tokenizer that remembers the results of another one. Concurrent
// identical requests make one upstream call; errors are never cached. It is
// safe for concurrent use. Create it with NewCache and release it with Close;
// a zero Cache is unusable.
type Cache struct {
	inner       Tokenizer
	store       *ristretto.Cache[uint64, *entry]
	group       singleflight.Group
	ttl         time.Duration
	callTimeout time.Duration
	protocol    string
	model       string
	share       bool
	maxBytes    int64
	log         *slog.Logger
	slots       chan struct{} // one per upstream call in progress (MaxCalls)

	life      sync.RWMutex // write-held only by Close; guards closed
	closed    bool
	closeOnce sync.Once
	flying    sync.WaitGroup // upstream calls in progress
	base      context.Context
	stop      context.CancelFunc

	hits, misses, coalesced, abandoned, collisions, calls atomic.Uint64
	errs                                                  [numKinds]atomic.Uint64
	latCount, latSum                                      atomic.Uint64
	latBuckets                                            [len(latencyBounds) + 1]atomic.Uint64

	// joined, when set (tests only), runs after a missing caller has joined or
	// started the upstream call for its key.
	joined func()
	// fixedKey, when not 0 (tests only), is every request's key.
	fixedKey uint64
}

var _ Tokenizer = (*Cache)(nil)

// entry is one cached result with the request it answers. The xxhash key only
// finds a candidate; a hit needs model, path and body to be equal byte for byte.
type entry struct {
	model, path string
	body        []byte
	res         Result
}

// matches reports whether e answers req exactly.
func (e *entry) matches(req *Request) bool {
	return e.model == req.Model && e.path == req.Path && bytes.Equal(e.body, req.Body)
}

// NewCache wraps inner with a cache. It validates opts, reporting every problem
// wrapped in ErrInvalidOptions, and starts ristretto's single maintenance
// goroutine, which Close stops.
func NewCache(inner Tokenizer, opts CacheOptions) (*Cache, error) {
	var problems []string
	if inner == nil {
		problems = append(problems, "inner tokenizer is nil")
	}
	if opts.MaxBytes < 0 {
		problems = append(problems, fmt.Sprintf("max bytes %d is negative", opts.MaxBytes))
	}
	if opts.TTL < 0 {
		problems = append(problems, fmt.Sprintf("TTL %v is negative", opts.TTL))
	}
	if opts.CallTimeout < 0 {
		problems = append(problems, fmt.Sprintf("call timeout %v is negative", opts.CallTimeout))
	}
	if opts.MaxCalls < 0 {
		problems = append(problems, fmt.Sprintf("max calls %d is negative", opts.MaxCalls))
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
	}
	maxBytes := orDefault(opts.MaxBytes, DefaultCacheMaxBytes)
	protocol := opts.Protocol
	if p, ok := inner.(interface{ Protocol() string }); ok && protocol == "" {
		protocol = p.Protocol()
	}
	store, err := ristretto.NewCache(&ristretto.Config[uint64, *entry]{
		// About ten counters per entry for entries around 2.5 KiB (600 tokens).
		NumCounters:        max(1024, maxBytes/256),
		MaxCost:            maxBytes,
		BufferItems:        64,
		IgnoreInternalCost: true,
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidOptions, err)
	}
	c := &Cache{
		inner:       inner,
		store:       store,
		ttl:         opts.TTL,
		callTimeout: orDefault(opts.CallTimeout, DefaultCacheCallTimeout),
		protocol:    protocol,
		model:       opts.Model,
		share:       opts.ShareResults,
		maxBytes:    maxBytes,
		log:         opts.Logger,
		slots:       make(chan struct{}, orDefault(opts.MaxCalls, DefaultCacheMaxCalls)),
	}
	c.base, c.stop = context.WithCancel(context.Background())
	return c, nil
}

// Tokenize returns the cached result for req or asks the inner tokenizer, once
// for all concurrent callers with the same request. The result is the caller's
// own copy. Errors are those of the inner tokenizer, ErrClosed after Close, and
// ErrCanceled or ErrTimeout when ctx ends while waiting. Because ristretto
// applies stores asynchronously and admits them by a frequency estimate, the
// first repeat of a request may still miss, and a store can be dropped.
func (c *Cache) Tokenize(ctx context.Context, req Request) (Result, error) {
	k := c.key(&req)
	c.life.RLock()
	if c.closed {
		c.life.RUnlock()
		return Result{}, c.count(ErrClosed)
	}
	e, ok := c.store.Get(k)
	c.life.RUnlock()
	if ok {
		if e.matches(&req) {
			c.hits.Add(1)
			return c.out(e), nil
		}
		c.collisions.Add(1)
	}
	return c.miss(ctx, req, k)
}

// out returns a cached result to a caller: a copy, or with ShareResults the
// cached slices themselves.
func (c *Cache) out(e *entry) Result {
	if c.share {
		return e.res
	}
	return e.res.clone()
}

func (c *Cache) miss(ctx context.Context, req Request, k uint64) (Result, error) {
	c.misses.Add(1)
	var flightKey [8]byte
	binary.LittleEndian.PutUint64(flightKey[:], k)
	var started bool // written by the flight goroutine before it delivers
	ch := c.group.DoChan(string(flightKey[:]), func() (any, error) {
		started = true
		return c.fill(ctx, req, k)
	})
	if c.joined != nil {
		c.joined()
	}
	select {
	case r := <-ch:
		e := r.Val.(*entry)
		if !started {
			if !e.matches(&req) {
				// Another request with the same key was in flight: its answer
				// is not ours. Ask for ours directly (a 2^-64 event).
				c.collisions.Add(1)
				res, err := c.inner.Tokenize(ctx, req)
				if err != nil {
					return Result{}, c.count(err)
				}
				return res, nil
			}
			c.coalesced.Add(1)
		}
		if r.Err != nil {
			return Result{}, c.count(r.Err)
		}
		return c.out(e), nil
	case <-ctx.Done():
		c.abandoned.Add(1)
		return Result{}, c.count(ctxError(ctx))
	}
}

// fill makes the upstream call for one flight and stores a success. The entry
// it returns (also on error) carries a copy of the request, so callers that
// joined the flight can check it was theirs.
func (c *Cache) fill(ctx context.Context, req Request, k uint64) (*entry, error) {
	select {
	case c.slots <- struct{}{}:
		defer func() { <-c.slots }()
	default:
		// Refused before the body is copied: a flood of misses costs nothing.
		return &entry{model: req.Model, path: req.Path, body: req.Body}, fmt.Errorf("%w: %d tokenizer calls in progress (MaxCalls)", ErrUnavailable, cap(c.slots))
	}
	e := &entry{model: req.Model, path: req.Path, body: bytes.Clone(req.Body)}
	if e.body == nil {
		e.body = []byte{}
	}
	req.Body = e.body
	c.life.RLock()
	if c.closed {
		c.life.RUnlock()
		return e, ErrClosed
	}
	c.flying.Add(1)
	c.life.RUnlock()
	defer c.flying.Done()
	c.calls.Add(1)

	// The call keeps the starting caller's values (trace ids) but not its
	// cancellation: others may be waiting for it. Close cancels it.
	callCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.callTimeout)
	defer cancel()
	stop := context.AfterFunc(c.base, cancel)
	defer stop()

	start := time.Now()
	res, err := c.inner.Tokenize(callCtx, req)
	c.observe(time.Since(start))
	if err != nil {
		if c.log != nil && ctx.Err() != nil {
			c.log.LogAttrs(ctx, slog.LevelDebug, "tokenize cache: upstream call failed after its caller left", slog.String("error", err.Error()))
		}
		return e, err
	}
	e.res = res
	cost := int64(len(e.model)+len(e.path)+len(e.body)+4*len(res.Tokens)+len(res.Features)+len(res.CacheSalt)) + entryOverhead
	c.store.SetWithTTL(k, e, cost, c.ttl)
	return e, nil
}

// key hashes everything the tokenizer's answer depends on: protocol, model, the
// request's model, path and body, each length-prefixed so no two different
// tuples feed the same bytes into xxhash64. The key only locates a candidate:
// the entry's own copy of the request decides whether it is a hit.
func (c *Cache) key(req *Request) uint64 {
	if c.fixedKey != 0 {
		return c.fixedKey
	}
	var d xxhash.Digest
	d.Reset()
	var n [8]byte
	for _, s := range [4]string{c.protocol, c.model, req.Model, req.Path} {
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		_, _ = d.Write(n[:])
		_, _ = d.WriteString(s)
	}
	binary.LittleEndian.PutUint64(n[:], uint64(len(req.Body)))
	_, _ = d.Write(n[:])
	_, _ = d.Write(req.Body)
	return d.Sum64()
}

// ctxError is the error for a caller whose context ended while waiting.
func ctxError(ctx context.Context) error {
	err := ctx.Err()
	if err == context.DeadlineExceeded {
		return fmt.Errorf("%w: waiting for the tokenizer: %w", ErrTimeout, err)
	}
	return fmt.Errorf("%w: waiting for the tokenizer: %w", ErrCanceled, err)
}

func (c *Cache) count(err error) error {
	c.errs[kindOf(err)].Add(1)
	return err
}

// latencyBounds are the upper bounds of the upstream latency histogram buckets.
var latencyBounds = [...]time.Duration{
	time.Millisecond, 2 * time.Millisecond, 5 * time.Millisecond,
	10 * time.Millisecond, 20 * time.Millisecond, 50 * time.Millisecond,
	100 * time.Millisecond, 200 * time.Millisecond, 500 * time.Millisecond,
	time.Second, 2 * time.Second, 5 * time.Second,
}

// LatencyBounds returns the upper bounds of LatencyStats.Buckets; the last
// bucket, one past these, counts the slower calls.
func LatencyBounds() [len(latencyBounds)]time.Duration { return latencyBounds }

func (c *Cache) observe(d time.Duration) {
	c.latCount.Add(1)
	c.latSum.Add(uint64(d))
	i := 0
	for i < len(latencyBounds) && d > latencyBounds[i] {
		i++
	}
	c.latBuckets[i].Add(1)
}

// CacheStats is a snapshot of a Cache's counters; all are cumulative since
// NewCache except Bytes.
type CacheStats struct {
	// Hits are calls answered from the cache.
	Hits uint64
	// Misses are calls not answered from the cache (Coalesced and Abandoned
	// included).
	Misses uint64
	// Coalesced are misses answered by an upstream call another caller started.
	Coalesced uint64
	// Abandoned are misses whose caller's context ended before the answer.
	Abandoned uint64
	// Collisions are lookups whose xxhash key found an entry (or a call in
	// flight) for a different request; such a lookup is a miss.
	Collisions uint64
	// Calls are upstream calls made.
	Calls uint64
	// Errors counts the errors returned to callers, by class.
	Errors ErrorCounts
	// Latency describes the upstream calls, failed ones included.
	Latency LatencyStats
	// Bytes is the cost currently held; MaxBytes its bound.
	Bytes, MaxBytes int64
}

// ErrorCounts counts errors by sentinel.
type ErrorCounts struct {
	BadRequest, Unavailable, Timeout, Upstream, Canceled, Other uint64
}

// LatencyStats is a small histogram of upstream call durations.
type LatencyStats struct {
	Count uint64
	Sum   time.Duration
	// Buckets[i] counts calls of at most LatencyBounds()[i] and more than the
	// bound before it (not cumulative); the last one counts slower calls.
	Buckets [len(latencyBounds) + 1]uint64
}

// Stats returns a snapshot of the counters. Counters are read one by one, so a
// snapshot taken under load may be off by the calls in progress.
func (c *Cache) Stats() CacheStats {
	s := CacheStats{
		Hits:       c.hits.Load(),
		Misses:     c.misses.Load(),
		Coalesced:  c.coalesced.Load(),
		Abandoned:  c.abandoned.Load(),
		Collisions: c.collisions.Load(),
		Calls:      c.calls.Load(),
		Errors: ErrorCounts{
			BadRequest:  c.errs[kindBadRequest].Load(),
			Unavailable: c.errs[kindUnavailable].Load(),
			Timeout:     c.errs[kindTimeout].Load(),
			Upstream:    c.errs[kindUpstream].Load(),
			Canceled:    c.errs[kindCanceled].Load(),
			Other:       c.errs[kindOther].Load(),
		},
		Latency:  LatencyStats{Count: c.latCount.Load(), Sum: time.Duration(c.latSum.Load())},
		MaxBytes: c.maxBytes,
	}
	for i := range c.latBuckets {
		s.Latency.Buckets[i] = c.latBuckets[i].Load()
	}
	c.life.RLock()
	if !c.closed {
		s.Bytes = c.maxBytes - c.store.RemainingCost()
	}
	c.life.RUnlock()
	return s
}

// Close cancels the upstream calls in progress, waits for them, and stops the
// cache's goroutine. Callers waiting for a canceled call get its error; later
// calls get ErrClosed. Close is idempotent and safe to call concurrently with
// Tokenize; a concurrent second Close waits for the first. It does not close the inner tokenizer.
func (c *Cache) Close() {
	c.closeOnce.Do(func() {
		c.life.Lock()
		c.closed = true
		c.life.Unlock()
		c.stop()
		c.flying.Wait()
		c.store.Close()
	})
}
