package extproctest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvselect/kvselect/gaie"
)

// Protocol names used by the driver (GAIE Endpoint Picker protocol).
const (
	HeaderDestination = gaie.HeaderDestination
	HeaderPrefiller   = gaie.HeaderPrefiller
	MetadataNamespace = gaie.MetadataNamespace
	SubsetNamespace   = "envoy.lb.subset_hint"
	SubsetKey         = gaie.HeaderDestinationSubset
	ServedKey         = gaie.HeaderDestinationServed
)

// Defaults.
const (
	DefaultChunkSize = 16 << 10
	DefaultAuthority = "gateway.test"
)

// Errors of the driver.
var (
	// ErrInvalidOptions: bad Options or HTTPRequest fields.
	ErrInvalidOptions = errors.New("extproctest: invalid options")
	// ErrProtocol: the server broke the ext_proc message order or sent a
	// reply Envoy would reject in this mode.
	ErrProtocol = errors.New("extproctest: ext_proc protocol violation")
	// ErrInvalidMutation: a header mutation Envoy would reject as a whole.
	ErrInvalidMutation = errors.New("extproctest: invalid header mutation")
	// ErrNoDestination: the server routed the request without a destination
	// and the Client has no Fallback.
	ErrNoDestination = errors.New("extproctest: no destination")
	// ErrDestinationMismatch: the destination header and the envoy.lb
	// metadata differ.
	ErrDestinationMismatch = errors.New("extproctest: destination header and metadata differ")
)

// Mode is the body processing mode, used for request and response bodies.
type Mode int

const (
	// FullDuplex is FULL_DUPLEX_STREAMED (GAIE's required mode).
	FullDuplex Mode = iota
	// Buffered is BUFFERED.
	Buffered
)

