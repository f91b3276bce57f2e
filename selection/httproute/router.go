package httproute

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httputil"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/lifecycle"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// Defaults applied by New to zero Options fields.
const (
	DefaultMaxBodyBytes  = 8 << 20
	DefaultRenewInterval = 10 * time.Second
	// DefaultBodyTimeout bounds reading a whole request body.
	DefaultBodyTimeout = 30 * time.Second
	// DefaultMaxInflight bounds the requests being read, tokenized or booked
	// at once: the reference EPP's DYN_EPP_MAX_INFLIGHT_REQUESTS default.
	DefaultMaxInflight = 1024
	// DefaultMaxPromptTokens bounds one request's prompt tokens: the
	// tokenizer client's default.
	DefaultMaxPromptTokens = tokenize.DefaultMaxPromptTokens
	// DefaultMaxIdleConnsPerHost is how many idle connections the default
	// transport keeps to each worker.
	DefaultMaxIdleConnsPerHost = 64
)

// Service books the requests a Router routes. Single books one worker of a
// selection service, Pairs a prefill/decode plan (or one worker) of a
// roles.PairBooker; a caller may wrap either (to count, to log, to restrict).
// It is called concurrently.
type Service interface {
	// Book picks where the request goes and books it.
	Book(ctx context.Context, req selection.Request) (Booked, error)
}

// Booked is a request a Service booked: where it goes, and the handle the
// Router settles it through (with a lifecycle.Follower).
type Booked struct {
	// Handle settles the booking. Required.
	Handle lifecycle.Handle
	// Endpoint is the destination, host:port. Required.
	Endpoint string
	// Prefiller is the prefill worker's endpoint of a prefill/decode plan:
	// the Router sends it to the destination's decode sidecar as
	// x-prefiller-host-port. Empty when the destination prefills the prompt
	// itself.
	Prefiller string
	// Worker names the destination worker, for the log.
	Worker string
	// ID names the booking (a reservation or plan id), for the log.
	ID reservation.ID
}

// Single is the Service that books one worker of svc per request
// (selection.SelectionService.Book).
func Single(svc *selection.SelectionService) Service { return single{svc} }

type single struct{ svc *selection.SelectionService }

func (s single) Book(ctx context.Context, req selection.Request) (Booked, error) {
	b, err := s.svc.Book(ctx, req)
	if err != nil {
		return Booked{}, err
	}
	return Booked{Handle: b, Endpoint: b.Endpoint, Worker: b.WorkerID, ID: b.ReservationID}, nil
}

// Pairs is the Service that books each request with pb: a prefill worker
// and a decode worker in disaggregated mode (the request goes to the decode
// worker, whose sidecar runs the prefill leg), one worker in aggregated
// mode (roles.PairBooker.Book).
func Pairs(pb *roles.PairBooker) Service { return pairs{pb} }

type pairs struct{ pb *roles.PairBooker }

func (p pairs) Book(ctx context.Context, req selection.Request) (Booked, error) {
	plan, err := p.pb.Book(ctx, req)
	if err != nil {
		return Booked{}, err
	}
	b := Booked{Handle: plan, Endpoint: plan.Destination(), Worker: plan.Decode.WorkerID, ID: plan.ID}
	if hint, ok := plan.PrefillHint(); ok {
		b.Prefiller = hint
	}
	return b, nil
}

