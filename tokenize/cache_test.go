package tokenize_test

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/tokenize"
)

// fakeTokenizer answers in memory: the ids are derived from the request so a
// wrong answer is detectable; err, when set, fails every call.
type fakeTokenizer struct {
	calls      atomic.Int64
	n          int  // tokens per answer
	noFeatures bool // answer without Features (a text-only request)
	err        atomic.Pointer[error]
}

func (f *fakeTokenizer) Tokenize(_ context.Context, req tokenize.Request) (tokenize.Result, error) {
	f.calls.Add(1)
	if e := f.err.Load(); e != nil {
		return tokenize.Result{}, *e
	}
	res := tokenize.Result{Tokens: idsFor(req, f.n), PromptCount: 1}
	if !f.noFeatures {
		res.Features = []byte(`{"mm_hashes":{}}`)
	}
	return res, nil
}

// idsFor derives n ids from the request's identity.
func idsFor(req tokenize.Request, n int) []uint32 {
	h := crc32.ChecksumIEEE([]byte(req.Model + "|" + req.Path + "|" + string(req.Body)))
	return seq(n, h%1000000)
}

func newCache(t *testing.T, inner tokenize.Tokenizer, opts tokenize.CacheOptions) *tokenize.Cache {
	t.Helper()
	c, err := tokenize.NewCache(inner, opts)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

func chatReq(s string) tokenize.Request {
	return tokenize.Request{Path: tokenize.PathChatCompletions, Body: chatBody(s), Model: "m"}
}

func TestNewCacheValidates(t *testing.T) {
	_, err := tokenize.NewCache(nil, tokenize.CacheOptions{MaxBytes: -1, TTL: -1, CallTimeout: -1})
	require.ErrorIs(t, err, tokenize.ErrInvalidOptions)
	contains(t, err, "nil", "max bytes", "TTL", "call timeout")

	cl := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolSGLang, BaseURL: "http://127.0.0.1:1"})
	c := newCache(t, cl, tokenize.CacheOptions{})
	require.Equal(t, tokenize.ProtocolSGLang, c.KeyProtocol(), "the key protocol defaults to the client's")
	require.EqualValues(t, tokenize.DefaultCacheMaxBytes, c.Stats().MaxBytes)
	c2 := newCache(t, cl, tokenize.CacheOptions{Protocol: "custom"})
	require.Equal(t, "custom", c2.KeyProtocol())
}

func TestCacheHitMissAndCopySafety(t *testing.T) {
	inner := &fakeTokenizer{n: 8}
	c := newCache(t, inner, tokenize.CacheOptions{})
	ctx := context.Background()
	req := chatReq("hello")
	want := idsFor(req, 8)

	r1, err := c.Tokenize(ctx, req)
	require.NoError(t, err)
	require.Equal(t, want, r1.Tokens)
	r1.Tokens[0] = 0xdead // the leader's copy is its own
	r1.Features[0] = 'X'
	c.Wait()

	r2, err := c.Tokenize(ctx, req)
	require.NoError(t, err)
	require.Equal(t, want, r2.Tokens)
	require.Equal(t, `{"mm_hashes":{}}`, string(r2.Features))
	r2.Tokens[1] = 0xbeef // a hit's copy is its own
	r3, err := c.Tokenize(ctx, req)
	require.NoError(t, err)
	require.Equal(t, want, r3.Tokens)
	require.EqualValues(t, 1, inner.calls.Load())

	s := c.Stats()
	require.EqualValues(t, 2, s.Hits)
	require.EqualValues(t, 1, s.Misses)
	require.EqualValues(t, 1, s.Calls)
	require.Zero(t, s.Coalesced)
	require.EqualValues(t, 1, s.Latency.Count)
	var inBuckets uint64
	for _, n := range s.Latency.Buckets {
		inBuckets += n
	}
	require.Equal(t, s.Latency.Count, inBuckets)
	require.EqualValues(t, len(req.Model)+len(req.Path)+len(req.Body)+4*8+len(`{"mm_hashes":{}}`)+160, s.Bytes)
}

func TestCacheShareResults(t *testing.T) {
	inner := &fakeTokenizer{n: 4}
	c := newCache(t, inner, tokenize.CacheOptions{ShareResults: true})
	req := chatReq("s")
	_, err := c.Tokenize(context.Background(), req)
	require.NoError(t, err)
	c.Wait()
	r1, err := c.Tokenize(context.Background(), req)
	require.NoError(t, err)
	r2, err := c.Tokenize(context.Background(), req)
	require.NoError(t, err)
	require.Equal(t, idsFor(req, 4), r2.Tokens)
	require.Same(t, &r1.Tokens[0], &r2.Tokens[0], "hits share the cached slice")
	require.EqualValues(t, 2, c.Stats().Hits)
}

