package tokenize

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of PoolOptions.
const (
	// DefaultPoolFailures is how many failures in a row open an endpoint's
	// circuit.
	DefaultPoolFailures = 3
	// DefaultPoolOpenFor is how long an open circuit keeps its endpoint out
	// before one probe may try it again.
	DefaultPoolOpenFor = 5 * time.Second
	// DefaultPoolHedgeQuantile is the latency quantile past which a call is
	// hedged on a second endpoint.
	DefaultPoolHedgeQuantile = 0.95
	// DefaultPoolHedgeMin is the least a call waits before it is hedged.
	DefaultPoolHedgeMin = 50 * time.Millisecond
)

// poolSamples is how many recent successful calls the hedge delay is read
// from; it is recomputed every poolSamples/4 of them.
const poolSamples = 256

// Endpoint is one tokenizer of a Pool: a Client (or any Tokenizer) and the
// name its counters go by (its base URL, say).
type Endpoint struct {
	Name      string
	Tokenizer Tokenizer
}

// PoolOptions configure a Pool. Zero fields are the defaults.
type PoolOptions struct {
	// Endpoints are the tokenizers, tried in turn (at least one, names
	// unique and not empty). Every vLLM and SGLang pod serves its model's
	// render or tokenize endpoint, so a pool's own workers are its
	// tokenizers; a TensorRT-LLM pool has a render service instead.
	Endpoints []Endpoint
	// Failures is how many failures in a row open an endpoint's circuit
	// (DefaultPoolFailures); > 0.
	Failures int
	// OpenFor is how long an open circuit keeps its endpoint out; then one
	// call probes it, which closes the circuit on success and opens it again
	// on failure (DefaultPoolOpenFor); > 0.
	OpenFor time.Duration
	// HedgeQuantile is the quantile of the recent successful calls' latency
	// after which a call not yet answered is sent to a second endpoint as
	// well, the first answer winning (DefaultPoolHedgeQuantile); in (0, 1],
	// or negative for no hedging.
	HedgeQuantile float64
	// HedgeMin is the least a call waits before it is hedged, also while
	// fewer than 16 calls have been timed (DefaultPoolHedgeMin); > 0.
	HedgeMin time.Duration
	// Now is the clock of the circuits. Default time.Now.
	Now func() time.Time
	// Logger gets a WARN each time an endpoint's circuit opens (its name,
	// the failures in a row, the last error) and an INFO when it closes
	// again. Default: none (NewClientPool: its Options.Logger).
	Logger *slog.Logger
}

// Pool is a Tokenizer over several endpoints: each call goes to the next
// endpoint whose circuit is closed (round robin), fails over to the next
// one on an error that is the endpoint's (ErrUnavailable, ErrTimeout of the
// call's own timeout, ErrUpstream), and is hedged on a second endpoint when
// it takes longer than most recent calls. An error that is the request's
// (ErrBadRequest, ErrPromptTooLong) or the caller's (ErrCanceled, its
// deadline) is returned at once. When every endpoint failed the last error
// is returned, wrapped; the caller decides whether to route without tokens
// (the reference EPP and selection/httproute do, counted as degraded).
//
// The endpoint set of a pool NewClientPool made can be replaced while it
// serves (SetBaseURLs), so that it follows a discovery of the engines; it
// may be empty, and every call then fails with ErrUnavailable.
//
// A Pool is safe for concurrent use, SetBaseURLs included. A hedged call
// runs on a goroutine of its own, which Tokenize cancels and waits for
// before it returns, so a Pool leaves nothing behind; Close only releases
// the idle connections of NewClientPool's Clients.
type Pool struct {
	// eps is the endpoint set, never nil; SetBaseURLs stores a new slice
	// (an endpoint that stays is the same *poolEndpoint in it) and never
	// modifies a stored one, so a call reads it without a lock.
	eps      atomic.Pointer[[]*poolEndpoint]
	failures int
	openFor  time.Duration
	quantile float64
	hedgeMin time.Duration
	now      func() time.Time
	log      *slog.Logger

	next atomic.Uint64 // round robin

	mu      sync.Mutex // guards lat and n
	lat     [poolSamples]time.Duration
	n       int          // samples recorded
	hedgeAt atomic.Int64 // the hedge delay in ns, recomputed from lat

	failovers, hedges, hedgeWins, exhausted atomic.Uint64

	// A pool NewClientPool made: newClient builds the Client of a base
	// URL, clients holds the current set's by URL. setMu serialises
	// SetBaseURLs and Close and guards clients.
	setMu     sync.Mutex
	newClient func(base string) (*Client, error)
	clients   map[string]*Client
}