func (m Mode) envoy() extprocfilterv3.ProcessingMode_BodySendMode {
	if m == Buffered {
		return extprocfilterv3.ProcessingMode_BUFFERED
	}
	return extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// InterruptPoint says when Roundtrip interrupts the exchange.
type InterruptPoint int

const (
	// NoInterrupt runs the exchange to the end.
	NoInterrupt InterruptPoint = iota
	// AfterDecision interrupts after the routing decision, before the request
	// is forwarded.
	AfterDecision
	// AfterResponseHeaders interrupts once the server answered the response
	// headers.
	AfterResponseHeaders
	// AfterFirstChunk interrupts once the server answered the first non-empty
	// response body chunk.
	AfterFirstChunk
)

// InterruptKind says how Roundtrip interrupts the exchange.
type InterruptKind int

const (
	// Cancel is a client disconnect: the ext_proc stream is reset and the
	// upstream request cancelled (the server sees its context cancelled).
	Cancel InterruptKind = iota
	// Abort ends the ext_proc stream early: a half-close without end of
	// stream (the server sees EOF in the middle of the exchange).
	Abort
)

// Interrupt configures Roundtrip's interruption.
type Interrupt struct {
	At   InterruptPoint
	Kind InterruptKind
}

// HTTPRequest is the request the client sends through the gateway.
type HTTPRequest struct {
	// Method defaults to POST with a body, GET without.
	Method string
	// Path defaults to "/".
	Path string
	// Authority is the :authority pseudo-header; default DefaultAuthority.
	Authority string
	// Headers are the client's headers (any case; sent lower-cased).
	Headers http.Header
	// Body is the request body; empty means a body-less request (end of
	// stream on the headers).
	Body []byte
	// SubsetHint is the gateway's subset metadata: nil (no hint), []string
	// (a list value; an empty non-nil slice is an empty list), string (a
	// comma-separated string value) or *structpb.Value (sent as is).
	SubsetHint any
	// ChunkSize is the size of the request body chunks in full-duplex mode
	// and of the reads from the upstream response body; default
	// DefaultChunkSize.
	ChunkSize int
	// Mode is the body mode; default FullDuplex.
	Mode Mode
	// Interrupt is used by Roundtrip only.
	Interrupt Interrupt
}

// Decision is the outcome of the request phase.
type Decision struct {
	// Status is 200 when the request is to be forwarded, else the
	// ImmediateResponse status.
	Status int
	// Destination is the x-gateway-destination-endpoint header after the
	// mutations (repeated values joined with ","), "" if absent.
	Destination string
	// MetadataDestination is envoy.lb/x-gateway-destination-endpoint from the
	// dynamic metadata, "" if absent.
	MetadataDestination string
	// Prefiller is the x-prefiller-host-port header after the mutations.
	Prefiller string
	// SetHeaders are the headers the server set (last value per key).
	SetHeaders map[string]string
	// RemovedHeaders are the header names the server asked to remove.
	RemovedHeaders []string
	// Headers are the request headers after the mutations, lower-cased keys,
	// pseudo-headers included: what Envoy forwards.
	Headers http.Header
	// Body is the request body that goes upstream (in full duplex, what the
	// server sent back).
	Body []byte
	// BodyChunks are the sizes of the body chunks the server sent back.
	BodyChunks []int
	// ClearRouteCache reports whether any reply asked to clear the route
	// cache.
	ClearRouteCache bool
	// ImmediateBody is the body of the ImmediateResponse.
	ImmediateBody []byte
	// ImmediateHeaders are the headers of the ImmediateResponse.
	ImmediateHeaders map[string]string
}

// Options configures a Client.
type Options struct {
	// Fallback is the host:port Roundtrip forwards to when the server sets
	// no destination (the route's own cluster); "" makes that ErrNoDestination.
	Fallback string
}

// Client plays Envoy against one ext_proc server. It is safe for concurrent
// use.
type Client struct {
	epp      extprocv3.ExternalProcessorClient
	fallback string
	ids      atomic.Uint64
}

// NewClient returns a Client using conn, which the caller owns and closes.
func NewClient(conn grpc.ClientConnInterface, opts Options) (*Client, error) {
	if conn == nil {
		return nil, fmt.Errorf("%w: nil connection", ErrInvalidOptions)
	}
	return &Client{epp: extprocv3.NewExternalProcessorClient(conn), fallback: opts.Fallback}, nil
}

// Do runs the request phase only: it sends the request headers and body,
// reads the decision, then ends the stream like a data plane that gives up
// (half-close) and waits until the server has closed it. It returns an error
// for transport failures and protocol violations, not for rejections (see
// Decision.Status).
func (c *Client) Do(ctx context.Context, req HTTPRequest) (Decision, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.epp.Process(ctx)
	if err != nil {
		return Decision{}, fmt.Errorf("extproctest: open stream: %w", err)
	}
	d, err := c.requestPhase(st, &req)
	if err != nil {
		return d, err
	}
	return d, finishStream(st)
}

// finishStream half-closes the stream and reads until the server ends it.
func finishStream(st extprocv3.ExternalProcessor_ProcessClient) error {
	if err := st.CloseSend(); err != nil {
		return fmt.Errorf("extproctest: close send: %w", err)
	}
	for {
		m, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("extproctest: stream ended with %w", err)
		}
		return fmt.Errorf("%w: unexpected %T after the exchange ended", ErrProtocol, m.GetResponse())
	}
}

func (req *HTTPRequest) normalise() error {
	if req.Method == "" {
		req.Method = http.MethodGet
		if len(req.Body) > 0 {
			req.Method = http.MethodPost
		}
	}
	if req.Path == "" {
		req.Path = "/"
	}
	if req.Authority == "" {
		req.Authority = DefaultAuthority
	}
	if req.ChunkSize == 0 {
		req.ChunkSize = DefaultChunkSize
	}
	if req.ChunkSize < 0 {
		return fmt.Errorf("%w: negative ChunkSize", ErrInvalidOptions)
	}
	if req.Mode != FullDuplex && req.Mode != Buffered {
		return fmt.Errorf("%w: unknown mode %d", ErrInvalidOptions, req.Mode)
	}
	return nil
}

