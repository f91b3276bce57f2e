package sidecar_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/internal/clocktest"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

// Every protocol, chat and completions, streamed and not: the prefill leg goes
// to the hinted engine only, the decode leg takes the KV over (no prompt token
// computed again), the client gets the decode engine's answer with its usage,
// and no orchestration header reaches an engine.
func TestProtocolsEndToEnd(t *testing.T) {
	for _, proto := range sidecar.Protocols {
		for _, chat := range []bool{true, false} {
			for _, stream := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/chat=%v/stream=%v", proto, chat, stream), func(t *testing.T) {
					r := newRig(t, proto, sidecar.Options{}, fakeengine.Options{}, fakeengine.Options{})
					path, body, promptLen := request(t, chat, stream, nil)
					resp, data := r.post(t, path, body, withOrchestration(r.hint()))
					require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
					require.Equal(t, strconv.Itoa(promptLen), resp.Header.Get(fakeengine.HeaderPromptTokens))

					var usage map[string]any
					if stream {
						require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
						events := sseEvents(t, data)
						require.Equal(t, "[DONE]", events[len(events)-1])
						var last map[string]any
						require.NoError(t, json.Unmarshal([]byte(events[len(events)-2]), &last))
						usage = last["usage"].(map[string]any)
					} else {
						var ans map[string]any
						require.NoError(t, json.Unmarshal(data, &ans))
						require.Len(t, ans["choices"], 1)
						require.NotContains(t, ans, "kv_transfer_params", "the client gets the decode answer, not the prefill's")
						usage = ans["usage"].(map[string]any)
					}
					require.Equal(t, float64(promptLen), usage["prompt_tokens"], "usage passes through")
					require.Equal(t, float64(5), usage["completion_tokens"])

					hintedStats, other := r.prefills[1].e.HTTPStats(), r.prefills[0].e.HTTPStats()
					require.Equal(t, uint64(1), hintedStats.PrefillLegs, "the hinted engine served the prefill")
					require.Equal(t, uint64(1), hintedStats.Pulls, "and handed its KV over")
					require.Zero(t, other.Requests, "the other prefill engine saw nothing")
					require.Empty(t, r.prefills[0].log.all())
					ds := r.decode.e.HTTPStats()
					require.Equal(t, uint64(1), ds.DecodeLegs, "the decode leg carried the transfer parameters")
					require.Equal(t, uint64(promptLen), ds.TransferredTokens)
					require.Zero(t, ds.ComputedTokens, "no prompt token was computed twice")
					r.requireNoOrchestration(t)

					st := r.sc.Stats()
					require.Equal(t, uint64(1), st.Disaggregated)
					require.Equal(t, uint64(1), st.Legs[sidecar.LegKey{Leg: sidecar.LegPrefill, Outcome: sidecar.OutcomeOK}])
					require.Equal(t, uint64(1), st.Legs[sidecar.LegKey{Leg: sidecar.LegDecode, Outcome: sidecar.OutcomeOK}])
					require.Equal(t, uint64(1), st.Handoff.Count)
					require.Equal(t, uint64(1), st.Handoff.Cumulative[len(st.Handoff.Cumulative)-1])
				})
			}
		}
	}
}