// Options configure a Router. The zero value of every field but Service and
// Tokenizer means the documented default; New copies the struct and never
// modifies the caller's.
type Options struct {
	// Service books every request. Required.
	Service Service
	// Tokenizer turns the request into the engine's token ids; wrap a
	// tokenize.Client in a tokenize.Cache (ShareResults: the Router only reads
	// the ids). Required.
	Tokenizer tokenize.Tokenizer
	// Model, when set, is the selection model of every request (and the model
	// name sent to the tokenize endpoints). Empty: each request's body names
	// it ("model"), so it must equal the catalog.Worker.Model its workers are
	// registered under; a body without one is catalog.DefaultModel.
	Model string
	// Prepare, when set, adjusts each selection.Request after tokenization and
	// before Book: map a vLLM LoRA adapter named in "model" to the base model
	// and LoRAName, restrict Allowed, set Priority. info is the body's
	// RequestInfo with the effective SessionID. An error rejects the request
	// with HTTPStatus(err) (wrap selection.ErrBadRequest for 400). It is called
	// concurrently and must not retain r.
	Prepare func(r *http.Request, info RequestInfo, req *selection.Request) error
	// MaxBodyBytes bounds the request body, which the Router buffers whole
	// (it is tokenized, then sent upstream); a larger one is answered 413.
	// The buffer grows with the bytes that arrive, from at most 16 KiB
	// whatever the Content-Length declares. Default DefaultMaxBodyBytes
	// (8 MiB); negative is an error.
	MaxBodyBytes int64
	// BodyTimeout bounds reading the whole body, from the start of ServeHTTP:
	// a body not in by then is answered 408 and its connection closed. It is
	// set as the connection's read deadline (http.ResponseController), which
	// replaces the server's ReadTimeout for the body, and lifted once the body
	// is in, so a long answer is never cut by it; a ResponseWriter that cannot
	// set read deadlines (neither net/http's own nor a wrapper with Unwrap)
	// gets none. Default DefaultBodyTimeout (30 s); negative sets no deadline.
	BodyTimeout time.Duration
	// MaxInflight bounds the requests between their arrival and their
	// booking (reading the body, tokenizing, booking), and so the bodies
	// being received and the tokenizer calls waiting: beyond it a request is
	// answered 503 at once, its body unread and its connection closed. A
	// booked request streaming its answer no longer counts (the workers'
	// load bounds those). Default DefaultMaxInflight (1024); negative is an
	// error.
	MaxInflight int
	// MaxPromptTokens bounds the token ids of a request's prompt: more is
	// answered 413 (tokenize.ErrPromptTooLong). A tokenize.Client refuses
	// them as it parses the answer, before they are stored: give it the same
	// bound (tokenize.Options.MaxPromptTokens); the Router checks what any
	// Tokenizer returns. Default DefaultMaxPromptTokens (1M); negative is an
	// error.
	MaxPromptTokens int
	// Scheme is the upstream scheme, "http" (the default) or "https".
	Scheme string
	// Transport sends the requests upstream. Default: a clone of
	// http.DefaultTransport that ignores HTTP_PROXY/HTTPS_PROXY (a proxy from
	// the environment would carry every prompt through it), does not ask for
	// compression (the client's Accept-Encoding goes through as sent, and
	// nothing is decompressed or buffered on the way) and keeps up to
	// DefaultMaxIdleConnsPerHost idle connections per worker. It sets no
	// response-header timeout: a prefill can take minutes.
	Transport http.RoundTripper
	// FailureStatus reports whether an upstream status means the worker
	// failed, in which case the Router marks it failed (Handle.MarkFailed;
	// the answer still goes to the client as it is). Transport errors
	// (connection refused or reset, a response cut short) always mark the
	// worker failed, unless the client left first. Default
	// lifecycle.FailureStatus.
	FailureStatus func(code int) bool
	// RenewInterval is how often a request in flight renews its booking's
	// lease (Handle.Renew), from the booking until it is settled:
	// while the worker prefills, streams, or computes a long answer that is
	// not streamed, so none of them outlives the service's
	// ActiveRequestExpiry and is released as an orphan. The lease still
	// releases the booking of a gateway that died, whose timers died with
	// it. Keep it well below ActiveRequestExpiry. Default
	// DefaultRenewInterval (10 s); negative disables renewal.
	RenewInterval time.Duration
	// NoDegrade answers 503 or 504 (HTTPStatus) when the Tokenizer fails
	// (unreachable, a timeout, an upstream error: not the request's fault).
	// By default such a request is routed on load alone instead (a
	// selection.Request with ISL and no tokens: no prefix reuse, the prompt
	// estimated at a token per 4 body bytes), counted in Stats.Degraded and
	// logged at WARN (at most once every 10 s): a tokenizer outage costs
	// cache hits, not requests.
	NoDegrade bool
	// OverloadStatus is the status of an overload or admission refusal,
	// which HTTPStatus maps to 429 (a full queue, the classifier's or fair
	// admission's refusal): 0 or 429 keeps 429; 529 (gaie.StatusSiteOverloaded)
	// answers as Dynamo's frontend does by default. Either carries
	// Retry-After; any refusal with a selection.RefusalReason names it in
	// the x-llm-d-request-dropped-reason header.
	OverloadStatus int
	// OutputGrowth grows each streamed request's booking as it generates:
	// every data line of a 2xx event stream is one token, and each BlockSize
	// of them one more active block on the worker (Handle.Generated). Off by
	// default: on the replay simulator's long-output workload it moved
	// requests away from their cached prefixes under Dynamo's cost (hit rate
	// 0.825 to 0.748, TTFT p90 0.13 s to 0.92 s), while under the predictive
	// cost (selection.CostPredictive) it kept both (p90 0.13 s to 0.11 s;
	// docs/ROUTING.md): turn it on with that cost.
	OutputGrowth bool
	// Logger receives upstream failures (WARN), refusals past a bound (WARN,
	// with the reason, at most one line per reason every 10 s, counting the
	// ones in between), and every rejection and cancel (DEBUG). Default:
	// none.
	Logger *slog.Logger
}