func (req *HTTPRequest) metadata() (*corev3.Metadata, error) {
	var v *structpb.Value
	switch h := req.SubsetHint.(type) {
	case nil:
		return nil, nil
	case []string:
		items := make([]*structpb.Value, len(h))
		for i, s := range h {
			items[i] = structpb.NewStringValue(s)
		}
		v = structpb.NewListValue(&structpb.ListValue{Values: items})
	case string:
		v = structpb.NewStringValue(h)
	case *structpb.Value:
		v = h
	default:
		return nil, fmt.Errorf("%w: SubsetHint of type %T", ErrInvalidOptions, h)
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		SubsetNamespace: {Fields: map[string]*structpb.Value{SubsetKey: v}},
	}}, nil
}

// requestPhase sends the request and reads the decision.
func (c *Client) requestPhase(st extprocv3.ExternalProcessor_ProcessClient, req *HTTPRequest) (Decision, error) {
	if err := req.normalise(); err != nil {
		return Decision{}, err
	}
	md, err := req.metadata()
	if err != nil {
		return Decision{}, err
	}
	headers := http.Header{
		":method":    {req.Method},
		":path":      {req.Path},
		":authority": {req.Authority},
		":scheme":    {"http"},
	}
	for k, vs := range req.Headers {
		k = strings.ToLower(k)
		headers[k] = append(headers[k], vs...)
	}
	if _, ok := headers["x-request-id"]; !ok {
		headers["x-request-id"] = []string{"extproctest-" + strconv.FormatUint(c.ids.Add(1), 10)}
	}
	if len(req.Body) > 0 {
		headers["content-length"] = []string{strconv.Itoa(len(req.Body))}
	}
	p := &phaseState{d: Decision{Headers: headers, SetHeaders: map[string]string{}}, bodyLess: len(req.Body) == 0}
	first := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: headerMap(headers), EndOfStream: p.bodyLess,
		}},
		MetadataContext: md,
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:                         req.Mode.envoy(),
			ResponseBodyMode:                        req.Mode.envoy(),
			SendBodyWithoutWaitingForHeaderResponse: req.Mode == FullDuplex,
		},
	}
	if req.Mode == Buffered {
		return c.bufferedRequest(st, req, md, first, p)
	}
	if err := st.Send(first); err != nil {
		return p.d, p.sendErr(st, err)
	}
	if !p.bodyLess {
		// Full duplex: the body streams on without waiting for any reply.
		for off := 0; off < len(req.Body); off += req.ChunkSize {
			end := min(off+req.ChunkSize, len(req.Body))
			err := st.Send(&extprocv3.ProcessingRequest{
				Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
					Body: req.Body[off:end], EndOfStream: end == len(req.Body),
				}},
				MetadataContext: md,
			})
			if errors.Is(err, io.EOF) {
				break // the server ended the stream; its reply says why
			}
			if err != nil {
				return p.d, fmt.Errorf("extproctest: send request body: %w", err)
			}
		}
	}
	for !p.done {
		m, err := st.Recv()
		if err != nil {
			return p.d, fmt.Errorf("extproctest: request phase: %w", err)
		}
		if err := p.fullDuplexReply(m); err != nil {
			return p.d, err
		}
	}
	return p.d, nil
}

// sendErr turns a failed Send into the server's reason when there is one.
func (p *phaseState) sendErr(st extprocv3.ExternalProcessor_ProcessClient, err error) error {
	if !errors.Is(err, io.EOF) {
		return fmt.Errorf("extproctest: send: %w", err)
	}
	_, rerr := st.Recv()
	return fmt.Errorf("extproctest: stream ended by the server: %w", rerr)
}

func (c *Client) bufferedRequest(st extprocv3.ExternalProcessor_ProcessClient, req *HTTPRequest,
	md *corev3.Metadata, first *extprocv3.ProcessingRequest, p *phaseState) (Decision, error) {
	if err := st.Send(first); err != nil {
		return p.d, p.sendErr(st, err)
	}
	m, err := st.Recv()
	if err != nil {
		return p.d, fmt.Errorf("extproctest: request headers reply: %w", err)
	}
	if done, err := p.bufferedReply(m, true); done || err != nil {
		return p.d, err
	}
	p.d.Body = req.Body
	if err := st.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: req.Body, EndOfStream: true,
		}},
		MetadataContext: md,
	}); err != nil {
		return p.d, p.sendErr(st, err)
	}
	if m, err = st.Recv(); err != nil {
		return p.d, fmt.Errorf("extproctest: request body reply: %w", err)
	}
	_, err = p.bufferedReply(m, false)
	return p.d, err
}