// What each protocol puts on the wire, read at a recording engine.
func TestPrefillLegBodies(t *testing.T) {
	type captured struct{ prefill, decode map[string]json.RawMessage }
	capture := func(t *testing.T, proto sidecar.Protocol, chat bool, answer string) captured {
		var got captured
		fake := func(dst *map[string]json.RawMessage, answer string) *httptest.Server {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				require.NoError(t, json.NewDecoder(req.Body).Decode(dst))
				w.Header().Set("Content-Type", "application/json")
				_, _ = w.Write([]byte(answer))
			}))
			t.Cleanup(srv.Close)
			return srv
		}
		p := fake(&got.prefill, answer)
		d := fake(&got.decode, `{"choices":[]}`)
		sc, err := sidecar.New(sidecar.Options{Protocol: proto, DecodeURL: d.URL})
		require.NoError(t, err)
		t.Cleanup(sc.Close)
		path, body, _ := request(t, chat, true, map[string]any{"min_tokens": 2, "max_completion_tokens": 9})
		req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
		req.Header.Set(sidecar.HeaderPrefiller, p.Listener.Addr().String())
		rec := httptest.NewRecorder()
		sc.ServeHTTP(rec, req)
		require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
		return got
	}

	t.Run("vllm-nixl", func(t *testing.T) {
		// Block ids beyond 2^53 must reach the decode exactly.
		got := capture(t, sidecar.ProtocolVLLMNIXL, true, `{"kv_transfer_params":{"do_remote_prefill":true,`+
			`"remote_block_ids":[[18446744073709551557]],"remote_engine_id":"e","remote_host":"10.0.0.5","remote_port":5600}}`)
		require.JSONEq(t, `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,`+
			`"remote_block_ids":null,"remote_host":null,"remote_port":null}`, string(got.prefill["kv_transfer_params"]))
		require.Equal(t, "false", string(got.prefill["stream"]))
		require.Equal(t, "1", string(got.prefill["max_tokens"]))
		require.Equal(t, "1", string(got.prefill["max_completion_tokens"]))
		for _, gone := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
			require.NotContains(t, got.prefill, gone)
		}
		require.Contains(t, string(got.decode["kv_transfer_params"]), "18446744073709551557")
		require.Equal(t, "true", string(got.decode["stream"]), "the decode keeps the client's fields")
		require.Equal(t, "2", string(got.decode["min_tokens"]))
		require.Equal(t, "9", string(got.decode["max_completion_tokens"]))
	})
	t.Run("trtllm", func(t *testing.T) {
		got := capture(t, sidecar.ProtocolTRTLLM, false, `{"prompt_token_ids":[1,2,3],"choices":[{"index":0,`+
			`"disaggregated_params":{"request_type":"context_only","ctx_request_id":7,"first_gen_tokens":[42],"encoded_opaque_state":"c3Q="}}]}`)
		require.JSONEq(t, `{"request_type":"context_only"}`, string(got.prefill["disaggregated_params"]))
		require.Equal(t, "false", string(got.prefill["stream"]))
		require.Equal(t, "1", string(got.prefill["max_tokens"]))
		require.NotContains(t, got.prefill, "stream_options")
		require.JSONEq(t, `{"request_type":"generation_only","ctx_request_id":7,"first_gen_tokens":[42],"encoded_opaque_state":"c3Q="}`,
			string(got.decode["disaggregated_params"]))
		require.Equal(t, "[1,2,3]", string(got.decode["prompt"]), "the context's prompt ids replace the prompt")
	})
	t.Run("sglang", func(t *testing.T) {
		got := capture(t, sidecar.ProtocolSGLang, true, `{}`)
		for _, f := range []string{"bootstrap_host", "bootstrap_port", "bootstrap_room"} {
			require.Equal(t, string(got.prefill[f]), string(got.decode[f]), "both legs carry the same %s", f)
		}
		require.Equal(t, `"127.0.0.1"`, string(got.prefill["bootstrap_host"]))
		require.Equal(t, strconv.Itoa(sidecar.DefaultSGLangBootstrapPort), string(got.prefill["bootstrap_port"]))
		room, err := strconv.ParseUint(string(got.prefill["bootstrap_room"]), 10, 64)
		require.NoError(t, err)
		require.Less(t, room, uint64(1)<<63)
		require.Equal(t, "true", string(got.prefill["stream"]), "SGLang's prefill gets the client's body")
	})
}

// Every malformed hint is answered 502 invalid_epp_metadata, counted by
// reason, and no engine is called.
func TestBadHints(t *testing.T) {
	r := newRig(t, sidecar.ProtocolVLLMNIXL, sidecar.Options{
		AllowedPrefillPrefixes: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128"),
			netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("2001:db8::/32")},
	}, fakeengine.Options{}, fakeengine.Options{})
	path, body, _ := request(t, true, false, nil)
	for _, tc := range []struct {
		values []string
		reason string
	}{
		{[]string{""}, sidecar.HintEmpty},
		{[]string{r.hint(), r.hint()}, sidecar.HintRepeated},
		{[]string{r.hint() + "," + r.prefills[0].addr}, sidecar.HintList},
		{[]string{"10.0.0.1"}, sidecar.HintMalformed},
		{[]string{"2001:db8::1:8000"}, sidecar.HintMalformed},
		{[]string{"[10.0.0.1]:8000"}, sidecar.HintMalformed},
		{[]string{"[2001:DB8::1]:8000"}, sidecar.HintMalformed},
		{[]string{"user@10.0.0.1:8000"}, sidecar.HintMalformed},
		{[]string{"10.0.0.1:8000/v1"}, sidecar.HintPort},
		{[]string{"prefill.default.svc:8000"}, sidecar.HintHostname},
		{[]string{"[fe80::1%eth0]:8000"}, sidecar.HintZone},
		{[]string{"10.0.0.1:0"}, sidecar.HintPort},
		{[]string{"10.0.0.1:65536"}, sidecar.HintPort},
		{[]string{"10.0.0.1:08000"}, sidecar.HintPort},
		{[]string{"169.254.169.254:80"}, sidecar.HintForbiddenAddress},
		{[]string{"0.0.0.0:8000"}, sidecar.HintForbiddenAddress},
		{[]string{"224.0.0.1:8000"}, sidecar.HintForbiddenAddress},
		{[]string{"[ff02::1]:8000"}, sidecar.HintForbiddenAddress},
		{[]string{"255.255.255.255:8000"}, sidecar.HintForbiddenAddress},
		{[]string{"192.168.1.1:8000"}, sidecar.HintNotAllowed},
	} {
		t.Run(strings.Join(tc.values, "+"), func(t *testing.T) {
			before := r.sc.Stats().BadHints[tc.reason]
			h := http.Header{sidecar.HeaderPrefiller: tc.values}
			resp, data := r.post(t, path, body, h)
			require.Equal(t, http.StatusBadGateway, resp.StatusCode, "%s", data)
			require.Equal(t, "invalid_epp_metadata", errorCode(t, data))
			require.Equal(t, before+1, r.sc.Stats().BadHints[tc.reason])
		})
	}
	for _, eng := range []*engine{r.prefills[0], r.prefills[1], r.decode} {
		require.Empty(t, eng.log.all(), "no engine was called")
	}
}

