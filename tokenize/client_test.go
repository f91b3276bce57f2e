package tokenize_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/tokenize"
)

func TestNewValidatesEverything(t *testing.T) {
	_, err := tokenize.New(tokenize.Options{
		Protocol:         "openai",
		BaseURL:          "ftp://x",
		Timeout:          -1,
		MaxResponseBytes: -1,
		MaxRequestBytes:  -1,
	})
	require.ErrorIs(t, err, tokenize.ErrInvalidOptions)
	contains(t, err, `"openai"`, "vllm-render, vllm-tokenize, sglang", "scheme", "timeout", "max response", "max request")

	for _, u := range []string{
		"", "relative/path", "/abs/path", "http://", "http://:8000", "ftp://h", "http://user:secret@h:1",
		"http://h:1/?q=1", "http://h:1/#frag", "://bad",
	} {
		_, err := tokenize.New(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: u})
		require.ErrorIs(t, err, tokenize.ErrInvalidOptions, "base URL %q", u)
		require.NotContains(t, err.Error(), "secret", "credentials must not leak into errors")
	}
	for _, p := range tokenize.Protocols() {
		c, err := tokenize.New(tokenize.Options{Protocol: p, BaseURL: "https://h:8443/prefix/"})
		require.NoError(t, err)
		require.Equal(t, p, c.Protocol())
		timeout, maxResp, maxReq := c.Limits()
		require.Equal(t, tokenize.DefaultTimeout, timeout)
		require.EqualValues(t, tokenize.DefaultMaxResponseBytes, maxResp)
		require.EqualValues(t, tokenize.DefaultMaxRequestBytes, maxReq)
		c.Close()
	}
}

func TestVLLMRenderChat(t *testing.T) {
	b := newBackend(t, reply(200, `{"request_id":"chatcmpl-9","token_ids":[151644, 872, 198, 0, 4294967295],
		"features":{"mm_hashes":{"image":["h1"]},"mm_placeholders":{"image":[{"offset":3,"length":2}]}},
		"sampling_params":{"max_tokens":128,"temperature":0.7},"cache_salt":"tenant-a","priority":0,
		"model":"m","stream":true,"some_future_field":{"x":[1,2]}}`))
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL + "/"})
	body := chatBody("hello")
	res, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: body, Model: "ignored"})
	require.NoError(t, err)
	require.Equal(t, []uint32{151644, 872, 198, 0, 4294967295}, res.Tokens)
	require.Equal(t, 1, res.PromptCount)
	require.JSONEq(t, `{"mm_hashes":{"image":["h1"]},"mm_placeholders":{"image":[{"offset":3,"length":2}]}}`, string(res.Features))
	require.Equal(t, "tenant-a", res.CacheSalt)
	require.EqualValues(t, 128, res.MaxTokens)

	got := b.last(t)
	require.Equal(t, http.MethodPost, got.Method)
	require.Equal(t, "/v1/chat/completions/render", got.Path)
	require.Equal(t, body, got.Body, "the body is forwarded unchanged")
	require.Equal(t, "application/json", got.Header.Get("Content-Type"))
	require.Equal(t, "application/json", got.Header.Get("Accept"))
	for name := range got.Header {
		switch name {
		case "Content-Type", "Accept", "Content-Length", "User-Agent":
		default:
			t.Errorf("unexpected header %s sent to the tokenizer", name)
		}
	}
}

func TestVLLMRenderCompletionsAndPrefix(t *testing.T) {
	b := newBackend(t, reply(200, `[{"request_id":"cmpl-1","token_ids":[1,2,3],"features":null},
		{"request_id":"cmpl-2","token_ids":[4,5]}]`))
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL + "/engine-a"})
	body := []byte(`{"model":"m","prompt":["one","two"]}`)
	res, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathCompletions, Body: body})
	require.NoError(t, err)
	require.Equal(t, []uint32{1, 2, 3}, res.Tokens)
	require.Equal(t, 2, res.PromptCount)
	require.Nil(t, res.Features)
	got := b.last(t)
	require.Equal(t, "/engine-a/v1/completions/render", got.Path)
	require.Equal(t, body, got.Body)
}

