package fakeengine

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/tokenize"
)

// httpRig is a started engine with HTTP and a client that is closed at test end.
type httpRig struct {
	e    *Engine
	c    *http.Client
	base string
}

func startHTTP(t *testing.T, o Options) *httpRig {
	t.Helper()
	o.EnableHTTP = true
	e := startEngine(t, o)
	tr := &http.Transport{Proxy: nil, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &httpRig{e: e, c: &http.Client{Transport: tr, Timeout: testTimeout}, base: "http://" + e.HTTPEndpoint()}
}

// post sends body as JSON and returns the answer with its whole body.
func (r *httpRig) post(t *testing.T, path, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := r.c.Post(r.base+path, "application/json", strings.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, data
}

func (r *httpRig) get(t *testing.T, path string) (*http.Response, []byte) {
	t.Helper()
	resp, err := r.c.Get(r.base + path)
	require.NoError(t, err)
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, data
}

// chatBodyJSON builds a chat request body.
func chatBodyJSON(t *testing.T, extra map[string]any, msgs ...Message) string {
	t.Helper()
	m := map[string]any{"model": DefaultModel}
	var list []map[string]any
	for _, msg := range msgs {
		list = append(list, map[string]any{"role": msg.Role, "content": msg.Content})
	}
	m["messages"] = list
	for k, v := range extra {
		m[k] = v
	}
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return string(b)
}

func decodeJSON(t *testing.T, data []byte) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(data, &m), "%s", data)
	return m
}

func num(t *testing.T, v any) int {
	t.Helper()
	f, ok := v.(float64)
	require.True(t, ok, "not a number: %#v", v)
	return int(f)
}

// sysPrompt is long enough to fill several 16-token blocks.
const sysPrompt = "You are a careful assistant. Answer briefly, cite sources, and never invent facts; " +
	"when unsure, say so. Use metric units, ISO dates, and plain English for every answer you give."

func TestTokenizerIsDeterministic(t *testing.T) {
	toks := Tokenize("Hello, world!  hello\tworld")
	require.Len(t, toks, 6, "Hello , world ! hello world")
	require.Equal(t, toks[2], toks[5], "same word, same id")
	require.NotEqual(t, toks[0], toks[4], "case matters")
	require.Equal(t, Tokenize("Hello , world !hello world"), toks, "white space only separates")
	for _, id := range Tokenize(sysPrompt + " ünïcode 42 日本") {
		require.GreaterOrEqual(t, id, FirstWordToken)
		require.Less(t, id, VocabSize)
	}
	require.Empty(t, Tokenize(" \n\t"))
	require.Equal(t, append([]uint32{TokenBOS}, toks...), CompletionTokens("Hello, world!  hello\tworld"))
}

func TestChatTemplate(t *testing.T) {
	sys, user := Tokenize("be nice"), Tokenize("hi there")
	got := ApplyChatTemplate([]Message{{"system", "be nice"}, {"user", "hi there"}})
	want := []uint32{TokenBOS, TokenSystem}
	want = append(want, sys...)
	want = append(want, TokenEndOfTurn, TokenUser)
	want = append(want, user...)
	want = append(want, TokenEndOfTurn, TokenAssistant)
	require.Equal(t, want, got)

	// A shared system prompt is a shared prefix.
	a := ApplyChatTemplate([]Message{{"system", sysPrompt}, {"user", "question one"}})
	b := ApplyChatTemplate([]Message{{"system", sysPrompt}, {"user", "another question"}})
	n := 2 + len(Tokenize(sysPrompt)) + 2
	require.Equal(t, a[:n], b[:n])
	require.NotEqual(t, a[n], b[n])

	noGen := ApplyChatTemplateWith([]Message{{"user", "hi there"}}, TemplateOptions{NoGenerationPrompt: true})
	require.Equal(t, TokenEndOfTurn, noGen[len(noGen)-1])
	cont := ApplyChatTemplateWith([]Message{{"user", "hi"}, {"assistant", "Sure"}}, TemplateOptions{ContinueFinalMessage: true})
	require.Equal(t, Tokenize("Sure")[0], cont[len(cont)-1], "the final message stays open")
	double := ApplyChatTemplateWith([]Message{{"user", "hi"}}, TemplateOptions{AddSpecialTokens: true})
	require.Equal(t, []uint32{TokenBOS, TokenBOS, TokenUser}, double[:3])
	other := ApplyChatTemplate([]Message{{"narrator", "x"}, {"developer", "y"}, {"tool", "z"}})
	require.Equal(t, []uint32{TokenBOS, TokenOtherRole, Tokenize("narrator")[0], Tokenize("x")[0], TokenEndOfTurn,
		TokenSystem, Tokenize("y")[0], TokenEndOfTurn, TokenTool, Tokenize("z")[0], TokenEndOfTurn, TokenAssistant}, other)
}

