package extproc

import (
	"errors"
	"net/http"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"

	"github.com/kvselect/kvselect/gaie"
)

// Errors of this package. The server answers its own failures with fixed
// statuses (noted on each); Picker errors go through Options.Status.
var (
	// ErrInvalidOptions is wrapped by NewServer for every invalid option.
	ErrInvalidOptions = errors.New("extproc: invalid options")
	// ErrBodyTooLarge: the request body exceeds Options.MaxBodyBytes (413).
	ErrBodyTooLarge = errors.New("extproc: request body too large")
	// ErrTooManyInflight: Options.MaxInflight requests are already in their
	// request phase (503).
	ErrTooManyInflight = errors.New("extproc: too many requests in flight")
	// ErrEmptySubset: the subset hint is present but names no usable
	// endpoint (503, the Picker is not called).
	ErrEmptySubset = errors.New("extproc: empty subset hint")
	// ErrInvalidEndpoint: a host:port is not an IP literal with a port in
	// 1-65535; a Pick carrying one fails with 500.
	ErrInvalidEndpoint = errors.New("extproc: invalid endpoint")
	// ErrInvalidSignature: a Pick's PrefillerSignature comes without a
	// Prefiller, with one not in canonical form, or is not a short visible
	// ASCII string; the Pick fails with 500.
	ErrInvalidSignature = errors.New("extproc: invalid prefiller signature")
	// ErrInvalidDebug: a Pick's Debug is too long or not printable ASCII;
	// the header is left out, the request is served.
	ErrInvalidDebug = errors.New("extproc: invalid debug header")
	// ErrUnsupportedMode: the request body mode is neither
	// FULL_DUPLEX_STREAMED nor BUFFERED, or observability mode is on; the
	// stream fails with FAILED_PRECONDITION.
	ErrUnsupportedMode = errors.New("extproc: unsupported processing mode")
	// ErrProtocol: a message arrived out of order; the stream fails with
	// INVALID_ARGUMENT.
	ErrProtocol = errors.New("extproc: protocol violation")
)

// clientBody is the short fixed body sent with an ImmediateResponse. It never
// carries error details.
func clientBody(status int) []byte {
	switch status {
	case http.StatusBadRequest:
		return []byte("bad request\n")
	case http.StatusRequestEntityTooLarge: // the body, or the prompt's tokens
		return []byte("request too large\n")
	case http.StatusTooManyRequests, gaie.StatusSiteOverloaded:
		return []byte("overloaded, retry later\n")
	case http.StatusBadGateway:
		return []byte("upstream error\n")
	case http.StatusServiceUnavailable:
		return []byte("no endpoint available\n")
	case http.StatusGatewayTimeout:
		return []byte("upstream timeout\n")
	case http.StatusInternalServerError:
		return []byte("internal error\n")
	}
	if t := http.StatusText(status); t != "" {
		return []byte(t + "\n")
	}
	return []byte("error\n")
}

// maxReasonLen bounds Options.Reason's answer in a body.
const maxReasonLen = 64

// safeReason reports whether a refusal reason may go to the client: a
// short token of lower-case letters, digits and _:-.
func safeReason(r string) bool {
	if r == "" || len(r) > maxReasonLen {
		return false
	}
	for i := 0; i < len(r); i++ {
		c := r[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == ':' || c == '-') {
			return false
		}
	}
	return true
}

// retryAfterSeconds is the Retry-After of an overload answer (429, 529).
const retryAfterSeconds = "1"

// immediate builds the ImmediateResponse for an HTTP status; a safe reason
// (Options.Reason) is named in the body: "no endpoint available
// (unknown_model)", and in llm-d's drop-reason header. An overload (429,
// 529) says when to retry.
func immediate(status int, reason string) *extprocv3.ProcessingResponse {
	body := clientBody(status)
	var headers []*corev3.HeaderValueOption
	if safeReason(reason) {
		body = append(body[:len(body)-1], " ("+reason+")\n"...)
		headers = append(headers, setHeader(gaie.HeaderDroppedReason, reason))
	}
	if status == http.StatusTooManyRequests || status == gaie.StatusSiteOverloaded {
		headers = append(headers, setHeader("retry-after", retryAfterSeconds))
	}
	ir := &extprocv3.ImmediateResponse{
		Status:  &typev3.HttpStatus{Code: typev3.StatusCode(status)},
		Body:    body,
		Details: "kvselect_epp_rejected",
	}
	if headers != nil {
		ir.Headers = &extprocv3.HeaderMutation{SetHeaders: headers}
	}
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: ir},
	}
}

// clampStatus keeps a mapped status inside 400-599; anything else is 500.
func clampStatus(s int) int {
	if s < 400 || s > 599 {
		return http.StatusInternalServerError
	}
	return s
}