// phaseState tracks the request phase.
type phaseState struct {
	d           Decision
	bodyLess    bool
	headersDone bool
	done        bool
}

func (p *phaseState) fullDuplexReply(m *extprocv3.ProcessingResponse) error {
	p.mergeMetadata(m)
	switch r := m.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		p.immediate(r.ImmediateResponse)
		return nil
	case *extprocv3.ProcessingResponse_RequestHeaders:
		if p.headersDone {
			return fmt.Errorf("%w: second request headers reply", ErrProtocol)
		}
		p.headersDone = true
		if err := p.common(r.RequestHeaders.GetResponse()); err != nil {
			return err
		}
		if p.bodyLess {
			p.route()
		}
		return nil
	case *extprocv3.ProcessingResponse_RequestBody:
		if !p.headersDone {
			return fmt.Errorf("%w: request body reply before the headers reply", ErrProtocol)
		}
		cr := r.RequestBody.GetResponse()
		sr := cr.GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return fmt.Errorf("%w: full-duplex body reply without streamed_response", ErrProtocol)
		}
		if cr.GetHeaderMutation() != nil {
			return fmt.Errorf("%w: header mutation in a full-duplex body reply", ErrProtocol)
		}
		p.d.ClearRouteCache = p.d.ClearRouteCache || cr.GetClearRouteCache()
		p.d.Body = append(p.d.Body, sr.GetBody()...)
		p.d.BodyChunks = append(p.d.BodyChunks, len(sr.GetBody()))
		if sr.GetEndOfStream() {
			p.route()
		}
		return nil
	default:
		return fmt.Errorf("%w: %T in the request phase", ErrProtocol, r)
	}
}

// bufferedReply handles the reply to the headers (headers=true) or the body.
func (p *phaseState) bufferedReply(m *extprocv3.ProcessingResponse, headers bool) (done bool, err error) {
	p.mergeMetadata(m)
	switch r := m.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		p.immediate(r.ImmediateResponse)
		return true, nil
	case *extprocv3.ProcessingResponse_RequestHeaders:
		if !headers {
			return true, fmt.Errorf("%w: headers reply to the body", ErrProtocol)
		}
		if err := p.common(r.RequestHeaders.GetResponse()); err != nil {
			return true, err
		}
		if p.bodyLess {
			p.route()
			return true, nil
		}
		return false, nil
	case *extprocv3.ProcessingResponse_RequestBody:
		if headers {
			return true, fmt.Errorf("%w: body reply to the headers", ErrProtocol)
		}
		cr := r.RequestBody.GetResponse()
		if err := p.common(cr); err != nil {
			return true, err
		}
		switch bm := cr.GetBodyMutation().GetMutation().(type) {
		case nil:
		case *extprocv3.BodyMutation_Body:
			p.d.Body = bm.Body
		case *extprocv3.BodyMutation_ClearBody:
			if bm.ClearBody {
				p.d.Body = nil
			}
		default:
			return true, fmt.Errorf("%w: %T in buffered mode", ErrProtocol, bm)
		}
		p.route()
		return true, nil
	default:
		return true, fmt.Errorf("%w: %T in the request phase", ErrProtocol, r)
	}
}

func (p *phaseState) immediate(ir *extprocv3.ImmediateResponse) {
	p.done = true
	p.d.Status = int(ir.GetStatus().GetCode())
	if p.d.Status == 0 {
		p.d.Status = http.StatusOK
	}
	p.d.ImmediateBody = ir.GetBody()
	p.d.ImmediateHeaders = map[string]string{}
	for _, o := range ir.GetHeaders().GetSetHeaders() {
		p.d.ImmediateHeaders[strings.ToLower(o.GetHeader().GetKey())] = headerValue(o.GetHeader())
	}
}

