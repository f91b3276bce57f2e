package sidecar

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/gaie"
)

// hintStartSkew is the clock skew allowed between the EPP and a sidecar when a
// signed hint's issue time is compared with the sidecar's start.
const hintStartSkew = time.Second

// Sidecar is the decode sidecar: an http.Handler in front of the local decode
// engine. Create it with New; it is safe for concurrent use.
type Sidecar struct {
	opts      Options
	decodeURL *url.URL
	client    *http.Client
	own       *http.Transport // the default transport, closed by Close; nil with Options.Transport
	verifier  *pdhint.Verifier
	log       *slog.Logger
	stats     counters
}

// New validates opts, applies defaults and returns a Sidecar. It starts
// nothing. It returns an error wrapping ErrInvalidOptions that names every
// problem.
func New(opts Options) (*Sidecar, error) {
	o, decode, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	s := &Sidecar{opts: o, decodeURL: decode, log: o.Logger}
	rt := o.Transport
	if rt == nil {
		s.own = &http.Transport{
			Proxy:                 nil, // engines are on the pod network; never an environment proxy
			DialContext:           (&net.Dialer{Timeout: o.DialTimeout, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:          256,
			MaxIdleConnsPerHost:   64,
			IdleConnTimeout:       90 * time.Second,
			TLSHandshakeTimeout:   10 * time.Second,
			ExpectContinueTimeout: time.Second,
		}
		rt = s.own
	}
	s.client = &http.Client{
		Transport:     rt,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	if o.HintKey != nil {
		// A restarted sidecar's replay cache is empty: refuse what was signed
		// before it started, but for clock skew between the EPP and here.
		s.verifier, err = pdhint.NewVerifier(pdhint.VerifierOptions{
			Key: o.HintKey, Now: o.Now, MaxLifetime: o.HintMaxLifetime, MaxNonces: o.HintReplayCache,
			NotBefore: o.Now().Add(-hintStartSkew),
		})
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, err)
		}
	}
	return s, nil
}

// Close closes the idle connections of the sidecar's own transport. Requests
// in flight are not affected; the Sidecar stays usable.
func (s *Sidecar) Close() {
	if s.own != nil {
		s.own.CloseIdleConnections()
	}
}

// Stats returns a consistent snapshot of the counters.
func (s *Sidecar) Stats() Stats { return s.stats.snapshot(s.opts.Protocol) }

// isCompletion reports whether r is one of the requests the P/D protocol
// applies to.
func isCompletion(r *http.Request) bool {
	return r.Method == http.MethodPost && (r.URL.Path == "/v1/chat/completions" || r.URL.Path == "/v1/completions")
}

// exchange is one P/D request, admitted.
type exchange struct {
	chat   bool
	hint   netip.AddrPort
	raw    []byte                     // the body as the client sent it
	body   map[string]json.RawMessage // the same, by field
	header http.Header                // what both legs get of the client's headers
}

// ServeHTTP runs the P/D protocol for a chat or completions POST carrying a
// prefill hint, and proxies everything else to the decode engine as it came.
// Orchestration headers never reach an engine.
func (s *Sidecar) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hints := r.Header.Values(HeaderPrefiller)
	if len(hints) == 0 || !isCompletion(r) {
		s.passthrough(w, r)
		return
	}
	x, ok := s.admit(w, r, hints)
	if !ok {
		return
	}
	s.stats.add(func(c *counters) { c.disaggregated++ })
	if s.opts.Protocol == ProtocolSGLang {
		s.concurrent(w, r, x)
		return
	}
	s.sequential(w, r, x)
}