type poolEndpoint struct {
	Endpoint

	mu        sync.Mutex
	streak    int       // failures in a row
	openUntil time.Time // zero: closed
	probing   bool      // a probe of the open circuit is in flight

	calls, failures, opened atomic.Uint64
}

// NewPool validates opts, reporting every problem at once (wrapped
// ErrInvalidOptions), and returns a Pool.
func NewPool(opts PoolOptions) (*Pool, error) { return newPool(opts, false) }

// newPool is NewPool; empty allows a pool without endpoints (NewClientPool's,
// whose URLs may come later).
func newPool(opts PoolOptions, empty bool) (*Pool, error) {
	var problems []string
	if len(opts.Endpoints) == 0 && !empty {
		problems = append(problems, "no Endpoints")
	}
	seen := map[string]bool{}
	for i, e := range opts.Endpoints {
		switch {
		case e.Name == "":
			problems = append(problems, fmt.Sprintf("Endpoints[%d] has no name", i))
		case seen[e.Name]:
			problems = append(problems, fmt.Sprintf("Endpoints[%d]: name %q repeated", i, e.Name))
		}
		seen[e.Name] = true
		if e.Tokenizer == nil {
			problems = append(problems, fmt.Sprintf("Endpoints[%d] has no Tokenizer", i))
		}
	}
	if opts.Failures == 0 {
		opts.Failures = DefaultPoolFailures
	}
	if opts.Failures < 0 {
		problems = append(problems, fmt.Sprintf("Failures %d < 0", opts.Failures))
	}
	if opts.OpenFor == 0 {
		opts.OpenFor = DefaultPoolOpenFor
	}
	if opts.OpenFor < 0 {
		problems = append(problems, fmt.Sprintf("OpenFor %v < 0", opts.OpenFor))
	}
	switch q := opts.HedgeQuantile; {
	case q == 0:
		opts.HedgeQuantile = DefaultPoolHedgeQuantile
	case q > 1 || q != q:
		problems = append(problems, fmt.Sprintf("HedgeQuantile %v not in (0, 1]", q))
	}
	if opts.HedgeMin == 0 {
		opts.HedgeMin = DefaultPoolHedgeMin
	}
	if opts.HedgeMin < 0 {
		problems = append(problems, fmt.Sprintf("HedgeMin %v < 0", opts.HedgeMin))
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
	}
	p := &Pool{failures: opts.Failures, openFor: opts.OpenFor, quantile: opts.HedgeQuantile, hedgeMin: opts.HedgeMin, now: opts.Now, log: opts.Logger}
	if p.now == nil {
		p.now = time.Now
	}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	eps := make([]*poolEndpoint, 0, len(opts.Endpoints))
	for _, e := range opts.Endpoints {
		eps = append(eps, &poolEndpoint{Endpoint: e})
	}
	p.eps.Store(&eps)
	p.hedgeAt.Store(int64(p.hedgeMin))
	return p, nil
}

// endpointFault reports whether err says the endpoint failed, so another
// may answer: not the request's fault nor the caller's.
func endpointFault(ctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return false // the caller left or its deadline passed: nobody can answer in time
	}
	return ServiceFailed(err)
}

// pick returns the next endpoint to try in round-robin order, not one of
// tried: one whose circuit is closed, or one whose open time passed (the
// call is its probe, and no other call probes it meanwhile); nil when none
// may be tried.
func (p *Pool) pick(tried []*poolEndpoint) *poolEndpoint {
	eps := *p.eps.Load()
	if len(eps) == 0 {
		return nil
	}
	start := int(p.next.Add(1) - 1)
	now := p.now()
	for i := range eps {
		e := eps[(start+i)%len(eps)]
		if slices.Contains(tried, e) {
			continue
		}
		e.mu.Lock()
		ok := e.openUntil.IsZero()
		if !ok && !e.probing && !now.Before(e.openUntil) {
			e.probing, ok = true, true
		}
		e.mu.Unlock()
		if ok {
			return e
		}
	}
	return nil
}