// A client that goes away mid-stream aborts the decode leg at the engine.
func TestCancelMidStreamAbortsDecode(t *testing.T) {
	for _, proto := range sidecar.Protocols {
		t.Run(string(proto), func(t *testing.T) {
			r := newRig(t, proto, sidecar.Options{}, fakeengine.Options{}, fakeengine.Options{TokenInterval: time.Hour})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			path, body, _ := request(t, true, true, nil)
			resp, err := r.client.Do(r.newRequest(t, ctx, path, body, hinted(r.hint())))
			require.NoError(t, err)
			defer resp.Body.Close()
			// The first event arrives while the engine waits an hour for the next:
			// the sidecar flushed it.
			rd := bufio.NewReader(resp.Body)
			line, err := rd.ReadString('\n')
			require.NoError(t, err)
			require.True(t, strings.HasPrefix(line, "data: "), line)
			cancel()
			require.Eventually(t, func() bool { return r.decode.e.HTTPStats().Aborted == 1 }, testTimeout, pollInterval)
			require.Equal(t, uint64(1), r.prefills[1].e.HTTPStats().PrefillLegs, "the prefill leg had finished")
			require.Eventually(t, func() bool {
				return r.sc.Stats().Legs[sidecar.LegKey{Leg: sidecar.LegDecode, Outcome: sidecar.OutcomeCanceled}] == 1
			}, testTimeout, pollInterval)
		})
	}
}

// A client that goes away during the prefill aborts it at the engine; the
// decode leg is never sent (vLLM, TensorRT-LLM) or is aborted too (SGLang).
func TestCancelDuringPrefillAbortsBothLegs(t *testing.T) {
	for _, proto := range sidecar.Protocols {
		t.Run(string(proto), func(t *testing.T) {
			slow := fakeengine.Options{SleepTTFT: true, TTFTBase: time.Hour}
			r := newRig(t, proto, sidecar.Options{}, slow, fakeengine.Options{})
			ctx, cancel := context.WithCancel(context.Background())
			path, body, _ := request(t, false, false, nil)
			done := make(chan error, 1)
			req := r.newRequest(t, ctx, path, body, hinted(r.hint()))
			go func() {
				resp, err := r.client.Do(req)
				if err == nil {
					resp.Body.Close()
				}
				done <- err
			}()
			sglang := proto == sidecar.ProtocolSGLang
			require.Eventually(t, func() bool {
				return r.prefills[1].e.HTTPStats().Running == 1 && (!sglang || r.decode.e.HTTPStats().Running == 1)
			}, testTimeout, pollInterval)
			cancel()
			require.Error(t, <-done)
			require.Eventually(t, func() bool { return r.prefills[1].e.HTTPStats().Aborted == 1 }, testTimeout, pollInterval)
			if sglang {
				require.Eventually(t, func() bool { return r.decode.e.HTTPStats().Aborted == 1 }, testTimeout, pollInterval)
			} else {
				require.Zero(t, r.decode.e.HTTPStats().Requests, "no decode leg after a canceled prefill")
			}
			require.Eventually(t, func() bool {
				return r.sc.Stats().Legs[sidecar.LegKey{Leg: sidecar.LegPrefill, Outcome: sidecar.OutcomeCanceled}] == 1
			}, testTimeout, pollInterval)
		})
	}
}