// admit checks the hint, reads the body, checks the signature and the body,
// and answers the refusal when one fails.
func (s *Sidecar) admit(w http.ResponseWriter, r *http.Request, hints []string) (*exchange, bool) {
	hint, reason := s.parseHint(hints)
	if reason != "" {
		s.badHint(w, r, reason, hints)
		return nil, false
	}
	raw, status, reason := s.readBody(w, r)
	if reason != "" {
		s.refuse(w, r, status, reason, bodyPhrases[reason])
		return nil, false
	}
	if reason := s.checkSignature(r, hints[0], raw); reason != "" {
		s.badHint(w, r, reason, hints)
		return nil, false
	}
	x := &exchange{chat: r.URL.Path == "/v1/chat/completions", hint: hint, raw: raw, header: outboundHeader(r.Header)}
	if err := json.Unmarshal(raw, &x.body); err != nil || x.body == nil {
		s.refuse(w, r, http.StatusBadRequest, RefusedNotJSONObject, "a P/D request body must be a JSON object")
		return nil, false
	}
	if reason, msg := s.checkBody(x); reason != "" {
		s.refuse(w, r, http.StatusBadRequest, reason, msg)
		return nil, false
	}
	return x, true
}

// bodyPhrases are the client-facing messages of the body refusals.
var bodyPhrases = map[string]string{
	RefusedBodyTooLarge:   "the request body is too large",
	RefusedBodyTimeout:    "the request body did not arrive in time",
	RefusedBodyUnreadable: "the request body could not be read",
}

// readBody reads the whole body, at most MaxRequestBytes, within
// BodyReadTimeout. It returns the status and reason of a failure. The read
// deadline is lifted only once the whole body came: after a failure it stays,
// so that net/http cannot wait forever for the rest of a stalled body.
func (s *Sidecar) readBody(w http.ResponseWriter, r *http.Request) ([]byte, int, string) {
	if r.ContentLength > s.opts.MaxRequestBytes {
		return nil, http.StatusRequestEntityTooLarge, RefusedBodyTooLarge
	}
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Now().Add(s.opts.BodyReadTimeout)) // not every writer supports it
	raw, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.opts.MaxRequestBytes))
	var tooLarge *http.MaxBytesError
	switch {
	case err == nil:
		// net/http's watch for a client that goes away reads on: no deadline.
		_ = rc.SetReadDeadline(time.Time{})
		return raw, 0, ""
	case errors.As(err, &tooLarge):
		return nil, http.StatusRequestEntityTooLarge, RefusedBodyTooLarge
	case errors.Is(err, os.ErrDeadlineExceeded):
		return nil, http.StatusRequestTimeout, RefusedBodyTimeout
	default:
		return nil, http.StatusBadRequest, RefusedBodyUnreadable
	}
}

// checkBody refuses what the P/D protocols cannot carry: a stream flag that is
// not a boolean, several choices, a batch of completions prompts, and the
// protocol's own hand-over fields set by the client (they would let a client
// point the engines' KV transfer anywhere).
func (s *Sidecar) checkBody(x *exchange) (string, string) {
	if v, ok := x.body["stream"]; ok && !isNull(v) && string(v) != "true" && string(v) != "false" {
		return RefusedBadStream, "stream must be a boolean"
	}
	if v, ok := x.body["n"]; ok && !isNull(v) {
		var n float64
		if json.Unmarshal(v, &n) != nil || n != 1 {
			return RefusedNotOneChoice, "P/D serving hands over one sequence: n must be 1"
		}
	}
	if v, ok := x.body["prompt"]; ok && !x.chat && len(v) > 0 && v[0] == '[' {
		var items []json.RawMessage
		if json.Unmarshal(v, &items) == nil && len(items) > 1 && len(items[0]) > 0 && (items[0][0] == '"' || items[0][0] == '[') {
			return RefusedBatchPrompt, "P/D serving hands over one prompt: send a batch as separate requests"
		}
	}
	for _, f := range s.handoverFields() {
		if v, ok := x.body[f]; ok && !isNull(v) && string(v) != "{}" {
			return RefusedTransferParams, fmt.Sprintf("%s is set by the sidecar, not the client", f)
		}
	}
	return "", ""
}

// handoverFields are the body fields the protocol's hand-over owns.
func (s *Sidecar) handoverFields() []string {
	switch s.opts.Protocol {
	case ProtocolSGLang:
		return []string{"bootstrap_host", "bootstrap_port", "bootstrap_room"}
	case ProtocolTRTLLM:
		return []string{"disaggregated_params"}
	default:
		return []string{"kv_transfer_params"}
	}
}