// Router is an http.Handler that routes OpenAI completion requests to the
// worker the selection service books, through an httputil.ReverseProxy, and
// settles the booking: PrefillComplete at the first response body byte of a
// 2xx answer, Renew while it is in flight, Done exactly once whatever happens. See
// the package documentation for the request path. A Router is safe for
// concurrent use; create it with New (a zero Router is unusable).
type Router struct {
	opts      Options
	proxy     *httputil.ReverseProxy
	transport http.RoundTripper
	owned     *http.Transport // the default transport, when the Router made it
	log       *slog.Logger
	st        counters
	inflight  atomic.Int64 // requests being read, tokenized or booked
	refusals  refusalLog
}

// New validates opts, reporting every problem at once (wrapped
// ErrInvalidOptions), and returns a Router. It starts nothing and dials
// nothing.
func New(opts Options) (*Router, error) {
	var problems []string
	if opts.Service == nil {
		problems = append(problems, "Service is nil")
	}
	if opts.Tokenizer == nil {
		problems = append(problems, "Tokenizer is nil")
	}
	switch {
	case opts.MaxBodyBytes == 0:
		opts.MaxBodyBytes = DefaultMaxBodyBytes
	case opts.MaxBodyBytes < 0:
		problems = append(problems, fmt.Sprintf("MaxBodyBytes %d is negative", opts.MaxBodyBytes))
	}
	switch {
	case opts.BodyTimeout == 0:
		opts.BodyTimeout = DefaultBodyTimeout
	case opts.BodyTimeout < 0:
		opts.BodyTimeout = 0 // no deadline
	}
	switch {
	case opts.MaxInflight == 0:
		opts.MaxInflight = DefaultMaxInflight
	case opts.MaxInflight < 0:
		problems = append(problems, fmt.Sprintf("MaxInflight %d is negative", opts.MaxInflight))
	}
	switch {
	case opts.MaxPromptTokens == 0:
		opts.MaxPromptTokens = DefaultMaxPromptTokens
	case opts.MaxPromptTokens < 0:
		problems = append(problems, fmt.Sprintf("MaxPromptTokens %d is negative", opts.MaxPromptTokens))
	}
	switch opts.Scheme {
	case "":
		opts.Scheme = "http"
	case "http", "https":
	default:
		problems = append(problems, fmt.Sprintf("Scheme %q is neither http nor https", opts.Scheme))
	}
	switch opts.OverloadStatus {
	case 0, http.StatusTooManyRequests, gaie.StatusSiteOverloaded:
	default:
		problems = append(problems, fmt.Sprintf("OverloadStatus %d is neither 429 nor 529", opts.OverloadStatus))
	}
	if opts.RenewInterval == 0 {
		opts.RenewInterval = DefaultRenewInterval
	}
	if opts.FailureStatus == nil {
		opts.FailureStatus = lifecycle.FailureStatus
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
	}
	r := &Router{opts: opts, transport: opts.Transport, log: opts.Logger}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	if r.transport == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.Proxy = nil
		t.DisableCompression = true
		t.MaxIdleConnsPerHost = DefaultMaxIdleConnsPerHost
		r.owned, r.transport = t, t
	}
	r.proxy = &httputil.ReverseProxy{
		Rewrite:        r.rewrite,
		Transport:      r.transport,
		ModifyResponse: r.modifyResponse,
		ErrorHandler:   r.errorHandler,
		// The proxy logs a body copy that failed, which every client cancel
		// mid-stream causes: DEBUG.
		ErrorLog: slog.NewLogLogger(r.log.Handler(), slog.LevelDebug),
	}
	return r, nil
}