func TestHTTPChatCompletionAndCacheHits(t *testing.T) {
	r := startHTTP(t, Options{})
	msgs := []Message{{"system", sysPrompt}, {"user", "What is the boiling point of water at sea level?"}}
	prompt := ApplyChatTemplate(msgs)
	body := chatBodyJSON(t, nil, msgs...)

	resp, data := r.post(t, "/v1/chat/completions", body)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	m := decodeJSON(t, data)
	require.Equal(t, "chat.completion", m["object"])
	require.Equal(t, DefaultModel, m["model"])
	require.True(t, strings.HasPrefix(m["id"].(string), "chatcmpl-"))
	require.NotZero(t, num(t, m["created"]))
	choices := m["choices"].([]any)
	require.Len(t, choices, 1)
	ch := choices[0].(map[string]any)
	require.Equal(t, "length", ch["finish_reason"])
	msg := ch["message"].(map[string]any)
	require.Equal(t, "assistant", msg["role"])
	require.Equal(t, generatedText(DefaultOutputTokens), msg["content"])
	require.Len(t, strings.Fields(msg["content"].(string)), DefaultOutputTokens)

	usage := m["usage"].(map[string]any)
	require.Equal(t, len(prompt), num(t, usage["prompt_tokens"]))
	require.Equal(t, DefaultOutputTokens, num(t, usage["completion_tokens"]))
	require.Equal(t, len(prompt)+DefaultOutputTokens, num(t, usage["total_tokens"]))
	require.Zero(t, num(t, usage["prompt_tokens_details"].(map[string]any)["cached_tokens"]))
	coldTTFT := usage["simulated_ttft_ms"].(float64)
	require.InDelta(t, durationMs(DefaultTTFTBase+time.Duration(len(prompt))*DefaultPerTokenPrefill), coldTTFT, 1e-9)
	require.Equal(t, strconv.FormatFloat(coldTTFT, 'f', 3, 64), resp.Header.Get(HeaderTTFT))
	require.Equal(t, strconv.Itoa(len(prompt)), resp.Header.Get(HeaderPromptTokens))
	require.Equal(t, "0", resp.Header.Get(HeaderCachedTokens))

	// The cache model saw exactly the template's tokens.
	full := len(prompt) / DefaultBlockSize
	require.Greater(t, full, 2)
	require.Equal(t, full, r.e.HeldPrefix(prompt, "", ""))

	// Same system prompt, other question: the shared blocks are hits.
	msgs2 := []Message{{"system", sysPrompt}, {"user", "And what is it on top of Mount Everest?"}}
	prompt2 := ApplyChatTemplate(msgs2)
	shared := 0
	for shared < min(len(prompt), len(prompt2)) && prompt[shared] == prompt2[shared] {
		shared++
	}
	wantCached := shared / DefaultBlockSize * DefaultBlockSize
	require.NotZero(t, wantCached)
	resp, data = r.post(t, "/v1/chat/completions", chatBodyJSON(t, map[string]any{"max_tokens": 3}, msgs2...))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	usage = decodeJSON(t, data)["usage"].(map[string]any)
	require.Equal(t, wantCached, num(t, usage["prompt_tokens_details"].(map[string]any)["cached_tokens"]))
	require.Equal(t, 3, num(t, usage["completion_tokens"]))
	warmTTFT := usage["simulated_ttft_ms"].(float64)
	require.InDelta(t, durationMs(DefaultTTFTBase+time.Duration(len(prompt2)-wantCached)*DefaultPerTokenPrefill), warmTTFT, 1e-9)

	// The identical request again: every complete block is a hit.
	resp, data = r.post(t, "/v1/chat/completions", body)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	usage = decodeJSON(t, data)["usage"].(map[string]any)
	require.Equal(t, full*DefaultBlockSize, num(t, usage["prompt_tokens_details"].(map[string]any)["cached_tokens"]))
	require.Less(t, usage["simulated_ttft_ms"].(float64), coldTTFT)
	require.Equal(t, strconv.Itoa(full*DefaultBlockSize), resp.Header.Get(HeaderCachedTokens))

	st := r.e.HTTPStats()
	require.Equal(t, uint64(3), st.Requests)
	require.Equal(t, uint64(3), st.Prompts)
	require.Equal(t, uint64(2*len(prompt)+len(prompt2)), st.PromptTokens)
	require.Equal(t, uint64(wantCached+full*DefaultBlockSize), st.CachedTokens)
	require.Equal(t, uint64(2*DefaultOutputTokens+3), st.OutputTokens)
	require.Zero(t, st.Running)
	require.Zero(t, st.Errors)
	require.InDelta(t, float64(wantCached+full*DefaultBlockSize)/float64(2*len(prompt)+len(prompt2)), st.HitRate(), 1e-12)
}