func isNull(v json.RawMessage) bool {
	t := bytes.TrimSpace(v)
	return len(t) == 0 || string(t) == "null"
}

// edit returns body with the fields of set replaced (values are marshalled;
// json.RawMessage ones go as they are) and those of del removed.
func edit(body map[string]json.RawMessage, set map[string]any, del ...string) ([]byte, error) {
	out := make(map[string]json.RawMessage, len(body)+len(set))
	for k, v := range body {
		out[k] = v
	}
	for _, k := range del {
		delete(out, k)
	}
	for k, v := range set {
		b, err := json.Marshal(v)
		if err != nil {
			return nil, err
		}
		out[k] = b
	}
	return json.Marshal(out)
}

// prefillResult is how a prefill leg went.
type prefillResult struct {
	outcome Outcome
	detail  string                     // what went wrong, for the log only (never the client)
	answer  map[string]json.RawMessage // a parsed 2xx answer (vLLM, TensorRT-LLM)
	took    time.Duration
}

// prefill sends body to the hinted engine within PrefillTimeout and reads its
// whole answer, at most MaxPrefillResponseBytes; with parse, the answer must be
// a JSON object. The leg is counted by the caller (finishPrefill).
func (s *Sidecar) prefill(ctx context.Context, r *http.Request, x *exchange, body []byte, parse bool) prefillResult {
	start := time.Now()
	legCtx, cancel := context.WithTimeout(ctx, s.opts.PrefillTimeout)
	defer cancel()
	target := url.URL{Scheme: "http", Host: x.hint.String(), Path: r.URL.Path, RawQuery: r.URL.RawQuery}
	req, err := http.NewRequestWithContext(legCtx, http.MethodPost, target.String(), bytes.NewReader(body))
	if err != nil {
		return prefillResult{outcome: OutcomeError, detail: err.Error()}
	}
	req.Header = x.header.Clone()
	req.Header.Del("Accept-Encoding") // let the transport negotiate and decompress
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.client.Do(req)
	if err != nil {
		return prefillResult{outcome: outcomeOf(r.Context(), legCtx), detail: err.Error(), took: time.Since(start)}
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, s.opts.MaxPrefillResponseBytes+1))
	res := prefillResult{took: time.Since(start)}
	switch {
	case err != nil:
		res.outcome, res.detail = outcomeOf(r.Context(), legCtx), err.Error()
	case int64(len(data)) > s.opts.MaxPrefillResponseBytes:
		res.outcome, res.detail = OutcomeTooLarge, fmt.Sprintf("the answer exceeds %d bytes", s.opts.MaxPrefillResponseBytes)
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		// The body is not relayed: it may quote the request.
		res.outcome, res.detail = OutcomeHTTPError, "the prefill engine answered "+resp.Status
	case !parse:
		res.outcome = OutcomeOK
	case json.Unmarshal(data, &res.answer) != nil || res.answer == nil:
		res.outcome, res.detail = OutcomeBadResponse, "the prefill answer is not a JSON object"
	default:
		res.outcome = OutcomeOK
	}
	return res
}

// finishPrefill counts a prefill leg, observes its hand-off latency and logs
// its failure.
func (s *Sidecar) finishPrefill(r *http.Request, x *exchange, res prefillResult) {
	s.stats.leg(LegPrefill, res.outcome)
	if res.outcome == OutcomeOK {
		s.stats.observeHandoff(res.took)
		return
	}
	if res.outcome != OutcomeCanceled {
		s.log.Warn("sidecar: prefill leg failed", "protocol", s.opts.Protocol, "prefill", x.hint.String(),
			"outcome", res.outcome, "detail", res.detail, "path", r.URL.Path, "remote", r.RemoteAddr)
	}
}

