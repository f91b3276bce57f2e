package tokenize_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/logtest"
	"github.com/kvselect/kvselect/tokenize"
)

// scripted is a Tokenizer whose answers the test sets: after delay, err, or
// the ids [id]. It counts its calls and the ones canceled under it.
type scripted struct {
	id    uint32
	mu    sync.Mutex
	delay time.Duration
	err   error
	calls int
	gone  int // calls whose context ended before the delay
}

func (s *scripted) set(delay time.Duration, err error) {
	s.mu.Lock()
	s.delay, s.err = delay, err
	s.mu.Unlock()
}

func (s *scripted) counts() (calls, gone int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls, s.gone
}

func (s *scripted) Tokenize(ctx context.Context, _ tokenize.Request) (tokenize.Result, error) {
	s.mu.Lock()
	s.calls++
	delay, err := s.delay, s.err
	s.mu.Unlock()
	if delay > 0 {
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			s.mu.Lock()
			s.gone++
			s.mu.Unlock()
			return tokenize.Result{}, fmt.Errorf("%w: %w", tokenize.ErrCanceled, ctx.Err())
		}
	}
	if err != nil {
		return tokenize.Result{}, err
	}
	return tokenize.Result{Tokens: []uint32{s.id}, PromptCount: 1}, nil
}

func newPool(t *testing.T, opts tokenize.PoolOptions, toks ...*scripted) *tokenize.Pool {
	t.Helper()
	for i, s := range toks {
		s.id = uint32(i)
		opts.Endpoints = append(opts.Endpoints, tokenize.Endpoint{Name: fmt.Sprintf("t%d", i), Tokenizer: s})
	}
	p, err := tokenize.NewPool(opts)
	require.NoError(t, err)
	return p
}

var poolReq = tokenize.Request{Path: tokenize.PathChatCompletions, Body: []byte(`{"messages":[]}`)}

func TestNewPoolValidates(t *testing.T) {
	_, err := tokenize.NewPool(tokenize.PoolOptions{})
	require.ErrorIs(t, err, tokenize.ErrInvalidOptions)
	_, err = tokenize.NewPool(tokenize.PoolOptions{
		Endpoints: []tokenize.Endpoint{{Name: "a", Tokenizer: &scripted{}}, {Name: "a"}, {Tokenizer: &scripted{}}},
		Failures:  -1, OpenFor: -1, HedgeQuantile: 1.5, HedgeMin: -1,
	})
	require.ErrorIs(t, err, tokenize.ErrInvalidOptions)
	for _, want := range []string{`name "a" repeated`, "Endpoints[1] has no Tokenizer", "Endpoints[2] has no name",
		"Failures -1", "OpenFor -1ns", "HedgeQuantile 1.5", "HedgeMin -1ns"} {
		require.ErrorContains(t, err, want)
	}
}