func TestHTTPPublishesKVEvents(t *testing.T) {
	r := startHTTP(t, Options{BlockSize: 4})
	sub := subscribe(t, r.e)
	msgs := []Message{{"user", "one two three four five six seven eight nine"}}
	prompt := ApplyChatTemplate(msgs)
	resp, _ := r.post(t, "/v1/chat/completions", chatBodyJSON(t, map[string]any{"cache_salt": "tenant-a"}, msgs...))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	_, payload := recvLive(t, sub, DefaultTopic)
	d := decodeBatch(t, payload)
	require.Len(t, d.events, 1)
	require.Equal(t, "BlockStored", d.events[0]["type"])
	require.Equal(t, r.e.BlockHashes(prompt, "", "tenant-a"), asHashes(t, d.events[0]["block_hashes"]))
	require.Equal(t, prompt[:len(prompt)/4*4], asTokens(t, d.events[0]["token_ids"]))
	require.Equal(t, len(prompt)/4, r.e.HeldPrefix(prompt, "", "tenant-a"))
	require.Zero(t, r.e.HeldPrefix(prompt, "", ""), "the salt isolates the blocks")
}

// sseEvents reads an SSE body: every event must be one "data: " line followed by
// a blank line; it returns the payloads, "[DONE]" included.
func sseEvents(t *testing.T, body []byte) []string {
	t.Helper()
	require.True(t, bytes.HasSuffix(body, []byte("\n\n")), "body ends with an empty line")
	var out []string
	for _, ev := range strings.Split(strings.TrimSuffix(string(body), "\n\n"), "\n\n") {
		require.NotContains(t, ev, "\n", "one line per event")
		payload, ok := strings.CutPrefix(ev, "data: ")
		require.True(t, ok, "event %q", ev)
		out = append(out, payload)
	}
	require.Equal(t, "[DONE]", out[len(out)-1])
	return out
}

func TestHTTPChatStream(t *testing.T) {
	r := startHTTP(t, Options{})
	msgs := []Message{{"system", sysPrompt}, {"user", "Stream please."}}
	prompt := ApplyChatTemplate(msgs)
	body := chatBodyJSON(t, map[string]any{"stream": true, "max_tokens": 5, "stream_options": map[string]any{"include_usage": true}}, msgs...)

	resp, data := r.post(t, "/v1/chat/completions", body)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	require.Equal(t, strconv.Itoa(len(prompt)), resp.Header.Get(HeaderPromptTokens))
	require.NotEmpty(t, resp.Header.Get(HeaderTTFT))
	events := sseEvents(t, data)
	require.Len(t, events, 1+5+1+1, "role chunk, 5 tokens, usage, [DONE]")

	var id string
	var text strings.Builder
	for i, ev := range events[:len(events)-1] {
		m := decodeJSON(t, []byte(ev))
		require.Equal(t, "chat.completion.chunk", m["object"])
		require.Equal(t, DefaultModel, m["model"])
		if id == "" {
			id = m["id"].(string)
		}
		require.Equal(t, id, m["id"], "one id per stream")
		choices := m["choices"].([]any)
		switch {
		case i == 0:
			require.Len(t, choices, 1)
			delta := choices[0].(map[string]any)["delta"].(map[string]any)
			require.Equal(t, map[string]any{"role": "assistant", "content": ""}, delta)
		case i <= 5:
			require.Len(t, choices, 1)
			c := choices[0].(map[string]any)
			text.WriteString(c["delta"].(map[string]any)["content"].(string))
			if i == 5 {
				require.Equal(t, "length", c["finish_reason"])
			} else {
				require.Nil(t, c["finish_reason"])
			}
			require.NotContains(t, m, "usage")
		default:
			require.Empty(t, choices)
			u := m["usage"].(map[string]any)
			require.Equal(t, len(prompt), num(t, u["prompt_tokens"]))
			require.Equal(t, 5, num(t, u["completion_tokens"]))
			require.Zero(t, num(t, u["prompt_tokens_details"].(map[string]any)["cached_tokens"]))
		}
	}
	require.Equal(t, generatedText(5), text.String())

	// Without include_usage there is no usage chunk; the second stream hits.
	resp, data = r.post(t, "/v1/chat/completions", chatBodyJSON(t, map[string]any{"stream": true, "max_tokens": 2}, msgs...))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Len(t, sseEvents(t, data), 1+2+1)
	require.Equal(t, strconv.Itoa(len(prompt)/DefaultBlockSize*DefaultBlockSize), resp.Header.Get(HeaderCachedTokens))
}

