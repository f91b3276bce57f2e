package fakeengine

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/clocktest"
)

// pdPrompt is a completions prompt of several blocks and a partial one.
var pdPrompt = sysPrompt

func pdBody(t *testing.T, extra map[string]any) string {
	t.Helper()
	m := map[string]any{"model": DefaultModel, "prompt": pdPrompt, "max_tokens": 4}
	for k, v := range extra {
		m[k] = v
	}
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return string(b)
}

// rawField returns a top-level field of a JSON answer as it was written (block
// hashes do not survive a float64).
func rawField(t *testing.T, data []byte, name string) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(data, &m), "%s", data)
	require.Contains(t, m, name)
	return m[name]
}

// vllmPrefillParams is what a sidecar sends to the prefill leg.
var vllmPrefillParams = map[string]any{
	"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
	"remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
}

func TestPDVLLMPrefillThenDecodePulls(t *testing.T) {
	p := startHTTP(t, Options{PDRole: PDRolePrefill, EngineID: "prefill-a"})
	d := startHTTP(t, Options{PDRole: PDRoleDecode, EngineID: "decode-a"})
	promptLen := len(CompletionTokens(pdPrompt))

	resp, data := p.post(t, "/v1/completions", pdBody(t, map[string]any{
		"kv_transfer_params": vllmPrefillParams, "max_tokens": 1, "stream": false}))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	ans := decodeJSON(t, data)
	raw := rawField(t, data, "kv_transfer_params")
	params := ans["kv_transfer_params"].(map[string]any)
	require.Equal(t, true, params["do_remote_prefill"])
	require.Equal(t, false, params["do_remote_decode"])
	require.Equal(t, "prefill-a", params["remote_engine_id"])
	require.Equal(t, ans["id"], params["remote_request_id"])
	host, port, err := net.SplitHostPort(p.e.HTTPEndpoint())
	require.NoError(t, err)
	require.Equal(t, host, params["remote_host"])
	require.Equal(t, port, strconv.Itoa(num(t, params["remote_port"])))
	require.Equal(t, promptLen, num(t, params["remote_num_tokens"]))
	// The block ids are the prefill engine's hashes, one KV-cache group, exact.
	var blocks struct {
		IDs [][]uint64 `json:"remote_block_ids"`
	}
	require.NoError(t, json.Unmarshal(raw, &blocks))
	require.Equal(t, [][]uint64{p.e.BlockHashes(CompletionTokens(pdPrompt), "", "")}, blocks.IDs)
	require.Equal(t, uint64(1), p.e.HTTPStats().PrefillLegs)

	// The decode leg takes the whole prompt over and computes none of it.
	resp, data = d.post(t, "/v1/completions", pdBody(t, map[string]any{"kv_transfer_params": raw}))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	ds := d.e.HTTPStats()
	require.Equal(t, uint64(1), ds.DecodeLegs)
	require.Equal(t, uint64(promptLen), ds.TransferredTokens)
	require.Zero(t, ds.ComputedTokens)
	require.Equal(t, uint64(1), p.e.HTTPStats().Pulls)

	// The KV is handed over once.
	resp, data = d.post(t, "/v1/completions", pdBody(t, map[string]any{"kv_transfer_params": raw}))
	require.Equal(t, http.StatusBadGateway, resp.StatusCode, "%s", data)
	require.Contains(t, string(data), "holds no KV")
	require.Equal(t, uint64(1), d.e.HTTPStats().DecodeLegs)
}

// A decode engine that has part of the prompt cached pulls only the rest.
func TestPDVLLMDecodePullsOnlyWhatItLacks(t *testing.T) {
	p := startHTTP(t, Options{EngineID: "p"})
	d := startHTTP(t, Options{TransferPerBlock: time.Millisecond})
	toks := CompletionTokens(pdPrompt)
	_, err := d.e.Serve(Request{Tokens: toks[:32]}) // two blocks cached locally
	require.NoError(t, err)

	_, data := p.post(t, "/v1/completions", pdBody(t, map[string]any{"kv_transfer_params": vllmPrefillParams, "max_tokens": 1}))
	params := decodeJSON(t, data)["kv_transfer_params"]
	resp, data := d.post(t, "/v1/completions", pdBody(t, map[string]any{"kv_transfer_params": params}))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	s := d.e.HTTPStats()
	require.Equal(t, uint64(32), s.CachedTokens)
	require.Equal(t, uint64(len(toks)-32), s.TransferredTokens)
	require.Zero(t, s.ComputedTokens)
	// TTFT: the base plus one TransferPerBlock per pulled block, no prefill.
	blocks := (len(toks) - 32 + DefaultBlockSize - 1) / DefaultBlockSize
	want := DefaultTTFTBase + time.Duration(blocks)*time.Millisecond
	require.Equal(t, strconv.FormatFloat(durationMs(want), 'f', 3, 64), resp.Header.Get(HeaderTTFT))
}