// hangUp returns the address of a server that closes every connection without
// answering (a port that is merely closed could be reused by another server).
func hangUp(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close()
		}
	}))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

// A prefill leg that fails (the engine hangs up) or times out falls back to a
// local prefill or is answered 502, as configured.
func TestPrefillFailureFallback(t *testing.T) {
	dead := hangUp(t)

	for _, proto := range sidecar.Protocols {
		for _, fallback := range []sidecar.Fallback{sidecar.FallbackLocal, sidecar.FallbackFail} {
			for _, failure := range []string{"refused", "timeout"} {
				t.Run(fmt.Sprintf("%s/%s/%s", proto, fallback, failure), func(t *testing.T) {
					po := fakeengine.Options{}
					so := sidecar.Options{Fallback: fallback}
					if failure == "timeout" {
						po = fakeengine.Options{SleepTTFT: true, TTFTBase: time.Hour}
						so.PrefillTimeout = 50 * time.Millisecond
					}
					r := newRig(t, proto, so, po, fakeengine.Options{})
					hint := r.hint()
					if failure == "refused" {
						hint = dead
					}
					path, body, promptLen := request(t, false, false, nil)
					resp, data := r.post(t, path, body, hinted(hint))
					st := r.sc.Stats()
					want := map[string]sidecar.Outcome{"refused": sidecar.OutcomeError, "timeout": sidecar.OutcomeTimeout}[failure]
					require.Equal(t, uint64(1), st.Legs[sidecar.LegKey{Leg: sidecar.LegPrefill, Outcome: want}], "%+v", st.Legs)
					ds := r.decode.e.HTTPStats()
					require.Zero(t, ds.DecodeLegs)
					require.Equal(t, gaie.FailedLegPrefill, resp.Header.Get(gaie.HeaderFailedLeg),
						"the picker is told to blame the prefill worker, not this decode worker")
					if fallback == sidecar.FallbackLocal {
						require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
						require.Equal(t, uint64(1), st.Fallbacks)
						require.Zero(t, ds.TransferredTokens)
						if proto != sidecar.ProtocolSGLang { // (the dropped SGLang decode leg cached some blocks)
							require.Equal(t, uint64(promptLen), ds.ComputedTokens, "the decode engine prefilled locally")
						}
						require.Equal(t, uint64(1), st.Legs[sidecar.LegKey{Leg: sidecar.LegDecode, Outcome: sidecar.OutcomeOK}])
						return
					}
					require.Equal(t, http.StatusBadGateway, resp.StatusCode, "%s", data)
					wantCode := map[string]string{"refused": "prefill_upstream_unavailable", "timeout": "prefill_upstream_timeout"}[failure]
					require.Equal(t, wantCode, errorCode(t, data))
					require.Zero(t, st.Fallbacks)
					if proto != sidecar.ProtocolSGLang {
						require.Zero(t, ds.Requests, "no decode leg")
					}
				})
			}
		}
	}
}