// TestCacheKeyCoversEverything: requests differing in any keyed part are
// separate entries, and each keeps its own answer.
func TestCacheKeyCoversEverything(t *testing.T) {
	inner := &fakeTokenizer{n: 4}
	c := newCache(t, inner, tokenize.CacheOptions{})
	ctx := context.Background()
	base := chatReq("a")
	reqs := []tokenize.Request{
		base,
		{Path: base.Path, Body: base.Body, Model: "other-model"},
		{Path: tokenize.PathCompletions, Body: base.Body, Model: base.Model},
		{Path: base.Path, Body: append(append([]byte{}, base.Body...), ' '), Model: base.Model},
		// Same concatenation of model and path, different split: length prefixes
		// keep them apart.
		{Path: "x" + base.Path, Body: base.Body, Model: ""},
	}
	for _, r := range reqs[:4] {
		_, err := c.Tokenize(ctx, r)
		require.NoError(t, err)
	}
	c.Wait()
	require.EqualValues(t, 4, inner.calls.Load())
	for _, r := range reqs[:4] {
		res, err := c.Tokenize(ctx, r)
		require.NoError(t, err)
		require.Equal(t, idsFor(r, 4), res.Tokens)
	}
	require.EqualValues(t, 4, inner.calls.Load(), "all four were hits")
	require.EqualValues(t, 4, c.Stats().Hits)
}

func TestCacheDoesNotCacheErrors(t *testing.T) {
	inner := &fakeTokenizer{n: 2}
	boom := fmt.Errorf("%w: status 500", tokenize.ErrUpstream)
	inner.err.Store(&boom)
	c := newCache(t, inner, tokenize.CacheOptions{})
	ctx := context.Background()
	_, err := c.Tokenize(ctx, chatReq("x"))
	require.ErrorIs(t, err, tokenize.ErrUpstream)
	c.Wait()
	inner.err.Store(nil)
	res, err := c.Tokenize(ctx, chatReq("x"))
	require.NoError(t, err)
	require.Len(t, res.Tokens, 2)
	require.EqualValues(t, 2, inner.calls.Load())
	s := c.Stats()
	require.EqualValues(t, 1, s.Errors.Upstream)
	require.EqualValues(t, 2, s.Misses)
}

// TestCacheCoalescesConcurrentMisses: N callers ask for the same request while
// the backend is held; exactly one upstream call is made and all get its answer.
func TestCacheCoalescesConcurrentMisses(t *testing.T) {
	const n = 16
	release := make(chan struct{})
	b := newBackend(t, func(w http.ResponseWriter, r *http.Request) {
		<-release
		reply(200, renderAnswer(seq(32, 7)))(w, r)
	})
	cl := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL})
	c := newCache(t, cl, tokenize.CacheOptions{})
	joined := make(chan struct{}, n)
	c.SetJoinedHook(func() { joined <- struct{}{} })

	var wg sync.WaitGroup
	results := make([]tokenize.Result, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { results[i], errs[i] = c.Tokenize(context.Background(), chatReq("same")) })
	}
	for range n {
		<-joined // every caller is registered with the one flight
	}
	close(release)
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, seq(32, 7), results[i].Tokens)
	}
	results[0].Tokens[0] = 1 << 30
	require.Equal(t, seq(32, 7), results[1].Tokens, "coalesced callers get distinct copies")
	require.EqualValues(t, 1, b.calls.Load(), "exactly one upstream call")
	s := c.Stats()
	require.EqualValues(t, n, s.Misses)
	require.EqualValues(t, n-1, s.Coalesced)
	require.EqualValues(t, 1, s.Calls)
}

// TestCacheCallerLeavesEarly: a caller whose context ends stops waiting at once;
// the shared call carries on and its answer is cached for the next caller.
func TestCacheCallerLeavesEarly(t *testing.T) {
	release := make(chan struct{})
	b := newBackend(t, func(w http.ResponseWriter, r *http.Request) {
		<-release
		reply(200, renderAnswer(seq(4, 1)))(w, r)
	})
	cl := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL})
	c := newCache(t, cl, tokenize.CacheOptions{})
	joined := make(chan struct{}, 4)
	c.SetJoinedHook(func() { joined <- struct{}{} })

	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-joined
		cancel()
	}()
	_, err := c.Tokenize(ctx, chatReq("q"))
	require.ErrorIs(t, err, tokenize.ErrCanceled)
	require.ErrorIs(t, err, context.Canceled)
	close(release)

	res, err := c.Tokenize(context.Background(), chatReq("q")) // joins the flight or hits
	require.NoError(t, err)
	require.Equal(t, seq(4, 1), res.Tokens)
	require.EqualValues(t, 1, b.calls.Load())
	s := c.Stats()
	require.EqualValues(t, 1, s.Abandoned)
	require.EqualValues(t, 1, s.Errors.Canceled)
}