func TestPDVLLMHoldExpires(t *testing.T) {
	clock := clocktest.New(time.Unix(1000, 0))
	p := startHTTP(t, Options{Now: clock.Now, KVHoldTimeout: time.Second})
	d := startHTTP(t, Options{})
	_, data := p.post(t, "/v1/completions", pdBody(t, map[string]any{"kv_transfer_params": vllmPrefillParams, "max_tokens": 1}))
	params := decodeJSON(t, data)["kv_transfer_params"]
	clock.Advance(2 * time.Second)
	resp, data := d.post(t, "/v1/completions", pdBody(t, map[string]any{"kv_transfer_params": params}))
	require.Equal(t, http.StatusBadGateway, resp.StatusCode, "%s", data)
	require.Equal(t, uint64(1), p.e.HTTPStats().HoldsExpired)
	require.Zero(t, p.e.HTTPStats().Pulls)
}

// The decode checks that the KV it pulled is its own prompt's.
func TestPDDecodeRefusesAnotherPromptsKV(t *testing.T) {
	p := startHTTP(t, Options{})
	d := startHTTP(t, Options{})
	_, data := p.post(t, "/v1/completions", pdBody(t, map[string]any{"kv_transfer_params": vllmPrefillParams, "max_tokens": 1}))
	params := decodeJSON(t, data)["kv_transfer_params"]
	body := pdBody(t, map[string]any{"kv_transfer_params": params, "prompt": "another prompt entirely"})
	resp, data := d.post(t, "/v1/completions", body)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, "%s", data)
	require.Contains(t, string(data), "another prompt's")
}

func TestPDTRTLLMContextThenGeneration(t *testing.T) {
	p := startHTTP(t, Options{EngineID: "ctx"})
	d := startHTTP(t, Options{})
	msgs := []Message{{"system", sysPrompt}, {"user", "hello"}}
	resp, data := p.post(t, "/v1/chat/completions", chatBodyJSON(t, map[string]any{
		"disaggregated_params": map[string]any{"request_type": "context_only"}, "max_tokens": 1}, msgs...))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	ans := decodeJSON(t, data)
	params := ans["choices"].([]any)[0].(map[string]any)["disaggregated_params"].(map[string]any)
	require.Equal(t, "context_only", params["request_type"])
	require.NotEmpty(t, params["encoded_opaque_state"])
	require.Equal(t, 1, num(t, params["ctx_request_id"]))
	require.Len(t, ans["prompt_token_ids"], len(ApplyChatTemplate(msgs)))

	params["request_type"] = "generation_only"
	resp, data = d.post(t, "/v1/chat/completions", chatBodyJSON(t, map[string]any{
		"disaggregated_params": params, "stream": true}, msgs...))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	require.Equal(t, "[DONE]", sseEvents(t, data)[len(sseEvents(t, data))-1])
	require.Equal(t, uint64(len(ApplyChatTemplate(msgs))), d.e.HTTPStats().TransferredTokens)
	require.Equal(t, uint64(1), d.e.HTTPStats().DecodeLegs)
	require.Equal(t, uint64(1), p.e.HTTPStats().PrefillLegs)
	require.Equal(t, uint64(1), p.e.HTTPStats().Pulls)
}

// sglangRig is an SGLang prefill engine (with its bootstrap server) and a
// decode engine.
type sglangRig struct {
	p, d          *httpRig
	bootstrapPort int
}

func startSGLang(t *testing.T, prefill, decode Options) sglangRig {
	t.Helper()
	prefill.PDRole, decode.PDRole = PDRolePrefill, PDRoleDecode
	p := startHTTP(t, prefill)
	bs := httptest.NewServer(p.e.BootstrapHandler())
	t.Cleanup(bs.Close)
	_, port, err := net.SplitHostPort(bs.Listener.Addr().String())
	require.NoError(t, err)
	n, err := strconv.Atoi(port)
	require.NoError(t, err)
	return sglangRig{p: p, d: startHTTP(t, decode), bootstrapPort: n}
}

func (r sglangRig) body(t *testing.T, room uint64) string {
	return pdBody(t, map[string]any{"bootstrap_host": "127.0.0.1", "bootstrap_port": r.bootstrapPort, "bootstrap_room": room})
}

func TestPDSGLangMeetInTheRoom(t *testing.T) {
	r := startSGLang(t, Options{}, Options{})
	const room = uint64(1) << 62
	// The decode comes first and waits for the prefill to reach the room.
	type result struct {
		status int
		data   []byte
	}
	decoded := make(chan result, 1)
	body := r.body(t, room)
	go func() {
		resp, err := r.d.c.Post(r.d.base+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			decoded <- result{}
			return
		}
		defer resp.Body.Close()
		var b strings.Builder
		_, _ = bufio.NewReader(resp.Body).WriteTo(&b)
		decoded <- result{resp.StatusCode, []byte(b.String())}
	}()
	require.Eventually(t, func() bool { return r.d.e.HTTPStats().Running == 1 }, testTimeout, pollInterval)
	resp, data := r.p.post(t, "/v1/completions", r.body(t, room))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	res := <-decoded
	require.Equal(t, http.StatusOK, res.status, "%s", res.data)
	promptLen := uint64(len(CompletionTokens(pdPrompt)))
	require.Equal(t, promptLen, r.d.e.HTTPStats().TransferredTokens)
	require.Equal(t, uint64(1), r.d.e.HTTPStats().DecodeLegs)
	require.Equal(t, uint64(1), r.p.e.HTTPStats().PrefillLegs)
	require.Equal(t, uint64(1), r.p.e.HTTPStats().Pulls)
}