// CloseIdleConnections closes the idle upstream connections of the transport
// the Router made (none when Options.Transport was given). The Router stays
// usable.
func (r *Router) CloseIdleConnections() {
	if r.owned != nil {
		r.owned.CloseIdleConnections()
	}
}

// ControlHeaders returns the request headers a client could use to steer
// routing downstream or to fake a gateway's report (gaie.ControlHeaders),
// lower case. The Router removes them from every upstream request; the
// reference EPP removes the same ones and never shows them to its picker.
func ControlHeaders() []string { return gaie.ControlHeaders() }

// controlHeaders is ControlHeaders, copied once.
var controlHeaders = gaie.ControlHeaders()

// ServeHTTP reads and bounds the body, tokenizes it, books a worker, and
// proxies the request there. Errors before the upstream are answered with an
// OpenAI error object (see HTTPStatus); upstream answers, error statuses
// included, are passed through; a transport error is 502 (504 for a timeout).
func (r *Router) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	r.st.requests.Add(1)
	if req.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		r.reject(w, req, nil, fmt.Errorf("%w: %s", ErrMethodNotAllowed, req.Method))
		return
	}
	body, b, err := r.admit(w, req)
	if err != nil {
		r.reject(w, req, body, err)
		return
	}
	r.st.booked.Add(1)
	ex := r.newExchange(req.Context(), b)
	ex.startRenewal()
	stop := context.AfterFunc(req.Context(), func() { ex.settle(outcomeCanceled) })
	defer func() {
		stop()
		if p := recover(); p != nil {
			// A panic in the proxy path (the transport, a body, the writer;
			// http.ErrAbortHandler when the copy failed): settle, then let it
			// go on to net/http, which aborts the response (silently for
			// ErrAbortHandler, logging anything else).
			ex.settle(outcomeAborted)
			panic(p)
		}
		ex.settle(ex.endOutcome())
	}()
	out := req.WithContext(context.WithValue(req.Context(), exchangeKey{}, ex))
	out.Body = io.NopCloser(bytes.NewReader(body))
	out.ContentLength = int64(len(body))
	out.TransferEncoding = nil
	out.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	r.proxy.ServeHTTP(w, out)
}

// book parses, tokenizes and books the request.
func (r *Router) book(req *http.Request, body []byte) (Booked, error) {
	info, err := ParseRequest(body)
	if err != nil {
		return Booked{}, err
	}
	if info.SessionID, err = SessionID(req.Header, info); err != nil {
		return Booked{}, err
	}
	model := r.opts.Model
	if model == "" {
		model = info.Model
	}
	tr, err := r.opts.Tokenizer.Tokenize(req.Context(), tokenize.Request{Path: req.URL.Path, Body: body, Model: r.opts.Model})
	isl := 0
	if err != nil {
		if r.opts.NoDegrade || req.Context().Err() != nil || !tokenize.ServiceFailed(err) {
			return Booked{}, err
		}
		// Degraded: route on load alone, the prompt's length estimated from
		// the body, rather than fail a request a worker can serve.
		r.st.refused[degraded].Add(1)
		if n, log := r.refusals.note(degraded, time.Now()); log {
			r.log.Warn("httproute: the tokenizer failed; routing on load alone (degraded: no prefix reuse) until it answers",
				slog.String("error", err.Error()), slog.Uint64("count_since_last_line", n))
		}
		tr, isl = tokenize.Result{}, tokenize.EstimateTokens(body)
	}
	if len(tr.Tokens) > r.opts.MaxPromptTokens {
		return Booked{}, fmt.Errorf("%w: %d tokens, the limit is %d (MaxPromptTokens)", tokenize.ErrPromptTooLong, len(tr.Tokens), r.opts.MaxPromptTokens)
	}
	sreq := selection.Request{
		Model: model, Tokens: tr.Tokens, ISL: isl, LoRAName: info.LoRA, CacheSalt: tr.CacheSalt,
		ExpectedOutputTokens: int(min(max(tr.MaxTokens, 0), math.MaxInt32)),
		SessionID:            info.SessionID, Class: policyClass(req.Header),
	}
	if sreq.CacheSalt == "" {
		sreq.CacheSalt = info.CacheSalt
	}
	if r.opts.Prepare != nil {
		if err := r.opts.Prepare(req, info, &sreq); err != nil {
			return Booked{}, err
		}
	}
	b, err := r.opts.Service.Book(req.Context(), sreq)
	if err != nil {
		return Booked{}, err
	}
	switch {
	case b.Handle == nil: // a wrapping Service's mistake: nothing to settle
		return Booked{}, fmt.Errorf("%w: booking %q", lifecycle.ErrNoHandle, b.ID)
	case b.Endpoint == "": // a catalog never schedules one; a wrapping Service might
		_ = b.Handle.Done()
		return Booked{}, fmt.Errorf("%w: worker %q has no endpoint", selection.ErrNoEndpoints, b.Worker)
	}
	return b, nil
}