func TestVLLMTokenizeChat(t *testing.T) {
	b := newBackend(t, reply(200, `{"count":3,"max_model_len":32768,"tokens":[9,8,7],"token_strs":null}`))
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMTokenize, BaseURL: b.URL})
	body := []byte(`{"model":"client-model","messages":[{"role":"user","content":"hi"}],
		"tools":[{"type":"function","function":{"name":"f"}}],"chat_template_kwargs":{"enable_thinking":false},
		"temperature":0.5,"stream":true,"max_tokens":10}`)
	res, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: body, Model: "base-model"})
	require.NoError(t, err)
	require.Equal(t, []uint32{9, 8, 7}, res.Tokens)
	require.EqualValues(t, 32768, res.MaxModelLen)
	got := b.last(t)
	require.Equal(t, "/tokenize", got.Path)
	require.JSONEq(t, `{"model":"base-model","messages":[{"role":"user","content":"hi"}],
		"tools":[{"type":"function","function":{"name":"f"}}],"chat_template_kwargs":{"enable_thinking":false},
		"add_special_tokens":false,"add_generation_prompt":true}`, string(got.Body))

	// The client's own template switches win over the defaults.
	body = []byte(`{"messages":[{"role":"assistant","content":"Once"}],"add_generation_prompt":false,
		"continue_final_message":true,"add_special_tokens":true,"chat_template":"{{x}}"}`)
	_, err = c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: body})
	require.NoError(t, err)
	require.JSONEq(t, `{"messages":[{"role":"assistant","content":"Once"}],"add_generation_prompt":false,
		"continue_final_message":true,"add_special_tokens":true,"chat_template":"{{x}}"}`, string(b.last(t).Body))
}

func TestVLLMTokenizeCompletions(t *testing.T) {
	b := newBackend(t, reply(200, `{"count":2,"max_model_len":4096,"tokens":[1,2]}`))
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMTokenize, BaseURL: b.URL})
	ctx := context.Background()
	cases := []struct {
		body, want string
	}{
		{`{"model":"m","prompt":"Hello"}`, `{"model":"m","prompt":"Hello","add_special_tokens":true}`},
		{`{"model":"m","prompt":["first","second"],"add_special_tokens":false}`, `{"model":"m","prompt":"first","add_special_tokens":false}`},
		{`{"prompt":"x","add_special_tokens":null}`, `{"prompt":"x","add_special_tokens":true}`},
	}
	for _, tc := range cases {
		res, err := c.Tokenize(ctx, tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(tc.body)})
		require.NoError(t, err)
		require.Equal(t, []uint32{1, 2}, res.Tokens)
		require.JSONEq(t, tc.want, string(b.last(t).Body), tc.body)
	}
	calls := b.calls.Load()

	// Prompts that already are token ids need no service.
	res, err := c.Tokenize(ctx, tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(`{"prompt":[5, 6, 7]}`)})
	require.NoError(t, err)
	require.Equal(t, []uint32{5, 6, 7}, res.Tokens)
	res, err = c.Tokenize(ctx, tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(`{"prompt":[[1],[2,3]]}`)})
	require.NoError(t, err)
	require.Equal(t, []uint32{1}, res.Tokens)
	require.Equal(t, 2, res.PromptCount)
	for _, bad := range []string{`{"prompt":[-1]}`, `{"prompt":[1.5]}`, `{"prompt":[]}`, `{"prompt":5}`, `{"prompt":[true]}`, `{"prompt":null}`} {
		_, err := c.Tokenize(ctx, tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(bad)})
		require.ErrorIs(t, err, tokenize.ErrBadRequest, bad)
	}
	require.Equal(t, calls, b.calls.Load())
}