// record updates e's circuit with a call's outcome (err nil: success).
func (p *Pool) record(e *poolEndpoint, err error) {
	e.calls.Add(1)
	e.mu.Lock()
	e.probing = false
	if err == nil {
		wasOpen := !e.openUntil.IsZero()
		e.streak, e.openUntil = 0, time.Time{}
		e.mu.Unlock()
		if wasOpen {
			p.log.Info("tokenize: endpoint answered again; circuit closed", "endpoint", e.Name)
		}
		return
	}
	e.failures.Add(1)
	e.streak++
	opened := false
	if !e.openUntil.IsZero() || e.streak >= p.failures {
		if e.openUntil.IsZero() {
			e.opened.Add(1)
			opened = true
		}
		e.openUntil = p.now().Add(p.openFor)
	}
	streak := e.streak
	e.mu.Unlock()
	if opened {
		p.log.Warn("tokenize: endpoint failed; circuit open, calls go to the other endpoints", "endpoint", e.Name,
			"failures_in_a_row", streak, "open_for", p.openFor, "err", err)
	}
}

// observe records a successful call's latency for the hedge delay.
func (p *Pool) observe(d time.Duration) {
	if p.quantile <= 0 {
		return // no hedging
	}
	p.mu.Lock()
	p.lat[p.n%poolSamples] = d
	p.n++
	n := p.n
	var sorted []time.Duration
	if n >= 16 && (n < poolSamples || n%(poolSamples/4) == 0) {
		sorted = slices.Clone(p.lat[:min(n, poolSamples)])
	}
	p.mu.Unlock()
	if sorted != nil {
		slices.Sort(sorted)
		q := sorted[min(len(sorted)-1, int(p.quantile*float64(len(sorted))))]
		p.hedgeAt.Store(int64(max(q, p.hedgeMin)))
	}
}

type poolAnswer struct {
	e   *poolEndpoint
	res Result
	err error
}

// Tokenize tokenizes req on the pool's endpoints (see Pool).
func (p *Pool) Tokenize(ctx context.Context, req Request) (Result, error) {
	eps := *p.eps.Load()
	if len(eps) == 0 {
		p.exhausted.Add(1)
		return Result{}, fmt.Errorf("%w: the tokenizer pool has no endpoint", ErrUnavailable)
	}
	ctx, cancel := context.WithCancel(ctx)
	// At most two calls are out at once (the first or a failover, and one
	// hedge), and every answer but theirs is received before the next call
	// starts: two slots let each call's goroutine deliver without blocking,
	// however many endpoints the call goes through.
	answers := make(chan poolAnswer, 2)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait() // a hedged call still out returns at its cancel
	}()
	call := func(e *poolEndpoint) {
		wg.Go(func() {
			start := time.Now()
			res, err := e.Tokenizer.Tokenize(ctx, req)
			if err == nil {
				p.observe(time.Since(start))
			}
			answers <- poolAnswer{e: e, res: res, err: err}
		})
	}
	var tried []*poolEndpoint
	first := p.pick(nil)
	if first == nil {
		// Every circuit is open and none is due a probe: try the one due
		// first rather than refuse outright.
		first = eps[int(p.next.Add(1)-1)%len(eps)]
	}
	tried = append(tried, first)
	call(first)
	out, hedged := 1, false
	var hedge <-chan time.Time
	if p.quantile > 0 && len(eps) > 1 {
		t := time.NewTimer(time.Duration(p.hedgeAt.Load()))
		defer t.Stop()
		hedge = t.C
	}
	var last error
	for out > 0 {
		select {
		case <-hedge:
			hedge = nil
			if e := p.pick(tried); e != nil {
				p.hedges.Add(1)
				hedged = true
				tried = append(tried, e)
				call(e)
				out++
			}
		case a := <-answers:
			out--
			if a.err == nil {
				p.record(a.e, nil)
				if hedged && a.e != first {
					p.hedgeWins.Add(1)
				}
				return a.res, nil
			}
			fault := endpointFault(ctx, a.err)
			if fault {
				p.record(a.e, a.err)
			} else if ctx.Err() == nil {
				p.record(a.e, nil) // the endpoint answered: the request's fault
			}
			if !fault {
				return Result{}, a.err
			}
			last = a.err
			if out > 0 {
				continue // the other call may still answer
			}
			if e := p.pick(tried); e != nil {
				p.failovers.Add(1)
				tried = append(tried, e)
				call(e)
				out++
			}
		}
	}
	p.exhausted.Add(1)
	return Result{}, fmt.Errorf("tokenize: every tokenizer failed (%d tried): %w", len(tried), last)
}

