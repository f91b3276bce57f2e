package tokenize_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/tokenize"
)

// zeroIDs is a JSON array of n zero ids, "[0,0,...]": the cheapest answer per
// id a tokenizer can send (2 bytes each).
func zeroIDs(n int) []byte {
	var b bytes.Buffer
	b.Grow(2*n + 1)
	b.WriteByte('[')
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('0')
	}
	b.WriteByte(']')
	return b.Bytes()
}

func TestPromptTooLongIsA413BadRequest(t *testing.T) {
	err := fmt.Errorf("ctx: %w", tokenize.ErrPromptTooLong)
	require.ErrorIs(t, err, tokenize.ErrBadRequest, "too long is the request's fault")
	require.Equal(t, http.StatusRequestEntityTooLarge, tokenize.HTTPStatus(err))
	require.Equal(t, http.StatusBadRequest, tokenize.HTTPStatus(fmt.Errorf("ctx: %w", tokenize.ErrBadRequest)))

	_, err = tokenize.New(tokenize.Options{Protocol: tokenize.ProtocolSGLang, BaseURL: "http://h:1", MaxPromptTokens: -1})
	require.ErrorIs(t, err, tokenize.ErrInvalidOptions)
	contains(t, err, "max prompt tokens -1")
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolSGLang, BaseURL: "http://h:1"})
	require.Equal(t, tokenize.DefaultMaxPromptTokens, c.MaxPromptTokens())
}

// The id parser stops at the bound: exactly limit ids parse, one more is
// refused, and the refusal of a huge array allocates no more than limit ids.
func TestParseTokenIDsStopsAtTheLimit(t *testing.T) {
	got, err := tokenize.ParseTokenIDsLimit([]byte(`[1,2,3]`), 3)
	require.NoError(t, err)
	require.Equal(t, []uint32{1, 2, 3}, got)
	_, err = tokenize.ParseTokenIDsLimit([]byte(`[1,2,3,4]`), 3)
	require.Error(t, err)
	// Too many valid ids is too many, whatever follows them.
	_, err = tokenize.ParseTokenIDsLimit([]byte(`[1,2,3,4,"x"]`), 3)
	require.ErrorContains(t, err, "limit")

	const n, limit = 4 << 20, 1024
	raw := zeroIDs(n)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err = tokenize.ParseTokenIDsLimit(raw, limit)
	runtime.ReadMemStats(&after)
	require.Error(t, err)
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20),
		"refusing %d ids must not allocate them (%d bytes would)", n, 4*n)
}

// A tokenizer answer of 4M valid ids (8 MB, within the answer bound) is
// refused with ErrPromptTooLong, 413, under the default bound, on every
// protocol; at the bound it is served.
func TestClientRefusesAPromptOverMaxPromptTokens(t *testing.T) {
	huge := zeroIDs(4 << 20)
	for _, p := range tokenize.Protocols() {
		answer := `{"tokens":` + string(huge) + `,"count":4194304}`
		switch p {
		case tokenize.ProtocolVLLMRender:
			answer = `{"token_ids":` + string(huge) + `}`
		case tokenize.ProtocolSGLangRenderer:
			answer = `{"input_ids":` + string(huge) + `}`
		}
		b := newBackend(t, reply(200, answer))
		c := newClient(t, tokenize.Options{Protocol: p, BaseURL: b.URL})
		_, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: chatBody("hi")})
		require.ErrorIs(t, err, tokenize.ErrPromptTooLong, p)
		require.Equal(t, http.StatusRequestEntityTooLarge, tokenize.HTTPStatus(err), p)
		contains(t, err, "1048576", "MaxPromptTokens")
	}

	b := newBackend(t, reply(200, renderAnswer(seq(4, 7))))
	at := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL, MaxPromptTokens: 4})
	res, err := at.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: chatBody("hi")})
	require.NoError(t, err)
	require.Len(t, res.Tokens, 4)
	over := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMRender, BaseURL: b.URL, MaxPromptTokens: 3})
	_, err = over.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathChatCompletions, Body: chatBody("hi")})
	require.ErrorIs(t, err, tokenize.ErrPromptTooLong)

	// A later prompt of a list is bounded too.
	b = newBackend(t, reply(200, `{"tokens":[[1],[1,2,3,4]]}`))
	sg := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolSGLang, BaseURL: b.URL, MaxPromptTokens: 3})
	_, err = sg.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(`{"prompt":["a","b"]}`)})
	require.ErrorIs(t, err, tokenize.ErrPromptTooLong)
}

// A completions prompt sent as ids is bounded before any call.
func TestClientRefusesPromptIDsOverMaxPromptTokens(t *testing.T) {
	b := newBackend(t, reply(200, `{"tokens":[1]}`))
	c := newClient(t, tokenize.Options{Protocol: tokenize.ProtocolVLLMTokenize, BaseURL: b.URL, MaxPromptTokens: 3})
	for _, prompt := range []string{`[1,2,3,4]`, `[[1,2,3,4],[5]]`} {
		_, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(`{"prompt":` + prompt + `}`)})
		require.ErrorIs(t, err, tokenize.ErrPromptTooLong, prompt)
		require.False(t, strings.Contains(err.Error(), prompt), "the client's prompt is never quoted")
	}
	res, err := c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(`{"prompt":[1,2,3]}`)})
	require.NoError(t, err)
	require.Equal(t, []uint32{1, 2, 3}, res.Tokens)
	_, err = c.Tokenize(context.Background(), tokenize.Request{Path: tokenize.PathCompletions, Body: []byte(`{"prompt":[1,"x"]}`)})
	require.NotErrorIs(t, err, tokenize.ErrPromptTooLong)
	require.ErrorIs(t, err, tokenize.ErrBadRequest)
	require.Zero(t, b.calls.Load(), "ids are never sent to the service")
}