func TestSGLang(t *testing.T) {
	b := newBackend(t, reply(200, `{"tokens":[[11,12],[13]],"count":[2,1],"max_model_len":8192}`))
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolSGLang, BaseURL: b.URL})
	res, err := c.Tokenize(context.Background(), tokenize.Request{
		Path: tokenize.PathChatCompletions,
		Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"reasoning_effort":"low","tool_choice":"auto","top_p":0.9}`),
	})
	require.NoError(t, err)
	require.Equal(t, []uint32{11, 12}, res.Tokens)
	require.Equal(t, 2, res.PromptCount)
	require.EqualValues(t, 8192, res.MaxModelLen)
	got := b.last(t)
	require.Equal(t, "/tokenize", got.Path)
	require.JSONEq(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"reasoning_effort":"low","tool_choice":"auto"}`, string(got.Body))

	b2 := newBackend(t, reply(200, `{"tokens":[21,22,23],"count":3,"max_model_len":8192}`))
	c2 := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolSGLang, BaseURL: b2.URL})
	res, err = c2.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(`{"model":"m","prompt":"abc"}`)})
	require.NoError(t, err)
	require.Equal(t, []uint32{21, 22, 23}, res.Tokens)
	require.JSONEq(t, `{"model":"m","prompt":"abc","add_special_tokens":true}`, string(b2.last(t).Body))
}

