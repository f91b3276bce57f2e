package extproc

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvselect/kvselect/gaie"
)

type phase int

const (
	phaseHeaders  phase = iota // waiting for request headers
	phaseBody                  // buffering the request body
	phaseResponse              // decision sent, waiting for the response
	phaseDone                  // response ended
)

func (p phase) String() string {
	return [...]string{"headers", "body", "response", "done"}[p]
}

// completion says which message completed the request.
type completion int

const (
	byHeaders completion = iota
	byBody
	byTrailers
)

// exchange is the state of one stream; it is used by one goroutine only.
type exchange struct {
	s        *Server
	stream   extprocv3.ExternalProcessor_ProcessServer
	ctx      context.Context
	reqMode  extprocfilterv3.ProcessingMode_BodySendMode
	respMode extprocfilterv3.ProcessingMode_BodySendMode
	phase    phase

	hdr           requestHeaders
	subset        []string
	subsetPresent bool
	body          []byte
	permit        bool

	outcome    int // 0 until decided
	decided    bool
	settle     Settler // non-nil once a pick succeeded
	settled    bool
	firstByte  bool
	dest       string   // canonical destination
	follow     Follower // the settler's, nil when it follows nothing
	debug      string   // Pick.Debug, checked; "" for none
	servedSeen bool
}

// configure reads the protocol configuration of the first message. Envoy
// before 1.32 sends none; full duplex (GAIE's required mode) is assumed then.
func (x *exchange) configure(req *extprocv3.ProcessingRequest) error {
	if req.GetObservabilityMode() {
		return status.Error(codes.FailedPrecondition, fmt.Sprintf("%v: observability mode", ErrUnsupportedMode))
	}
	if pc := req.GetProtocolConfig(); pc != nil {
		x.reqMode = pc.GetRequestBodyMode()
		x.respMode = pc.GetResponseBodyMode()
	}
	return nil
}

func (x *exchange) handle(req *extprocv3.ProcessingRequest) error {
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		if x.phase != phaseHeaders {
			return x.protocolError("request headers in phase %s", x.phase)
		}
		return x.onRequestHeaders(r.RequestHeaders, req.GetMetadataContext())
	case *extprocv3.ProcessingRequest_RequestBody:
		if x.phase != phaseBody {
			return x.protocolError("request body in phase %s", x.phase)
		}
		return x.onRequestBody(r.RequestBody, req.GetMetadataContext())
	case *extprocv3.ProcessingRequest_RequestTrailers:
		switch {
		case x.phase == phaseBody && x.reqMode == extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
			x.readSubset(req.GetMetadataContext())
			return x.decide(byTrailers)
		case x.phase == phaseResponse && x.reqMode != extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
			return x.send(trailersResponse(false))
		}
		return x.protocolError("request trailers in phase %s", x.phase)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		if x.phase != phaseResponse {
			return x.protocolError("response headers in phase %s", x.phase)
		}
		return x.onResponseHeaders(r.ResponseHeaders, req.GetMetadataContext())
	case *extprocv3.ProcessingRequest_ResponseBody:
		if x.phase != phaseResponse {
			return x.protocolError("response body in phase %s", x.phase)
		}
		return x.onResponseBody(r.ResponseBody, req.GetMetadataContext())
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		if x.phase != phaseResponse {
			return x.protocolError("response trailers in phase %s", x.phase)
		}
		if err := x.send(trailersResponse(true)); err != nil {
			return err
		}
		x.complete()
		return nil
	default:
		return x.protocolError("unknown request message %T", r)
	}
}

func (x *exchange) protocolError(format string, a ...any) error {
	msg := fmt.Sprintf(format, a...)
	x.s.log.Warn("ext_proc protocol violation", "request_id", x.hdr.requestID, "detail", msg)
	return status.Error(codes.InvalidArgument, ErrProtocol.Error()+": "+msg)
}

func (x *exchange) onRequestHeaders(h *extprocv3.HttpHeaders, md *corev3.Metadata) error {
	x.hdr = readRequestHeaders(h.GetHeaders())
	if !x.acquire() {
		x.s.log.Warn("request rejected", "request_id", x.hdr.requestID, "status", http.StatusServiceUnavailable,
			"err", ErrTooManyInflight)
		return x.reject(http.StatusServiceUnavailable)
	}
	x.readSubset(md)
	if h.GetEndOfStream() {
		return x.decide(byHeaders)
	}
	x.phase = phaseBody
	switch x.reqMode {
	case extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		// The headers reply carries the routing decision, so it waits for the
		// end of the body; Envoy streams the body meanwhile.
		return nil
	case extprocfilterv3.ProcessingMode_BUFFERED:
		// Envoy waits for this reply before sending the buffered body.
		return x.send(&extprocv3.ProcessingResponse{
			Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
				Response: &extprocv3.CommonResponse{HeaderMutation: removeOnly(x.hdr.remove)},
			}},
		})
	default:
		return status.Error(codes.FailedPrecondition,
			fmt.Sprintf("%v: request body mode %s", ErrUnsupportedMode, x.reqMode))
	}
}

