package httproute

import (
	"encoding/json"
	"errors"
	"net/http"

	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// Errors of this package. Errors of the tokenizer and of the selection service
// reach HTTPStatus as they are, wrapped with context.
var (
	// ErrInvalidOptions: New found problems in its Options; the message lists
	// all of them.
	ErrInvalidOptions = errors.New("httproute: invalid options")
	// ErrBadRequest: the body is not a JSON object, or a field the Router reads
	// (model, lora_path, cache_salt, prompt_cache_key) has the wrong type or is
	// longer than MaxFieldBytes (400).
	ErrBadRequest = errors.New("httproute: bad request")
	// ErrBodyTooLarge: the body is larger than Options.MaxBodyBytes (413).
	ErrBodyTooLarge = errors.New("httproute: request body too large")
	// ErrBodyTimeout: the body did not arrive whole within
	// Options.BodyTimeout (408, and the connection is closed).
	ErrBodyTimeout = errors.New("httproute: request body timeout")
	// ErrOverloaded: Options.MaxInflight requests are already being read,
	// tokenized or booked (503, and the connection is closed).
	ErrOverloaded = errors.New("httproute: too many requests in flight")
	// ErrMethodNotAllowed: the request is not a POST (405).
	ErrMethodNotAllowed = errors.New("httproute: method not allowed")
)

// tokenizerClasses are the sentinels of the tokenize package; an error wrapping
// one of them is the tokenizer's and is mapped by tokenize.HTTPStatus.
var tokenizerClasses = []error{
	tokenize.ErrBadRequest, tokenize.ErrUnavailable, tokenize.ErrTimeout,
	tokenize.ErrUpstream, tokenize.ErrCanceled, tokenize.ErrClosed,
}

// HTTPStatus returns the status the Router answers with for an error met before
// the request reached a worker: 413 ErrBodyTooLarge, 408 ErrBodyTimeout, 503
// ErrOverloaded, 405 ErrMethodNotAllowed, 400 ErrBadRequest; then, like the
// reference EPP, the tokenizer's classes by tokenize.HTTPStatus (413
// tokenize.ErrPromptTooLong, 400, 503, 504, 502, 499) and everything else by
// selection.HTTPStatus (400, 404, 409, 429, 503, 504, 499, 500). A nil error is
// 200.
func HTTPStatus(err error) int {
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, ErrBodyTooLarge):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, ErrBodyTimeout):
		return http.StatusRequestTimeout
	case errors.Is(err, ErrOverloaded):
		return http.StatusServiceUnavailable
	case errors.Is(err, ErrMethodNotAllowed):
		return http.StatusMethodNotAllowed
	case errors.Is(err, ErrBadRequest):
		return http.StatusBadRequest
	}
	for _, c := range tokenizerClasses {
		if errors.Is(err, c) {
			return tokenize.HTTPStatus(err)
		}
	}
	return selection.HTTPStatus(err)
}

// errorBody is the OpenAI error object, {"error": {"message", "type", "code"}},
// with the HTTP status as code (vLLM's convention).
type errorBody struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	} `json:"error"`
}

// errorType names the class of a status in OpenAI's vocabulary.
func errorType(status int) string {
	switch {
	case status == http.StatusTooManyRequests, status == gaie.StatusSiteOverloaded:
		return "rate_limit_error"
	case status == tokenize.StatusClientClosedRequest:
		return "client_closed_request"
	case status == http.StatusBadGateway, status == http.StatusGatewayTimeout:
		return "upstream_error"
	case status == http.StatusServiceUnavailable:
		return "service_unavailable_error"
	case status < 500:
		return "invalid_request_error"
	}
	return "server_error"
}

// clientMessage is what the client is told. A client error (4xx) carries the
// error's text, which names what is wrong with the request and never quotes
// its body; a server error carries a fixed phrase, because its details (worker
// names, their reasons, the tokenizer's answer) describe the deployment, and
// go to the log instead.
func clientMessage(err error, status int) string {
	if status < 500 || status == gaie.StatusSiteOverloaded {
		return err.Error()
	}
	tokenizer := false
	for _, c := range tokenizerClasses {
		if errors.Is(err, c) {
			tokenizer = true
		}
	}
	switch {
	case errors.Is(err, ErrOverloaded):
		return "the gateway has too many requests in flight; retry later"
	case tokenizer && status == http.StatusGatewayTimeout:
		return "the tokenizer service timed out"
	case tokenizer:
		return "the tokenizer service failed"
	case status == http.StatusServiceUnavailable:
		if r := selection.RefusalReason(err); r != "" {
			return "no worker is available for this model (" + r + ")"
		}
		return "no worker is available for this model"
	case status == http.StatusBadGateway:
		return "the worker failed to answer"
	case status == http.StatusGatewayTimeout:
		return "the worker timed out"
	}
	return "internal error"
}

// retryAfterSeconds is the Retry-After of an overload answer (429, 529).
const retryAfterSeconds = "1"

// writeError answers with the OpenAI error object for status.
func writeError(w http.ResponseWriter, status int, msg string) {
	var e errorBody
	e.Error.Message, e.Error.Type, e.Error.Code = msg, errorType(status), status
	b, _ := json.Marshal(e) // strings and an int: it always marshals
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}
