package httproute_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/selection/httproute"
)

func TestParseRequest(t *testing.T) {
	long := strings.Repeat("x", httproute.MaxFieldBytes+1)
	for _, tc := range []struct {
		name, body string
		want       httproute.RequestInfo
		err        string // "" for success
	}{
		{"chat", `{"model":"qwen","messages":[{"role":"user","content":"hi"}]}`, httproute.RequestInfo{Model: "qwen"}, ""},
		{"every field", `{"model":"m","lora_path":"ad-1","cache_salt":"tenant-a","prompt_cache_key":"conv-9","prompt":"x"}`,
			httproute.RequestInfo{Model: "m", LoRA: "ad-1", CacheSalt: "tenant-a", SessionID: "conv-9"}, ""},
		{"nulls", `{"model":null,"lora_path":null,"cache_salt":null,"prompt_cache_key":null}`, httproute.RequestInfo{}, ""},
		{"no fields", `{}`, httproute.RequestInfo{}, ""},
		{"lora list", `{"lora_path":["a","b"]}`, httproute.RequestInfo{LoRA: "a"}, ""},
		{"lora list, first null", `{"lora_path":[null,"b"]}`, httproute.RequestInfo{}, ""},
		{"lora empty list", `{"lora_path":[]}`, httproute.RequestInfo{}, ""},
		{"keys are case-sensitive", `{"Model":"wrong","model":"right"}`, httproute.RequestInfo{Model: "right"}, ""},
		{"the last duplicate wins", `{"model":"a","model":"b"}`, httproute.RequestInfo{Model: "b"}, ""},
		{"user is not a session", `{"user":"alice","safety_identifier":"h"}`, httproute.RequestInfo{}, ""},
		{"escapes", `{"model":"a\u00e9\n"}`, httproute.RequestInfo{Model: "aé\n"}, ""},
		{"empty body", ``, httproute.RequestInfo{}, "not a JSON object"},
		{"null body", `null`, httproute.RequestInfo{}, "not a JSON object"},
		{"array body", `[{"model":"m"}]`, httproute.RequestInfo{}, "not a JSON object"},
		{"truncated", `{"model":"m"`, httproute.RequestInfo{}, "not a JSON object"},
		{"trailing garbage", `{"model":"m"} x`, httproute.RequestInfo{}, "not a JSON object"},
		{"model a number", `{"model":1}`, httproute.RequestInfo{}, `"model" must be a string`},
		{"salt an object", `{"cache_salt":{}}`, httproute.RequestInfo{}, `"cache_salt" must be a string`},
		{"lora a number", `{"lora_path":3}`, httproute.RequestInfo{}, `"lora_path" must be`},
		{"lora list of numbers", `{"lora_path":[3]}`, httproute.RequestInfo{}, `"lora_path" must be`},
		{"model too long", `{"model":"` + long + `"}`, httproute.RequestInfo{}, "longer than"},
		{"lora entry too long", `{"lora_path":["a","` + long + `"]}`, httproute.RequestInfo{}, "longer than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := httproute.ParseRequest([]byte(tc.body))
			if tc.err != "" {
				require.ErrorIs(t, err, httproute.ErrBadRequest)
				require.ErrorContains(t, err, tc.err)
				require.Zero(t, got)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestSessionID(t *testing.T) {
	info := httproute.RequestInfo{SessionID: "from-body"}
	h := http.Header{}
	id := func() string {
		t.Helper()
		s, err := httproute.SessionID(h, info)
		require.NoError(t, err)
		return s
	}
	require.Equal(t, "from-body", id())
	h.Set(httproute.HeaderDynamoSessionID, " dyn ")
	require.Equal(t, "dyn", id())
	h.Set(httproute.HeaderSessionID, "plain")
	require.Equal(t, "plain", id())
	h.Set(httproute.HeaderSessionID, strings.Repeat("s", selection.MaxSessionIDLen))
	require.Len(t, id(), selection.MaxSessionIDLen)
	h.Set(httproute.HeaderSessionID, strings.Repeat("s", selection.MaxSessionIDLen+1))
	_, err := httproute.SessionID(h, info)
	require.ErrorIs(t, err, httproute.ErrBadRequest)
	require.ErrorContains(t, err, "x-session-id is 257 bytes")
	h.Set(httproute.HeaderSessionID, "  ")
	h.Del(httproute.HeaderDynamoSessionID)
	require.Equal(t, "from-body", id())
	info.SessionID = strings.Repeat("k", selection.MaxSessionIDLen+1)
	require.Empty(t, id(), "a long prompt_cache_key is no session")
	h, info = http.Header{}, httproute.RequestInfo{}
	require.Empty(t, id())
}

// FuzzParseRequest: no body makes ParseRequest panic; an accepted body is a
// JSON object whose fields, read by a generic decoder, are the ones returned;
// every string returned is bounded.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"qwen","messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","lora_path":["a",null],"cache_salt":"s","prompt_cache_key":"k"}`,
		`{"lora_path":[]}`, `{"model":null}`, `{"Model":"x"}`, `[]`, `null`, `{"model":1}`, `{"model":"\ud800"}`,
		`{"model":"a","model":"b"}`, `{"lora_path":"` + strings.Repeat("p", httproute.MaxFieldBytes) + `"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		info, err := httproute.ParseRequest(body)
		if err != nil {
			require.ErrorIs(t, err, httproute.ErrBadRequest)
			require.Zero(t, info)
			return
		}
		// Numbers stay text (UseNumber): JSON bounds no number, and a value
		// past float64's range is still a document.
		var generic map[string]any
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.UseNumber()
		require.NoError(t, dec.Decode(&generic), "accepted a body that is no JSON document")
		_, err = dec.Token()
		require.ErrorIs(t, err, io.EOF, "accepted a body with more after its document")
		require.NotNil(t, generic, "accepted a body that is no JSON object")
		str := func(key string) string {
			s, _ := generic[key].(string)
			return s
		}
		require.Equal(t, str("model"), info.Model)
		require.Equal(t, str("cache_salt"), info.CacheSalt)
		require.Equal(t, str("prompt_cache_key"), info.SessionID)
		switch v := generic["lora_path"].(type) {
		case string:
			require.Equal(t, v, info.LoRA)
		case []any:
			if len(v) > 0 {
				s, _ := v[0].(string)
				require.Equal(t, s, info.LoRA)
			} else {
				require.Empty(t, info.LoRA)
			}
		default:
			require.Empty(t, info.LoRA)
		}
		for _, s := range []string{info.Model, info.LoRA, info.CacheSalt, info.SessionID} {
			require.LessOrEqual(t, len(s), httproute.MaxFieldBytes)
		}
	})
}
