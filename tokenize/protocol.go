package tokenize

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Tokenizer turns an OpenAI request into the token ids the engine will compute
// for it. Implementations must be safe for concurrent use.
type Tokenizer interface {
	Tokenize(ctx context.Context, req Request) (Result, error)
}

// The OpenAI paths a Request may carry.
const (
	PathChatCompletions = "/v1/chat/completions"
	PathCompletions     = "/v1/completions"
)

// Protocol names accepted by Options.Protocol.
const (
	// ProtocolVLLMRender posts the body unchanged to the vLLM render endpoint
	// for its path (/v1/chat/completions/render, /v1/completions/render). It is
	// the exact choice: the service runs the same preprocessing as generation.
	ProtocolVLLMRender = "vllm-render"
	// ProtocolVLLMTokenize posts to vLLM's /tokenize, with the chat fields that
	// drive the template (chat) or the prompt (completions).
	ProtocolVLLMTokenize = "vllm-tokenize"
	// ProtocolSGLang posts to SGLang's /tokenize.
	ProtocolSGLang = "sglang"
	// ProtocolSGLangRenderer posts the body unchanged to the render endpoint
	// of SGLang's renderer (the sglang-renderer binary, CPU only) for its
	// path, as ProtocolVLLMRender does; the answer is SGLang's
	// GenerateRequest, whose ids are input_ids.
	ProtocolSGLangRenderer = "sglang-renderer"
)

// Protocols lists the protocol names Options.Protocol accepts, for a
// program's flag check and help.
func Protocols() []string {
	return []string{ProtocolVLLMRender, ProtocolVLLMTokenize, ProtocolSGLang, ProtocolSGLangRenderer}
}

// rendersBody reports whether protocol posts the client's body unchanged to
// a render endpoint (the service runs generation's own preprocessing).
func rendersBody(protocol string) bool {
	return protocol == ProtocolVLLMRender || protocol == ProtocolSGLangRenderer
}

// Request is the client's OpenAI request as the gateway received it. The zero
// value is invalid (no path).
type Request struct {
	// Path is PathChatCompletions or PathCompletions, with or without a query
	// string; anything else is ErrBadRequest.
	Path string
	// Body is the original JSON body, never modified by this package. Callers
	// must not modify it while Tokenize runs.
	Body []byte
	// Model, when not empty, is the model name sent to the tokenize endpoints
	// (vllm-tokenize, sglang) instead of the body's "model". The render
	// protocols (vllm-render, sglang-renderer) forward the body unchanged and
	// ignore it. The cache key includes it.
	Model string
}

// Result is what the backend computed for a Request. A Result returned by
// Tokenize belongs to the caller, who may modify it (the cache copies it).
type Result struct {
	// Tokens are the prompt's token ids, chat template and special tokens
	// included. For a completions request with several prompts, they are the
	// first prompt's; PromptCount tells how many there were.
	Tokens []uint32
	// PromptCount is the number of prompts the service tokenized (1 for chat).
	PromptCount int
	// Features is vllm-render's "features" object verbatim (multimodal hashes
	// and placeholder offsets: {"mm_hashes": ..., "mm_placeholders": ...}), or
	// nil when the service sent none or null.
	Features json.RawMessage
	// CacheSalt is the cache_salt a render protocol echoed, "" when none.
	CacheSalt string
	// MaxTokens is the output budget a render protocol resolved:
	// sampling_params.max_tokens (vllm-render) or
	// sampling_params.max_new_tokens (sglang-renderer), 0 when absent.
	MaxTokens int64
	// MaxModelLen is the engine context length the tokenize endpoints report,
	// 0 when absent.
	MaxModelLen int64
}

// clone returns a deep copy of r (Tokens and Features are fresh slices).
func (r *Result) clone() Result {
	out := *r
	if r.Tokens != nil {
		out.Tokens = make([]uint32, len(r.Tokens))
		copy(out.Tokens, r.Tokens)
	}
	if r.Features != nil {
		out.Features = bytes.Clone(r.Features)
	}
	return out
}

// isChat reports whether path is the chat path; it fails for an unknown path.
// A query string (Azure-style ?api-version=...) does not change the route.
func isChat(path string) (bool, error) {
	p, _, _ := strings.Cut(path, "?")
	switch p {
	case PathChatCompletions:
		return true, nil
	case PathCompletions:
		return false, nil
	default:
		return false, fmt.Errorf("%w: unsupported path %q (want %s or %s)", ErrBadRequest, excerpt([]byte(path)), PathChatCompletions, PathCompletions)
	}
}

