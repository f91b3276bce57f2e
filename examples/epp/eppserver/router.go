package eppserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/epp/oteltracing"
	"github.com/kvselect/kvselect/examples/epp/prommetrics"
	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/lifecycle"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// Priority and policy-class headers (Dynamo's EPP contract, GAIE's).
const (
	headerPriority       = gaie.HeaderDynamoPriority       // queue jump, seconds (>= 0)
	headerDynamoSession  = gaie.HeaderDynamoSessionID      // Dynamo's session header, read after the configured one
	headerStrictPriority = gaie.HeaderDynamoStrictPriority // strict tier (integer)
	headerPolicyClass    = gaie.HeaderPolicyClass          // fair admission's class
	headerObjective      = gaie.HeaderInferenceObjective   // GAIE's objective, read after it
)

// booker is what the router needs to book a request: roles.PairBooker, in both
// topologies (in aggregated mode it books one aggregated worker per plan).
type booker interface {
	Book(ctx context.Context, req selection.Request) (roles.Plan, error)
	Scores(ctx context.Context, req selection.Request) ([]selection.Scored, error)
}

var _ booker = (*roles.PairBooker)(nil)

// destination is the destination role's service: its loads, for body-less
// requests.
type destination interface {
	Loads(model string) []selection.WorkerLoad
}

// router is the extproc.Picker of the EPP: it tokenizes the request with the
// engine's own tokenizer and books it with the pair booker: one worker in
// aggregated mode, a prefill/decode pair in disaggregated mode. It is safe for
// concurrent use.
type router struct {
	model string
	tok   tokenize.Tokenizer
	book  booker
	loads destination // the destination role's service
	// signer signs prefill hints; nil leaves them unsigned. Set before the
	// router serves, never after.
	signer *hintSigner
	// sessionHeader names the session id header read before Dynamo's
	// (DYN_EPP_SESSION_HEADER); "" reads Dynamo's only. Set before the router
	// serves, never after.
	sessionHeader string
	// The settings below are set before the router serves, never after.
	// fallbacks is the number of fallback endpoints asked per request
	// (DYN_EPP_FALLBACKS).
	fallbacks int
	// growth counts the SSE events of 2xx event streams as generated output
	// (DYN_EPP_OUTPUT_GROWTH).
	growth bool
	// hold is how long a request arriving now waits before it books, for
	// the bookings of the replicas ahead of this one in a burst
	// (selection.ReplicaPlane.Hold); nil without replicas or with
	// DYN_EPP_REPLICA_HOLD_BURSTS off.
	hold func(model string) time.Duration
	// debug explains each decision in the x-kvselect-debug response header
	// (DYN_EPP_DEBUG_HEADER).
	debug bool
	// renew renews the leases of requests in flight; nil when off
	// (DYN_EPP_RENEW_INTERVAL_MS 0).
	renew *renewer
	// tracer traces picks (tokenize, and the decisions through the
	// services' Tracer); nil when tracing is off.
	tracer trace.Tracer
	// handleOf is the handle a booked plan is settled through: nil for the
	// plan itself (a roles.Plan is a lifecycle.Handle); the tests' fake
	// bookers give their own.
	handleOf func(roles.Plan) lifecycle.Handle
	// m counts rebookings, workers marked failed, renewals and response
	// chunks; nil records nothing.
	m *prommetrics.Responses
	// log reports rebookings and the degraded mode. Default: discard.
	log *slog.Logger
	// noDegrade refuses a request the tokenizers failed instead of
	// routing it on load alone (DYN_EPP_TOKENIZER_NO_DEGRADE). Set before
	// the router serves, never after.
	noDegrade bool
	// degraded counts (and logs) the requests routed on load alone.
	degraded degradation

	mu        sync.RWMutex
	byAddr    map[string]string             // canonical ip:port -> worker id
	byIP      map[string][]string           // ip -> worker ids
	endpoint  map[string]string             // worker id -> canonical ip:port
	firstRank map[string]catalog.WorkerRank // worker id -> its first data-parallel rank
}