// An endpoint that fails is failed over, and after Failures in a row its
// circuit opens: it is left out for OpenFor, then one call probes it.
func TestPoolFailsOverAndOpens(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a, b := &scripted{}, &scripted{}
		a.set(0, fmt.Errorf("%w: connection refused", tokenize.ErrUnavailable))
		var logs logtest.Buffer
		p := newPool(t, tokenize.PoolOptions{HedgeQuantile: -1, Logger: slog.New(slog.NewTextHandler(&logs, nil))}, a, b)
		for range 6 {
			res, err := p.Tokenize(context.Background(), poolReq)
			require.NoError(t, err)
			require.Equal(t, []uint32{1}, res.Tokens)
		}
		calls, _ := a.counts()
		require.Equal(t, 3, calls, "open after 3 failures: no call since")
		st := p.Stats()
		require.EqualValues(t, 3, st.Failovers)
		require.Equal(t, tokenize.EndpointStats{Name: "t0", Calls: 3, Failures: 3, Opened: 1, Open: true}, st.Endpoints[0])
		require.Equal(t, tokenize.EndpointStats{Name: "t1", Calls: 6}, st.Endpoints[1])
		require.Equal(t, 1, strings.Count(logs.String(), "circuit open"), "one WARN as it opens:\n%s", logs.String())
		require.Contains(t, logs.String(), "endpoint=t0")
		require.Contains(t, logs.String(), "connection refused")

		time.Sleep(tokenize.DefaultPoolOpenFor)
		a.set(0, nil)
		for range 4 {
			_, err := p.Tokenize(context.Background(), poolReq)
			require.NoError(t, err)
		}
		calls, _ = a.counts()
		require.Equal(t, 5, calls, "probed once, closed, then its turns again")
		require.False(t, p.Stats().Endpoints[0].Open)
		require.Contains(t, logs.String(), "circuit closed")

		// A probe that fails opens the circuit again at once.
		a.set(0, fmt.Errorf("%w: 500", tokenize.ErrUpstream))
		for range 3 {
			_, _ = p.Tokenize(context.Background(), poolReq)
		}
		time.Sleep(tokenize.DefaultPoolOpenFor)
		for range 4 {
			_, err := p.Tokenize(context.Background(), poolReq)
			require.NoError(t, err)
		}
		st = p.Stats()
		require.True(t, st.Endpoints[0].Open, "the probe failed")
		require.EqualValues(t, 2, st.Endpoints[0].Opened)
	})
}

// The request's fault and the caller's are returned at once: no other
// endpoint could do better, and the endpoint's circuit does not count them.
func TestPoolDoesNotFailOverTheRequestsFault(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a, b := &scripted{}, &scripted{}
		p := newPool(t, tokenize.PoolOptions{HedgeQuantile: -1}, a, b)
		bad := fmt.Errorf("%w: 400 messages missing", tokenize.ErrBadRequest)
		a.set(0, bad)
		b.set(0, bad)
		for range 5 {
			_, err := p.Tokenize(context.Background(), poolReq)
			require.ErrorIs(t, err, tokenize.ErrBadRequest)
		}
		st := p.Stats()
		require.Zero(t, st.Failovers)
		require.Zero(t, st.Endpoints[0].Failures+st.Endpoints[1].Failures)

		a.set(time.Second, nil)
		b.set(time.Second, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
		defer cancel()
		_, err := p.Tokenize(ctx, poolReq)
		require.ErrorIs(t, err, tokenize.ErrCanceled)
		require.Equal(t, http.StatusGatewayTimeout, tokenize.HTTPStatus(context.DeadlineExceeded))
		require.Zero(t, p.Stats().Failovers, "the caller's deadline is nobody's fault")
	})
}

// A call slower than most is hedged on a second endpoint; the first answer
// wins and the other call is canceled before Tokenize returns.
func TestPoolHedges(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a, b := &scripted{}, &scripted{}
		p := newPool(t, tokenize.PoolOptions{}, a, b)
		a.set(time.Second, nil)
		b.set(time.Millisecond, nil)
		start := time.Now()
		var res tokenize.Result
		var err error
		for { // the round robin starts on a: make sure the slow one went first
			res, err = p.Tokenize(context.Background(), poolReq)
			require.NoError(t, err)
			if calls, _ := a.counts(); calls > 0 {
				break
			}
		}
		require.Equal(t, []uint32{1}, res.Tokens)
		require.Less(t, time.Since(start), 100*time.Millisecond, "answered by the hedge at 50 ms")
		_, gone := a.counts()
		require.Equal(t, 1, gone, "the slow call was canceled")
		st := p.Stats()
		require.EqualValues(t, 1, st.Hedges)
		require.EqualValues(t, 1, st.HedgeWins)
		require.Equal(t, tokenize.DefaultPoolHedgeMin, st.HedgeAfter)

		// The hedge delay follows the latency: once calls take 200 ms, so
		// does the delay, and a call of 150 ms is not hedged.
		a.set(200*time.Millisecond, nil)
		b.set(200*time.Millisecond, nil)
		for range 20 {
			_, err := p.Tokenize(context.Background(), poolReq)
			require.NoError(t, err)
		}
		st = p.Stats()
		require.Equal(t, 200*time.Millisecond, st.HedgeAfter)
		hedges := st.Hedges
		a.set(150*time.Millisecond, nil)
		b.set(150*time.Millisecond, nil)
		_, err = p.Tokenize(context.Background(), poolReq)
		require.NoError(t, err)
		require.Equal(t, hedges, p.Stats().Hedges)
	})
}