// prefillFailed answers a request whose prefill leg failed: nothing when the
// client is gone, the original request sent to decode with FallbackLocal, else
// 502 naming the failure. Either answer carries gaie.HeaderFailedLeg, so that
// the picker marks the prefill worker failed, not this decode worker.
func (s *Sidecar) prefillFailed(w http.ResponseWriter, r *http.Request, x *exchange, res prefillResult) {
	if res.outcome == OutcomeCanceled || r.Context().Err() != nil {
		return
	}
	w.Header().Set(gaie.HeaderFailedLeg, gaie.FailedLegPrefill)
	if s.opts.Fallback == FallbackLocal {
		s.stats.add(func(c *counters) { c.fallbacks++ })
		s.log.Warn("sidecar: prefill leg failed, prefilling on the decode engine", "protocol", s.opts.Protocol,
			"prefill", x.hint.String(), "outcome", res.outcome, "path", r.URL.Path)
		s.decode(w, r, x.header, x.raw)
		return
	}
	p, ok := prefillPhrases[res.outcome]
	if !ok {
		p = prefillPhrases[OutcomeError]
	}
	writeError(w, http.StatusBadGateway, p.code, p.message)
}

// prefillPhrases are the client-facing code and message of a failed prefill
// leg, by outcome. They are fixed: what the hinted address answered (a
// transport error quoting a service's banner, a status line, a body) goes to
// the log only, so that the sidecar is no port scanner.
var prefillPhrases = map[Outcome]struct{ code, message string }{
	OutcomeError:       {"prefill_upstream_unavailable", "the prefill engine could not be reached"},
	OutcomeTimeout:     {"prefill_upstream_timeout", "the prefill engine did not answer in time"},
	OutcomeHTTPError:   {"prefill_upstream_error", "the prefill engine answered with an error"},
	OutcomeTooLarge:    {"prefill_response_too_large", "the prefill engine's answer is too large"},
	OutcomeBadResponse: {"invalid_prefill_handoff", "the prefill engine's answer has no usable hand-over"},
}

// decodeStart is a decode leg whose answer headers came (resp), or failed.
type decodeStart struct {
	resp   *http.Response
	err    error
	ctx    context.Context // the leg's context: DecodeTimeout, ReadIdleTimeout
	idle   *time.Timer     // cancels ctx after ReadIdleTimeout without bytes; relay resets it
	cancel context.CancelFunc
}

// errReadIdle is the cause of a leg canceled by ReadIdleTimeout.
var errReadIdle = errors.New("sidecar: the engine sent nothing within the read timeout")

// legContext returns a decode or pass-through leg's context, canceled past
// DecodeTimeout and when its idle timer (ReadIdleTimeout, started now) fires
// first; cancel stops both.
func (s *Sidecar) legContext(parent context.Context) decodeStart {
	idleCtx, idleCancel := context.WithCancelCause(parent)
	ctx, cancel := context.WithTimeout(idleCtx, s.opts.DecodeTimeout)
	idle := time.AfterFunc(s.opts.ReadIdleTimeout, func() { idleCancel(errReadIdle) })
	return decodeStart{ctx: ctx, idle: idle, cancel: func() {
		idle.Stop()
		cancel()
		idleCancel(context.Canceled)
	}}
}

// startDecode sends body to the decode engine; the leg lasts until cancel.
func (s *Sidecar) startDecode(ctx context.Context, r *http.Request, header http.Header, body []byte) decodeStart {
	d := s.legContext(ctx)
	req, err := http.NewRequestWithContext(d.ctx, http.MethodPost, s.decodeTarget(r.URL).String(), bytes.NewReader(body))
	if err != nil {
		d.err = err
		return d
	}
	req.Header = header.Clone()
	req.Header.Set("Content-Type", "application/json")
	d.resp, d.err = s.client.Do(req)
	return d
}

// decode sends body to the decode engine and relays its answer.
func (s *Sidecar) decode(w http.ResponseWriter, r *http.Request, header http.Header, body []byte) {
	d := s.startDecode(r.Context(), r, header, body)
	defer d.cancel()
	s.finishDecode(w, r, d, LegDecode)
}

