package extproc

import (
	"context"
	"time"
)

// Picker chooses the destination for one request. It is implemented by the
// EPP's router and must be safe for concurrent use: the server calls it from
// one goroutine per request, with a context that is cancelled when the
// request's ext_proc stream ends.
type Picker interface {
	Pick(ctx context.Context, req PickRequest) (Pick, error)
}

// PickerFunc adapts a function to a Picker.
type PickerFunc func(ctx context.Context, req PickRequest) (Pick, error)

// Pick calls f.
func (f PickerFunc) Pick(ctx context.Context, req PickRequest) (Pick, error) { return f(ctx, req) }

// PickRequest is what the server knows about a request when it asks for a
// destination. The Picker must not retain or modify Body or Headers after
// Pick returns.
type PickRequest struct {
	// Path is the :path pseudo-header, e.g. /v1/chat/completions.
	Path string
	// Method is the :method pseudo-header.
	Method string
	// Headers holds the lower-cased request headers after the control headers
	// (ControlHeaders) were removed; pseudo-headers are not included and
	// repeated headers are joined with ",".
	Headers map[string]string
	// Body is the whole request body; nil for a request without a body.
	Body []byte
	// Subset lists the endpoints the gateway allows, from the subset hint:
	// canonical "ip:port" entries, or a bare IP meaning any port of that
	// address. Nil means no hint (the whole pool is allowed); the Picker is
	// never called with an empty, non-nil subset.
	Subset []string
}

// Pick is the Picker's decision.
type Pick struct {
	// Destination is the host:port of the worker that serves the request
	// (the decode worker in disaggregated mode). It must be an IP literal and
	// a port in 1-65535, else the request fails with 500.
	Destination string
	// Prefiller is the host:port of the prefill worker in disaggregated mode,
	// sent as x-prefiller-host-port; "" in aggregated mode.
	Prefiller string
	// PrefillerSignature, when set, is sent as x-kvselect-prefiller-signature
	// next to Prefiller: the Picker's signature of that exact value (package
	// pdhint), which the decode sidecar checks. It requires a Prefiller that is
	// already canonical (CanonicalEndpoint), since the signature covers the
	// value as sent, and must be at most MaxSignatureLen visible ASCII
	// characters; the request fails with 500 otherwise. "" sends no header.
	PrefillerSignature string
	// Fallbacks are endpoints the gateway may try, in order, when it cannot
	// reach Destination (the GAIE protocol's comma-separated list), each an
	// IP literal and a port like Destination. The destination header and
	// metadata then carry "Destination,fallback,...", at most MaxFallbacks
	// of them; an invalid one, a repeat or Destination itself is left out
	// (and logged). Nil: Destination alone.
	Fallbacks []string
	// Debug, when set, is sent back to the client as the HeaderDebug
	// response header (an explanation of the decision). It must be at most
	// MaxDebugLen bytes of printable ASCII, else it is left out (and
	// logged). "" sends no header.
	Debug string
	// Settle settles the booking behind the pick. Nil is treated as a no-op.
	// It may also implement Follower to see the response.
	Settle Settler
}

// MaxFallbacks bounds Pick.Fallbacks.
const MaxFallbacks = 16

// MaxDebugLen bounds Pick.Debug.
const MaxDebugLen = 2048

// Settler settles the booking behind a Pick. Both methods must be idempotent
// and safe to call concurrently; the server calls FirstByte at most once and
// Done exactly once per successful Pick, from the request's goroutine.
type Settler interface {
	// FirstByte reports the first non-empty response body chunk (prefill
	// complete, or the hand-off of a prefill/decode plan). It is called after
	// that chunk has been passed on, so it never delays it.
	FirstByte()
	// Done reports the end of the exchange: response end of stream, client
	// cancel, stream error or EOF, or a failure after the pick.
	Done()
}

// Follower is implemented by a Settler that follows the response of its
// request: where it was served, its status, its body. The server calls its
// methods from the request's goroutine, in the order below, after the
// message concerned has been answered, so they never delay the response;
// they must not block long (a chunk waits for the previous call).
type Follower interface {
	// Served reports, at most once and before ResponseHeaders, the endpoint
	// that served the request as the gateway reports it (the GAIE protocol's
	// x-gateway-destination-endpoint-served response metadata), canonical
	// when it parses, as reported otherwise, when it is not the pick's
	// Destination: a fallback of the list, or a retry elsewhere.
	Served(endpoint string)
	// ResponseHeaders reports what the response's headers say, once.
	ResponseHeaders(r Response)
	// ResponseBody reports each non-empty response body chunk. The chunk is
	// only valid during the call.
	ResponseBody(chunk []byte)
}

// Response is what the server reads of a response's headers for a
// Follower.
type Response struct {
	// Status is the :status, 0 when it is missing or not a number.
	Status int
	// ContentType is the content-type header.
	ContentType string
	// PrefillFailed is set when the decode worker's sidecar reported that
	// the request's prefill leg failed (gaie.HeaderFailedLeg), so that the
	// prefill worker is to blame, not the destination. The server removes
	// the header from the client's response.
	PrefillFailed bool
}

// NopSettler is a Settler that does nothing, for picks that booked nothing.
// It is safe for concurrent use.
type NopSettler struct{}

// FirstByte does nothing.
func (NopSettler) FirstByte() {}

// Done does nothing.
func (NopSettler) Done() {}

// Recorder receives the server's measurements; the EPP binary backs it with
// Prometheus. Implementations must be safe for concurrent use and cheap: they
// are called on the request path.
type Recorder interface {
	// Outcome reports how the request phase ended: 200 when the request was
	// routed, the ImmediateResponse status otherwise, or 0 when the stream
	// ended (client gone, protocol error) before a decision was made.
	Outcome(status int)
	// PickLatency reports how long Picker.Pick took, whatever its result.
	PickLatency(d time.Duration)
	// ServedMismatch reports a response whose served endpoint (reported by
	// the gateway) differs from the destination that was picked.
	ServedMismatch()
	// Inflight reports the number of requests currently in their request
	// phase (headers received, no decision sent yet), after each change.
	Inflight(n int)
}

// NopRecorder is a Recorder that records nothing. It is safe for concurrent
// use.
type NopRecorder struct{}

// Outcome does nothing.
func (NopRecorder) Outcome(int) {}

// PickLatency does nothing.
func (NopRecorder) PickLatency(time.Duration) {}

// ServedMismatch does nothing.
func (NopRecorder) ServedMismatch() {}

// Inflight does nothing.
func (NopRecorder) Inflight(int) {}

var (
	_ Settler  = NopSettler{}
	_ Recorder = NopRecorder{}
)
