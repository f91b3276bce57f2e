package tokenize

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/kvselect/kvselect/gaie"
)

// Errors returned by this package. Every error returned by Tokenize wraps exactly
// one of ErrBadRequest (ErrPromptTooLong being one kind of it), ErrUnavailable,
// ErrTimeout, ErrUpstream and ErrCanceled (plus the context error for ErrTimeout
// and ErrCanceled), with context: the tokenizer path, the HTTP status, a short
// excerpt of the service's answer. The client's own request body never appears
// in an error. HTTPStatus maps each to the status a front end should answer
// with.
var (
	// ErrBadRequest: the request cannot be tokenized as sent: a path other than
	// the two OpenAI ones, a body that is not a JSON object or is larger than
	// Options.MaxRequestBytes, a body without messages or prompt, or a 400, 413
	// or 422 answer from the service (400).
	ErrBadRequest = errors.New("tokenize: bad request")
	// ErrPromptTooLong: the prompt has more token ids than
	// Options.MaxPromptTokens, in the service's answer or in a completions
	// prompt sent as ids; refused before more than that many are stored (413).
	// It wraps ErrBadRequest: the request is refused as sent.
	ErrPromptTooLong = fmt.Errorf("%w: prompt too long", ErrBadRequest)
	// ErrUnavailable: the service could not be reached (connection refused or
	// reset, DNS failure) or answered 429 (503).
	ErrUnavailable = errors.New("tokenize: service unavailable")
	// ErrTimeout: the per-call timeout or the caller's deadline passed, or the
	// service answered 408 (504). It is returned together with
	// context.DeadlineExceeded when a deadline caused it.
	ErrTimeout = errors.New("tokenize: timeout")
	// ErrUpstream: the service answered with a 5xx or another unexpected status,
	// or with a body that is truncated, larger than Options.MaxResponseBytes, not
	// JSON, of the wrong shape, or holds a token id that is negative, fractional
	// or above 2^32-1 (502).
	ErrUpstream = errors.New("tokenize: upstream error")
	// ErrCanceled: the caller's context was canceled before an answer arrived;
	// returned together with context.Canceled (499, the caller is gone).
	ErrCanceled = errors.New("tokenize: canceled")
	// ErrClosed: Tokenize was called on a Cache after Close (503).
	ErrClosed = errors.New("tokenize: closed")
	// ErrInvalidOptions: New, NewCache, NewPool or NewClientPool found
	// problems in its options, or Pool.SetBaseURLs in its URLs; the message
	// lists all of them.
	ErrInvalidOptions = errors.New("tokenize: invalid options")
)

// ServiceFailed reports whether err is the tokenizer service's failure
// (ErrUnavailable, ErrTimeout, ErrUpstream, ErrClosed), which another
// endpoint might not have, as opposed to the request's fault (ErrBadRequest)
// or the caller's (ErrCanceled). A timeout of the caller's own deadline is
// ErrTimeout too: check the caller's context first. Pool fails over on these;
// a gateway routes without tokens on them (its degraded mode).
func ServiceFailed(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, ErrTimeout) || errors.Is(err, ErrUpstream) || errors.Is(err, ErrClosed)
}

// BytesPerToken is how many bytes of a request body a token is taken to be
// where the tokens are unknown (English text and JSON run about four): a
// gateway that routes without tokens books EstimateTokens of the body.
const BytesPerToken = 4

// EstimateTokens estimates the prompt tokens of a body the tokenizer could
// not tokenize: at least 1.
func EstimateTokens(body []byte) int { return max(len(body)/BytesPerToken, 1) }

// StatusClientClosedRequest is the status HTTPStatus gives ErrCanceled
// (gaie.StatusClientClosedRequest: the nginx convention for a client that
// went away before the answer).
const StatusClientClosedRequest = gaie.StatusClientClosedRequest

// HTTPStatus returns the HTTP status a front end should answer with for an error
// returned by this package: 413 ErrPromptTooLong, 400 ErrBadRequest (any other),
// 503 ErrUnavailable and ErrClosed, 504 ErrTimeout (and a bare
// context.DeadlineExceeded), 502 ErrUpstream, 499 ErrCanceled (and a bare
// context.Canceled), 500 for anything else including ErrInvalidOptions. A nil
// error is 200.
func HTTPStatus(err error) int {
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, ErrPromptTooLong):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, ErrBadRequest):
		return http.StatusBadRequest
	case errors.Is(err, ErrUnavailable), errors.Is(err, ErrClosed):
		return http.StatusServiceUnavailable
	case errors.Is(err, ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	case errors.Is(err, ErrUpstream):
		return http.StatusBadGateway
	case errors.Is(err, ErrCanceled), errors.Is(err, context.Canceled):
		return StatusClientClosedRequest
	default:
		return http.StatusInternalServerError
	}
}

// errKind is the class of an error, used by the cache's statistics.
type errKind int

const (
	kindBadRequest errKind = iota
	kindUnavailable
	kindTimeout
	kindUpstream
	kindCanceled
	kindOther
	numKinds
)

func kindOf(err error) errKind {
	switch {
	case errors.Is(err, ErrBadRequest):
		return kindBadRequest
	case errors.Is(err, ErrUnavailable), errors.Is(err, ErrClosed):
		return kindUnavailable
	case errors.Is(err, ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return kindTimeout
	case errors.Is(err, ErrUpstream):
		return kindUpstream
	case errors.Is(err, ErrCanceled), errors.Is(err, context.Canceled):
		return kindCanceled
	default:
		return kindOther
	}
}

// maxExcerpt bounds the part of a service's answer quoted in an error.
const maxExcerpt = 200

// excerpt returns at most maxExcerpt bytes of b as a string, cut on a rune
// boundary and with "..." appended when cut. Callers quote it with %q, so
// control characters cannot reach a log line raw.
func excerpt(b []byte) string {
	if len(b) <= maxExcerpt {
		return strings.ToValidUTF8(string(b), "\uFFFD")
	}
	cut := maxExcerpt
	for cut > 0 && !utf8.RuneStart(b[cut]) {
		cut--
	}
	return strings.ToValidUTF8(string(b[:cut]), "\uFFFD") + "..."
}