func (x *exchange) onRequestBody(b *extprocv3.HttpBody, md *corev3.Metadata) error {
	x.readSubset(md)
	if len(x.body)+len(b.GetBody()) > x.s.maxBody {
		x.s.log.Warn("request rejected", "request_id", x.hdr.requestID, "status", http.StatusRequestEntityTooLarge,
			"err", fmt.Errorf("%w: more than %d bytes", ErrBodyTooLarge, x.s.maxBody))
		return x.reject(http.StatusRequestEntityTooLarge)
	}
	if x.body == nil {
		x.body = make([]byte, 0, max(len(b.GetBody()), 512))
	}
	x.body = append(x.body, b.GetBody()...)
	if x.reqMode == extprocfilterv3.ProcessingMode_BUFFERED || b.GetEndOfStream() {
		return x.decide(byBody)
	}
	return nil
}

func (x *exchange) readSubset(md *corev3.Metadata) {
	if x.subsetPresent || md == nil {
		return
	}
	subset, present, dropped := readSubset(md)
	if !present {
		return
	}
	x.subset, x.subsetPresent = subset, true
	if dropped > 0 {
		x.s.log.Warn("subset hint entries ignored", "request_id", x.hdr.requestID, "ignored", dropped,
			"kept", len(subset))
	}
}

// decide asks the Picker and sends the routing decision.
func (x *exchange) decide(by completion) error {
	defer x.release()
	if x.s.testHooks && x.hdr.testSelection != "" {
		// The conformance suite steers the request: the header's endpoints
		// are the subset, over the gateway's; none usable leaves the
		// gateway's (or none).
		if sel, _ := appendSubsetItems(nil, x.hdr.testSelection, 0); len(sel) > 0 {
			x.subset, x.subsetPresent = sel, true
		}
	}
	if x.subsetPresent && len(x.subset) == 0 {
		x.s.log.Warn("request rejected", "request_id", x.hdr.requestID, "status", http.StatusServiceUnavailable,
			"err", ErrEmptySubset)
		return x.reject(http.StatusServiceUnavailable)
	}
	var body []byte
	if by != byHeaders {
		body = x.body
	}
	start := x.s.now()
	pick, err := x.s.picker.Pick(x.ctx, PickRequest{
		Path: x.hdr.path, Method: x.hdr.method, Headers: x.hdr.picker, Body: body, Subset: x.subset,
	})
	x.s.rec.PickLatency(x.s.now().Sub(start))
	if err == nil && pick.Settle == nil {
		pick.Settle = NopSettler{}
	}
	if err == nil {
		x.settle = pick.Settle // owed a Done from here on
	}
	if err != nil {
		if x.ctx.Err() != nil {
			return status.FromContextError(x.ctx.Err()).Err()
		}
		st := clampStatus(x.s.status(err))
		x.logRejected(st, err)
		reason := ""
		if x.s.reason != nil {
			reason = x.s.reason(err)
		}
		return x.rejectWith(st, reason)
	}
	dest, err := CanonicalEndpoint(pick.Destination)
	if err != nil {
		x.logRejected(http.StatusInternalServerError, fmt.Errorf("picker destination: %w", err))
		return x.reject(http.StatusInternalServerError)
	}
	prefiller := ""
	if pick.Prefiller != "" {
		if prefiller, err = CanonicalEndpoint(pick.Prefiller); err != nil {
			x.logRejected(http.StatusInternalServerError, fmt.Errorf("picker prefiller: %w", err))
			return x.reject(http.StatusInternalServerError)
		}
	}
	if pick.PrefillerSignature != "" {
		if err := checkSignature(pick.PrefillerSignature, pick.Prefiller, prefiller); err != nil {
			x.logRejected(http.StatusInternalServerError, fmt.Errorf("picker: %w", err))
			return x.reject(http.StatusInternalServerError)
		}
	}
	x.dest = dest
	x.follow, _ = pick.Settle.(Follower)
	if pick.Debug != "" {
		if err := checkDebug(pick.Debug); err != nil {
			x.s.log.Warn("debug header left out", "request_id", x.hdr.requestID, "err", err)
		} else {
			x.debug = pick.Debug
		}
	}
	list := x.destinationList(dest, pick.Fallbacks)
	if err := x.sendDecision(by, list, prefiller, pick.PrefillerSignature); err != nil {
		return err
	}
	x.body = nil
	x.phase = phaseResponse
	x.record(http.StatusOK)
	x.s.log.Debug("request routed", "request_id", x.hdr.requestID, "destination", list, "prefiller", prefiller)
	return nil
}