func TestHTTPCompletions(t *testing.T) {
	r := startHTTP(t, Options{BlockSize: 4})
	resp, data := r.post(t, "/v1/completions", `{"model":"fake-model","prompt":"The quick brown fox jumps over the lazy dog","max_tokens":4}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	m := decodeJSON(t, data)
	require.Equal(t, "text_completion", m["object"])
	require.True(t, strings.HasPrefix(m["id"].(string), "cmpl-"))
	ch := m["choices"].([]any)[0].(map[string]any)
	require.Equal(t, generatedText(4), ch["text"])
	require.Equal(t, "length", ch["finish_reason"])
	require.NotContains(t, ch, "message")
	want := CompletionTokens("The quick brown fox jumps over the lazy dog")
	require.Equal(t, len(want), num(t, m["usage"].(map[string]any)["prompt_tokens"]))
	require.Equal(t, len(want)/4, r.e.HeldPrefix(want, "", ""))

	// Several prompts: one choice each, usage summed; token ids are used as given.
	resp, data = r.post(t, "/v1/completions", `{"prompt":[[5,6,7,8,9],[5,6,7,8,1,2,3,4]],"max_tokens":2}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	m = decodeJSON(t, data)
	require.Len(t, m["choices"], 2)
	require.Equal(t, 1, num(t, m["choices"].([]any)[1].(map[string]any)["index"]))
	u := m["usage"].(map[string]any)
	require.Equal(t, 13, num(t, u["prompt_tokens"]))
	require.Equal(t, 4, num(t, u["completion_tokens"]))
	require.Equal(t, 4, num(t, u["prompt_tokens_details"].(map[string]any)["cached_tokens"]), "the second prompt hits the first's block")
	require.Equal(t, 2, r.e.HeldPrefix([]uint32{5, 6, 7, 8, 1, 2, 3, 4}, "", ""))

	resp, data = r.post(t, "/v1/completions", `{"prompt":["a b c","d e f"],"add_special_tokens":false,"max_tokens":1}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	require.Equal(t, 6, num(t, decodeJSON(t, data)["usage"].(map[string]any)["prompt_tokens"]))
	resp, data = r.post(t, "/v1/completions", `{"prompt":[1,2,3],"max_tokens":1}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	require.Equal(t, 3, num(t, decodeJSON(t, data)["usage"].(map[string]any)["prompt_tokens"]))

	// Streaming completions: text chunks, no role chunk.
	resp, data = r.post(t, "/v1/completions", `{"prompt":"x y","max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	events := sseEvents(t, data)
	require.Len(t, events, 3+1+1)
	var text strings.Builder
	for _, ev := range events[:3] {
		m := decodeJSON(t, []byte(ev))
		require.Equal(t, "text_completion", m["object"])
		text.WriteString(m["choices"].([]any)[0].(map[string]any)["text"].(string))
	}
	require.Equal(t, generatedText(3), text.String())
	require.Equal(t, 3, num(t, decodeJSON(t, []byte(events[3]))["usage"].(map[string]any)["prompt_tokens"]))
}

func TestHTTPRenderShapes(t *testing.T) {
	r := startHTTP(t, Options{})
	msgs := []Message{{"system", "sys"}, {"user", "hello"}}
	resp, data := r.post(t, "/v1/chat/completions/render",
		chatBodyJSON(t, map[string]any{"stream": true, "cache_salt": "s1", "max_tokens": 7, "priority": 3}, msgs...))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	m := decodeJSON(t, data)
	for _, k := range []string{"request_id", "token_ids", "features", "sampling_params", "model", "stream",
		"stream_options", "cache_salt", "priority", "kv_transfer_params"} {
		require.Contains(t, m, k)
	}
	require.True(t, strings.HasPrefix(m["request_id"].(string), "chatcmpl-"))
	var ids []uint32
	require.NoError(t, json.Unmarshal(mustJSON(t, m["token_ids"]), &ids))
	require.Equal(t, ApplyChatTemplate(msgs), ids)
	require.Nil(t, m["features"])
	require.Equal(t, 7, num(t, m["sampling_params"].(map[string]any)["max_tokens"]))
	require.Equal(t, DefaultModel, m["model"])
	require.Equal(t, true, m["stream"])
	require.Equal(t, "s1", m["cache_salt"])
	require.Equal(t, 3, num(t, m["priority"]))
	require.Nil(t, m["kv_transfer_params"])

	resp, data = r.post(t, "/v1/completions/render", `{"model":"fake-model","prompt":["a b","c"]}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	var list []map[string]any
	require.NoError(t, json.Unmarshal(data, &list))
	require.Len(t, list, 2)
	require.NoError(t, json.Unmarshal(mustJSON(t, list[1]["token_ids"]), &ids))
	require.Equal(t, CompletionTokens("c"), ids)
	require.Equal(t, DefaultOutputTokens, num(t, list[0]["sampling_params"].(map[string]any)["max_tokens"]))
	require.Nil(t, list[0]["cache_salt"])
	require.Equal(t, false, list[0]["stream"])

	require.Zero(t, r.e.Blocks(), "render never touches the cache")
	require.Zero(t, r.e.HTTPStats().Requests)
	require.Equal(t, uint64(2), r.e.HTTPStats().Renders)
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}

func TestHTTPTokenizeEndpoint(t *testing.T) {
	r := startHTTP(t, Options{MaxModelLen: 4096})
	resp, data := r.post(t, "/tokenize", `{"model":"fake-model","prompt":"Hello, world"}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	var ans struct {
		Count       int       `json:"count"`
		MaxModelLen int       `json:"max_model_len"`
		Tokens      []uint32  `json:"tokens"`
		TokenStrs   *[]string `json:"token_strs"`
	}
	require.NoError(t, json.Unmarshal(data, &ans))
	require.Equal(t, CompletionTokens("Hello, world"), ans.Tokens)
	require.Equal(t, len(ans.Tokens), ans.Count)
	require.Equal(t, 4096, ans.MaxModelLen)
	require.Nil(t, ans.TokenStrs)
	require.Contains(t, string(data), `"token_strs":null`)

	resp, data = r.post(t, "/tokenize", `{"messages":[{"role":"user","content":[{"type":"text","text":"Hi"},{"type":"text","text":"there!"}]}],"return_token_strs":true}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	require.NoError(t, json.Unmarshal(data, &ans))
	require.Equal(t, ApplyChatTemplate([]Message{{"user", "Hi there!"}}), ans.Tokens)
	require.Equal(t, []string{"<s>", "<|user|>", "Hi", "there", "!", "<|end|>", "<|assistant|>"}, *ans.TokenStrs)

	resp, data = r.post(t, "/tokenize", `{"prompt":"Hi","add_special_tokens":false}`)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.NoError(t, json.Unmarshal(data, &ans))
	require.Equal(t, Tokenize("Hi"), ans.Tokens)
	require.Zero(t, r.e.Blocks())
}

// The kvselect tokenize clients parse this server's answers into exactly the ids
// the template gives, for both protocols and both paths.
func TestTokenizeClientsParseServer(t *testing.T) {
	r := startHTTP(t, Options{})
	msgs := []Message{{"system", sysPrompt}, {"user", "How far is the Moon?"}}
	chat := chatBodyJSON(t, map[string]any{"cache_salt": "t1", "max_tokens": 9}, msgs...)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	for _, proto := range []string{tokenize.ProtocolVLLMRender, tokenize.ProtocolVLLMTokenize} {
		t.Run(proto, func(t *testing.T) {
			c, err := tokenize.New(tokenize.Options{Protocol: proto, BaseURL: r.base})
			require.NoError(t, err)
			defer c.Close()

			res, err := c.Tokenize(ctx, tokenize.Request{Path: tokenize.PathChatCompletions, Body: []byte(chat)})
			require.NoError(t, err)
			require.Equal(t, ApplyChatTemplate(msgs), res.Tokens)
			require.Equal(t, 1, res.PromptCount)
			if proto == tokenize.ProtocolVLLMRender {
				require.Equal(t, "t1", res.CacheSalt)
				require.Equal(t, int64(9), res.MaxTokens)
			} else {
				require.Equal(t, int64(DefaultMaxModelLen), res.MaxModelLen)
			}

			res, err = c.Tokenize(ctx, tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(`{"model":"fake-model","prompt":"Once upon a time"}`)})
			require.NoError(t, err)
			require.Equal(t, CompletionTokens("Once upon a time"), res.Tokens)

			res, err = c.Tokenize(ctx, tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(`{"prompt":["first one","second"],"add_special_tokens":false}`)})
			require.NoError(t, err)
			require.Equal(t, Tokenize("first one"), res.Tokens)
			if proto == tokenize.ProtocolVLLMRender {
				require.Equal(t, 2, res.PromptCount)
			}

			_, err = c.Tokenize(ctx, tokenize.Request{Path: tokenize.PathChatCompletions, Body: []byte(`{"model":"other","messages":[{"role":"user","content":"x"}]}`)})
			require.ErrorIs(t, err, tokenize.ErrUpstream, "a 404 from the service (unknown model) is a misconfigured service: 502")
			require.Contains(t, err.Error(), "does not exist")
		})
	}
	require.Zero(t, r.e.Blocks())
}

func TestHTTPErrors(t *testing.T) {
	r := startHTTP(t, Options{MaxModelLen: 64})
	cases := []struct {
		path, body string
		status     int
		msg        string
	}{
		{"/v1/chat/completions", `{"model":"gpt-4","messages":[{"role":"user","content":"x"}]}`, 404, "The model `gpt-4` does not exist."},
		{"/v1/completions", `{"model":"gpt-4","prompt":"x"}`, 404, "does not exist"},
		{"/v1/chat/completions/render", `{"model":"gpt-4","messages":[{"role":"user","content":"x"}]}`, 404, "does not exist"},
		{"/v1/completions/render", `{"model":"gpt-4","prompt":"x"}`, 404, "does not exist"},
		{"/tokenize", `{"model":"gpt-4","prompt":"x"}`, 404, "does not exist"},
		{"/v1/chat/completions", `{"messages":[`, 400, "invalid request body"},
		{"/v1/completions", `not json`, 400, "not a JSON object"},
		{"/tokenize", `[1,2]`, 400, "not a JSON object"},
		{"/v1/chat/completions/render", `{"messages":"hi"}`, 400, "invalid request body"},
		{"/v1/chat/completions", `{"messages":[]}`, 400, "non-empty"},
		{"/v1/chat/completions", `{"messages":[{"content":"x"}]}`, 400, "no role"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}`, 400, "only text parts"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":0}`, 400, "at least 1"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":60}`, 400, "maximum context length is 64"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"n":2}`, 400, "n must be 1"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}`, 400, "stream_options"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"continue_final_message":true}`, 400, "continue_final_message"},
		{"/v1/completions", `{}`, 400, "prompt is required"},
		{"/v1/completions", `{"prompt":[]}`, 400, "empty list"},
		{"/v1/completions", `{"prompt":[1,"a"]}`, 400, "only strings"},
		{"/v1/completions", `{"prompt":[32000]}`, 400, "out of vocabulary"},
		{"/v1/completions", `{"prompt":"","add_special_tokens":false}`, 400, "empty"},
		{"/tokenize", `{"prompt":"x","messages":[{"role":"user","content":"x"}]}`, 400, "exactly one"},
		{"/tokenize", `{}`, 400, "exactly one"},
		{"/tokenize", `{"prompt":["x"]}`, 400, "must be a string"},
	}
	for _, tc := range cases {
		resp, data := r.post(t, tc.path, tc.body)
		require.Equal(t, tc.status, resp.StatusCode, "%s %s: %s", tc.path, tc.body, data)
		var e errorJSON
		require.NoError(t, json.Unmarshal(data, &e), "%s", data)
		require.Equal(t, tc.status, e.Error.Code)
		require.Contains(t, e.Error.Message, tc.msg, "%s %s", tc.path, tc.body)
		require.NotEmpty(t, e.Error.Type)
	}
	require.Equal(t, uint64(len(cases)), r.e.HTTPStats().Errors)
	require.Zero(t, r.e.HTTPStats().Requests)
	require.Zero(t, r.e.Blocks())

	// An oversized body, through the handler directly (no network race between
	// the client still sending and the server closing).
	rec := httptest.NewRecorder()
	big := `{"prompt":"` + strings.Repeat("a", maxHTTPBody) + `"}`
	r.e.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader(big)))
	require.Equal(t, http.StatusRequestEntityTooLarge, rec.Code, "%.100s", rec.Body.String())

	resp, _ := r.get(t, "/v1/chat/completions")
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
	resp, _ = r.get(t, "/v1/unknown")
	require.Equal(t, http.StatusNotFound, resp.StatusCode)
}