// TestCacheCloseCancelsCalls: Close cancels the call in progress, waits for it,
// and later calls fail with ErrClosed.
func TestCacheCloseCancelsCalls(t *testing.T) {
	arrived := make(chan struct{}, 1)
	b := newBackend(t, func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-r.Context().Done()
	})
	cl := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL})
	c, err := tokenize.NewCache(cl, tokenize.CacheOptions{})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := c.Tokenize(context.Background(), chatReq("q"))
		done <- err
	}()
	<-arrived // the upstream call is in progress
	c.Close()
	require.ErrorIs(t, <-done, tokenize.ErrCanceled)
	_, err = c.Tokenize(context.Background(), chatReq("q"))
	require.ErrorIs(t, err, tokenize.ErrClosed)
	require.Equal(t, 503, tokenize.HTTPStatus(err))
	c.Close() // idempotent
	require.Zero(t, c.Stats().Bytes)
}

func TestCacheCallTimeout(t *testing.T) {
	b := newBackend(t, func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	cl := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL})
	c := newCache(t, cl, tokenize.CacheOptions{CallTimeout: 50 * time.Millisecond})
	_, err := c.Tokenize(context.Background(), chatReq("q"))
	require.ErrorIs(t, err, tokenize.ErrTimeout)
	require.EqualValues(t, 1, c.Stats().Errors.Timeout)
}

// TestCacheBoundedMemory fills a small cache with far more than it can hold.
func TestCacheBoundedMemory(t *testing.T) {
	const maxBytes = 64 << 10
	inner := &fakeTokenizer{n: 256} // about 1.2 KiB per entry
	c := newCache(t, inner, tokenize.CacheOptions{MaxBytes: maxBytes})
	for i := range 400 {
		_, err := c.Tokenize(context.Background(), chatReq(fmt.Sprint(i)))
		require.NoError(t, err)
		c.Wait()
		require.LessOrEqual(t, c.Stats().Bytes, int64(maxBytes))
	}
	s := c.Stats()
	require.Positive(t, s.Bytes)
	require.EqualValues(t, 400, inner.calls.Load())
}

// TestCacheCollisionIsAMiss: an entry under the same xxhash key but for another
// request body is not returned.
func TestCacheCollisionIsAMiss(t *testing.T) {
	inner := &fakeTokenizer{n: 3}
	c := newCache(t, inner, tokenize.CacheOptions{})
	req := chatReq("victim")
	c.Poison(req, []uint32{6, 6, 6})
	res, err := c.Tokenize(context.Background(), req)
	require.NoError(t, err)
	require.Equal(t, idsFor(req, 3), res.Tokens)
	require.EqualValues(t, 1, c.Stats().Collisions)
	require.EqualValues(t, 1, inner.calls.Load())
}

// gatedTokenizer answers like fakeTokenizer once gate is closed.
type gatedTokenizer struct {
	fakeTokenizer
	gate chan struct{}
}

func (g *gatedTokenizer) Tokenize(ctx context.Context, req tokenize.Request) (tokenize.Result, error) {
	<-g.gate
	return g.fakeTokenizer.Tokenize(ctx, req)
}

// TestCacheCollisionInFlight: a caller whose request collides with a call in
// flight for another request does not take that call's answer.
func TestCacheCollisionInFlight(t *testing.T) {
	inner := &gatedTokenizer{fakeTokenizer: fakeTokenizer{n: 5}, gate: make(chan struct{})}
	c := newCache(t, inner, tokenize.CacheOptions{})
	c.FixKey(42)
	joined := make(chan struct{}, 2)
	c.SetJoinedHook(func() { joined <- struct{}{} })
	a, b := chatReq("a"), chatReq("b")
	var resA, resB tokenize.Result
	var errA, errB error
	var wg sync.WaitGroup
	wg.Go(func() { resA, errA = c.Tokenize(context.Background(), a) })
	<-joined
	wg.Go(func() { resB, errB = c.Tokenize(context.Background(), b) })
	<-joined
	close(inner.gate)
	wg.Wait()
	require.NoError(t, errA)
	require.NoError(t, errB)
	require.Equal(t, idsFor(a, 5), resA.Tokens)
	require.Equal(t, idsFor(b, 5), resB.Tokens)
	require.EqualValues(t, 2, inner.calls.Load())
	s := c.Stats()
	require.EqualValues(t, 1, s.Collisions)
	require.Zero(t, s.Coalesced)

	// The stored entry is a's; b still never gets a's ids.
	c.Wait()
	res, err := c.Tokenize(context.Background(), b)
	require.NoError(t, err)
	require.Equal(t, idsFor(b, 5), res.Tokens)
}