// common applies a CommonResponse to the request.
func (p *phaseState) common(cr *extprocv3.CommonResponse) error {
	if cr.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE {
		return fmt.Errorf("%w: CONTINUE_AND_REPLACE is not used by an EPP", ErrProtocol)
	}
	p.d.ClearRouteCache = p.d.ClearRouteCache || cr.GetClearRouteCache()
	removed, set, err := applyMutation(p.d.Headers, cr.GetHeaderMutation())
	if err != nil {
		return err
	}
	p.d.RemovedHeaders = append(p.d.RemovedHeaders, removed...)
	for k, v := range set {
		p.d.SetHeaders[k] = v
	}
	return nil
}

// route ends the request phase with the request forwarded.
func (p *phaseState) route() {
	p.done = true
	p.d.Status = http.StatusOK
	p.d.Destination = strings.Join(p.d.Headers[HeaderDestination], ",")
	p.d.Prefiller = strings.Join(p.d.Headers[HeaderPrefiller], ",")
}

func (p *phaseState) mergeMetadata(m *extprocv3.ProcessingResponse) {
	ns := m.GetDynamicMetadata().GetFields()[MetadataNamespace].GetStructValue()
	if v, ok := ns.GetFields()[HeaderDestination]; ok {
		p.d.MetadataDestination = v.GetStringValue()
	}
}

func headerMap(h http.Header) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{}
	for k, vs := range h {
		for _, v := range vs {
			hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: k, RawValue: []byte(v)})
		}
	}
	return hm
}

func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}

// applyMutation applies a header mutation to h (lower-cased keys) the way
// Envoy does: removals, then sets.
func applyMutation(h http.Header, m *extprocv3.HeaderMutation) (removed []string, set map[string]string, err error) {
	if m == nil {
		return nil, nil, nil
	}
	for _, o := range m.GetSetHeaders() {
		hv := o.GetHeader()
		if hv.GetValue() != "" && len(hv.GetRawValue()) > 0 {
			return nil, nil, fmt.Errorf("%w: %q has both value and raw_value", ErrInvalidMutation, hv.GetKey())
		}
		if !validName(hv.GetKey()) || !validValue(headerValue(hv)) {
			return nil, nil, fmt.Errorf("%w: invalid header %q", ErrInvalidMutation, hv.GetKey())
		}
	}
	for _, k := range m.GetRemoveHeaders() {
		k = strings.ToLower(k)
		removed = append(removed, k)
		if immutable(k) {
			continue
		}
		delete(h, k)
	}
	set = map[string]string{}
	for _, o := range m.GetSetHeaders() {
		k, v := strings.ToLower(o.GetHeader().GetKey()), headerValue(o.GetHeader())
		if immutable(k) || strings.HasPrefix(k, "x-envoy-") {
			continue
		}
		if v == "" && !o.GetKeepEmptyValue() {
			continue
		}
		set[k] = v
		action := o.GetAppendAction()
		if o.GetAppend() != nil {
			action = corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD
			if o.GetAppend().GetValue() {
				action = corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD
			}
		}
		_, exists := h[k]
		switch action {
		case corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD:
			h[k] = append(h[k], v)
		case corev3.HeaderValueOption_ADD_IF_ABSENT:
			if !exists {
				h[k] = []string{v}
			}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD:
			h[k] = []string{v}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS:
			if exists {
				h[k] = []string{v}
			}
		}
	}
	return removed, set, nil
}

// immutable headers cannot be set or removed by ext_proc with the default
// mutation rules.
func immutable(k string) bool {
	return strings.HasPrefix(k, ":") || k == "host"
}

func validName(k string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte("\"(),/;<=>?@[\\]{}", c) >= 0 {
			if !(i == 0 && c == ':') {
				return false
			}
		}
	}
	return true
}

func validValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; c == '\r' || c == '\n' || c == 0 {
			return false
		}
	}
	return true
}