// reject answers an error met before the upstream. body is nil when the
// request's body was not read to its end: the connection is then closed after
// the answer (HTTP/1), so that net/http does not read the rest of the body
// after ServeHTTP returns, with no deadline, before it can serve the next
// request.
func (r *Router) reject(w http.ResponseWriter, req *http.Request, body []byte, err error) {
	status := HTTPStatus(err)
	r.st.rejected.Add(1)
	r.countRefusal(err, status)
	r.log.Debug("httproute: request rejected", slog.Int("status", status), slog.String("error", err.Error()))
	h := w.Header()
	if body == nil && req.ContentLength != 0 && req.ProtoMajor == 1 {
		h.Set("Connection", "close")
	}
	if reason := selection.RefusalReason(err); reason != "" {
		h.Set(gaie.HeaderDroppedReason, reason)
	}
	if status == http.StatusTooManyRequests {
		h.Set("Retry-After", retryAfterSeconds)
		if r.opts.OverloadStatus != 0 {
			status = r.opts.OverloadStatus
		}
	}
	writeError(w, status, clientMessage(err, status))
}

// rewrite points the upstream request at the booked worker.
func (r *Router) rewrite(pr *httputil.ProxyRequest) {
	ex := exchangeOf(pr.In.Context())
	pr.Out.URL.Scheme = r.opts.Scheme
	pr.Out.URL.Host = ex.b.Endpoint
	pr.Out.Host = ""
	pr.SetXForwarded()
	for _, h := range controlHeaders {
		pr.Out.Header.Del(h)
	}
	if ex.b.Prefiller != "" {
		pr.Out.Header.Set(gaie.HeaderPrefiller, ex.b.Prefiller)
	}
}

// modifyResponse runs when the upstream's headers arrive, before anything is
// sent to the client: it reports a failure status and wraps the body, whose
// reads settle the booking. Nothing is freed here while a body is to come.
func (r *Router) modifyResponse(resp *http.Response) error {
	ex := exchangeOf(resp.Request.Context())
	if r.opts.FailureStatus(resp.StatusCode) {
		r.st.failureStatuses.Add(1)
		ex.why = fmt.Sprintf("status %d", resp.StatusCode)
	}
	if resp.Header.Get(gaie.HeaderFailedLeg) == gaie.FailedLegPrefill {
		// The decode sidecar's report: the prefill worker failed, not this one.
		ex.f.PrefillFailed()
	}
	resp.Header.Del(gaie.HeaderFailedLeg) // the routing layer's, not the client's
	ex.f.Response(resp.StatusCode, resp.Header.Get("Content-Type"))
	if resp.ContentLength == 0 || resp.Body == nil || resp.Body == http.NoBody {
		ex.settle(outcomeEnded) // no body will follow
		return nil
	}
	resp.Body = &settleBody{ReadCloser: resp.Body, ex: ex, left: resp.ContentLength}
	return nil
}

