package httproute

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/selection"
)

// MaxFieldBytes bounds every string ParseRequest and SessionID return: a longer
// body field is ErrBadRequest, a longer header value is ignored.
const MaxFieldBytes = 4096

// Session headers, read by SessionID in this order before the body's
// prompt_cache_key.
const (
	HeaderSessionID       = gaie.HeaderSessionID
	HeaderDynamoSessionID = gaie.HeaderDynamoSessionID
)

// RequestInfo is what ParseRequest reads from an OpenAI chat or completions
// body: the fields that decide where a request may go and which cache entries
// it may share. Every field is "" when the body does not set it (or sets it to
// null).
type RequestInfo struct {
	// Model is the body's "model". With vLLM, a request for a LoRA adapter names
	// the adapter here (vLLM serves each adapter as a model of its own), so
	// Model is then the adapter's name, not the base model the workers are
	// registered under: a caller with adapters maps it in Options.Prepare
	// (selection.Request.Model to the base model, LoRAName to the adapter).
	Model string
	// LoRA is SGLang's "lora_path", the adapter of the request; for a batch
	// (a list, one entry per prompt) the first entry, like the token ids the
	// tokenizer returns. The Router passes it as selection.Request.LoRAName.
	LoRA string
	// CacheSalt is vLLM's "cache_salt", which isolates one tenant's prefix
	// cache entries from another's. The Router uses it when the tokenizer does
	// not echo one (only vllm-render does).
	CacheSalt string
	// SessionID is the body's "prompt_cache_key", OpenAI's field for grouping
	// requests that share a long prefix (one conversation, one agent run).
	// "user" and "safety_identifier" are not read: they name an end user, who
	// has many conversations with unrelated prefixes, and they are identifiers
	// of a person that routing has no business keeping. The Router hands
	// Options.Prepare the effective id, SessionID(headers, info), in which the
	// session headers win, and books the request with it
	// (selection.Request.SessionID: session affinity).
	SessionID string
}

// ParseRequest reads the RequestInfo of an OpenAI request body. The body must
// be a JSON object; its keys are matched exactly (case-sensitively, the last
// one of a duplicated key wins, as the engines' JSON parsers do) and only the
// four fields above are looked at, so a field an engine does not know is no
// error here. Errors wrap ErrBadRequest: a body that is not a JSON object, a
// field of the wrong type (a string, or null; lora_path also a list of
// strings and nulls), or a string longer than MaxFieldBytes. ParseRequest
// allocates in proportion to the body, never panics (FuzzParseRequest), and is
// safe for concurrent use.
func ParseRequest(body []byte) (RequestInfo, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil || fields == nil {
		return RequestInfo{}, fmt.Errorf("%w: the body is not a JSON object", ErrBadRequest)
	}
	var info RequestInfo
	var err error
	if info.Model, err = stringField(fields, "model"); err != nil {
		return RequestInfo{}, err
	}
	if info.CacheSalt, err = stringField(fields, "cache_salt"); err != nil {
		return RequestInfo{}, err
	}
	if info.SessionID, err = stringField(fields, "prompt_cache_key"); err != nil {
		return RequestInfo{}, err
	}
	if info.LoRA, err = loraField(fields["lora_path"]); err != nil {
		return RequestInfo{}, err
	}
	return info, nil
}

// stringField reads a string or null field.
func stringField(fields map[string]json.RawMessage, key string) (string, error) {
	raw, ok := fields[key]
	if !ok || isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", fmt.Errorf("%w: %q must be a string", ErrBadRequest, key)
	}
	return bounded(key, s)
}

// loraField reads lora_path: a string, null, or a list of strings and nulls
// (its first entry counts).
func loraField(raw json.RawMessage) (string, error) {
	if raw == nil || isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return bounded("lora_path", s)
	}
	var list []*string
	if err := json.Unmarshal(raw, &list); err != nil {
		return "", fmt.Errorf("%w: \"lora_path\" must be a string or a list of strings", ErrBadRequest)
	}
	for _, p := range list {
		if p != nil && len(*p) > MaxFieldBytes {
			return bounded("lora_path", *p)
		}
	}
	if len(list) == 0 || list[0] == nil {
		return "", nil
	}
	return *list[0], nil
}

func bounded(key, s string) (string, error) {
	if len(s) > MaxFieldBytes {
		return "", fmt.Errorf("%w: %q is longer than %d bytes", ErrBadRequest, key, MaxFieldBytes)
	}
	return s, nil
}

func isNull(raw json.RawMessage) bool {
	return bytes.Equal(bytes.TrimSpace(raw), []byte("null"))
}

// policyClass returns the request's policy class (selection.Request.Class):
// Dynamo's x-dynamo-meta-policy-class header, else GAIE's
// x-gateway-inference-objective, trimmed; "" when neither is set. A name no
// configured class has is the default class's.
func policyClass(h http.Header) string {
	for _, name := range []string{gaie.HeaderPolicyClass, gaie.HeaderInferenceObjective} {
		if v := strings.TrimSpace(h.Get(name)); v != "" {
			return v
		}
	}
	return ""
}

// SessionID returns the request's session id: the x-session-id header, else
// x-dynamo-session-id (Dynamo's), else the body's prompt_cache_key
// (info.SessionID from ParseRequest); "" when none is set. Header values are
// trimmed of spaces and an empty one is skipped; a header value longer than
// selection.MaxSessionIDLen is an error wrapping ErrBadRequest (the client
// named a session the service cannot pin), while a longer prompt_cache_key
// (a cache key, not only a session) is not used as a session.
func SessionID(h http.Header, info RequestInfo) (string, error) {
	for _, name := range []string{HeaderSessionID, HeaderDynamoSessionID} {
		v := strings.TrimSpace(h.Get(name))
		if v == "" {
			continue
		}
		if len(v) > selection.MaxSessionIDLen {
			return "", fmt.Errorf("%w: header %s is %d bytes, longer than %d", ErrBadRequest, name, len(v), selection.MaxSessionIDLen)
		}
		return v, nil
	}
	if len(info.SessionID) > selection.MaxSessionIDLen {
		return "", nil
	}
	return info.SessionID, nil
}