// A prefill answer without a usable hand-over, too large, or an error status
// fails the leg with its own code, and its body never reaches the client.
func TestPrefillBadAnswers(t *testing.T) {
	for _, tc := range []struct {
		name   string
		proto  sidecar.Protocol
		status int
		answer string
		code   string
	}{
		{"no params", sidecar.ProtocolVLLMNIXL, 200, `{"choices":[]}`, "invalid_prefill_handoff"},
		{"params not an object", sidecar.ProtocolVLLMNIXL, 200, `{"kv_transfer_params":"x"}`, "invalid_prefill_handoff"},
		{"prefill flag missing", sidecar.ProtocolVLLMNIXL, 200, `{"kv_transfer_params":{"remote_engine_id":"e"}}`, "invalid_prefill_handoff"},
		{"not json", sidecar.ProtocolVLLMNIXL, 200, `data: {}`, "invalid_prefill_handoff"},
		{"no disaggregated params", sidecar.ProtocolTRTLLM, 200, `{"choices":[{"index":0}]}`, "invalid_prefill_handoff"},
		{"too large", sidecar.ProtocolVLLMNIXL, 200, `{"pad":"` + strings.Repeat("x", 2048) + `"}`, "prefill_response_too_large"},
		{"engine error", sidecar.ProtocolVLLMNIXL, 503, `{"error":{"message":"the prompt was: SECRET"}}`, "prefill_upstream_error"},
		{"sglang engine error", sidecar.ProtocolSGLang, 500, `{"error":{"message":"the prompt was: SECRET"}}`, "prefill_upstream_error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				w.WriteHeader(tc.status)
				_, _ = w.Write([]byte(tc.answer))
			}))
			defer p.Close()
			d := startEngine(t, fakeengine.Options{PDRole: fakeengine.PDRoleDecode})
			// An SGLang decode waits at a bootstrap server that never answers, as
			// it would for a prefill that fails.
			bootstrap := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
			defer bootstrap.Close()
			sc, err := sidecar.New(sidecar.Options{Protocol: tc.proto, DecodeURL: "http://" + d.addr, MaxPrefillResponseBytes: 1024,
				SGLangBootstrapPort: port(t, bootstrap.Listener.Addr().String())})
			require.NoError(t, err)
			defer sc.Close()
			path, body, _ := request(t, false, false, nil)
			req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
			req.Header.Set(sidecar.HeaderPrefiller, p.Listener.Addr().String())
			rec := httptest.NewRecorder()
			sc.ServeHTTP(rec, req)
			require.Equal(t, http.StatusBadGateway, rec.Code, rec.Body.String())
			require.Equal(t, tc.code, errorCode(t, rec.Body.Bytes()))
			require.NotContains(t, rec.Body.String(), "SECRET")
			if tc.proto != sidecar.ProtocolSGLang {
				require.Empty(t, d.log.all(), "no decode leg")
			}
		})
	}
}