// parseMetrics reads the Prometheus text format strictly enough for our output:
// every sample's family has HELP and TYPE lines before it, and every sample is
// name{labels} value.
func parseMetrics(t *testing.T, text string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	types := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "# TYPE "); ok {
			f := strings.Fields(rest)
			require.Len(t, f, 2, line)
			require.Contains(t, []string{"counter", "gauge", "summary"}, f[1])
			types[f[0]] = f[1]
			continue
		}
		if strings.HasPrefix(line, "# HELP ") {
			continue
		}
		require.NotEmpty(t, line)
		sp := strings.LastIndexByte(line, ' ')
		require.Positive(t, sp, line)
		series, value := line[:sp], line[sp+1:]
		v, err := strconv.ParseFloat(value, 64)
		require.NoError(t, err, line)
		name, labels, ok := strings.Cut(series, "{")
		require.True(t, ok, line)
		require.Equal(t, `model_name="`+DefaultModel+`"}`, labels)
		family := strings.TrimSuffix(strings.TrimSuffix(name, "_sum"), "_count")
		require.Contains(t, types, family, "TYPE before sample %s", name)
		out[name] = v
	}
	require.NoError(t, sc.Err())
	return out
}

func TestHTTPMetricsAndHealth(t *testing.T) {
	r := startHTTP(t, Options{})
	resp, _ := r.get(t, "/health")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	resp, data := r.get(t, "/v1/models")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, DefaultModel, decodeJSON(t, data)["data"].([]any)[0].(map[string]any)["id"])

	msgs := []Message{{"system", sysPrompt}, {"user", "q"}}
	for range 2 {
		resp, _ = r.post(t, "/v1/chat/completions", chatBodyJSON(t, nil, msgs...))
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	resp, _ = r.post(t, "/v1/chat/completions", `{"model":"nope","messages":[]}`)
	require.Equal(t, http.StatusNotFound, resp.StatusCode)

	resp, data = r.get(t, "/metrics")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.True(t, strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain; version=0.0.4"))
	m := parseMetrics(t, string(data))
	n := len(ApplyChatTemplate(msgs))
	require.Equal(t, float64(2*n), m["fake_prefix_cache_queries_total"])
	require.Equal(t, float64(n/DefaultBlockSize*DefaultBlockSize), m["fake_prefix_cache_hits_total"])
	require.Equal(t, float64(2), m["fake_requests_total"])
	require.Zero(t, m["fake_requests_running"])
	require.Equal(t, float64(2*DefaultOutputTokens), m["fake_generation_tokens_total"])
	require.Equal(t, float64(1), m["fake_request_errors_total"])
	require.Equal(t, float64(r.e.Blocks()), m["fake_kv_cache_blocks"])
	require.Equal(t, float64(DefaultCapacityBlocks), m["fake_kv_cache_capacity_blocks"])
	require.Equal(t, float64(2), m["fake_simulated_ttft_seconds_count"])
	require.InDelta(t, r.e.HTTPStats().TTFTTotal.Seconds(), m["fake_simulated_ttft_seconds_sum"], 1e-12)
}

func TestHTTPConcurrentRequests(t *testing.T) {
	r := startHTTP(t, Options{})
	const workers, each = 6, 8
	var mu sync.Mutex
	var prompt, cached int
	var wg sync.WaitGroup
	errs := make(chan error, workers*each)
	bodies := make([][]string, workers)
	for w := range workers {
		for i := range each {
			msgs := []Message{{"system", sysPrompt}, {"user", fmt.Sprintf("worker %d question %d", w, i%3)}}
			bodies[w] = append(bodies[w], chatBodyJSON(t, map[string]any{"max_tokens": 2, "stream": i%2 == 0}, msgs...))
		}
	}
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, body := range bodies[w] {
				resp, err := r.c.Post(r.base+"/v1/chat/completions", "application/json", strings.NewReader(body))
				if err != nil {
					errs <- err
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					errs <- fmt.Errorf("status %d", resp.StatusCode)
					return
				}
				p, _ := strconv.Atoi(resp.Header.Get(HeaderPromptTokens))
				c, _ := strconv.Atoi(resp.Header.Get(HeaderCachedTokens))
				mu.Lock()
				prompt += p
				cached += c
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	st := r.e.HTTPStats()
	require.Equal(t, uint64(workers*each), st.Requests)
	require.Equal(t, uint64(prompt), st.PromptTokens)
	require.Equal(t, uint64(cached), st.CachedTokens)
	require.Zero(t, st.Running)
	// Every request after the first shares at least the system prompt's blocks.
	sysBlocks := (2 + len(Tokenize(sysPrompt)) + 1) / DefaultBlockSize
	require.GreaterOrEqual(t, cached, (workers*each-1)*sysBlocks*DefaultBlockSize)
}

func TestHTTPSleepTTFT(t *testing.T) {
	r := startHTTP(t, Options{SleepTTFT: true, TTFTBase: 30 * time.Millisecond, PerTokenPrefill: time.Nanosecond})
	start := time.Now()
	resp, data := r.post(t, "/v1/completions", `{"prompt":"a b c","max_tokens":1}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	require.GreaterOrEqual(t, time.Since(start), 30*time.Millisecond, "the answer waited its TTFT")
}

// Close cuts a request that waits its TTFT and waits for its handler.
func TestHTTPCloseDuringTTFTWait(t *testing.T) {
	e, err := New(Options{EnableHTTP: true, SleepTTFT: true, TTFTBase: time.Hour})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	require.NoError(t, e.Start(ctx))
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: testTimeout}

	type result struct {
		stream bool
		status int
		body   string
		err    error
	}
	done := make(chan result, 2)
	for _, stream := range []bool{false, true} {
		go func() {
			body := fmt.Sprintf(`{"prompt":"wait for it","stream":%v}`, stream)
			resp, err := c.Post("http://"+e.HTTPEndpoint()+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				done <- result{stream: stream, err: err}
				return
			}
			data, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			done <- result{stream: stream, status: resp.StatusCode, body: string(data)}
		}()
	}
	require.Eventually(t, func() bool { return e.HTTPStats().Requests == 2 }, testTimeout, pollInterval)
	closed := time.Now()
	require.NoError(t, e.Close())
	require.Less(t, time.Since(closed), httpShutdownGrace, "in-flight waits end at once")
	for range 2 {
		res := <-done
		require.NoError(t, res.err)
		if res.stream {
			// The headers went out before the wait; the stream ends without a token.
			require.Equal(t, http.StatusOK, res.status)
			require.Empty(t, res.body)
		} else {
			require.Equal(t, http.StatusServiceUnavailable, res.status)
		}
	}
	require.Zero(t, e.HTTPStats().Running)
	_, err = c.Get("http://" + e.HTTPEndpoint() + "/health")
	require.Error(t, err, "the listener is closed")
}

func TestHTTPLifecycle(t *testing.T) {
	e, err := New(Options{EnableHTTP: true})
	require.NoError(t, err)
	require.Empty(t, e.HTTPEndpoint(), "before Start")
	require.NoError(t, e.Close())

	plain := startEngine(t, Options{})
	require.Empty(t, plain.HTTPEndpoint(), "HTTP disabled")

	// The handler works without Start, on a caller's server; after Close it answers 503.
	e, err = New(Options{Model: "m1", BlockSize: 2})
	require.NoError(t, err)
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	resp, err := srv.Client().Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m1","prompt":[1,2,3,4]}`))
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, 2, e.HeldPrefix([]uint32{1, 2, 3, 4}, "", ""))
	require.Equal(t, uint64(1), e.Stats().LiveUnsent, "numbered for replay, not sent")
	require.NoError(t, e.Close())
	for _, path := range []string{"/health", "/v1/models"} {
		resp, err = srv.Client().Get(srv.URL + path)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, path)
	}
	for _, path := range []string{"/v1/completions", "/v1/completions/render", "/tokenize"} {
		resp, err = srv.Client().Post(srv.URL+path, "application/json", strings.NewReader(`{"prompt":"x"}`))
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, path)
	}
	srv.Client().Transport.(*http.Transport).CloseIdleConnections()
}

