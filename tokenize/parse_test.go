package tokenize_test

import (
	"encoding/json"
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/tokenize"
)

func TestParseTokenIDs(t *testing.T) {
	ok := map[string][]uint32{
		`[]`:                      {},
		` [ ] `:                   {},
		`[0]`:                     {0},
		`[-0]`:                    {0},
		"[1,2,\n3]":               {1, 2, 3},
		` [ 4294967295 , 7 ] `:    {math.MaxUint32, 7},
		`[151643,151644,872,198]`: {151643, 151644, 872, 198},
	}
	for in, want := range ok {
		got, err := tokenize.ParseTokenIDs([]byte(in))
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{
		``, `null`, `{}`, `"1"`, `[`, `[1`, `[1,]`, `[,1]`, `[1 2]`, `[1]]`, `[1] x`, `[01]`, `[1.0]`, `[1e2]`,
		`[1E2]`, `[-1]`, `[--1]`, `[-]`, `[4294967296]`, `[99999999999999999999999]`, `["1"]`, `[true]`,
		`[null]`, `[[1]]`, `[+1]`, `[0x10]`,
	} {
		_, err := tokenize.ParseTokenIDs([]byte(in))
		require.Error(t, err, in)
	}
}

func TestParseResponseShapes(t *testing.T) {
	render := func(s string) (tokenize.Result, error) {
		return tokenize.ParseResponse(tokenize.ProtocolVLLMRender, []byte(s))
	}
	res, err := render(`{"token_ids":[1,2],"features":"not an object","cache_salt":5,"sampling_params":{"max_tokens":"x"}}`)
	require.NoError(t, err, "wrong-typed extras are ignored")
	require.Equal(t, []uint32{1, 2}, res.Tokens)
	require.Nil(t, res.Features)
	require.Empty(t, res.CacheSalt)
	require.Zero(t, res.MaxTokens)
	res, err = render(`[{"token_ids":[3]}]`)
	require.NoError(t, err)
	require.Equal(t, []uint32{3}, res.Tokens)
	_, err = render(`[{"token_ids":[3]}, 5]`)
	require.ErrorIs(t, err, tokenize.ErrUpstream)

	sglang := func(s string) (tokenize.Result, error) {
		return tokenize.ParseResponse(tokenize.ProtocolSGLangRenderer, []byte(s))
	}
	res, err = sglang(`{"input_ids":[5,6],"token_ids":[9],"features":{"mm_hashes":{}},"cache_salt":["x"],"sampling_params":{"max_new_tokens":-1,"max_tokens":7}}`)
	require.NoError(t, err, "wrong-typed extras are ignored")
	require.Equal(t, []uint32{5, 6}, res.Tokens, "input_ids, not vLLM's token_ids")
	require.Nil(t, res.Features, "SGLang's answer has no vLLM features")
	require.Empty(t, res.CacheSalt)
	require.Zero(t, res.MaxTokens, "max_new_tokens, not vLLM's max_tokens")
	res, err = sglang(`[{"input_ids":[7]},{"input_ids":[8,9]},{"input_ids":[10]}]`)
	require.NoError(t, err)
	require.Equal(t, []uint32{7}, res.Tokens)
	require.Equal(t, 3, res.PromptCount)
	for _, bad := range []string{`{"token_ids":[1]}`, `{"input_ids":[]}`, `{"input_ids":null}`, `[{"input_ids":[1]},{"input_ids":[-1]}]`, `[]`, `"x"`} {
		_, err := sglang(bad)
		require.ErrorIs(t, err, tokenize.ErrUpstream, bad)
	}

	for _, p := range []string{tokenize.ProtocolVLLMTokenize, tokenize.ProtocolSGLang} {
		_, err := tokenize.ParseResponse(p, []byte(`{"tokens":[],"count":0,"max_model_len":-5}`))
		require.ErrorIs(t, err, tokenize.ErrUpstream, "a prompt has tokens: none is the service's fault")
		_, err = tokenize.ParseResponse(p, []byte(`{"tokens":[[]] }`))
		require.ErrorIs(t, err, tokenize.ErrUpstream)
		res, err := tokenize.ParseResponse(p, []byte(`{"tokens":[[4],[5,6]] }`))
		require.NoError(t, err)
		require.Equal(t, []uint32{4}, res.Tokens)
		for _, bad := range []string{`{"count":1}`, `{"tokens":null}`, `{"tokens":[[1],"x"]}`, `{"tokens":[[1],[-1]]}`, `{"tokens":[[-1]]}`, `[]`, `{"tokens":{}}`} {
			_, err := tokenize.ParseResponse(p, []byte(bad))
			require.ErrorIs(t, err, tokenize.ErrUpstream, "%s %s", p, bad)
		}
	}
}

// referenceIDs decodes raw with encoding/json, the slow obvious way.
func referenceIDs(raw []byte) ([]uint32, bool) {
	var v any
	if err := json.Unmarshal(raw, &v); err != nil || v == nil {
		return nil, false
	}
	var ids []int64
	if err := json.Unmarshal(raw, &ids); err != nil {
		return nil, false
	}
	out := make([]uint32, len(ids))
	for i, id := range ids {
		if id < 0 || id > math.MaxUint32 {
			return nil, false
		}
		out[i] = uint32(id)
	}
	return out, true
}

// FuzzParseTokenIDs checks the hand-written id parser against encoding/json.
func FuzzParseTokenIDs(f *testing.F) {
	for _, s := range []string{`[]`, `[1,2,3]`, `[-0]`, `[4294967295]`, `[4294967296]`, `[1.0]`, `[1e2]`, ` [ 1 ] `, `[01]`, `null`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, err := tokenize.ParseTokenIDs(raw)
		want, ok := referenceIDs(raw)
		if ok != (err == nil) {
			t.Fatalf("%q: parser err=%v, reference ok=%v", raw, err, ok)
		}
		if ok && !equalIDs(got, want) {
			t.Fatalf("%q: parser %v, reference %v", raw, got, want)
		}
	})
}