// With a key, only hints signed for this prefill endpoint, this sidecar (among
// the destinations the EPP routed the request to), this path and body, live,
// issued since the sidecar started and fresh, run the protocol.
func TestSignedHints(t *testing.T) {
	key := bytes.Repeat([]byte{7}, pdhint.MinKeyLen)
	clock := clocktest.New(time.Unix(1_800_000_000, 0))
	r := newRig(t, sidecar.ProtocolVLLMNIXL, sidecar.Options{HintKey: key, Now: clock.Now}, fakeengine.Options{}, fakeengine.Options{})
	path, body, _ := request(t, false, false, nil)
	self := strings.TrimPrefix(r.base, "http://") // the endpoint the EPP routed to: this sidecar
	const elsewhere = "10.9.9.9:8000"             // another decode sidecar holding the same key
	claim := func(dests ...string) pdhint.Claim {
		return pdhint.Claim{Prefiller: r.hint(), Destinations: dests, Path: path, Body: []byte(body)}
	}
	sign := func(k []byte, c pdhint.Claim, issued time.Time, ttl time.Duration) string {
		v, err := pdhint.Sign(k, c, issued, clock.Now().Add(ttl), pdhint.NewNonce())
		require.NoError(t, err)
		return v
	}
	send := func(base string, dests []string, sigs ...string) (*http.Response, []byte) {
		h := hinted(r.hint())
		for _, d := range dests {
			h.Add(sidecar.HeaderDestination, d)
		}
		for _, s := range sigs {
			h.Add(sidecar.HeaderSignature, s)
		}
		req := r.newRequest(t, context.Background(), path, body, h)
		req.URL.Host = strings.TrimPrefix(base, "http://")
		resp, err := r.client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		var b bytes.Buffer
		_, err = b.ReadFrom(resp.Body)
		require.NoError(t, err)
		return resp, b.Bytes()
	}
	now := clock.Now()

	// Signed for this sidecar: with the destination header, without it (the
	// gateway dropped it), and as the fallback of another sidecar.
	good := sign(key, claim(self), now, 30*time.Second)
	for _, tc := range []struct {
		name  string
		dests []string
		sig   string
	}{
		{"destination header", []string{self}, good},
		{"no destination header", nil, sign(key, claim(self), now, 30*time.Second)},
		{"a fallback", []string{elsewhere + "," + self}, sign(key, claim(elsewhere, self), now, 30*time.Second)},
	} {
		resp, data := send(r.base, tc.dests, tc.sig)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", tc.name, data)
	}
	require.Equal(t, uint64(3), r.decode.e.HTTPStats().DecodeLegs)

	for _, tc := range []struct {
		name   string
		dests  []string
		sigs   []string
		reason string
	}{
		{"replayed", []string{self}, []string{good}, sidecar.HintReplayed},
		{"unsigned", nil, nil, sidecar.HintUnsigned},
		{"two signatures", nil, []string{sign(key, claim(self), now, time.Minute), sign(key, claim(self), now, time.Minute)}, sidecar.HintSignatureRepeated},
		{"other key", nil, []string{sign(bytes.Repeat([]byte{8}, pdhint.MinKeyLen), claim(self), now, time.Minute)}, sidecar.HintForged},
		{"other prefill endpoint", nil, []string{sign(key, pdhint.Claim{Prefiller: r.prefills[0].addr, Destinations: []string{self}, Path: path, Body: []byte(body)}, now, time.Minute)}, sidecar.HintForged},
		{"other body", nil, []string{sign(key, pdhint.Claim{Prefiller: r.hint(), Destinations: []string{self}, Path: path, Body: []byte(`{"prompt":"x"}`)}, now, time.Minute)}, sidecar.HintForged},
		{"other path", nil, []string{sign(key, pdhint.Claim{Prefiller: r.hint(), Destinations: []string{self}, Path: "/v1/chat/completions", Body: []byte(body)}, now, time.Minute)}, sidecar.HintForged},
		{"signed for another sidecar", nil, []string{sign(key, claim(elsewhere), now, time.Minute)}, sidecar.HintForged},
		{"signed for another sidecar, its destination header", []string{elsewhere}, []string{sign(key, claim(elsewhere), now, time.Minute)}, sidecar.HintWrongDestination},
		{"destination header twice", []string{self, self}, []string{sign(key, claim(self), now, time.Minute)}, sidecar.HintWrongDestination},
		{"destinations not as signed", []string{self + "," + elsewhere}, []string{sign(key, claim(self), now, time.Minute)}, sidecar.HintForged},
		{"expired", nil, []string{sign(key, claim(self), now.Add(-time.Minute), -time.Second)}, sidecar.HintExpired},
		{"too long-lived", nil, []string{sign(key, claim(self), now, time.Hour)}, sidecar.HintTooLongLived},
		{"issued before the sidecar started", nil, []string{sign(key, claim(self), now.Add(-2*time.Second), time.Minute)}, sidecar.HintStale},
		{"malformed", nil, []string{"v2.x"}, sidecar.HintSignatureBad},
		{"version 1", nil, []string{"v1.1800000030.AAAAAAAAAAAAAAAAAAAAAA.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"}, sidecar.HintSignatureBad},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := r.sc.Stats().BadHints[tc.reason]
			resp, data := send(r.base, tc.dests, tc.sigs...)
			require.Equal(t, http.StatusBadGateway, resp.StatusCode, "%s", data)
			require.Equal(t, "invalid_epp_metadata", errorCode(t, data))
			require.Equal(t, before+1, r.sc.Stats().BadHints[tc.reason])
		})
	}
	require.Equal(t, uint64(3), r.prefills[1].e.HTTPStats().Requests, "only the signed requests reached an engine")

	// The sidecar restarts (its replay cache empty), at the same endpoint
	// (HintAudience, as its listener now has another port): the hint it took
	// before is stale; one issued since is taken.
	clock.Advance(10 * time.Second)
	restarted, err := sidecar.New(sidecar.Options{DecodeURL: "http://" + r.decode.addr, HintKey: key, Now: clock.Now,
		HintAudience: netip.MustParseAddrPort(self)})
	require.NoError(t, err)
	defer restarted.Close()
	front := httptest.NewServer(restarted)
	defer front.Close()
	resp, data := send(front.URL, []string{self}, good)
	require.Equal(t, http.StatusBadGateway, resp.StatusCode, "%s", data)
	require.Equal(t, uint64(1), restarted.Stats().BadHints[sidecar.HintStale])
	resp, data = send(front.URL, []string{self}, sign(key, claim(self), clock.Now(), 30*time.Second))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)

	// A signature expires with the clock.
	late := sign(key, claim(self), clock.Now(), 10*time.Second)
	clock.Advance(10 * time.Second)
	resp, data = send(r.base, nil, late)
	require.Equal(t, http.StatusBadGateway, resp.StatusCode, "%s", data)
	require.Equal(t, uint64(2), r.sc.Stats().BadHints[sidecar.HintExpired])
}