// outbound is the request to send to the service, or, when direct is set, a
// result computed without calling it (a completions prompt that already is
// token ids).
type outbound struct {
	path   string // appended to the base URL
	body   []byte
	direct *Result
}

// Fields copied from a chat body into a vLLM /tokenize request because vLLM's
// chat template rendering reads them. Copied verbatim when present.
var vllmChatFields = []string{
	"messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
	"chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs",
}

// Fields copied from a chat body into an SGLang /tokenize request.
var sglangChatFields = []string{
	"messages", "tools", "tool_choice", "reasoning_effort", "continue_final_message",
	"chat_template_kwargs", "add_special_tokens",
}

// buildRequest prepares the service call for req under protocol. chat tells which
// OpenAI path req has; maxTokens bounds a prompt given as token ids. It is a
// pure function.
func buildRequest(protocol string, chat bool, req Request, maxTokens int) (outbound, error) {
	if !isJSONObject(req.Body) {
		return outbound{}, fmt.Errorf("%w: body is not a JSON object", ErrBadRequest)
	}
	if rendersBody(protocol) {
		// The render endpoints take the OpenAI body as is and run the engine's
		// own preprocessing on it, so nothing is rewritten.
		path := PathCompletions
		if chat {
			path = PathChatCompletions
		}
		return outbound{path: path + "/render", body: req.Body}, nil
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(req.Body, &fields); err != nil {
		return outbound{}, fmt.Errorf("%w: body: %v", ErrBadRequest, err)
	}
	out := make(map[string]json.RawMessage, 10)
	switch {
	case req.Model != "":
		m, _ := json.Marshal(req.Model)
		out["model"] = m
	case fields["model"] != nil:
		out["model"] = fields["model"]
	}
	if chat {
		if isAbsent(fields["messages"]) {
			return outbound{}, fmt.Errorf("%w: chat body has no messages", ErrBadRequest)
		}
		copyFields := sglangChatFields
		if protocol == ProtocolVLLMTokenize {
			copyFields = vllmChatFields
			// add_special_tokens: vLLM's chat endpoint defaults it to false,
			// because the chat template itself writes the BOS and role markers;
			// adding the tokenizer's specials again would put a second BOS in
			// front. add_generation_prompt defaults to true there (the template
			// ends with the assistant header). /tokenize in its chat form has the
			// same defaults; we still send them explicitly, and a value the
			// client set wins, because the engine will honour the client's value
			// when it serves the request.
			out["add_special_tokens"] = json.RawMessage("false")
			out["add_generation_prompt"] = json.RawMessage("true")
		}
		for _, k := range copyFields {
			if v, ok := fields[k]; ok && !isAbsent(v) {
				out[k] = v
			}
		}
	} else {
		prompt := fields["prompt"]
		if isAbsent(prompt) {
			return outbound{}, fmt.Errorf("%w: completions body has no prompt", ErrBadRequest)
		}
		text, direct, err := firstPrompt(prompt, maxTokens)
		if err != nil {
			return outbound{}, err
		}
		if direct != nil {
			return outbound{direct: direct}, nil
		}
		out["prompt"] = text
		// add_special_tokens: for a plain prompt nothing else adds the BOS, so
		// vLLM's completions endpoint (and SGLang's /tokenize) default it to
		// true; /tokenize in its prompt form defaults to true as well. Sent
		// explicitly, and the client's own value wins as for chat.
		out["add_special_tokens"] = json.RawMessage("true")
		if v, ok := fields["add_special_tokens"]; ok && !isAbsent(v) {
			out["add_special_tokens"] = v
		}
	}
	body, err := json.Marshal(out)
	if err != nil {
		return outbound{}, fmt.Errorf("%w: body: %v", ErrBadRequest, err)
	}
	return outbound{path: "/tokenize", body: body}, nil
}

// firstPrompt interprets a completions "prompt": a string is sent as is; a list
// of strings sends its first one; a list of token ids (or of lists of token ids)
// needs no service at all and is returned as a direct result, at most
// maxTokens of them (ErrPromptTooLong).
func firstPrompt(prompt json.RawMessage, maxTokens int) (json.RawMessage, *Result, error) {
	p := bytes.TrimLeft(prompt, " \t\r\n")
	switch {
	case len(p) > 0 && p[0] == '"':
		return prompt, nil, nil
	case len(p) > 0 && p[0] == '[':
	default:
		return nil, nil, fmt.Errorf("%w: prompt is neither a string nor a list", ErrBadRequest)
	}
	var items []json.RawMessage
	if err := json.Unmarshal(p, &items); err != nil {
		return nil, nil, fmt.Errorf("%w: prompt: %v", ErrBadRequest, err)
	}
	if len(items) == 0 {
		return nil, nil, fmt.Errorf("%w: prompt is an empty list", ErrBadRequest)
	}
	first := bytes.TrimLeft(items[0], " \t\r\n")
	switch {
	case len(first) > 0 && first[0] == '"':
		return items[0], nil, nil
	case len(first) > 0 && first[0] == '[':
		toks, err := parseTokenIDs(items[0], maxTokens)
		if err != nil {
			return nil, nil, promptIDsError(err, maxTokens)
		}
		return nil, &Result{Tokens: toks, PromptCount: len(items)}, nil
	default:
		toks, err := parseTokenIDs(p, maxTokens)
		if err != nil {
			return nil, nil, promptIDsError(err, maxTokens)
		}
		return nil, &Result{Tokens: toks, PromptCount: 1}, nil
	}
}

// promptIDsError classifies a parseTokenIDs error on the client's own prompt
// ids: too many is ErrPromptTooLong, anything else ErrBadRequest.
func promptIDsError(err error, maxTokens int) error {
	if errors.Is(err, errTooMany) {
		return fmt.Errorf("%w: the prompt's token ids are more than %d (MaxPromptTokens)", ErrPromptTooLong, maxTokens)
	}
	return fmt.Errorf("%w: prompt token ids: %v", ErrBadRequest, err)
}

// isJSONObject reports whether b is one valid JSON object.
func isJSONObject(b []byte) bool {
	t := bytes.TrimLeft(b, " \t\r\n")
	return len(t) > 0 && t[0] == '{' && json.Valid(b)
}

// firstByte returns the first non-space byte of b, or 0.
func firstByte(b []byte) byte {
	if i := skipSpace(b, 0); i < len(b) {
		return b[i]
	}
	return 0
}

// isAbsent reports whether a raw field is missing or null.
func isAbsent(v json.RawMessage) bool {
	return v == nil || string(bytes.TrimSpace(v)) == "null"
}

// renderAnswer is one GenerateRequest as a render endpoint returns it:
// vLLM's (the ids in token_ids) or SGLang's (the ids in input_ids). Only the
// protocol's ids field is required; the extras are read leniently (a wrong
// type is ignored, not an error) because routing does not depend on them.
type renderAnswer struct {
	TokenIDs       json.RawMessage `json:"token_ids"`
	InputIDs       json.RawMessage `json:"input_ids"`
	Features       json.RawMessage `json:"features"`
	CacheSalt      json.RawMessage `json:"cache_salt"`
	SamplingParams json.RawMessage `json:"sampling_params"`
}

// renderShape names the fields a render protocol's answer carries.
type renderShape struct {
	ids       string                              // the ids field, for errors
	pick      func(*renderAnswer) json.RawMessage // the ids field's value
	maxTokens string                              // the output budget in sampling_params
	features  bool                                // vLLM's multimodal features are kept
}

var (
	vllmRenderShape = renderShape{ids: "token_ids", maxTokens: "max_tokens", features: true,
		pick: func(a *renderAnswer) json.RawMessage { return a.TokenIDs }}
	sglangRenderShape = renderShape{ids: "input_ids", maxTokens: "max_new_tokens",
		pick: func(a *renderAnswer) json.RawMessage { return a.InputIDs }}
)

// tokenizeAnswer is the /tokenize answer of vLLM and SGLang.
type tokenizeAnswer struct {
	Tokens      json.RawMessage `json:"tokens"`
	MaxModelLen json.RawMessage `json:"max_model_len"`
}

// parseResponse decodes a successful answer of the service. It is a pure
// function and never panics. A prompt of more than maxTokens ids is
// ErrPromptTooLong, refused before more than maxTokens ids are stored; every
// other failure wraps ErrUpstream.
func parseResponse(protocol string, data []byte, maxTokens int) (Result, error) {
	var (
		res Result
		err error
	)
	switch protocol {
	case ProtocolVLLMRender:
		res, err = parseRender(data, maxTokens, vllmRenderShape)
	case ProtocolSGLangRenderer:
		res, err = parseRender(data, maxTokens, sglangRenderShape)
	case ProtocolVLLMTokenize, ProtocolSGLang:
		res, err = parseTokenize(data, maxTokens)
	default:
		err = fmt.Errorf("unknown protocol %q", protocol)
	}
	if err == nil && len(res.Tokens) == 0 {
		err = errors.New("no tokens for the prompt") // the service's fault: a prompt has tokens
	}
	if errors.Is(err, errTooMany) {
		return Result{}, fmt.Errorf("%w: the %s answer holds a prompt of more than %d tokens (MaxPromptTokens)", ErrPromptTooLong, protocol, maxTokens)
	}
	if err != nil {
		return Result{}, fmt.Errorf("%w: %s answer: %v", ErrUpstream, protocol, err)
	}
	return res, nil
}

// parseRender accepts both shapes whatever the path: one GenerateRequest object
// (the chat endpoint) or a non-empty array of them (the completions endpoint,
// one per prompt), so a server that changes one shape still parses. shape
// names the protocol's fields.
func parseRender(data []byte, maxTokens int, shape renderShape) (Result, error) {
	t := bytes.TrimLeft(data, " \t\r\n")
	var ans renderAnswer
	count := 1
	switch {
	case len(t) > 0 && t[0] == '{':
		if err := json.Unmarshal(t, &ans); err != nil {
			return Result{}, err
		}
	case len(t) > 0 && t[0] == '[':
		var list []renderAnswer
		if err := json.Unmarshal(t, &list); err != nil {
			return Result{}, err
		}
		if len(list) == 0 {
			return Result{}, fmt.Errorf("empty list")
		}
		// Every prompt's ids are validated; the first prompt's are returned.
		for i := 1; i < len(list); i++ {
			if _, err := parseTokenIDs(shape.pick(&list[i]), maxTokens); err != nil {
				return Result{}, fmt.Errorf("prompt %d: %s: %w", i, shape.ids, err)
			}
		}
		ans, count = list[0], len(list)
	default:
		return Result{}, fmt.Errorf("not a JSON object or array")
	}
	ids := shape.pick(&ans)
	if isAbsent(ids) {
		return Result{}, fmt.Errorf("no %s", shape.ids)
	}
	toks, err := parseTokenIDs(ids, maxTokens)
	if err != nil {
		return Result{}, fmt.Errorf("%s: %w", shape.ids, err)
	}
	res := Result{Tokens: toks, PromptCount: count}
	if shape.features && firstByte(ans.Features) == '{' {
		res.Features = bytes.Clone(ans.Features)
	}
	var salt string
	if json.Unmarshal(ans.CacheSalt, &salt) == nil {
		res.CacheSalt = salt
	}
	if !isAbsent(ans.SamplingParams) {
		var sp map[string]json.RawMessage
		if json.Unmarshal(ans.SamplingParams, &sp) == nil {
			res.MaxTokens = lenientInt(sp[shape.maxTokens])
		}
	}
	return res, nil
}

// parseTokenize reads {"tokens": [int] | [[int]], "count": ..., "max_model_len": int}.
// The nested form (SGLang with a list of prompts) yields the first list; every
// list is validated.
func parseTokenize(data []byte, maxTokens int) (Result, error) {
	var ans tokenizeAnswer
	if err := json.Unmarshal(data, &ans); err != nil {
		return Result{}, err
	}
	if isAbsent(ans.Tokens) {
		return Result{}, fmt.Errorf("no tokens")
	}
	res := Result{PromptCount: 1, MaxModelLen: lenientInt(ans.MaxModelLen)}
	raw := ans.Tokens
	inner := bytes.TrimLeft(raw, " \t\r\n")
	if len(inner) > 0 && inner[0] == '[' && firstByte(inner[1:]) == '[' {
		var lists []json.RawMessage
		if err := json.Unmarshal(raw, &lists); err != nil {
			return Result{}, err
		}
		for i := 1; i < len(lists); i++ {
			if _, err := parseTokenIDs(lists[i], maxTokens); err != nil {
				return Result{}, fmt.Errorf("prompt %d: tokens: %w", i, err)
			}
		}
		raw, res.PromptCount = lists[0], len(lists)
	}
	toks, err := parseTokenIDs(raw, maxTokens)
	if err != nil {
		return Result{}, fmt.Errorf("tokens: %w", err)
	}
	res.Tokens = toks
	return res, nil
}

// lenientInt decodes a non-negative integer field, 0 when absent or malformed.
func lenientInt(raw json.RawMessage) int64 {
	var v int64
	if isAbsent(raw) || json.Unmarshal(raw, &v) != nil || v < 0 {
		return 0
	}
	return v
}

// validProtocol reports whether name is one of Protocols().
func validProtocol(name string) bool {
	for _, p := range Protocols() {
		if p == name {
			return true
		}
	}
	return false
}

func protocolList() string { return strings.Join(Protocols(), ", ") }