// EndpointStats are one endpoint's counters and circuit.
type EndpointStats struct {
	Name string
	// Calls counts the calls it answered or failed; Failures those that
	// failed it (the endpoint's fault); Opened how often its circuit opened.
	Calls, Failures, Opened uint64
	// Open is set while its circuit is open.
	Open bool
}

// PoolStats are a Pool's counters. Each is read atomically; the set is not
// one snapshot while calls are in flight.
type PoolStats struct {
	// Failovers counts calls sent to another endpoint after one failed;
	// Hedges second calls sent because the first was slow, HedgeWins those
	// that answered first; Exhausted the Tokenize calls every endpoint failed
	// (or that found the pool without an endpoint).
	Failovers, Hedges, HedgeWins, Exhausted uint64
	// HedgeAfter is the current hedge delay.
	HedgeAfter time.Duration
	// Endpoints are the current set's, in its order.
	Endpoints []EndpointStats
}

// Stats returns the counters.
func (p *Pool) Stats() PoolStats {
	st := PoolStats{Failovers: p.failovers.Load(), Hedges: p.hedges.Load(), HedgeWins: p.hedgeWins.Load(),
		Exhausted: p.exhausted.Load(), HedgeAfter: time.Duration(p.hedgeAt.Load())}
	for _, e := range *p.eps.Load() {
		e.mu.Lock()
		open := !e.openUntil.IsZero()
		e.mu.Unlock()
		st.Endpoints = append(st.Endpoints, EndpointStats{Name: e.Name, Calls: e.calls.Load(), Failures: e.failures.Load(), Opened: e.opened.Load(), Open: open})
	}
	return st
}

// MaxPoolTries is how many endpoints' timeouts CallTimeout allows a call:
// a call that fails over further is cut by it.
const MaxPoolTries = 3

// CallTimeout is the bound to give a Cache over p (CacheOptions.CallTimeout)
// when each endpoint's call is bounded by perCall: room for the call to
// fail over up to MaxPoolTries endpoints, fewer when the pool has fewer now.
// An empty pool (one whose URLs come later from SetBaseURLs) counts
// MaxPoolTries.
func (p *Pool) CallTimeout(perCall time.Duration) time.Duration {
	n := len(*p.eps.Load())
	if n == 0 {
		n = MaxPoolTries
	}
	return perCall * time.Duration(min(n, MaxPoolTries))
}

// ParseBaseURLs splits a comma-separated list of tokenizer base URLs (the
// binaries' setting), skipping empty entries: each must be an absolute
// http(s) URL, listed once, and there must be 1 to max of them.
func ParseBaseURLs(list string, max int) ([]string, error) {
	var out []string
	for _, f := range strings.Split(list, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		u, err := url.Parse(f)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("%q is not an absolute http(s) URL", f)
		}
		if slices.Contains(out, f) {
			return nil, fmt.Errorf("%q is listed twice", f)
		}
		out = append(out, f)
	}
	switch {
	case len(out) == 0:
		return nil, fmt.Errorf("%q names no URL", list)
	case len(out) > max:
		return nil, fmt.Errorf("%d URLs, at most %d", len(out), max)
	}
	return out, nil
}

