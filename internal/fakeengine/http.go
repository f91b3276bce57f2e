package fakeengine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Response headers set on every completion answer (streaming or not), so a client
// that only sees headers (a gateway, the demo driver) gets the engine's view of
// the request.
const (
	// HeaderTTFT is the simulated time to first token in milliseconds, with three
	// decimals ("1.340").
	HeaderTTFT = "x-fake-ttft-ms"
	// HeaderPromptTokens is the number of prompt tokens.
	HeaderPromptTokens = "x-fake-prompt-tokens"
	// HeaderCachedTokens is the number of prompt tokens served from the prefix
	// cache (usage.prompt_tokens_details.cached_tokens).
	HeaderCachedTokens = "x-fake-cached-tokens"
)

// maxHTTPBody bounds request bodies; a larger one is answered 413.
const maxHTTPBody = 16 << 20

// httpShutdownGrace is how long Close lets in-flight answers finish before it
// closes their connections.
const httpShutdownGrace = 2 * time.Second

// HTTPStats are the HTTP API's counters, a consistent copy taken by
// Engine.HTTPStats. Token counts add up over every prompt of every request.
type HTTPStats struct {
	// Requests counts completion requests (chat and completions) whose prompts
	// went through Serve; they are answered 200 unless the engine closes while
	// they wait.
	Requests uint64
	// Running is the number of completion requests being handled now.
	Running int
	// Prompts counts prompts served (a completions request may carry several).
	Prompts uint64
	// PromptTokens counts prompt tokens (fake_prefix_cache_queries_total).
	PromptTokens uint64
	// CachedTokens counts prompt tokens served from the prefix cache, i.e. the
	// leading complete cached blocks times the block size
	// (fake_prefix_cache_hits_total).
	CachedTokens uint64
	// OutputTokens counts generated tokens.
	OutputTokens uint64
	// TTFTTotal is the sum of the simulated TTFTs of Requests.
	TTFTTotal time.Duration
	// Renders counts render and /tokenize answers with status 200.
	Renders uint64
	// Errors counts API answers with an error status (4xx, 5xx).
	Errors uint64
	// PublishErrors counts requests whose KV-event batch the PUB socket refused
	// (the request is still served and the cache change stands).
	PublishErrors uint64
	// ComputedTokens counts prompt tokens the engine computed itself: neither
	// cached nor transferred from a prefill engine.
	ComputedTokens uint64
	// Aborted counts completion requests that ended before their answer did:
	// the client went away (or the engine closed) during the TTFT wait, a P/D
	// wait or the stream.
	Aborted uint64

	// Disaggregated serving (see PDRole). PrefillLegs and DecodeLegs count the
	// legs served to the end of their hand-over: vLLM's do_remote_decode and
	// do_remote_prefill, SGLang's bootstrap requests in prefill and decode mode,
	// TensorRT-LLM's context_only and generation_only.
	PrefillLegs uint64
	DecodeLegs  uint64
	// TransferredTokens counts prompt tokens decode legs took from a prefill
	// engine instead of computing them.
	TransferredTokens uint64
	// Pulls counts hand-overs this engine gave as the prefill engine (a KV pull
	// answered, an SGLang room taken).
	Pulls uint64
	// HoldsExpired counts prefill legs whose blocks nobody pulled in time.
	HoldsExpired uint64
}

// HitRate returns CachedTokens / PromptTokens, or 0 when no prompt was served.
func (s HTTPStats) HitRate() float64 {
	if s.PromptTokens == 0 {
		return 0
	}
	return float64(s.CachedTokens) / float64(s.PromptTokens)
}

// httpState is the HTTP API's part of an Engine: the handler and its counters,
// which have their own mutex so that scrapes never wait for the cache.
type httpState struct {
	handler http.Handler
	reqID   atomic.Uint64
	pd      pdState // held transfers and SGLang rooms; see pd.go

	mu    sync.Mutex
	stats HTTPStats
}

func (h *httpState) update(f func(*HTTPStats)) {
	h.mu.Lock()
	f(&h.stats)
	h.mu.Unlock()
}