// finishDecode relays a started decode (or pass-through) leg, or answers its
// failure to start.
func (s *Sidecar) finishDecode(w http.ResponseWriter, r *http.Request, d decodeStart, leg Leg) {
	if d.err == nil {
		s.relay(w, r, d, leg)
		return
	}
	o := outcomeOf(r.Context(), d.ctx)
	s.legDone(r, leg, o, d.err)
	switch o {
	case OutcomeTimeout:
		writeError(w, http.StatusGatewayTimeout, "decode_upstream_timeout", "the local decode engine timed out")
	case OutcomeError:
		writeError(w, http.StatusBadGateway, "decode_upstream_error", "the local decode engine request failed")
	}
}

// outcomeOf says why a leg's call failed: the client left, its deadline
// passed or it idled past its read timeout, the sidecar dropped it, or the
// engine failed.
func outcomeOf(reqCtx, legCtx context.Context) Outcome {
	switch {
	case reqCtx.Err() != nil:
		return OutcomeCanceled
	case errors.Is(legCtx.Err(), context.DeadlineExceeded), errors.Is(context.Cause(legCtx), errReadIdle):
		return OutcomeTimeout
	case legCtx.Err() != nil:
		return OutcomeAbandoned
	default:
		return OutcomeError
	}
}

// legDone counts a decode or pass-through leg and logs its failure.
func (s *Sidecar) legDone(r *http.Request, leg Leg, o Outcome, err error) {
	s.stats.leg(leg, o)
	if o != OutcomeOK && o != OutcomeCanceled && o != OutcomeHTTPError && o != OutcomeAbandoned {
		s.log.Warn("sidecar: leg failed", "protocol", s.opts.Protocol, "leg", leg, "outcome", o,
			"error", err, "path", r.URL.Path, "remote", r.RemoteAddr)
	}
}

// relay writes an engine's answer to the client as it arrives, flushing the
// headers and every chunk of an event stream at once, and counts the leg;
// each read of the engine's answer restarts the leg's idle timer. When the engine
// fails after the headers went out, relay aborts the client's connection
// (panic(http.ErrAbortHandler), which net/http handles), so a truncated
// answer never looks complete.
func (s *Sidecar) relay(w http.ResponseWriter, r *http.Request, d decodeStart, leg Leg) {
	resp, legCtx := d.resp, d.ctx
	defer resp.Body.Close()
	copyResponseHeader(w.Header(), resp.Header)
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	stream := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	if stream {
		_ = rc.Flush()
	}
	end := OutcomeOK
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		end = OutcomeHTTPError
	}
	buf := make([]byte, 32<<10)
	for {
		// The idle timer runs while the engine is read from, not while a
		// slow client is written to.
		d.idle.Reset(s.opts.ReadIdleTimeout)
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			_, werr := w.Write(buf[:n])
			if werr == nil && stream {
				werr = rc.Flush()
			}
			if werr != nil {
				s.legDone(r, leg, OutcomeCanceled, werr)
				return
			}
		}
		switch {
		case rerr == io.EOF:
			s.legDone(r, leg, end, nil)
			return
		case rerr != nil:
			o := outcomeOf(r.Context(), legCtx)
			s.legDone(r, leg, o, rerr)
			if o != OutcomeCanceled {
				panic(http.ErrAbortHandler)
			}
			return
		}
	}
}

// decodeTarget is the decode engine's URL for a request path.
func (s *Sidecar) decodeTarget(u *url.URL) *url.URL {
	t := *s.decodeURL
	t.Path = strings.TrimSuffix(s.decodeURL.Path, "/") + u.Path
	t.RawPath = ""
	t.RawQuery = u.RawQuery
	return &t
}