var _ extproc.Picker = (*router)(nil)

func newRouter(model string, tok tokenize.Tokenizer, book booker, loads destination) *router {
	return &router{model: model, tok: tok, book: book, loads: loads, log: slog.New(slog.DiscardHandler)}
}

// setWorkers replaces the endpoint maps used to honour subset hints.
func (r *router) setWorkers(ws []catalog.Worker) {
	byAddr := make(map[string]string, len(ws))
	byIP := make(map[string][]string, len(ws))
	endpoint := make(map[string]string, len(ws))
	firstRank := make(map[string]catalog.WorkerRank, len(ws))
	for _, w := range ws {
		if rs := w.Ranks(); len(rs) > 0 {
			firstRank[w.ID] = catalog.WorkerRank{WorkerID: w.ID, Rank: rs[0]}
		} else {
			firstRank[w.ID] = catalog.WorkerRank{WorkerID: w.ID}
		}
		ep, err := extproc.CanonicalEndpoint(w.Endpoint)
		if err != nil {
			continue // not routable through Envoy (no IP literal); discovery reports it
		}
		byAddr[ep] = w.ID
		ip := strings.Trim(ep[:strings.LastIndex(ep, ":")], "[]")
		byIP[ip] = append(byIP[ip], w.ID)
		endpoint[w.ID] = ep
	}
	r.mu.Lock()
	r.byAddr, r.byIP, r.endpoint, r.firstRank = byAddr, byIP, endpoint, firstRank
	r.mu.Unlock()
}

// allowed maps a subset hint to worker ids; nil means no restriction.
func (r *router) allowed(subset []string) ([]string, error) {
	if subset == nil {
		return nil, nil
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	var ids []string
	for _, e := range subset {
		if id, ok := r.byAddr[e]; ok {
			ids = append(ids, id)
			continue
		}
		ids = append(ids, r.byIP[strings.Trim(e, "[]")]...)
	}
	if len(ids) == 0 {
		return nil, fmt.Errorf("%w: the subset hint names no known worker", selection.ErrNoEndpoints)
	}
	return ids, nil
}

func parsePriority(h map[string]string) (selection.Priority, error) {
	var p selection.Priority
	if v, ok := h[headerPriority]; ok {
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
			return p, fmt.Errorf("%w: %s %q", selection.ErrBadRequest, headerPriority, v)
		}
		p.Jump = f
	}
	if v, ok := h[headerStrictPriority]; ok {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil {
			return p, fmt.Errorf("%w: %s %q", selection.ErrBadRequest, headerStrictPriority, v)
		}
		p.Tier = n
	}
	return p, nil
}

// policyClass reads the request's policy class (selection.Request.Class):
// Dynamo's x-dynamo-meta-policy-class, else GAIE's InferenceObjective name;
// "" for none. A name no configured class has is the default class's.
func policyClass(h map[string]string) string {
	for _, name := range []string{headerPolicyClass, headerObjective} {
		if v := strings.TrimSpace(h[name]); v != "" {
			return v
		}
	}
	return ""
}

// sessionID reads the request's session id: the configured header, else
// Dynamo's; "" for none. An id over selection.MaxSessionIDLen bytes is a bad
// request (400): the client named a session it cannot have.
func (r *router) sessionID(h map[string]string) (string, error) {
	for _, name := range []string{r.sessionHeader, headerDynamoSession} {
		if name == "" {
			continue
		}
		v := strings.TrimSpace(h[name])
		if v == "" {
			continue
		}
		if len(v) > selection.MaxSessionIDLen {
			return "", fmt.Errorf("%w: header %s is %d bytes, longer than %d", selection.ErrBadRequest, name, len(v), selection.MaxSessionIDLen)
		}
		return v, nil
	}
	return "", nil
}