// Without a hint (or off the completion paths) requests go to the decode engine
// as they came, less the orchestration headers.
func TestPassthrough(t *testing.T) {
	r := newRig(t, sidecar.ProtocolVLLMNIXL, sidecar.Options{MaxRequestBytes: 4096}, fakeengine.Options{}, fakeengine.Options{})
	get := func(path string, h http.Header) (*http.Response, []byte) {
		req, err := http.NewRequest(http.MethodGet, r.base+path, nil)
		require.NoError(t, err)
		req.Header = h
		resp, err := r.client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		var b bytes.Buffer
		_, err = b.ReadFrom(resp.Body)
		require.NoError(t, err)
		return resp, b.Bytes()
	}
	h := withOrchestration(r.hint()) // a hint on GET /v1/models is no P/D request
	resp, data := get("/v1/models", h)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	require.Contains(t, string(data), fakeengine.DefaultModel)
	resp, _ = get("/health", withOrchestration(r.hint()))
	require.Equal(t, http.StatusOK, resp.StatusCode)

	h = withOrchestration(r.hint())
	h.Del(sidecar.HeaderPrefiller)
	for _, stream := range []bool{false, true} {
		path, body, promptLen := request(t, true, stream, nil)
		resp, data = r.post(t, path, body, h)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
		require.Equal(t, strconv.Itoa(promptLen), resp.Header.Get(fakeengine.HeaderPromptTokens))
	}
	r.requireNoOrchestration(t)
	require.Empty(t, r.prefills[1].log.all())
	st := r.sc.Stats()
	require.Equal(t, uint64(4), st.Passthrough)
	require.Equal(t, uint64(4), st.Legs[sidecar.LegKey{Leg: sidecar.LegPassthrough, Outcome: sidecar.OutcomeOK}])

	// Bodies are bounded on this path too.
	resp, data = r.post(t, "/v1/completions", `{"prompt":"`+strings.Repeat("a ", 4096)+`"}`, nil)
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode, "%s", data)
	require.Equal(t, uint64(1), r.sc.Stats().Refused[sidecar.RefusedBodyTooLarge])
}

// A decode engine that is down is answered 502 decode_upstream_error.
func TestDecodeDown(t *testing.T) {
	sc, err := sidecar.New(sidecar.Options{DecodeURL: "http://" + hangUp(t)})
	require.NoError(t, err)
	defer sc.Close()
	rec := httptest.NewRecorder()
	sc.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/v1/models", nil))
	require.Equal(t, http.StatusBadGateway, rec.Code)
	require.Equal(t, "decode_upstream_error", errorCode(t, rec.Body.Bytes()))
	require.Equal(t, uint64(1), sc.Stats().Legs[sidecar.LegKey{Leg: sidecar.LegPassthrough, Outcome: sidecar.OutcomeError}])
}

// Requests the P/D protocols cannot carry are refused before any leg.
func TestRefusals(t *testing.T) {
	for _, tc := range []struct {
		proto  sidecar.Protocol
		chat   bool
		body   string
		status int
		reason string
	}{
		{sidecar.ProtocolVLLMNIXL, true, `[1,2]`, 400, sidecar.RefusedNotJSONObject},
		{sidecar.ProtocolVLLMNIXL, true, `null`, 400, sidecar.RefusedNotJSONObject},
		{sidecar.ProtocolVLLMNIXL, true, `{"messages":[],"stream":"yes"}`, 400, sidecar.RefusedBadStream},
		{sidecar.ProtocolVLLMNIXL, true, `{"messages":[],"n":2}`, 400, sidecar.RefusedNotOneChoice},
		{sidecar.ProtocolVLLMNIXL, false, `{"prompt":["a","b"]}`, 400, sidecar.RefusedBatchPrompt},
		{sidecar.ProtocolVLLMNIXL, false, `{"prompt":"a","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.1.1.1"}}`, 400, sidecar.RefusedTransferParams},
		{sidecar.ProtocolSGLang, false, `{"prompt":"a","bootstrap_host":"10.1.1.1"}`, 400, sidecar.RefusedTransferParams},
		{sidecar.ProtocolTRTLLM, false, `{"prompt":"a","disaggregated_params":{"request_type":"generation_only"}}`, 400, sidecar.RefusedTransferParams},
		{sidecar.ProtocolVLLMNIXL, false, `{"prompt":"` + strings.Repeat("a", 2048) + `"}`, 413, sidecar.RefusedBodyTooLarge},
	} {
		t.Run(tc.reason, func(t *testing.T) {
			r := newRig(t, tc.proto, sidecar.Options{MaxRequestBytes: 1024}, fakeengine.Options{}, fakeengine.Options{})
			path := "/v1/completions"
			if tc.chat {
				path = "/v1/chat/completions"
			}
			resp, data := r.post(t, path, tc.body, hinted(r.hint()))
			require.Equal(t, tc.status, resp.StatusCode, "%s", data)
			require.NotEmpty(t, errorCode(t, data))
			require.Equal(t, uint64(1), r.sc.Stats().Refused[tc.reason])
			for _, eng := range []*engine{r.prefills[0], r.prefills[1], r.decode} {
				require.Empty(t, eng.log.all())
			}
		})
	}
	// kv_transfer_params: {} or null is no hand-over: tolerated.
	r := newRig(t, sidecar.ProtocolVLLMNIXL, sidecar.Options{}, fakeengine.Options{}, fakeengine.Options{})
	path, body, _ := request(t, false, false, map[string]any{"kv_transfer_params": map[string]any{}})
	resp, data := r.post(t, path, body, hinted(r.hint()))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
}