// When every endpoint fails, the last error comes back wrapped and counted.
func TestPoolExhausted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a, b := &scripted{}, &scripted{}
		a.set(0, fmt.Errorf("%w: connection refused", tokenize.ErrUnavailable))
		b.set(0, fmt.Errorf("%w: 503", tokenize.ErrUnavailable))
		p := newPool(t, tokenize.PoolOptions{}, a, b)
		_, err := p.Tokenize(context.Background(), poolReq)
		require.ErrorIs(t, err, tokenize.ErrUnavailable)
		require.ErrorContains(t, err, "every tokenizer failed (2 tried)")
		require.Equal(t, http.StatusServiceUnavailable, tokenize.HTTPStatus(err))
		require.EqualValues(t, 1, p.Stats().Exhausted)
	})
}

// Through real sockets: two vLLM render endpoints, one of them gone.
func TestPoolOverClients(t *testing.T) {
	up := newBackend(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"token_ids":[7,8,9]}`))
	})
	down := newBackend(t, func(http.ResponseWriter, *http.Request) {})
	down.Close()
	var eps []tokenize.Endpoint
	for _, b := range []*backend{down, up} {
		c, err := tokenize.New(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL})
		require.NoError(t, err)
		eps = append(eps, tokenize.Endpoint{Name: b.URL, Tokenizer: c})
	}
	p, err := tokenize.NewPool(tokenize.PoolOptions{Endpoints: eps})
	require.NoError(t, err)
	for range 4 {
		res, err := p.Tokenize(context.Background(), poolReq)
		require.NoError(t, err)
		require.Equal(t, []uint32{7, 8, 9}, res.Tokens)
	}
	st := p.Stats()
	require.Positive(t, st.Endpoints[0].Failures)
	require.Equal(t, st.Endpoints[0].Failures, st.Failovers)
	require.False(t, errors.Is(err, tokenize.ErrUnavailable))
}

// ServiceFailed tells the service's failures from the request's faults and
// the caller's; EstimateTokens books at least a token.
func TestServiceFailed(t *testing.T) {
	for _, err := range []error{tokenize.ErrUnavailable, tokenize.ErrTimeout, tokenize.ErrUpstream, tokenize.ErrClosed,
		fmt.Errorf("wrapped: %w", tokenize.ErrUpstream)} {
		require.True(t, tokenize.ServiceFailed(err), "%v", err)
	}
	for _, err := range []error{nil, tokenize.ErrBadRequest, tokenize.ErrPromptTooLong, tokenize.ErrCanceled, errors.New("other")} {
		require.False(t, tokenize.ServiceFailed(err), "%v", err)
	}
	require.Equal(t, 1, tokenize.EstimateTokens(nil))
	require.Equal(t, 25, tokenize.EstimateTokens(make([]byte, 100)))
}

func TestParseBaseURLs(t *testing.T) {
	urls, err := tokenize.ParseBaseURLs(" http://a:8000 ,, https://b/x ", 4)
	require.NoError(t, err)
	require.Equal(t, []string{"http://a:8000", "https://b/x"}, urls)
	for list, want := range map[string]string{
		"":                           "names no URL",
		" , ":                        "names no URL",
		"ftp://a":                    "not an absolute http(s) URL",
		"a:8000":                     "not an absolute http(s) URL",
		"http://a,http://a":          "listed twice",
		"http://a,http://b,http://c": "3 URLs, at most 2",
	} {
		_, err := tokenize.ParseBaseURLs(list, 2)
		require.ErrorContains(t, err, want, "%q", list)
	}
}

// NewClientPool names each endpoint by its URL, bounds a Cache's call by up
// to three endpoints' timeouts, and refuses a bad client option as New
// does (a URL with credentials among them).
func TestNewClientPool(t *testing.T) {
	urls := []string{"http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3", "http://127.0.0.1:4"}
	p, err := tokenize.NewClientPool(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender}, urls, tokenize.PoolOptions{})
	require.NoError(t, err)
	defer p.Close()
	st := p.Stats()
	require.Len(t, st.Endpoints, 4)
	require.Equal(t, "http://127.0.0.1:1", st.Endpoints[0].Name)
	require.Equal(t, 3*time.Second, p.CallTimeout(time.Second))
	one, err := tokenize.NewClientPool(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender}, urls[1:2], tokenize.PoolOptions{})
	require.NoError(t, err)
	one.Close()
	one.Close()
	require.Equal(t, time.Second, one.CallTimeout(time.Second))
	_, err = tokenize.NewClientPool(tokenize.Options{Protocol: "nope"}, urls, tokenize.PoolOptions{})
	require.ErrorIs(t, err, tokenize.ErrInvalidOptions)
	_, err = tokenize.NewClientPool(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender}, []string{urls[0], "http://u:p@127.0.0.1:5"}, tokenize.PoolOptions{})
	require.ErrorIs(t, err, tokenize.ErrInvalidOptions)
}

// idBackend is a vLLM render endpoint whose every answer is [id].
func idBackend(t *testing.T, id int) *backend {
	t.Helper()
	return newBackend(t, reply(200, fmt.Sprintf(`{"token_ids":[%d]}`, id)))
}

func endpointNames(p *tokenize.Pool) []string {
	var names []string
	for _, e := range p.Stats().Endpoints {
		names = append(names, e.Name)
	}
	return names
}

// A client pool follows its URLs: it may start empty (its calls fail with
// ErrUnavailable, counted as exhausted), SetBaseURLs adds and removes
// endpoints, an endpoint that stays keeps its circuit and counters, and the
// changes are logged. A bad list is refused whole and changes nothing.
func TestPoolFollowsBaseURLs(t *testing.T) {
	a, b, c := idBackend(t, 1), idBackend(t, 2), idBackend(t, 3)
	down := closedURL(t)
	var logs logtest.Buffer
	p, err := tokenize.NewClientPool(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender}, nil,
		tokenize.PoolOptions{HedgeQuantile: -1, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	defer p.Close()
	ctx := context.Background()

	require.Empty(t, p.Stats().Endpoints)
	require.Equal(t, 3*time.Second, p.CallTimeout(time.Second), "an empty pool leaves room for MaxPoolTries endpoints")
	_, err = p.Tokenize(ctx, poolReq)
	require.ErrorIs(t, err, tokenize.ErrUnavailable)
	require.ErrorContains(t, err, "no endpoint")
	require.True(t, tokenize.ServiceFailed(err), "a gateway's degraded mode acts on it")
	require.EqualValues(t, 1, p.Stats().Exhausted)

	require.NoError(t, p.SetBaseURLs([]string{a.URL}))
	res, err := p.Tokenize(ctx, poolReq)
	require.NoError(t, err)
	require.Equal(t, []uint32{1}, res.Tokens)
	require.Contains(t, logs.String(), "endpoints changed")
	require.Contains(t, logs.String(), "added=["+a.URL+"]")

	require.NoError(t, p.SetBaseURLs([]string{a.URL, b.URL}))
	require.Equal(t, []string{a.URL, b.URL}, endpointNames(p))
	require.EqualValues(t, 1, p.Stats().Endpoints[0].Calls, "a stayed: its counters too")
	seen := map[uint32]bool{}
	for range 4 {
		res, err := p.Tokenize(ctx, poolReq)
		require.NoError(t, err)
		seen[res.Tokens[0]] = true
	}
	require.Equal(t, map[uint32]bool{1: true, 2: true}, seen, "round robin over both")
	require.Equal(t, 2, strings.Count(logs.String(), "endpoints changed"), "one INFO per change:\n%s", logs.String())

	// a leaves, a dead URL comes: its circuit opens, and stays open when
	// the set changes around it.
	require.NoError(t, p.SetBaseURLs([]string{down, b.URL}))
	require.Equal(t, []string{down, b.URL}, endpointNames(p))
	require.Contains(t, logs.String(), "removed=["+a.URL+"]")
	for range 6 {
		res, err := p.Tokenize(ctx, poolReq)
		require.NoError(t, err)
		require.Equal(t, []uint32{2}, res.Tokens)
	}
	require.NoError(t, p.SetBaseURLs([]string{c.URL, down, b.URL}))
	st := p.Stats()
	require.Equal(t, tokenize.EndpointStats{Name: down, Calls: 3, Failures: 3, Opened: 1, Open: true}, st.Endpoints[1])
	require.Equal(t, tokenize.EndpointStats{Name: c.URL}, st.Endpoints[0], "a new endpoint starts closed, at zero")

	// A bad list is refused whole, each problem named, credentials not quoted.
	err = p.SetBaseURLs([]string{b.URL, "ftp://x:1", b.URL, "http://user:secret@10.0.0.1:8000"})
	require.ErrorIs(t, err, tokenize.ErrInvalidOptions)
	require.ErrorContains(t, err, "URL 1")
	require.ErrorContains(t, err, "repeated")
	require.ErrorContains(t, err, "user information")
	require.NotContains(t, err.Error(), "secret")
	require.Equal(t, []string{c.URL, down, b.URL}, endpointNames(p), "nothing changed")

	// No URL at all: back to an empty pool.
	require.NoError(t, p.SetBaseURLs(nil))
	require.Empty(t, p.Stats().Endpoints)
	_, err = p.Tokenize(ctx, poolReq)
	require.ErrorIs(t, err, tokenize.ErrUnavailable)

	// A pool of the caller's own Tokenizers has no URLs to set.
	own := newPool(t, tokenize.PoolOptions{}, &scripted{})
	require.ErrorIs(t, own.SetBaseURLs([]string{a.URL}), tokenize.ErrInvalidOptions)
	require.Equal(t, []string{"t0"}, endpointNames(own))
}

// The endpoint set changes while calls are in flight, from several
// goroutines at once: every set holds live endpoints only, so no call
// fails, and Stats reads a whole set each time (run it with -race).
func TestPoolSetBaseURLsWhileServing(t *testing.T) {
	var urls []string
	for i := range 4 {
		urls = append(urls, idBackend(t, i).URL)
	}
	sets := [][]string{{urls[0]}, {urls[0], urls[1]}, {urls[1], urls[2], urls[3]}, {urls[3]}, {urls[2], urls[0]}}
	p, err := tokenize.NewClientPool(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender}, sets[0], tokenize.PoolOptions{HedgeMin: time.Millisecond})
	require.NoError(t, err)
	defer p.Close()
	const workers, calls = 8, 150
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := range calls {
				if _, err := p.Tokenize(context.Background(), poolReq); err != nil {
					errs <- fmt.Errorf("worker %d call %d: %w", w, i, err)
					return
				}
				if i%10 == w%10 {
					if err := p.SetBaseURLs(sets[(w+i)%len(sets)]); err != nil {
						errs <- err
						return
					}
				}
				if st := p.Stats(); len(st.Endpoints) == 0 {
					errs <- errors.New("an empty set was seen")
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	st := p.Stats()
	require.Zero(t, st.Exhausted)
	require.Zero(t, st.Failovers, "no endpoint of any set failed")
}