func TestPDSGLangDecodeGivesUpWithoutPrefill(t *testing.T) {
	r := startSGLang(t, Options{}, Options{KVWaitTimeout: 20 * time.Millisecond})
	resp, data := r.d.post(t, "/v1/completions", r.body(t, 7))
	require.Equal(t, http.StatusBadGateway, resp.StatusCode, "%s", data)
	require.Zero(t, r.d.e.HTTPStats().DecodeLegs)
}

func TestPDSGLangPrefillGivesUpWithoutDecode(t *testing.T) {
	r := startSGLang(t, Options{KVHoldTimeout: 20 * time.Millisecond}, Options{})
	resp, data := r.p.post(t, "/v1/completions", r.body(t, 8))
	require.Equal(t, http.StatusGatewayTimeout, resp.StatusCode, "%s", data)
	require.Equal(t, uint64(1), r.p.e.HTTPStats().HoldsExpired)
	require.Zero(t, r.p.e.HTTPStats().PrefillLegs)
}

func TestPDLegValidation(t *testing.T) {
	anyRole := startHTTP(t, Options{})
	prefill := startHTTP(t, Options{PDRole: PDRolePrefill})
	decode := startHTTP(t, Options{PDRole: PDRoleDecode})
	decodeParams := map[string]any{"do_remote_prefill": true, "remote_engine_id": "x", "remote_request_id": "y",
		"remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": [][]int{{1}}}
	for _, tc := range []struct {
		name  string
		rig   *httpRig
		extra map[string]any
		want  string
	}{
		{"both flags", anyRole, map[string]any{"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": true}}, "both true"},
		{"decode without host", anyRole, map[string]any{"kv_transfer_params": map[string]any{"do_remote_prefill": true, "remote_engine_id": "x", "remote_request_id": "y"}}, "remote_host"},
		{"prefill that streams", anyRole, map[string]any{"kv_transfer_params": vllmPrefillParams, "stream": true}, "must not stream"},
		{"prefill on a decode engine", decode, map[string]any{"kv_transfer_params": vllmPrefillParams}, "decode legs only"},
		{"decode on a prefill engine", prefill, map[string]any{"kv_transfer_params": decodeParams}, "prefill legs only"},
		{"two prompts", anyRole, map[string]any{"kv_transfer_params": vllmPrefillParams, "prompt": []string{"a", "b"}}, "one prompt"},
		{"unknown request_type", anyRole, map[string]any{"disaggregated_params": map[string]any{"request_type": "both"}}, "unknown request_type"},
		{"generation without state", anyRole, map[string]any{"disaggregated_params": map[string]any{"request_type": "generation_only"}}, "encoded_opaque_state"},
		{"bootstrap without a mode", anyRole, map[string]any{"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 1}, "prefill or decode mode"},
		{"bootstrap room negative", decode, map[string]any{"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": -1}, "bootstrap_room"},
		{"two protocols", anyRole, map[string]any{"kv_transfer_params": vllmPrefillParams, "disaggregated_params": map[string]any{"request_type": "context_only"}}, "more than one protocol"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, data := tc.rig.post(t, "/v1/completions", pdBody(t, tc.extra))
			require.Equal(t, http.StatusBadRequest, resp.StatusCode, "%s", data)
			require.Contains(t, string(data), tc.want)
		})
	}
	// kv_transfer_params without either flag is an ordinary request.
	resp, data := anyRole.post(t, "/v1/completions", pdBody(t, map[string]any{"kv_transfer_params": map[string]any{}}))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	require.Zero(t, anyRole.e.HTTPStats().PrefillLegs+anyRole.e.HTTPStats().DecodeLegs)
}

// A client that goes away mid-stream is an abort the engine counts.
func TestPDAbortMidStream(t *testing.T) {
	r := startHTTP(t, Options{TokenInterval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.base+"/v1/completions",
		strings.NewReader(pdBody(t, map[string]any{"stream": true})))
	require.NoError(t, err)
	resp, err := r.c.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(line, "data: "), line)
	cancel()
	require.Eventually(t, func() bool { return r.e.HTTPStats().Aborted == 1 }, testTimeout, pollInterval)
}

func TestPDOptionsValidation(t *testing.T) {
	for _, o := range []Options{
		{PDRole: 9}, {AdvertiseAddr: "nohostport"}, {TransferPerBlock: -1},
		{KVHoldTimeout: -1}, {KVWaitTimeout: -1}, {TokenInterval: -1},
	} {
		_, err := New(o)
		require.ErrorIs(t, err, ErrInvalidOptions, "%+v", o)
	}
	require.Equal(t, "prefill", PDRolePrefill.String())
}