// An IPv6 hint works end to end: the prefill leg dials the bracketed address,
// the decode pulls from it, and SGLang's bootstrap_host is bracketed.
func TestIPv6Hint(t *testing.T) {
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback here: %v", err)
	}
	require.NoError(t, ln.Close())
	for _, proto := range []sidecar.Protocol{sidecar.ProtocolVLLMNIXL, sidecar.ProtocolSGLang} {
		t.Run(string(proto), func(t *testing.T) {
			listen6 := func(h http.Handler) *httptest.Server {
				srv := httptest.NewUnstartedServer(h)
				l, err := net.Listen("tcp", "[::1]:0")
				require.NoError(t, err)
				srv.Listener.Close()
				srv.Listener = l
				srv.Start()
				t.Cleanup(srv.Close)
				return srv
			}
			p, err := fakeengine.New(fakeengine.Options{PDRole: fakeengine.PDRolePrefill})
			require.NoError(t, err)
			psrv := listen6(p.Handler())
			bs := listen6(p.BootstrapHandler())
			d := startEngine(t, fakeengine.Options{PDRole: fakeengine.PDRoleDecode})
			sc, err := sidecar.New(sidecar.Options{Protocol: proto, DecodeURL: "http://" + d.addr,
				SGLangBootstrapPort: port(t, bs.Listener.Addr().String())})
			require.NoError(t, err)
			defer sc.Close()
			hint := psrv.Listener.Addr().String()
			require.True(t, strings.HasPrefix(hint, "[::1]:"), hint)
			path, body, promptLen := request(t, false, false, nil)
			req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
			req.Header.Set(sidecar.HeaderPrefiller, hint)
			rec := httptest.NewRecorder()
			sc.ServeHTTP(rec, req)
			require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
			require.Equal(t, uint64(1), p.HTTPStats().PrefillLegs)
			require.Equal(t, uint64(promptLen), d.e.HTTPStats().TransferredTokens)
		})
	}
}

func TestOptionsValidation(t *testing.T) {
	_, err := sidecar.New(sidecar.Options{
		Protocol: "grpc", Fallback: "maybe", DecodeURL: "ftp://x", PrefillTimeout: -1, DecodeTimeout: -1,
		BodyReadTimeout: -1, DialTimeout: -1, MaxRequestBytes: -1, MaxPrefillResponseBytes: -1,
		SGLangBootstrapPort: 70000, AllowedPrefillPrefixes: []netip.Prefix{{}}, HintKey: []byte("short"),
		HintMaxLifetime: -1, HintReplayCache: -1,
	})
	require.ErrorIs(t, err, sidecar.ErrInvalidOptions)
	for _, name := range []string{"Protocol", "Fallback", "DecodeURL", "PrefillTimeout", "DecodeTimeout", "BodyReadTimeout",
		"DialTimeout", "MaxRequestBytes", "MaxPrefillResponseBytes", "SGLangBootstrapPort", "AllowedPrefillPrefixes",
		"HintKey", "HintMaxLifetime", "HintReplayCache"} {
		require.Contains(t, err.Error(), name)
	}
	sc, err := sidecar.New(sidecar.Options{})
	require.NoError(t, err, "the zero value is valid")
	sc.Close()
	p, err := sidecar.ParseProtocol("sglang")
	require.NoError(t, err)
	require.Equal(t, sidecar.ProtocolSGLang, p)
	_, err = sidecar.ParseFallback("local")
	require.NoError(t, err)
}

// The counters hold every reason, counted or not.
func TestStatsListEveryReason(t *testing.T) {
	sc, err := sidecar.New(sidecar.Options{})
	require.NoError(t, err)
	defer sc.Close()
	st := sc.Stats()
	require.Contains(t, st.BadHints, sidecar.HintForged)
	require.Contains(t, st.Refused, sidecar.RefusedBatchPrompt)
	require.Equal(t, sidecar.HandoffBuckets, st.Handoff.Bounds)
	require.Equal(t, sidecar.ProtocolVLLMNIXL, st.Protocol)
}