// HTTPStats returns a snapshot of the HTTP API's counters.
func (e *Engine) HTTPStats() HTTPStats {
	e.web.mu.Lock()
	defer e.web.mu.Unlock()
	return e.web.stats
}

// HTTPEndpoint returns the host:port the HTTP server listens on (with the real
// port); "" before Start or when EnableHTTP is not set. It keeps the last address
// after Close.
func (e *Engine) HTTPEndpoint() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.httpEP
}

// Handler returns the engine's OpenAI-compatible HTTP API, the one Start serves
// when EnableHTTP is set. It may also be mounted on a server of the caller's
// (httptest, for instance), with or without Start; the caller then owns that
// server's lifetime. After Close every endpoint but /metrics answers 503. The
// handler is safe for concurrent use.
//
//	POST /v1/chat/completions          chat request; JSON or, with "stream": true, SSE
//	POST /v1/completions               completions request (string, strings, ids or lists of ids)
//	POST /v1/chat/completions/render   vLLM render: one GenerateRequest object
//	POST /v1/completions/render        vLLM render: a list of GenerateRequest, one per prompt
//	POST /tokenize                     vLLM /tokenize, prompt or messages form
//	GET  /v1/models                    the served model
//	GET  /health                       200 while the engine is not closed
//	GET  /metrics                      Prometheus text format (see the package doc)
//	POST /fake/kv/pull                 a decode engine takes a prefill leg's held KV (PullPath)
func (e *Engine) Handler() http.Handler { return e.web.handler }

func (e *Engine) newHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		e.handleGenerate(w, r, true)
	})
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		e.handleGenerate(w, r, false)
	})
	mux.HandleFunc("POST /v1/chat/completions/render", func(w http.ResponseWriter, r *http.Request) {
		e.handleRender(w, r, true)
	})
	mux.HandleFunc("POST /v1/completions/render", func(w http.ResponseWriter, r *http.Request) {
		e.handleRender(w, r, false)
	})
	mux.HandleFunc("POST /tokenize", e.handleTokenize)
	mux.HandleFunc("GET /v1/models", e.handleModels)
	mux.HandleFunc("GET /health", e.handleHealth)
	mux.HandleFunc("GET /metrics", e.handleMetrics)
	mux.HandleFunc("POST "+PullPath, e.handlePull)
	return mux
}

// closed reports whether Close has been called.
func (e *Engine) closed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.state == stateClosed
}

// now reads the clock under the engine's mutex, as Options.Now promises.
func (e *Engine) now() time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.opts.Now()
}

// httpServer is the engine's own HTTP server. It counts the handlers in flight so
// that close can wait for every one of them, even those on connections that
// Shutdown had to close by force.
type httpServer struct {
	srv    *http.Server
	ln     net.Listener
	addr   string
	cancel context.CancelFunc // cancels every request's context

	mu      sync.Mutex
	closing bool
	active  sync.WaitGroup // Add only under mu while !closing
}

// listenHTTP binds addr, unless the caller gave a listener ln, and prepares a
// server for h on it; serve runs it.
func listenHTTP(ctx context.Context, ln net.Listener, addr string, h http.Handler) (*httpServer, error) {
	if ln == nil {
		var lc net.ListenConfig
		var err error
		if ln, err = lc.Listen(ctx, "tcp", addr); err != nil {
			return nil, fmt.Errorf("%w: listen HTTP %s: %w", ErrSocket, addr, err)
		}
	}
	base, cancel := context.WithCancel(context.Background())
	s := &httpServer{ln: ln, addr: ln.Addr().String(), cancel: cancel}
	s.srv = &http.Server{
		Handler:           http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.handle(w, r, h) }),
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       time.Minute,
		BaseContext:       func(net.Listener) context.Context { return base },
		ErrorLog:          log.New(io.Discard, "", 0),
	}
	return s, nil
}

// serve runs the server until close; it returns when the listener is closed.
func (s *httpServer) serve() {
	_ = s.srv.Serve(s.ln) // always http.ErrServerClosed after close
}