// sglang-renderer speaks the contract of SGLang's renderer binary
// (rust/sglang-renderer/src/http/render.rs) as Dynamo's EPP does
// (deploy/inference-gateway/ext-proc/src/sglang_renderer_client.rs): the
// body goes unchanged to the path's render route; the chat answer is one
// GenerateRequest, the completions answer a list of them; the ids are
// input_ids, and an answer in vLLM's shape (token_ids) is not one.
func TestSGLangRenderer(t *testing.T) {
	b := newBackend(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/chat/completions/render":
			reply(200, `{"rid":"chatcmpl-7","input_ids":[151644,872,198,4294967295],
				"sampling_params":{"max_new_tokens":64,"temperature":1.0,"top_k":1,"n":1,"stop_strs":[],"is_normalized":true},
				"stream":false,"return_logprob":false,"logprob_start_len":0,"top_logprobs_num":0,
				"return_hidden_states":false,"model":"m","cache_salt":"tenant-a","priority":3}`)(w, r)
		case "/v1/completions/render":
			reply(200, `[{"rid":"cmpl-1-0","input_ids":[1,2,3],"sampling_params":{"max_new_tokens":null}},
				{"rid":"cmpl-1-1","input_ids":[4],"sampling_params":{}}]`)(w, r)
		default:
			reply(404, `{"detail":"Not Found"}`)(w, r)
		}
	})
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolSGLangRenderer, BaseURL: b.URL})
	body := chatBody("hello")
	res, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: body, Model: "ignored"})
	require.NoError(t, err)
	require.Equal(t, []uint32{151644, 872, 198, 4294967295}, res.Tokens)
	require.Equal(t, 1, res.PromptCount)
	require.Equal(t, "tenant-a", res.CacheSalt)
	require.EqualValues(t, 64, res.MaxTokens)
	require.Nil(t, res.Features)
	got := b.last(t)
	require.Equal(t, http.MethodPost, got.Method)
	require.Equal(t, "/v1/chat/completions/render", got.Path)
	require.Equal(t, body, got.Body, "the body is forwarded unchanged")
	require.Equal(t, "application/json", got.Header.Get("Content-Type"))

	body = []byte(`{"model":"m","prompt":["one two three","four"],"max_tokens":5}`)
	res, err = c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathCompletions, Body: body})
	require.NoError(t, err)
	require.Equal(t, []uint32{1, 2, 3}, res.Tokens)
	require.Equal(t, 2, res.PromptCount)
	require.Zero(t, res.MaxTokens, "max_new_tokens null: no limit, none known")
	got = b.last(t)
	require.Equal(t, "/v1/completions/render", got.Path)
	require.Equal(t, body, got.Body)

	// vLLM's answer is not SGLang's: no input_ids is the service's fault.
	vllm := newBackend(t, reply(200, `{"token_ids":[1,2,3]}`))
	c = newClient(t, tokenize.Options{Protocol: tokenize.ProtocolSGLangRenderer, BaseURL: vllm.URL})
	_, err = c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: chatBody("x")})
	require.ErrorIs(t, err, tokenize.ErrUpstream)
	contains(t, err, "no input_ids", "/v1/chat/completions/render")

	// The renderer refuses a chat body asking for several choices with 400:
	// the request's fault.
	refuse := newBackend(t, reply(400, `{"error":{"message":"the standalone chat renderer currently requires n=1","type":"BadRequestError"}}`))
	c = newClient(t, tokenize.Options{Protocol: tokenize.ProtocolSGLangRenderer, BaseURL: refuse.URL})
	_, err = c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions,
		Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"n":2}`)})
	require.ErrorIs(t, err, tokenize.ErrBadRequest)
	contains(t, err, "requires n=1")
}

func TestRequestErrorsSendNothing(t *testing.T) {
	b := newBackend(t, reply(200, `{"token_ids":[1]}`))
	for _, p := range tokenize.Protocols() {
		c := newClient(t, tokenize.Options{Protocol: p, BaseURL: b.URL, MaxRequestBytes: 64})
		for name, req := range map[string]tokenize.Request{
			"unknown path":   {Path: "/v1/embeddings", Body: []byte(`{}`)},
			"render path":    {Path: "/v1/chat/completions/render", Body: []byte(`{}`)},
			"empty path":     {Body: []byte(`{}`)},
			"not JSON":       {Path: tokenize.PathChatCompletions, Body: []byte(`{"messages":`)},
			"not an object":  {Path: tokenize.PathChatCompletions, Body: []byte(`[1,2]`)},
			"empty body":     {Path: tokenize.PathCompletions},
			"too big":        {Path: tokenize.PathCompletions, Body: []byte(`{"prompt":"` + strings.Repeat("a", 64) + `"}`)},
			"trailing bytes": {Path: tokenize.PathCompletions, Body: []byte(`{"prompt":"a"} x`)},
		} {
			_, err := c.Tokenize(context.Background(), req)
			require.ErrorIs(t, err, tokenize.ErrBadRequest, "%s %s", p, name)
			require.Equal(t, 400, tokenize.HTTPStatus(err))
		}
		if p == tokenize.ProtocolVLLMTokenize || p == tokenize.ProtocolSGLang { // the render protocols leave the body to the renderer
			_, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: []byte(`{"model":"m"}`)})
			require.ErrorIs(t, err, tokenize.ErrBadRequest)
			_, err = c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(`{"model":"m"}`)})
			require.ErrorIs(t, err, tokenize.ErrBadRequest)
		}
	}
	require.Zero(t, b.calls.Load())
}

// TestErrorClasses drives every failure class through a real loopback server and
// checks the sentinel and the HTTP status it maps to.
func TestErrorClasses(t *testing.T) {
	other := newBackend(t, reply(200, renderAnswer(seq(3, 1))))
	hold := func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }
	big := `{"token_ids":[` + strings.Repeat("1,", 600) + `1]}`

	cases := []struct {
		name    string
		handler http.HandlerFunc
		want    error
		status  int
		msg     string
	}{
		{"400 with vLLM error", reply(400, `{"object":"error","message":"messages: field required","type":"BadRequestError","code":400}`), tokenize.ErrBadRequest, 400, "field required"},
		{"404 openai error", reply(404, `{"error":{"message":"The model x does not exist.","type":"NotFoundError","code":404}}`), tokenize.ErrUpstream, 502, "does not exist"},
		{"401", reply(401, `no key`), tokenize.ErrUpstream, 502, "401"},
		{"422", reply(422, `bad messages`), tokenize.ErrBadRequest, 400, "422"},
		{"413", reply(413, `too large`), tokenize.ErrBadRequest, 400, "413"},
		{"408", reply(408, ``), tokenize.ErrTimeout, 504, "408"},
		{"429", reply(429, `slow down`), tokenize.ErrUnavailable, 503, "slow down"},
		{"500", reply(500, `{"error":{"message":"boom"}}`), tokenize.ErrUpstream, 502, "boom"},
		{"501", reply(501, `nope`), tokenize.ErrUpstream, 502, "501"},
		{"503", reply(503, strings.Repeat("x", 5000)), tokenize.ErrUpstream, 502, "xxx..."},
		{"redirect to another host", func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, other.URL+r.URL.Path, http.StatusTemporaryRedirect)
		}, tokenize.ErrUpstream, 502, "307"},
		{"not JSON", reply(200, `<html>oops</html>`), tokenize.ErrUpstream, 502, ""},
		{"empty 200", reply(200, ``), tokenize.ErrUpstream, 502, ""},
		{"204", reply(204, ``), tokenize.ErrUpstream, 502, ""},
		{"ids are a string", reply(200, `{"token_ids":"1,2"}`), tokenize.ErrUpstream, 502, "not a JSON array"},
		{"ids are strings", reply(200, `{"token_ids":["1"]}`), tokenize.ErrUpstream, 502, "not an integer"},
		{"fraction", reply(200, `{"token_ids":[1.5]}`), tokenize.ErrUpstream, 502, "not an integer"},
		{"exponent", reply(200, `{"token_ids":[1e3]}`), tokenize.ErrUpstream, 502, "not an integer"},
		{"negative", reply(200, `{"token_ids":[3,-1]}`), tokenize.ErrUpstream, 502, "negative"},
		{"above uint32", reply(200, `{"token_ids":[4294967296]}`), tokenize.ErrUpstream, 502, "32 bits"},
		{"huge number", reply(200, `{"token_ids":[123456789012345678901234567890]}`), tokenize.ErrUpstream, 502, "32 bits"},
		{"null ids", reply(200, `{"token_ids":null}`), tokenize.ErrUpstream, 502, "no token_ids"},
		{"missing ids", reply(200, `{"tokens":[1]}`), tokenize.ErrUpstream, 502, "no token_ids"},
		{"ids object", reply(200, `{"token_ids":{"a":1}}`), tokenize.ErrUpstream, 502, ""},
		{"empty list", reply(200, `[]`), tokenize.ErrUpstream, 502, "empty list"},
		{"scalar", reply(200, `42`), tokenize.ErrUpstream, 502, ""},
		{"truncated", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", "1000")
			_, _ = io.WriteString(w, `{"token_ids":[1,2`)
		}, tokenize.ErrUpstream, 502, "reading"},
		{"oversized declared", reply(200, big), tokenize.ErrUpstream, 502, "exceeds"},
		{"oversized chunked", func(w http.ResponseWriter, _ *http.Request) {
			for i := 0; i < 4; i++ {
				_, _ = io.WriteString(w, big[i*len(big)/4:(i+1)*len(big)/4])
				w.(http.Flusher).Flush()
			}
		}, tokenize.ErrUpstream, 502, "exceeds"},
		{"hang up", func(w http.ResponseWriter, _ *http.Request) {
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				_ = conn.Close()
			}
		}, tokenize.ErrUnavailable, 503, ""},
		{"slow", hold, tokenize.ErrTimeout, 504, "no answer within"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := newBackend(t, tc.handler)
			timeout := 10 * time.Second // generous: a loaded machine must not turn a case into a timeout
			if tc.name == "slow" {
				timeout = 100 * time.Millisecond
			}
			c := newClient(t, tokenize.Options{
				Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL,
				Timeout: timeout, MaxResponseBytes: 1024,
			})
			_, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: chatBody("x")})
			require.ErrorIs(t, err, tc.want)
			require.Equal(t, tc.status, tokenize.HTTPStatus(err), "%v", err)
			contains(t, err, "tokenize: ", tc.msg)
			require.LessOrEqual(t, len(err.Error()), 400, "error excerpts are bounded")
		})
	}
	require.Zero(t, other.calls.Load(), "a redirect must never be followed")
}

func TestTransportErrors(t *testing.T) {
	ctx := context.Background()
	req := tokenize.Request{Path: tokenize.PathChatCompletions, Body: chatBody("x")}

	t.Run("connection refused", func(t *testing.T) {
		c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: closedURL(t)})
		_, err := c.Tokenize(ctx, req)
		require.ErrorIs(t, err, tokenize.ErrUnavailable)
		require.Equal(t, 503, tokenize.HTTPStatus(err))
	})
	t.Run("dns failure", func(t *testing.T) {
		hc := &http.Client{Transport: &http.Transport{
			DialContext: func(context.Context, string, string) (net.Conn, error) {
				return nil, &net.OpError{Op: "dial", Net: "tcp", Err: &net.DNSError{Err: "no such host", Name: "renderer.invalid", IsNotFound: true}}
			},
		}}
		c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: "http://renderer.invalid:8000", HTTPClient: hc})
		_, err := c.Tokenize(ctx, req)
		require.ErrorIs(t, err, tokenize.ErrUnavailable)
		contains(t, err, "no such host")
		require.Nil(t, hc.CheckRedirect, "the caller's client is not modified")
	})
	t.Run("caller deadline", func(t *testing.T) {
		b := newBackend(t, func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
		c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL})
		dctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		_, err := c.Tokenize(dctx, req)
		require.ErrorIs(t, err, tokenize.ErrTimeout)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Equal(t, 504, tokenize.HTTPStatus(err))
	})
	t.Run("caller cancel", func(t *testing.T) {
		arrived := make(chan struct{})
		b := newBackend(t, func(w http.ResponseWriter, r *http.Request) {
			close(arrived)
			<-r.Context().Done()
		})
		c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL})
		cctx, cancel := context.WithCancel(ctx)
		go func() {
			<-arrived
			cancel()
		}()
		_, err := c.Tokenize(cctx, req)
		require.ErrorIs(t, err, tokenize.ErrCanceled)
		require.ErrorIs(t, err, context.Canceled)
		require.Equal(t, tokenize.StatusClientClosedRequest, tokenize.HTTPStatus(err))
	})
	t.Run("redirect refused with a caller client", func(t *testing.T) {
		other := newBackend(t, reply(200, renderAnswer(seq(2, 0))))
		b := newBackend(t, func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, other.URL+r.URL.Path, http.StatusPermanentRedirect)
		})
		hc := &http.Client{}
		c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL, HTTPClient: hc})
		_, err := c.Tokenize(ctx, req)
		require.ErrorIs(t, err, tokenize.ErrUpstream)
		require.Zero(t, other.calls.Load())
		hc.CloseIdleConnections()
	})
}

func TestHTTPStatus(t *testing.T) {
	cases := map[error]int{
		nil:                          200,
		tokenize.ErrBadRequest:       400,
		tokenize.ErrUnavailable:      503,
		tokenize.ErrClosed:           503,
		tokenize.ErrTimeout:          504,
		context.DeadlineExceeded:     504,
		tokenize.ErrUpstream:         502,
		tokenize.ErrCanceled:         499,
		context.Canceled:             499,
		tokenize.ErrInvalidOptions:   500,
		errors.New("something else"): 500,
	}
	for err, want := range cases {
		require.Equal(t, want, tokenize.HTTPStatus(err), "%v", err)
		if err != nil {
			require.Equal(t, want, tokenize.HTTPStatus(errors.Join(errors.New("ctx"), err)), "wrapped %v", err)
		}
	}
}

// TestConnectionReuse checks that sequential calls share one keep-alive
// connection.
func TestConnectionReuse(t *testing.T) {
	remotes := make(map[string]int)
	b := newBackend(t, func(w http.ResponseWriter, r *http.Request) {
		remotes[r.RemoteAddr]++ // handlers run one at a time here: calls are sequential
		reply(200, renderAnswer(seq(4, 0)))(w, r)
	})
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL})
	for i := 0; i < 20; i++ {
		res, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: chatBody(strconv.Itoa(i))})
		require.NoError(t, err)
		require.Len(t, res.Tokens, 4)
	}
	require.Len(t, remotes, 1, "one connection for all calls: %v", remotes)
}

func TestTokenizeResultIsTheCallers(t *testing.T) {
	b := newBackend(t, reply(200, `{"token_ids":[1,2,3],"features":{"mm_hashes":{}}}`))
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL})
	r1, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: chatBody("a")})
	require.NoError(t, err)
	r1.Tokens[0] = 99
	r1.Features[0] = 'X'
	r2, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: chatBody("a")})
	require.NoError(t, err)
	require.Equal(t, []uint32{1, 2, 3}, r2.Tokens)
	require.True(t, json.Valid(r2.Features))
}

func TestPathWithQueryStringRoutesLikeItsPath(t *testing.T) {
	b := newBackend(t, reply(200, `{"token_ids":[1,2]}`))
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL})
	res, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions + "?api-version=2024-06-01", Body: chatBody("hi")})
	require.NoError(t, err)
	require.Equal(t, []uint32{1, 2}, res.Tokens)
	require.Equal(t, "/v1/chat/completions/render", b.last(t).Path)
	_, err = c.Tokenize(context.Background(), tokenize.Request{Path: "/v1/embeddings?x=1", Body: chatBody("hi")})
	require.ErrorIs(t, err, tokenize.ErrBadRequest)
}