// errorHandler answers a request the upstream did not answer (connection
// refused or reset, a timeout, the client's cancel).
func (r *Router) errorHandler(w http.ResponseWriter, req *http.Request, err error) {
	ex := exchangeOf(req.Context())
	if cerr := req.Context().Err(); cerr != nil {
		// The client left (or the caller's deadline passed): not the worker's
		// fault. The answer is for the log; nobody may be reading it.
		ex.settle(outcomeCanceled)
		status := HTTPStatus(cerr)
		writeError(w, status, clientMessage(cerr, status))
		return
	}
	r.st.upstreamErrors.Add(1)
	ex.fail(err.Error())
	ex.settle(outcomeFailed)
	status := http.StatusBadGateway
	if isTimeout(err) {
		status = http.StatusGatewayTimeout
	}
	writeError(w, status, clientMessage(err, status))
}

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}

// Stats are a Router's counters since New. Once no request is in flight,
// Booked == Done, and Done == Ended + Canceled + Failed + Aborted.
type Stats struct {
	// Requests counts requests received; Rejected those answered before any
	// upstream (method, body, tokenizer, Prepare, selection).
	Requests, Rejected uint64
	// Overloaded, BodyTimeouts, BodiesTooLarge and PromptsTooLong split the
	// refusals past a bound out of Rejected, under the reasons the log names:
	// "overloaded" (MaxInflight, 503), "body_timeout" (BodyTimeout, 408),
	// "body_too_large" (MaxBodyBytes, 413), "prompt_too_long"
	// (MaxPromptTokens, or the Tokenizer's own bound, 413).
	Overloaded, BodyTimeouts, BodiesTooLarge, PromptsTooLong uint64
	// Degraded counts requests routed on load alone because the Tokenizer
	// failed ("tokenizer_degraded"; see Options.NoDegrade).
	Degraded uint64
	// Booked counts bookings made; Done those settled.
	Booked, Done uint64
	// Ended, Canceled, Failed and Aborted split Done by how the exchange
	// ended: the upstream's answer was read to its end; the client left (or
	// the request's deadline passed); the upstream could not be reached or
	// cut its answer short; the proxy path panicked or stopped otherwise.
	Ended, Canceled, Failed, Aborted uint64
	// FirstBytes counts PrefillComplete calls (the first body byte of a 2xx
	// answer); Renewals the leases renewed; Stalls the renewal ticks skipped
	// because a started body sent nothing since the last one.
	FirstBytes, Renewals, Stalls uint64
	// UpstreamErrors counts transport errors (client cancels excluded);
	// FailureStatuses upstream answers with a failure status; MarkedFailed the
	// MarkFailed calls (at most one per request).
	UpstreamErrors, FailureStatuses, MarkedFailed uint64
}

// Stats returns the counters. Each is read atomically, but the set is not one
// snapshot while requests are in flight.
func (r *Router) Stats() Stats {
	s := &r.st
	return Stats{
		Requests: s.requests.Load(), Rejected: s.rejected.Load(),
		Overloaded: s.refused[refusedOverloaded].Load(), BodyTimeouts: s.refused[refusedBodyTimeout].Load(),
		BodiesTooLarge: s.refused[refusedBodyTooLarge].Load(), PromptsTooLong: s.refused[refusedPromptTooLong].Load(),
		Degraded: s.refused[degraded].Load(),
		Booked:   s.booked.Load(), Done: s.done.Load(),
		Ended: s.ended.Load(), Canceled: s.canceled.Load(), Failed: s.failed.Load(), Aborted: s.aborted.Load(),
		FirstBytes: s.firstBytes.Load(), Renewals: s.renewals.Load(), Stalls: s.stalls.Load(),
		UpstreamErrors: s.upstreamErrors.Load(), FailureStatuses: s.failureStatuses.Load(), MarkedFailed: s.markedFailed.Load(),
	}
}

type counters struct {
	requests, rejected, booked, done              atomic.Uint64
	ended, canceled, failed, aborted              atomic.Uint64
	firstBytes, renewals, stalls                  atomic.Uint64
	upstreamErrors, failureStatuses, markedFailed atomic.Uint64
	refused                                       [numRefusals]atomic.Uint64
}