// Pick tokenizes and books. Body-less requests go to the least-loaded eligible
// worker without a booking. A request the tokenizers failed
// (tokenize.ServiceFailed, the client still there) is booked on load alone unless noDegrade is set; the request's own faults
// (a bad body, a prompt too long) are refused.
func (r *router) Pick(ctx context.Context, req extproc.PickRequest) (extproc.Pick, error) {
	arrived := time.Now()
	allowed, err := r.allowed(req.Subset)
	if err != nil {
		return extproc.Pick{}, err
	}
	if len(req.Body) == 0 {
		return r.leastLoaded(allowed)
	}
	prio, err := parsePriority(req.Headers)
	if err != nil {
		return extproc.Pick{}, err
	}
	session, err := r.sessionID(req.Headers)
	if err != nil {
		return extproc.Pick{}, err
	}
	if r.tracer != nil {
		var span trace.Span
		ctx, span = oteltracing.StartPick(ctx, r.tracer, req.Headers)
		defer span.End()
	}
	tr, err := r.tokenize(ctx, req)
	isl := 0
	if err != nil {
		if r.noDegrade || ctx.Err() != nil || !tokenize.ServiceFailed(err) {
			return extproc.Pick{}, err
		}
		// Degraded: a load-only decision, the prompt's length estimated
		// from the body, rather than fail a request a worker can serve.
		r.degraded.note(r.log, err, time.Now())
		tr, isl = tokenize.Result{}, tokenize.EstimateTokens(req.Body)
	}
	sreq := selection.Request{
		Model: r.model, Tokens: tr.Tokens, ISL: isl, CacheSalt: tr.CacheSalt, Allowed: allowed, Priority: prio,
		ExpectedOutputTokens: int(min(max(tr.MaxTokens, 0), math.MaxInt32)), SessionID: session,
		Fallbacks: r.fallbacks, Class: policyClass(req.Headers),
	}
	var debug []selection.Scored
	if r.debug {
		debug, _ = r.book.Scores(ctx, sreq) // an explanation that fails is left out
	}
	if err := r.waitHold(ctx, arrived); err != nil {
		return extproc.Pick{}, err
	}
	plan, err := r.book.Book(ctx, sreq)
	if err != nil {
		return extproc.Pick{}, err
	}
	f := r.newFlight(plan)
	pick := extproc.Pick{Destination: plan.Destination(), Settle: f}
	for _, fb := range plan.Decode.Fallbacks {
		pick.Fallbacks = append(pick.Fallbacks, fb.Endpoint)
	}
	if r.debug {
		pick.Debug = explain(plan.Decode.WorkerRank, debug)
	}
	if hint, ok := plan.PrefillHint(); ok {
		pick.Prefiller = hint
		if r.signer != nil {
			if pick.Prefiller, pick.PrefillerSignature, err = r.signer.sign(hint, pick, req); err != nil {
				f.Done() // no pick, so nobody else settles it
				return extproc.Pick{}, err
			}
		}
	}
	return pick, nil
}

// hintSigner signs the prefill hint of each disaggregated pick (package
// pdhint), so that only the decode sidecar this EPP routed the request to (or
// one of its fallbacks), holding the same key, runs a P/D exchange, only with
// the prefill worker this EPP chose, for that path and body, until the
// signature expires, once. It is safe for concurrent use (it only reads).
type hintSigner struct {
	key []byte        // at least pdhint.MinKeyLen bytes
	ttl time.Duration // > 0; the expiry is truncated to the second
	now func() time.Time
}

// sign returns the hint as it goes on the wire (canonical, as the ext_proc
// server would send it) and its signature over the claim the sidecar rebuilds:
// that value, the destination list as the server sends it, the request's path
// and body; issued now, expiring now+ttl, with a fresh nonce.
func (s *hintSigner) sign(hint string, pick extproc.Pick, req extproc.PickRequest) (endpoint, signature string, err error) {
	var dests []string
	if endpoint, err = extproc.CanonicalEndpoint(hint); err == nil {
		dests, err = destinationList(pick.Destination, pick.Fallbacks)
	}
	if err == nil {
		now := s.now()
		claim := pdhint.Claim{Prefiller: endpoint, Destinations: dests, Path: requestPath(req.Path), Body: req.Body}
		signature, err = pdhint.Sign(s.key, claim, now, now.Add(s.ttl), pdhint.NewNonce())
	}
	if err != nil {
		return "", "", fmt.Errorf("epp: sign the prefill hint: %w", err)
	}
	return endpoint, signature, nil
}