// destinationList is the destination header's value: the canonical primary,
// then each valid fallback not already in the list, at most MaxFallbacks.
func (x *exchange) destinationList(dest string, fallbacks []string) string {
	if len(fallbacks) == 0 {
		return dest
	}
	list := make([]string, 1, 1+min(len(fallbacks), MaxFallbacks))
	list[0] = dest
	dropped := 0
	for _, f := range fallbacks {
		c, err := CanonicalEndpoint(f)
		if err != nil || contains(list, c) || len(list) > MaxFallbacks {
			dropped++
			continue
		}
		list = append(list, c)
	}
	if dropped > 0 {
		x.s.log.Warn("fallback endpoints left out", "request_id", x.hdr.requestID, "left_out", dropped, "kept", len(list)-1)
	}
	return strings.Join(list, ",")
}

// checkDebug validates a Pick's debug header value.
func checkDebug(v string) error {
	if len(v) > MaxDebugLen {
		return fmt.Errorf("%w: %d bytes, at most %d", ErrInvalidDebug, len(v), MaxDebugLen)
	}
	for i := 0; i < len(v); i++ {
		if v[i] < ' ' || v[i] > '~' {
			return fmt.Errorf("%w: byte %d is not printable ASCII", ErrInvalidDebug, i)
		}
	}
	return nil
}

func (x *exchange) logRejected(st int, err error) {
	lvl := x.s.log.Warn
	if st < 500 {
		lvl = x.s.log.Info
	}
	lvl("request rejected", "request_id", x.hdr.requestID, "status", st, "err", err)
}

// sendDecision sends the routing mutations: the destination (a list when
// there are fallbacks), and in
// disaggregated mode the prefiller and, when hints are signed, its signature
// (no header for what is ""), then the body.
func (x *exchange) sendDecision(by completion, dest, prefiller, signature string) error {
	mut := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setHeader(HeaderDestination, dest)}}
	if prefiller != "" {
		mut.SetHeaders = append(mut.SetHeaders, setHeader(HeaderPrefiller, prefiller))
	}
	if signature != "" {
		mut.SetHeaders = append(mut.SetHeaders, setHeader(HeaderPrefillerSignature, signature))
	}
	buffered := x.reqMode == extprocfilterv3.ProcessingMode_BUFFERED && by == byBody
	if !buffered {
		// Removing a header that is also set in the same mutation is left
		// out: the overwrite already replaces the client's value.
		for _, h := range x.hdr.remove {
			if h == HeaderDestination || (h == HeaderPrefiller && prefiller != "") ||
				(h == HeaderPrefillerSignature && signature != "") {
				continue
			}
			mut.RemoveHeaders = append(mut.RemoveHeaders, h)
		}
	}
	common := &extprocv3.CommonResponse{HeaderMutation: mut, ClearRouteCache: true}
	resp := &extprocv3.ProcessingResponse{DynamicMetadata: destinationMetadata(dest)}
	if buffered {
		// Envoy applies header mutations of a body reply in buffered mode;
		// the control headers were removed in the headers reply.
		resp.Response = &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}}
		return x.send(resp)
	}
	resp.Response = &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: common}}
	if err := x.send(resp); err != nil {
		return err
	}
	if by == byHeaders {
		return nil
	}
	// Full duplex: Envoy forwards only what we send back.
	// An empty body ended by end of stream still gets one (empty) chunk so
	// that Envoy sees the end of the request.
	body := x.body
	for off := 0; off < len(body) || (len(body) == 0 && by == byBody); {
		end := min(off+x.s.chunk, len(body))
		if err := x.send(streamedBody(true, body[off:end], end == len(body) && by == byBody)); err != nil {
			return err
		}
		if end == len(body) {
			break
		}
		off = end
	}
	if by == byTrailers {
		return x.send(trailersResponse(false))
	}
	return nil
}

func (x *exchange) onResponseHeaders(h *extprocv3.HttpHeaders, md *corev3.Metadata) error {
	served := x.checkServed(md)
	common := &extprocv3.CommonResponse{}
	var set []*corev3.HeaderValueOption
	if x.debug != "" {
		set = append(set, setHeader(HeaderDebug, x.debug))
	}
	if x.s.testHooks {
		// The gateway's report, never the pick: the suite checks where the
		// request really went.
		if v := strings.TrimSpace(readServed(md)); v != "" && checkDebug(v) == nil { // bounded, printable
			set = append(set, setHeader(gaie.HeaderTestServed, v))
		}
	}
	resp := readResponse(h.GetHeaders())
	var remove []string
	if resp.PrefillFailed {
		remove = []string{gaie.HeaderFailedLeg} // the routing layer's, not the client's
	}
	if len(set) > 0 || len(remove) > 0 {
		common.HeaderMutation = &extprocv3.HeaderMutation{SetHeaders: set, RemoveHeaders: remove}
	}
	if err := x.send(&extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{Response: common}},
	}); err != nil {
		return err
	}
	if x.follow != nil {
		if served != "" {
			x.follow.Served(served)
		}
		x.follow.ResponseHeaders(resp)
	}
	if h.GetEndOfStream() {
		x.complete()
	}
	return nil
}