func TestCacheTTL(t *testing.T) {
	inner := &fakeTokenizer{n: 1}
	c := newCache(t, inner, tokenize.CacheOptions{TTL: time.Nanosecond})
	for range 2 {
		_, err := c.Tokenize(context.Background(), chatReq("q"))
		require.NoError(t, err)
		c.Wait()
	}
	require.EqualValues(t, 2, inner.calls.Load(), "an expired entry is a miss")
}

// TestCacheConcurrentMix hammers a few keys from many goroutines under -race and
// checks every answer belongs to its own request.
func TestCacheConcurrentMix(t *testing.T) {
	inner := &fakeTokenizer{n: 16}
	c := newCache(t, inner, tokenize.CacheOptions{})
	var wg sync.WaitGroup
	var bad atomic.Int64
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				req := chatReq(fmt.Sprint((g + i) % 5))
				res, err := c.Tokenize(context.Background(), req)
				if err != nil || !equalIDs(res.Tokens, idsFor(req, 16)) {
					bad.Add(1)
				}
				res.Tokens[0]++ // callers may scribble on their copy
			}
		})
	}
	wg.Wait()
	require.Zero(t, bad.Load())
	s := c.Stats()
	require.EqualValues(t, 1600, s.Hits+s.Misses)
	require.LessOrEqual(t, s.Calls, s.Misses)
	require.Positive(t, s.Hits)
}

func equalIDs(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestCacheCountsErrorKinds(t *testing.T) {
	inner := &fakeTokenizer{}
	c := newCache(t, inner, tokenize.CacheOptions{})
	for i, e := range []error{tokenize.ErrBadRequest, tokenize.ErrUnavailable, tokenize.ErrTimeout, tokenize.ErrUpstream, tokenize.ErrCanceled, errors.New("x")} {
		inner.err.Store(&e)
		_, err := c.Tokenize(context.Background(), chatReq(fmt.Sprint(i)))
		require.ErrorIs(t, err, e)
	}
	require.Equal(t, tokenize.ErrorCounts{BadRequest: 1, Unavailable: 1, Timeout: 1, Upstream: 1, Canceled: 1, Other: 1}, c.Stats().Errors)
}

// enteringTokenizer is a gatedTokenizer that says when a call reached it.
type enteringTokenizer struct {
	gatedTokenizer
	entered chan struct{}
}

func (e *enteringTokenizer) Tokenize(ctx context.Context, req tokenize.Request) (tokenize.Result, error) {
	e.entered <- struct{}{}
	return e.gatedTokenizer.Tokenize(ctx, req)
}

// TestCacheMaxCallsBoundsDetachedCalls: calls whose callers left still count
// until they end; one more miss is refused at once with ErrUnavailable, and a
// slot frees when a call ends.
func TestCacheMaxCallsBoundsDetachedCalls(t *testing.T) {
	inner := &enteringTokenizer{gatedTokenizer: gatedTokenizer{fakeTokenizer: fakeTokenizer{n: 3}, gate: make(chan struct{})}, entered: make(chan struct{}, 8)}
	c := newCache(t, inner, tokenize.CacheOptions{MaxCalls: 2})
	for _, q := range []string{"a", "b"} {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			_, err := c.Tokenize(ctx, chatReq(q))
			done <- err
		}()
		<-inner.entered
		cancel() // the caller leaves; its call goes on, detached
		require.ErrorIs(t, <-done, tokenize.ErrCanceled)
	}
	_, err := c.Tokenize(context.Background(), chatReq("c"))
	require.ErrorIs(t, err, tokenize.ErrUnavailable)
	require.Equal(t, 503, tokenize.HTTPStatus(err))
	close(inner.gate)
	require.Eventually(t, func() bool {
		_, err := c.Tokenize(context.Background(), chatReq("d"))
		return err == nil
	}, 10*time.Second, time.Millisecond)
	_, err = tokenize.NewCache(inner, tokenize.CacheOptions{MaxCalls: -1})
	require.ErrorIs(t, err, tokenize.ErrInvalidOptions)
}