// passthrough proxies a request without a hint to the decode engine as it
// came, its body streamed (at most MaxRequestBytes), less the orchestration
// headers.
func (s *Sidecar) passthrough(w http.ResponseWriter, r *http.Request) {
	s.stats.add(func(c *counters) { c.passthrough++ })
	if r.ContentLength > s.opts.MaxRequestBytes {
		s.refuse(w, r, http.StatusRequestEntityTooLarge, RefusedBodyTooLarge, bodyPhrases[RefusedBodyTooLarge])
		return
	}
	d := s.legContext(r.Context())
	defer d.cancel()
	var body io.Reader
	var limited *limitedBody
	if r.Body != nil && r.Body != http.NoBody {
		limited = &limitedBody{r: http.MaxBytesReader(w, r.Body, s.opts.MaxRequestBytes)}
		body = limited
	}
	req, err := http.NewRequestWithContext(d.ctx, r.Method, s.decodeTarget(r.URL).String(), body)
	if err != nil {
		s.refuse(w, r, http.StatusInternalServerError, RefusedInternal, "the request could not be forwarded")
		return
	}
	req.ContentLength = r.ContentLength
	req.Header = outboundHeader(r.Header)
	d.resp, d.err = s.client.Do(req)
	if d.err != nil && limited != nil && limited.exceeded.Load() {
		s.refuse(w, r, http.StatusRequestEntityTooLarge, RefusedBodyTooLarge, bodyPhrases[RefusedBodyTooLarge])
		return
	}
	s.finishDecode(w, r, d, LegPassthrough)
}

// limitedBody records that its MaxBytesReader refused to read on.
type limitedBody struct {
	r        io.Reader
	exceeded atomic.Bool // read by the handler, written by the transport's writer
}

func (b *limitedBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		b.exceeded.Store(true)
	}
	return n, err
}

// refuse answers a request refused before any leg, counts and logs it; the
// connection closes after the answer (lastAnswer).
func (s *Sidecar) refuse(w http.ResponseWriter, r *http.Request, status int, reason, msg string) {
	lastAnswer(w, r)
	s.stats.add(func(c *counters) { c.refused[reason]++ })
	s.log.Warn("sidecar: request refused", "reason", reason, "status", status, "path", r.URL.Path, "remote", r.RemoteAddr)
	code := map[int]string{
		http.StatusRequestEntityTooLarge: "request_too_large",
		http.StatusRequestTimeout:        "request_timeout",
		http.StatusInternalServerError:   "internal_error",
	}[status]
	if code == "" {
		code = "invalid_pd_request"
	}
	writeError(w, status, code, msg)
}

// badHint answers a refused hint (502 invalid_epp_metadata), counts and logs
// it; the connection closes after the answer (lastAnswer).
func (s *Sidecar) badHint(w http.ResponseWriter, r *http.Request, reason string, hints []string) {
	lastAnswer(w, r)
	s.stats.add(func(c *counters) { c.badHints[reason]++ })
	shown := strings.Join(hints, " | ")
	if len(shown) > 80 {
		shown = shown[:80] + "..."
	}
	s.log.Warn("sidecar: bad prefill hint", "reason", reason, "hint", shown, "path", r.URL.Path, "remote", r.RemoteAddr)
	writeError(w, http.StatusBadGateway, "invalid_epp_metadata", "invalid EPP routing metadata: "+reason)
}

// lastAnswer makes the answer to a refused request, whose body may be unread
// or stalled, the connection's last. Connection: close makes net/http send the
// answer at once instead of first reading up to 256 KiB of the rest of the
// body, then close the connection; the read deadline, set to now, keeps the
// reading net/http still does after the handler (looking for the body's end)
// from waiting on a client that stalls. (HTTP/2 resets the stream instead.)
func lastAnswer(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor < 2 {
		w.Header().Set("Connection", "close")
	}
	_ = http.NewResponseController(w).SetReadDeadline(time.Now()) // not every writer supports it
}

// errorJSON is an OpenAI error answer.
type errorJSON struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	} `json:"error"`
}

func writeError(w http.ResponseWriter, status int, code, msg string) {
	var e errorJSON
	e.Error.Message, e.Error.Code = msg, code
	e.Error.Type = "invalid_request_error"
	if status >= 500 {
		e.Error.Type = "server_error"
	}
	b, _ := json.Marshal(e) // strings only: it always marshals
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}