func (x *exchange) onResponseBody(b *extprocv3.HttpBody, md *corev3.Metadata) error {
	served := x.checkServed(md)
	var resp *extprocv3.ProcessingResponse
	if x.respMode == extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		// Envoy passes on only the bytes we send back: echo at once.
		resp = streamedBody(false, b.GetBody(), b.GetEndOfStream())
	} else {
		resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}},
		}}
	}
	if err := x.send(resp); err != nil {
		return err
	}
	if x.follow != nil {
		if served != "" {
			x.follow.Served(served)
		}
		if len(b.GetBody()) > 0 {
			x.follow.ResponseBody(b.GetBody())
		}
	}
	if len(b.GetBody()) > 0 && !x.firstByte && x.settle != nil {
		x.firstByte = true
		x.settle.FirstByte()
	}
	if b.GetEndOfStream() {
		x.complete()
	}
	return nil
}

// checkServed compares the gateway's served endpoint with the pick, once,
// and returns it (canonical when it parses) when it differs, "" otherwise.
func (x *exchange) checkServed(md *corev3.Metadata) string {
	if x.servedSeen || md == nil {
		return ""
	}
	served := strings.TrimSpace(readServed(md))
	if served == "" {
		return ""
	}
	x.servedSeen = true
	if sameEndpoint(served, x.dest) {
		return ""
	}
	x.s.rec.ServedMismatch()
	x.s.log.Info("served endpoint differs from the pick", "request_id", x.hdr.requestID,
		"picked", x.dest, "served", served)
	if c, err := CanonicalEndpoint(served); err == nil {
		return c
	}
	return served
}

// readResponse reads the :status, content-type and failed-leg response headers.
func readResponse(hm *corev3.HeaderMap) Response {
	var r Response
	for _, h := range hm.GetHeaders() {
		switch strings.ToLower(h.GetKey()) {
		case ":status":
			if n, err := strconv.Atoi(strings.TrimSpace(headerValue(h))); err == nil && n > 0 && n < 1000 {
				r.Status = n
			}
		case "content-type":
			r.ContentType = headerValue(h)
		case gaie.HeaderFailedLeg:
			r.PrefillFailed = r.PrefillFailed || strings.TrimSpace(headerValue(h)) == gaie.FailedLegPrefill
		}
	}
	return r
}

// complete ends the exchange after the response ended.
func (x *exchange) complete() {
	x.phase = phaseDone
	x.settleDone()
}

func (x *exchange) settleDone() {
	if x.settle != nil && !x.settled {
		x.settled = true
		x.settle.Done()
	}
}

// finish runs when Process returns, whatever the reason.
func (x *exchange) finish() {
	x.settleDone()
	x.release()
	if !x.decided {
		x.record(0)
	}
}

// reject answers with an ImmediateResponse and ends the stream.
func (x *exchange) reject(st int) error { return x.rejectWith(st, "") }

// rejectWith is reject naming reason in the body (see immediate).
func (x *exchange) rejectWith(st int, reason string) error {
	x.record(st)
	x.settleDone()
	if err := x.send(immediate(st, reason)); err != nil {
		return err
	}
	return errFinished
}

func (x *exchange) record(st int) {
	if x.decided {
		return
	}
	x.decided = true
	x.s.rec.Outcome(st)
}

func (x *exchange) acquire() bool {
	n := x.s.inflight.Add(1)
	if n > x.s.maxFlight {
		x.s.inflight.Add(-1)
		return false
	}
	x.permit = true
	x.s.rec.Inflight(int(n))
	return true
}

func (x *exchange) release() {
	if x.permit {
		x.permit = false
		x.s.rec.Inflight(int(x.s.inflight.Add(-1)))
	}
}

func (x *exchange) send(resp *extprocv3.ProcessingResponse) error {
	return x.stream.Send(resp)
}

func setHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}

func removeOnly(remove []string) *extprocv3.HeaderMutation {
	if len(remove) == 0 {
		return nil
	}
	return &extprocv3.HeaderMutation{RemoveHeaders: remove}
}

func destinationMetadata(dest string) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		MetadataNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			HeaderDestination: structpb.NewStringValue(dest),
		}}),
	}}
}

func streamedBody(request bool, body []byte, eos bool) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
		BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
			StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: eos},
		}},
	}}
	if request {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
}

func trailersResponse(response bool) *extprocv3.ProcessingResponse {
	if response {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{},
		}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{},
	}}
}