// destinationList is the destination list the ext_proc server sends in
// x-gateway-destination-endpoint for a pick: the canonical destination, then
// each valid fallback not already listed, at most extproc.MaxFallbacks of
// them. (The server builds the same list; the sidecar verifies the signature
// over what it receives.)
func destinationList(dest string, fallbacks []string) ([]string, error) {
	d, err := extproc.CanonicalEndpoint(dest)
	if err != nil {
		return nil, err
	}
	list := []string{d}
	for _, f := range fallbacks {
		c, err := extproc.CanonicalEndpoint(f)
		if err != nil || slices.Contains(list, c) || len(list) > extproc.MaxFallbacks {
			continue
		}
		list = append(list, c)
	}
	return list, nil
}

// requestPath is the path of a :path value without its query, as net/http
// parses it on the sidecar's side.
func requestPath(p string) string {
	if u, err := url.ParseRequestURI(p); err == nil {
		return u.Path
	}
	path, _, _ := strings.Cut(p, "?")
	return path
}

// tokenize tokenizes the request's body, in a span when tracing is on.
func (r *router) tokenize(ctx context.Context, req extproc.PickRequest) (tokenize.Result, error) {
	treq := tokenize.Request{Path: req.Path, Body: req.Body, Model: r.model}
	if r.tracer == nil {
		return r.tok.Tokenize(ctx, treq)
	}
	ctx, span := r.tracer.Start(ctx, oteltracing.SpanTokenize)
	tr, err := r.tok.Tokenize(ctx, treq)
	oteltracing.EndTokenize(span, tr, err)
	return tr, err
}

func (r *router) leastLoaded(allowed []string) (extproc.Pick, error) {
	ok := func(id string) bool {
		if allowed == nil {
			return true
		}
		for _, a := range allowed {
			if a == id {
				return true
			}
		}
		return false
	}
	best, bestLoad := "", math.MaxInt
	for _, l := range r.loads.Loads(r.model) {
		if ok(l.WorkerID) && l.ActiveRequests < bestLoad {
			best, bestLoad = l.WorkerID, l.ActiveRequests
		}
	}
	r.mu.RLock()
	ep := r.endpoint[best]
	r.mu.RUnlock()
	if best == "" || ep == "" {
		return extproc.Pick{}, fmt.Errorf("%w: no schedulable worker for a body-less request", selection.ErrNoEndpoints)
	}
	return extproc.Pick{Destination: ep, Settle: extproc.NopSettler{}}, nil
}

// statusOf maps any error of the request path to the HTTP status the client
// gets: the tokenizer's classes first, then the selection service's.
// overloadAs returns status answering overload (429: a full queue, the
// classifier's or fair admission's refusal) with the given status instead;
// 0 or 429 changes nothing.
func overloadAs(status func(error) int, overload int) func(error) int {
	if overload == 0 || overload == http.StatusTooManyRequests {
		return status
	}
	return func(err error) int {
		if st := status(err); st != http.StatusTooManyRequests {
			return st
		}
		return overload
	}
}

func statusOf(err error) int {
	for _, e := range []error{tokenize.ErrBadRequest, tokenize.ErrUnavailable, tokenize.ErrTimeout,
		tokenize.ErrUpstream, tokenize.ErrCanceled, tokenize.ErrClosed} {
		if errors.Is(err, e) {
			return tokenize.HTTPStatus(err)
		}
	}
	return roles.HTTPStatus(err)
}

// waitHold waits until the hold of a request that arrived at arrived is
// over (router.hold; tokenizing counts towards it), or ctx ends: its
// error then.
func (r *router) waitHold(ctx context.Context, arrived time.Time) error {
	if r.hold == nil {
		return nil
	}
	d := r.hold(r.model) - time.Since(arrived)
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