func TestHTTPStartFailsOnBusyAddress(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	e, err := New(Options{EnableHTTP: true, HTTPAddr: ln.Addr().String(), EnableReplay: true})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	err = e.Start(ctx)
	require.ErrorIs(t, err, ErrSocket)
	require.Empty(t, e.PubEndpoint())
	require.Empty(t, e.HTTPEndpoint())
	require.NoError(t, ln.Close())
	require.NoError(t, e.Start(ctx), "a failed Start may be retried")
	require.NotEmpty(t, e.HTTPEndpoint())
	require.NoError(t, e.Close())
}

func TestHTTPOptionsValidation(t *testing.T) {
	_, err := New(Options{HTTPAddr: "nope", TTFTBase: -1, PerTokenPrefill: -1, OutputTokens: -1, MaxModelLen: 8, Model: ""})
	require.ErrorIs(t, err, ErrInvalidOptions)
	for _, want := range []string{"HTTPAddr", "TTFTBase", "PerTokenPrefill", "OutputTokens"} {
		require.Contains(t, err.Error(), want)
	}
	_, err = New(Options{MaxModelLen: 16})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.Contains(t, err.Error(), "MaxModelLen 16 <= OutputTokens 16")

	e, err := New(Options{})
	require.NoError(t, err)
	o := e.Options()
	require.Equal(t, DefaultHTTPAddr, o.HTTPAddr)
	require.Equal(t, DefaultModel, o.Model)
	require.Equal(t, DefaultMaxModelLen, o.MaxModelLen)
	require.Equal(t, DefaultOutputTokens, o.OutputTokens)
	require.Equal(t, DefaultTTFTBase, o.TTFTBase)
	require.Equal(t, DefaultPerTokenPrefill, o.PerTokenPrefill)
	require.False(t, errors.Is(e.Close(), ErrSocket))
}

func TestHTTPServesOnCallersListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	_, err = New(Options{EnableHTTP: true, HTTPListener: ln, HTTPAddr: "127.0.0.1:0"})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "HTTPListener are both set")

	r := startHTTP(t, Options{HTTPListener: ln})
	require.Equal(t, ln.Addr().String(), r.e.HTTPEndpoint())
	resp, _ := r.get(t, "/health")
	require.Equal(t, http.StatusOK, resp.StatusCode)

	require.NoError(t, r.e.Close())
	_, err = ln.Accept()
	require.ErrorIs(t, err, net.ErrClosed, "Close closes the caller's listener")
}