// NewClientPool builds a Client per base URL (opts, with its BaseURL
// replaced) and a Pool over them, each endpoint named by its URL. baseURLs
// may be empty: the pool then starts without an endpoint and gets them from
// SetBaseURLs (a pool that follows a discovery of the engines). opts is
// checked even then. Close the Pool to close the Clients.
func NewClientPool(opts Options, baseURLs []string, popts PoolOptions) (*Pool, error) {
	if problems := opts.problems(); len(problems) > 0 {
		return nil, fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
	}
	popts.Endpoints = nil
	if popts.Logger == nil {
		popts.Logger = opts.Logger
	}
	p, err := newPool(popts, true)
	if err != nil {
		return nil, err
	}
	p.newClient = func(base string) (*Client, error) {
		o := opts
		o.BaseURL = base
		return New(o) // New refuses credentials in a URL
	}
	p.clients = map[string]*Client{}
	if _, _, err := p.replace(baseURLs); err != nil {
		return nil, err
	}
	return p, nil
}

// SetBaseURLs replaces the endpoints of a pool NewClientPool made with one
// Client per URL of urls, in that order: each an absolute http(s) base URL
// listed once, and none at all is allowed (every call then fails with
// ErrUnavailable until URLs come back). An endpoint whose URL stays keeps
// its Client, its circuit and its counters; a new URL gets a new Client and
// a closed circuit; the Clients of the URLs that left are closed (their
// calls in flight finish) and their counters leave Stats. A call in
// progress keeps the endpoint it is calling and fails over within the new
// set. When the set changes, PoolOptions.Logger gets an INFO naming the
// URLs added and removed.
//
// A URL list with problems is refused whole, each problem named (wrapped
// ErrInvalidOptions), and the set stays as it was; so is a pool NewPool
// made, whose endpoints are the caller's.
func (p *Pool) SetBaseURLs(urls []string) error {
	added, removed, err := p.replace(urls)
	if err != nil {
		return err
	}
	if len(added)+len(removed) > 0 {
		p.log.Info("tokenize: endpoints changed", "added", added, "removed", removed, "endpoints", len(urls))
	}
	return nil
}

// replace does SetBaseURLs' work and says which URLs came and went.
func (p *Pool) replace(urls []string) (added, removed []string, err error) {
	if p.newClient == nil {
		return nil, nil, fmt.Errorf("%w: SetBaseURLs: the pool was made by NewPool; only NewClientPool's pools build their endpoints from URLs", ErrInvalidOptions)
	}
	var problems []string
	seen := make(map[string]bool, len(urls))
	for i, u := range urls {
		if _, err := checkBaseURL(u); err != nil {
			problems = append(problems, fmt.Sprintf("URL %d: %v", i, err))
		}
		if seen[u] {
			problems = append(problems, fmt.Sprintf("URL %d: %q repeated", i, u))
		}
		seen[u] = true
	}
	if len(problems) > 0 {
		return nil, nil, fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
	}
	p.setMu.Lock()
	defer p.setMu.Unlock()
	cur := map[string]*poolEndpoint{}
	for _, e := range *p.eps.Load() {
		cur[e.Name] = e
	}
	eps := make([]*poolEndpoint, 0, len(urls))
	made := map[string]*Client{}
	for _, u := range urls {
		if e := cur[u]; e != nil {
			eps = append(eps, e)
			continue
		}
		c, err := p.newClient(u)
		if err != nil {
			for _, c := range made {
				c.Close()
			}
			return nil, nil, err
		}
		made[u] = c
		added = append(added, u)
		eps = append(eps, &poolEndpoint{Endpoint: Endpoint{Name: u, Tokenizer: c}})
	}
	p.eps.Store(&eps)
	maps.Copy(p.clients, made)
	for u, c := range p.clients {
		if !seen[u] {
			c.Close()
			delete(p.clients, u)
			removed = append(removed, u)
		}
	}
	slices.Sort(removed)
	return added, removed, nil
}

// Close closes the Clients NewClientPool and SetBaseURLs made (their idle
// connections); a Pool of the caller's own Tokenizers has nothing to close.
// The Clients stay usable, so calls may go on; Close is idempotent.
func (p *Pool) Close() {
	p.setMu.Lock()
	defer p.setMu.Unlock()
	for _, c := range p.clients {
		c.Close()
	}
}