// FuzzParseResponse feeds arbitrary bodies to every protocol's parser: it must
// never panic, fail only with ErrUpstream, and a success must agree with a
// straightforward encoding/json decode of the id field.
func FuzzParseResponse(f *testing.F) {
	for _, s := range []string{
		`{"token_ids":[1,2,3],"features":null}`,
		`[{"token_ids":[1]},{"token_ids":[2]}]`,
		`{"token_ids":[1],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"image":[{"offset":0,"length":1}]}},"cache_salt":"s","sampling_params":{"max_tokens":9}}`,
		`{"tokens":[5,6],"count":2,"max_model_len":100}`,
		`{"tokens":[[5],[6,7]],"count":[1,2]}`,
		`{"tokens":[-1]}`, `[]`, `{}`, `null`, ``, `{"token_ids":[4294967296]}`,
		`{"rid":"r","input_ids":[1,2],"sampling_params":{"max_new_tokens":128},"cache_salt":"s"}`,
		`[{"input_ids":[1]},{"input_ids":[2,3]}]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, p := range tokenize.Protocols() {
			res, err := tokenize.ParseResponse(p, data)
			if err != nil {
				if !errors.Is(err, tokenize.ErrUpstream) {
					t.Fatalf("%s: error %v does not wrap ErrUpstream", p, err)
				}
				continue
			}
			if res.Tokens == nil || res.PromptCount < 1 || res.MaxTokens < 0 || res.MaxModelLen < 0 {
				t.Fatalf("%s: implausible result %+v", p, res)
			}
			if res.Features != nil && !json.Valid(res.Features) {
				t.Fatalf("%s: features not JSON", p)
			}
			if p == tokenize.ProtocolVLLMRender || p == tokenize.ProtocolSGLangRenderer {
				var one struct {
					TokenIDs []int64 `json:"token_ids"`
					InputIDs []int64 `json:"input_ids"`
				}
				if json.Unmarshal(data, &one) == nil {
					ids := one.TokenIDs
					if p == tokenize.ProtocolSGLangRenderer {
						ids = one.InputIDs
					}
					require.Len(t, res.Tokens, len(ids))
				}
			}
		}
	})
}

// FuzzBuildRequest: any body yields either an error wrapping ErrBadRequest or a
// JSON request for the service; never a panic.
func FuzzBuildRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"x"}]}`,
		`{"prompt":"x"}`, `{"prompt":[[1,2],[3]]}`, `{"prompt":["a","b"]}`, `{"prompt":[1,-2]}`, `{}`, `[]`, `nul`,
	} {
		f.Add([]byte(s), true)
		f.Add([]byte(s), false)
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		path := tokenize.PathCompletions
		if chat {
			path = tokenize.PathChatCompletions
		}
		for _, p := range tokenize.Protocols() {
			_, out, direct, err := tokenize.BuildRequest(p, tokenize.Request{Path: path, Body: body, Model: "m"})
			switch {
			case err != nil:
				if !errors.Is(err, tokenize.ErrBadRequest) {
					t.Fatalf("%s: error %v does not wrap ErrBadRequest", p, err)
				}
			case direct != nil:
				if direct.Tokens == nil {
					t.Fatalf("%s: direct result without tokens", p)
				}
			case !json.Valid(out):
				t.Fatalf("%s: request body is not JSON: %q", p, out)
			}
		}
	})
}