func (s *httpServer) handle(w http.ResponseWriter, r *http.Request, h http.Handler) {
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		writeJSONError(w, http.StatusServiceUnavailable, "the engine is shutting down")
		return
	}
	s.active.Add(1)
	s.mu.Unlock()
	defer s.active.Done()
	h.ServeHTTP(w, r)
}

// close stops accepting, cancels the requests in flight (a TTFT wait or a stream
// ends at once), gives their answers httpShutdownGrace to finish, closes what
// remains and waits for every handler to return. serve returns too.
func (s *httpServer) close() error {
	s.mu.Lock()
	s.closing = true
	s.mu.Unlock()
	s.cancel()
	ctx, cancel := context.WithTimeout(context.Background(), httpShutdownGrace)
	defer cancel()
	var err error
	if s.srv.Shutdown(ctx) != nil {
		// Grace expired: cut the remaining connections.
		err = s.srv.Close()
	}
	s.active.Wait()
	return err
}

// waitTTFT waits d when SleepTTFT is set; false means ctx ended first.
func (e *Engine) waitTTFT(ctx context.Context, d time.Duration) bool {
	if !e.opts.SleepTTFT {
		return ctx.Err() == nil
	}
	return wait(ctx, d)
}

// wait waits d (no time when d <= 0); false means ctx ended first.
func wait(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// ttft is the simulated time to first token of uncached prompt tokens.
func (e *Engine) ttft(uncached int) time.Duration {
	return e.opts.TTFTBase + time.Duration(uncached)*e.opts.PerTokenPrefill
}

func (e *Engine) handleGenerate(w http.ResponseWriter, r *http.Request, chat bool) {
	e.web.update(func(s *HTTPStats) { s.Running++ })
	defer e.web.update(func(s *HTTPStats) { s.Running-- })

	body, aerr := readBody(w, r)
	if aerr == nil {
		var p prepared
		if p, aerr = e.prepare(chat, body); aerr == nil {
			e.generate(w, r, p)
			return
		}
	}
	e.fail(w, aerr)
}

// generate serves a validated request: every prompt goes through Serve, then the
// answer is written as its pacer says (the simulated TTFT, or the engine
// model's events). A P/D decode leg takes its KV from the prefill engine first;
// a prefill leg hands its KV over after its first token.
func (e *Engine) generate(w http.ResponseWriter, r *http.Request, p prepared) {
	l, aerr := e.parseLeg(&p)
	if aerr != nil {
		e.fail(w, aerr)
		return
	}
	promptTokens, cachedTokens, publishErrs := 0, 0, 0
	for _, toks := range p.prompts {
		res, err := e.Serve(Request{Tokens: toks, CacheSalt: p.cacheSalt})
		switch {
		case errors.Is(err, ErrClosed):
			e.fail(w, &apiError{status: http.StatusServiceUnavailable, msg: "the engine is shutting down"})
			return
		case err != nil:
			publishErrs++
		}
		promptTokens += len(toks)
		cachedTokens += res.CachedBlocks * e.opts.BlockSize
	}
	id := fmt.Sprintf("%s-fake-%d", p.idPrefix(), e.web.reqID.Add(1))
	var leg legResult
	if l.decode() {
		leg, aerr = e.takeOver(r.Context(), l, p.prompts[0], cachedTokens)
	}
	computed := max(promptTokens-cachedTokens-leg.transferred, 0)
	ttft := e.ttft(computed) + time.Duration(leg.pulledBlocks)*e.opts.TransferPerBlock
	if aerr != nil {
		computed = 0 // the decode leg failed before computing anything
	}
	e.web.update(func(s *HTTPStats) {
		s.Requests++
		s.Prompts += uint64(len(p.prompts))
		s.PromptTokens += uint64(promptTokens)
		s.CachedTokens += uint64(cachedTokens)
		s.ComputedTokens += uint64(computed)
		s.TransferredTokens += uint64(leg.transferred)
		s.OutputTokens += uint64(p.maxTokens * len(p.prompts))
		s.TTFTTotal += ttft
		s.PublishErrors += uint64(publishErrs)
		if aerr == nil && l.decode() {
			s.DecodeLegs++
		}
	})
	if aerr != nil {
		e.fail(w, aerr)
		return
	}

	// The model (a SleepTTFT engine) computes the prompt tokens neither cached
	// nor transferred, after the transfer; it leaves when the answer ends.
	pc := e.pacer(computed, p.maxTokens, time.Duration(leg.pulledBlocks)*e.opts.TransferPerBlock, ttft)
	defer pc.release()
	a := answer{
		prepared: p,
		id:       id,
		created:  e.now().Unix(),
		model:    e.opts.Model,
		usage: usageJSON{
			PromptTokens:     promptTokens,
			CompletionTokens: p.maxTokens * len(p.prompts),
			TotalTokens:      promptTokens + p.maxTokens*len(p.prompts),
			SimulatedTTFTMs:  durationMs(ttft),
		},
		pace: pc,
	}
	a.usage.PromptTokensDetails.CachedTokens = cachedTokens
	h := w.Header()
	h.Set(HeaderTTFT, strconv.FormatFloat(durationMs(ttft), 'f', 3, 64))
	h.Set(HeaderPromptTokens, strconv.Itoa(promptTokens))
	h.Set(HeaderCachedTokens, strconv.Itoa(cachedTokens))
	// measured puts the model's TTFT, once known, in the usage block and the
	// header (when it has not been sent).
	measured := func() {
		if d, ok := pc.ttft(); ok {
			a.usage.SimulatedTTFTMs = durationMs(d)
			h.Set(HeaderTTFT, strconv.FormatFloat(durationMs(d), 'f', 3, 64))
		}
	}

	if l.prefill() {
		// The prompt is computed (its first token), its KV handed over, then
		// answered; the request leaves the engine at its first token.
		if !pc.first(r.Context()) {
			e.fail(w, errCanceled())
			return
		}
		measured()
		pc.release()
		if a.leg, aerr = e.handOver(r, l, p.prompts[0], id); aerr != nil {
			e.fail(w, aerr)
			return
		}
		e.web.update(func(s *HTTPStats) { s.PrefillLegs++ })
		after := sleepPacer{e: e, interval: e.opts.TokenInterval}
		if _, model := pc.(modelPacer); model {
			after.interval = 0
		}
		a.pace = after
	}
	if !p.stream {
		if !a.pace.first(r.Context()) || !a.pace.all(r.Context()) {
			e.fail(w, errCanceled())
			return
		}
		measured()
		writeJSON(w, http.StatusOK, a.whole())
		return
	}
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	if !a.pace.first(r.Context()) {
		e.web.update(func(s *HTTPStats) { s.Aborted++ })
		return
	}
	measured() // the usage chunk's; the header went out with the estimate
	if !a.stream(r.Context(), w, rc) {
		e.web.update(func(s *HTTPStats) { s.Aborted++ })
	}
}

// durationMs converts d to milliseconds.
func durationMs(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func (e *Engine) handleRender(w http.ResponseWriter, r *http.Request, chat bool) {
	body, aerr := readBody(w, r)
	var p prepared
	if aerr == nil {
		p, aerr = e.prepare(chat, body)
	}
	if aerr == nil && e.closed() {
		aerr = &apiError{status: http.StatusServiceUnavailable, msg: "the engine is shutting down"}
	}
	if aerr != nil {
		e.fail(w, aerr)
		return
	}
	id := fmt.Sprintf("%s-fake-%d", p.idPrefix(), e.web.reqID.Add(1))
	list := make([]generateRequestJSON, len(p.prompts))
	for i, toks := range p.prompts {
		g := generateRequestJSON{
			RequestID:        id,
			TokenIDs:         toks,
			SamplingParams:   samplingJSON{N: 1, MaxTokens: p.maxTokens},
			Model:            e.opts.Model,
			Stream:           p.stream,
			StreamOptions:    p.streamOptions,
			Priority:         p.priority,
			KVTransferParams: p.kvTransferParams,
		}
		if p.hasSalt {
			salt := p.cacheSalt
			g.CacheSalt = &salt
		}
		if len(p.prompts) > 1 {
			g.RequestID = id + "-" + strconv.Itoa(i)
		}
		list[i] = g
	}
	e.web.update(func(s *HTTPStats) { s.Renders++ })
	if chat {
		writeJSON(w, http.StatusOK, list[0])
		return
	}
	writeJSON(w, http.StatusOK, list)
}

func (e *Engine) handleTokenize(w http.ResponseWriter, r *http.Request) {
	body, aerr := readBody(w, r)
	var ans tokenizeJSON
	if aerr == nil {
		ans, aerr = e.tokenizeBody(body)
	}
	if aerr == nil && e.closed() {
		aerr = &apiError{status: http.StatusServiceUnavailable, msg: "the engine is shutting down"}
	}
	if aerr != nil {
		e.fail(w, aerr)
		return
	}
	e.web.update(func(s *HTTPStats) { s.Renders++ })
	writeJSON(w, http.StatusOK, ans)
}

func (e *Engine) handleModels(w http.ResponseWriter, _ *http.Request) {
	if e.closed() {
		e.fail(w, &apiError{status: http.StatusServiceUnavailable, msg: "the engine is shutting down"})
		return
	}
	writeJSON(w, http.StatusOK, modelsJSON{
		Object: "list",
		Data: []modelJSON{{
			ID: e.opts.Model, Object: "model", OwnedBy: "fakeengine", MaxModelLen: e.opts.MaxModelLen,
		}},
	})
}

func (e *Engine) handleHealth(w http.ResponseWriter, _ *http.Request) {
	if e.closed() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// handleMetrics writes the counters in the Prometheus text exposition format
// (version 0.0.4), every sample labelled with the model name.
func (e *Engine) handleMetrics(w http.ResponseWriter, _ *http.Request) {
	s := e.HTTPStats()
	blocks := e.Blocks()
	label := `{model_name="` + escapeLabel(e.opts.Model) + `"}`
	var b strings.Builder
	metric := func(name, typ, help string, value string) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n%s%s %s\n", name, help, name, typ, name, label, value)
	}
	u := func(v uint64) string { return strconv.FormatUint(v, 10) }
	metric("fake_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", u(s.PromptTokens))
	metric("fake_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (complete blocks).", u(s.CachedTokens))
	metric("fake_requests_total", "counter", "Completion requests served.", u(s.Requests))
	metric("fake_requests_running", "gauge", "Completion requests being handled.", strconv.Itoa(s.Running))
	metric("fake_generation_tokens_total", "counter", "Output tokens generated.", u(s.OutputTokens))
	metric("fake_request_errors_total", "counter", "API answers with an error status.", u(s.Errors))
	metric("fake_kv_cache_blocks", "gauge", "Blocks held in the prefix cache.", strconv.Itoa(blocks))
	metric("fake_kv_cache_capacity_blocks", "gauge", "Capacity of the prefix cache in blocks.", strconv.Itoa(e.opts.CapacityBlocks))
	fmt.Fprintf(&b, "# HELP fake_simulated_ttft_seconds Simulated time to first token of served requests.\n"+
		"# TYPE fake_simulated_ttft_seconds summary\n"+
		"fake_simulated_ttft_seconds_sum%s %s\nfake_simulated_ttft_seconds_count%s %s\n",
		label, strconv.FormatFloat(s.TTFTTotal.Seconds(), 'g', -1, 64), label, u(s.Requests))
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	_, _ = io.WriteString(w, b.String())
}

// escapeLabel escapes a Prometheus label value.
func escapeLabel(v string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(v)
}

// fail writes an OpenAI-style error answer and counts it (and the abort, when
// the request was canceled).
func (e *Engine) fail(w http.ResponseWriter, aerr *apiError) {
	e.web.update(func(s *HTTPStats) {
		s.Errors++
		if aerr.aborted {
			s.Aborted++
		}
	})
	writeJSONError(w, aerr.status, aerr.msg)
}

// readBody reads the whole request body, at most maxHTTPBody bytes.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, *apiError) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxHTTPBody))
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		return nil, &apiError{status: http.StatusRequestEntityTooLarge, msg: fmt.Sprintf("request body exceeds %d bytes", maxHTTPBody)}
	case err != nil:
		return nil, &apiError{status: http.StatusBadRequest, msg: "cannot read the request body"}
	}
	return body, nil
}
