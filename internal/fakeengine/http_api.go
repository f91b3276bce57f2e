package fakeengine

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// apiError is an error answer: its status and a message for the client.
// aborted marks a request that ended because it was canceled.
type apiError struct {
	status  int
	msg     string
	aborted bool
}

func badRequest(format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, msg: fmt.Sprintf(format, args...)}
}

// errCanceled is the answer to a request whose client went away.
func errCanceled() *apiError {
	return &apiError{status: http.StatusServiceUnavailable, msg: "the request was canceled", aborted: true}
}

// errorJSON is vLLM's ErrorResponse: {"error": {message, type, param, code}}.
type errorJSON struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    int     `json:"code"`
	} `json:"error"`
}

func writeJSONError(w http.ResponseWriter, status int, msg string) {
	var e errorJSON
	e.Error.Message, e.Error.Code = msg, status
	switch status {
	case http.StatusNotFound:
		e.Error.Type = "NotFoundError"
	case http.StatusServiceUnavailable:
		e.Error.Type = "ServiceUnavailableError"
	case http.StatusBadGateway, http.StatusGatewayTimeout, http.StatusInternalServerError:
		e.Error.Type = "InternalServerError"
	default:
		e.Error.Type = "BadRequestError"
	}
	writeJSON(w, status, e)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil { // only our own types are encoded; they always marshal
		panic(fmt.Sprintf("fakeengine: encode answer: %v", err))
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// prepared is a validated completion request: its prompts as token ids and the
// fields the answers need.
type prepared struct {
	chat             bool
	prompts          [][]uint32 // one for chat; >= 1 for completions, none empty
	maxTokens        int
	stream           bool
	includeUsage     bool
	streamOptions    json.RawMessage // echoed by render; nil is null
	cacheSalt        string
	hasSalt          bool
	priority         int
	kvTransferParams json.RawMessage
	pd               pdFields // the P/D fields, read by parseLeg (pd.go)
}

func (p *prepared) idPrefix() string {
	if p.chat {
		return "chatcmpl"
	}
	return "cmpl"
}

// commonBody holds the fields chat and completions requests share.
type commonBody struct {
	Model            *string         `json:"model"`
	Stream           *bool           `json:"stream"`
	StreamOptions    json.RawMessage `json:"stream_options"`
	MaxTokens        *int            `json:"max_tokens"`
	N                *int            `json:"n"`
	CacheSalt        *string         `json:"cache_salt"`
	Priority         *int            `json:"priority"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	// TensorRT-LLM's and SGLang's P/D fields (see pd.go).
	DisaggregatedParams json.RawMessage `json:"disaggregated_params"`
	BootstrapHost       json.RawMessage `json:"bootstrap_host"`
	BootstrapPort       json.RawMessage `json:"bootstrap_port"`
	BootstrapRoom       json.RawMessage `json:"bootstrap_room"`
}

type chatBody struct {
	commonBody
	Messages             []chatMessage `json:"messages"`
	MaxCompletionTokens  *int          `json:"max_completion_tokens"`
	AddGenerationPrompt  *bool         `json:"add_generation_prompt"`
	ContinueFinalMessage *bool         `json:"continue_final_message"`
	AddSpecialTokens     *bool         `json:"add_special_tokens"`
}

type completionBody struct {
	commonBody
	Prompt           json.RawMessage `json:"prompt"`
	AddSpecialTokens *bool           `json:"add_special_tokens"`
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// decodeBody decodes a JSON object into v; anything else is a 400.
func decodeBody(body []byte, v any) *apiError {
	t := bytes.TrimLeft(body, " \t\r\n")
	if len(t) == 0 || t[0] != '{' {
		return badRequest("the request body is not a JSON object")
	}
	if err := json.Unmarshal(body, v); err != nil {
		return badRequest("invalid request body: %v", err)
	}
	return nil
}

// checkModel answers 404 when the request names another model, as vLLM does.
func (e *Engine) checkModel(model *string) *apiError {
	if model != nil && *model != e.opts.Model {
		return &apiError{status: http.StatusNotFound, msg: fmt.Sprintf("The model `%s` does not exist.", *model)}
	}
	return nil
}

// prepare validates a chat or completions body and renders its prompts.
func (e *Engine) prepare(chat bool, body []byte) (prepared, *apiError) {
	p := prepared{chat: chat}
	var common *commonBody
	var maxTok *int
	if chat {
		var b chatBody
		if aerr := decodeBody(body, &b); aerr != nil {
			return p, aerr
		}
		common, maxTok = &b.commonBody, b.MaxTokens
		if b.MaxCompletionTokens != nil {
			maxTok = b.MaxCompletionTokens
		}
		if aerr := e.checkModel(b.Model); aerr != nil {
			return p, aerr
		}
		if len(b.Messages) == 0 {
			return p, badRequest("messages must be a non-empty list")
		}
		msgs, aerr := toMessages(b.Messages)
		if aerr != nil {
			return p, aerr
		}
		o, aerr := templateOptions(b.AddGenerationPrompt, b.ContinueFinalMessage, b.AddSpecialTokens)
		if aerr != nil {
			return p, aerr
		}
		p.prompts = [][]uint32{renderChat(nil, msgs, o)}
	} else {
		var b completionBody
		if aerr := decodeBody(body, &b); aerr != nil {
			return p, aerr
		}
		common, maxTok = &b.commonBody, b.MaxTokens
		if aerr := e.checkModel(b.Model); aerr != nil {
			return p, aerr
		}
		addSpecial := b.AddSpecialTokens == nil || *b.AddSpecialTokens
		var aerr *apiError
		if p.prompts, aerr = completionPrompts(b.Prompt, addSpecial); aerr != nil {
			return p, aerr
		}
	}

	p.stream = common.Stream != nil && *common.Stream
	if !isNull(common.StreamOptions) {
		if !p.stream {
			return p, badRequest("stream_options can only be set when stream is true")
		}
		var so struct {
			IncludeUsage *bool `json:"include_usage"`
		}
		if err := json.Unmarshal(common.StreamOptions, &so); err != nil {
			return p, badRequest("invalid stream_options: %v", err)
		}
		p.includeUsage = so.IncludeUsage != nil && *so.IncludeUsage
		p.streamOptions = common.StreamOptions
	}
	if common.N != nil && *common.N != 1 {
		return p, badRequest("n must be 1 (the fake engine generates one choice per prompt)")
	}
	if common.CacheSalt != nil {
		if *common.CacheSalt == "" {
			return p, badRequest("cache_salt must be a non-empty string when set")
		}
		p.cacheSalt, p.hasSalt = *common.CacheSalt, true
	}
	if common.Priority != nil {
		p.priority = *common.Priority
	}
	if !isNull(common.KVTransferParams) {
		p.kvTransferParams = common.KVTransferParams
	}
	p.pd = pdFields{
		disaggregated: common.DisaggregatedParams,
		host:          common.BootstrapHost,
		port:          common.BootstrapPort,
		room:          common.BootstrapRoom,
	}
	p.maxTokens = e.opts.OutputTokens
	if maxTok != nil {
		if *maxTok < 1 {
			return p, badRequest("max_tokens must be at least 1, got %d", *maxTok)
		}
		p.maxTokens = *maxTok
	}
	for _, toks := range p.prompts {
		if len(toks)+p.maxTokens > e.opts.MaxModelLen {
			return p, badRequest("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the prompt, %d in the completion).",
				e.opts.MaxModelLen, len(toks)+p.maxTokens, len(toks), p.maxTokens)
		}
	}
	return p, nil
}

// templateOptions resolves the chat template flags with vLLM's defaults and its
// one conflict.
func templateOptions(addGen, cont, addSpecial *bool) (TemplateOptions, *apiError) {
	o := TemplateOptions{
		NoGenerationPrompt:   addGen != nil && !*addGen,
		ContinueFinalMessage: cont != nil && *cont,
		AddSpecialTokens:     addSpecial != nil && *addSpecial,
	}
	if o.ContinueFinalMessage && !o.NoGenerationPrompt {
		return o, badRequest("cannot set both continue_final_message and add_generation_prompt to true")
	}
	return o, nil
}

// toMessages converts OpenAI messages: content is a string, null, or a list of
// text parts (joined by a newline); other part types are refused.
func toMessages(in []chatMessage) ([]Message, *apiError) {
	out := make([]Message, len(in))
	for i, m := range in {
		if m.Role == "" {
			return nil, badRequest("messages[%d] has no role", i)
		}
		out[i].Role = m.Role
		c := bytes.TrimLeft(m.Content, " \t\r\n")
		switch {
		case isNull(c):
		case c[0] == '"':
			if err := json.Unmarshal(c, &out[i].Content); err != nil {
				return nil, badRequest("messages[%d].content: %v", i, err)
			}
		case c[0] == '[':
			var parts []struct {
				Type string  `json:"type"`
				Text *string `json:"text"`
			}
			if err := json.Unmarshal(c, &parts); err != nil {
				return nil, badRequest("messages[%d].content: %v", i, err)
			}
			texts := make([]string, 0, len(parts))
			for j, part := range parts {
				if (part.Type != "text" && part.Type != "input_text") || part.Text == nil {
					return nil, badRequest("messages[%d].content[%d]: only text parts are supported", i, j)
				}
				texts = append(texts, *part.Text)
			}
			out[i].Content = strings.Join(texts, "\n")
		default:
			return nil, badRequest("messages[%d].content must be a string or a list of parts", i)
		}
	}
	return out, nil
}

// completionPrompts renders a completions "prompt": a string, a list of strings,
// a list of token ids or a list of lists of token ids. Token ids are used as
// they are (no special token is added, as in vLLM).
func completionPrompts(raw json.RawMessage, addSpecial bool) ([][]uint32, *apiError) {
	t := bytes.TrimLeft(raw, " \t\r\n")
	if isNull(t) {
		return nil, badRequest("prompt is required")
	}
	var out [][]uint32
	switch t[0] {
	case '"':
		var s string
		if err := json.Unmarshal(t, &s); err != nil {
			return nil, badRequest("prompt: %v", err)
		}
		out = [][]uint32{renderPrompt(nil, s, addSpecial)}
	case '[':
		var items []json.RawMessage
		if err := json.Unmarshal(t, &items); err != nil {
			return nil, badRequest("prompt: %v", err)
		}
		if len(items) == 0 {
			return nil, badRequest("prompt must not be an empty list")
		}
		first := bytes.TrimLeft(items[0], " \t\r\n")
		switch {
		case len(first) > 0 && first[0] == '"':
			var ss []string
			if err := json.Unmarshal(t, &ss); err != nil {
				return nil, badRequest("prompt: a list must hold only strings, only ids or only lists of ids: %v", err)
			}
			for _, s := range ss {
				out = append(out, renderPrompt(nil, s, addSpecial))
			}
		case len(first) > 0 && first[0] == '[':
			var lists [][]int64
			if err := json.Unmarshal(t, &lists); err != nil {
				return nil, badRequest("prompt: a list must hold only strings, only ids or only lists of ids: %v", err)
			}
			for _, l := range lists {
				toks, aerr := tokenIDs(l)
				if aerr != nil {
					return nil, aerr
				}
				out = append(out, toks)
			}
		default:
			var ids []int64
			if err := json.Unmarshal(t, &ids); err != nil {
				return nil, badRequest("prompt: a list must hold only strings, only ids or only lists of ids: %v", err)
			}
			toks, aerr := tokenIDs(ids)
			if aerr != nil {
				return nil, aerr
			}
			out = [][]uint32{toks}
		}
	default:
		return nil, badRequest("prompt must be a string or a list")
	}
	for i, toks := range out {
		if len(toks) == 0 {
			return nil, badRequest("prompt %d is empty", i)
		}
	}
	return out, nil
}

// tokenIDs checks ids against the vocabulary.
func tokenIDs(ids []int64) ([]uint32, *apiError) {
	out := make([]uint32, len(ids))
	for i, id := range ids {
		if id < 0 || id >= int64(VocabSize) {
			return nil, badRequest("token id %d is out of vocabulary [0, %d)", id, VocabSize)
		}
		out[i] = uint32(id)
	}
	return out, nil
}

func isNull(raw []byte) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || string(t) == "null"
}

// tokenizeBody answers vLLM's /tokenize, in its prompt or its messages form.
func (e *Engine) tokenizeBody(body []byte) (tokenizeJSON, *apiError) {
	var b struct {
		Model                *string         `json:"model"`
		Prompt               json.RawMessage `json:"prompt"`
		Messages             []chatMessage   `json:"messages"`
		AddSpecialTokens     *bool           `json:"add_special_tokens"`
		AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
		ContinueFinalMessage *bool           `json:"continue_final_message"`
		ReturnTokenStrs      bool            `json:"return_token_strs"`
	}
	if aerr := decodeBody(body, &b); aerr != nil {
		return tokenizeJSON{}, aerr
	}
	if aerr := e.checkModel(b.Model); aerr != nil {
		return tokenizeJSON{}, aerr
	}
	hasPrompt, hasMessages := !isNull(b.Prompt), b.Messages != nil
	var strs *[]string
	if b.ReturnTokenStrs {
		strs = new([]string)
	}
	var toks []uint32
	switch {
	case hasPrompt == hasMessages:
		return tokenizeJSON{}, badRequest("exactly one of prompt and messages is required")
	case hasPrompt:
		var s string
		if err := json.Unmarshal(b.Prompt, &s); err != nil {
			return tokenizeJSON{}, badRequest("prompt must be a string")
		}
		toks = renderPrompt(strs, s, b.AddSpecialTokens == nil || *b.AddSpecialTokens)
	default:
		msgs, aerr := toMessages(b.Messages)
		if aerr != nil {
			return tokenizeJSON{}, aerr
		}
		o, aerr := templateOptions(b.AddGenerationPrompt, b.ContinueFinalMessage, b.AddSpecialTokens)
		if aerr != nil {
			return tokenizeJSON{}, aerr
		}
		toks = renderChat(strs, msgs, o)
	}
	ans := tokenizeJSON{Count: len(toks), MaxModelLen: e.opts.MaxModelLen, Tokens: toks}
	if strs != nil {
		ans.TokenStrs = *strs
	}
	return ans, nil
}

// tokenizeJSON is vLLM's /tokenize answer.
type tokenizeJSON struct {
	Count       int      `json:"count"`
	MaxModelLen int      `json:"max_model_len"`
	Tokens      []uint32 `json:"tokens"`
	TokenStrs   []string `json:"token_strs"`
}

// generateRequestJSON is vLLM's GenerateRequest, the render endpoints' answer.
type generateRequestJSON struct {
	RequestID        string          `json:"request_id"`
	TokenIDs         []uint32        `json:"token_ids"`
	Features         json.RawMessage `json:"features"`
	SamplingParams   samplingJSON    `json:"sampling_params"`
	Model            string          `json:"model"`
	Stream           bool            `json:"stream"`
	StreamOptions    json.RawMessage `json:"stream_options"`
	CacheSalt        *string         `json:"cache_salt"`
	Priority         int             `json:"priority"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

type samplingJSON struct {
	N         int `json:"n"`
	MaxTokens int `json:"max_tokens"`
}

type modelsJSON struct {
	Object string      `json:"object"`
	Data   []modelJSON `json:"data"`
}

type modelJSON struct {
	ID          string `json:"id"`
	Object      string `json:"object"`
	OwnedBy     string `json:"owned_by"`
	MaxModelLen int    `json:"max_model_len"`
}

// usageJSON is the OpenAI usage block, with vLLM's cached-token detail and the
// simulated TTFT.
type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	TotalTokens         int `json:"total_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
	SimulatedTTFTMs float64 `json:"simulated_ttft_ms"`
}

// answer builds the completion answers of a served request.
type answer struct {
	prepared
	id      string
	created int64
	model   string
	usage   usageJSON
	pace    pacer     // when the first and each later token may be written
	leg     legResult // the P/D fields of a whole answer
}

type chatMessageJSON struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type deltaJSON struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type choiceJSON struct {
	Index        int              `json:"index"`
	Message      *chatMessageJSON `json:"message,omitempty"` // chat, whole answer
	Delta        *deltaJSON       `json:"delta,omitempty"`   // chat, stream chunk
	Text         *string          `json:"text,omitempty"`    // completions
	Logprobs     *struct{}        `json:"logprobs"`
	FinishReason *string          `json:"finish_reason"`
	// TensorRT-LLM's context_only answer (P/D).
	DisaggregatedParams json.RawMessage `json:"disaggregated_params,omitempty"`
}

type completionJSON struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []choiceJSON `json:"choices"`
	Usage   *usageJSON   `json:"usage,omitempty"`
	// vLLM's prefill answer, and TensorRT-LLM's prompt ids (P/D).
	KVTransferParams json.RawMessage `json:"kv_transfer_params,omitempty"`
	PromptTokenIDs   []uint32        `json:"prompt_token_ids,omitempty"`
}

var finishLength = "length"

// generatedText is the whole dummy output of n tokens.
func generatedText(n int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString(outputPiece(i))
	}
	return b.String()
}

// whole is the non-streaming answer.
func (a *answer) whole() completionJSON {
	c := a.frame(a.objectName(false))
	text := generatedText(a.maxTokens)
	for i := range a.prompts {
		ch := choiceJSON{Index: i, FinishReason: &finishLength}
		if a.chat {
			ch.Message = &chatMessageJSON{Role: "assistant", Content: text}
		} else {
			ch.Text = &text
		}
		ch.DisaggregatedParams = a.leg.disaggregatedParams
		c.Choices = append(c.Choices, ch)
	}
	u := a.usage
	c.Usage = &u
	c.KVTransferParams, c.PromptTokenIDs = a.leg.kvTransferParams, a.leg.promptTokenIDs
	return c
}

func (a *answer) frame(object string) completionJSON {
	return completionJSON{ID: a.id, Object: object, Created: a.created, Model: a.model}
}

func (a *answer) objectName(chunk bool) string {
	switch {
	case !a.chat:
		return "text_completion"
	case chunk:
		return "chat.completion.chunk"
	default:
		return "chat.completion"
	}
}

// stream writes the SSE answer: for chat a first chunk with the assistant role,
// then one chunk per generated token (the last one carries finish_reason), per
// prompt; then, with stream_options.include_usage, a chunk with no choices and
// the usage; then "data: [DONE]". Each event is flushed, and token chunks are
// paced by a.pace. It stops early, returning false, when ctx ends or a write
// fails.
func (a *answer) stream(ctx context.Context, w http.ResponseWriter, rc *http.ResponseController) bool {
	obj := a.objectName(true)
	send := func(c completionJSON) bool {
		if ctx.Err() != nil {
			return false
		}
		b, err := json.Marshal(c)
		if err != nil {
			panic(fmt.Sprintf("fakeengine: encode chunk: %v", err))
		}
		if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	for i := range a.prompts {
		if a.chat {
			c := a.frame(obj)
			empty := ""
			c.Choices = []choiceJSON{{Index: i, Delta: &deltaJSON{Role: "assistant", Content: &empty}}}
			if !send(c) {
				return false
			}
		}
		for t := range a.maxTokens {
			if t > 0 && !a.pace.token(ctx, t+1) {
				return false
			}
			piece := outputPiece(t)
			ch := choiceJSON{Index: i}
			if a.chat {
				ch.Delta = &deltaJSON{Content: &piece}
			} else {
				ch.Text = &piece
			}
			if t == a.maxTokens-1 {
				ch.FinishReason = &finishLength
			}
			c := a.frame(obj)
			c.Choices = []choiceJSON{ch}
			if !send(c) {
				return false
			}
		}
	}
	if a.includeUsage {
		c := a.frame(obj)
		c.Choices = []choiceJSON{}
		u := a.usage
		c.Usage = &u
		if !send(c) {
			return false
		}
	}
	if ctx.Err() != nil {
		return false
	}
	if _, err := io.WriteString(w, "data: [DONE]\n\n"); err != nil {
		return false
	}
	return rc.Flush() == nil
}
