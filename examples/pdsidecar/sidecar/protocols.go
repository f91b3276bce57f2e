package sidecar

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
)

// vllmPrefillParams are the kv_transfer_params of vLLM's prefill leg: the
// decode is remote, the other fields are the prefill engine's to fill (vLLM's
// toy_proxy_server.py sends the same).
var vllmPrefillParams = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,` +
	`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// trtContextParams mark TensorRT-LLM's context (prefill) request.
var trtContextParams = json.RawMessage(`{"request_type":"context_only"}`)

// sequential runs vLLM's and TensorRT-LLM's protocol: the prefill leg to the
// hinted engine, then the decode leg with the hand-over its answer carries.
func (s *Sidecar) sequential(w http.ResponseWriter, r *http.Request, x *exchange) {
	pbody, err := s.prefillBody(x)
	if err != nil {
		s.refuse(w, r, http.StatusInternalServerError, RefusedInternal, "the prefill request could not be built")
		return
	}
	res := s.prefill(r.Context(), r, x, pbody, true)
	var dbody []byte
	if res.outcome == OutcomeOK {
		var why string
		if dbody, why = s.decodeBody(x, res.answer); why != "" {
			res.outcome, res.detail = OutcomeBadResponse, why
		}
	}
	s.finishPrefill(r, x, res)
	if res.outcome != OutcomeOK {
		s.prefillFailed(w, r, x, res)
		return
	}
	s.decode(w, r, x.header, dbody)
}

// prefillBody is the prefill leg's body: the client's, not streamed, one token,
// marked as the prefill of a remote decode.
func (s *Sidecar) prefillBody(x *exchange) ([]byte, error) {
	set := map[string]any{"stream": false, "max_tokens": 1}
	if s.opts.Protocol == ProtocolTRTLLM {
		set["disaggregated_params"] = trtContextParams
		if _, ok := x.body["max_completion_tokens"]; ok {
			set["max_completion_tokens"] = 1
		}
		return edit(x.body, set, "stream_options")
	}
	set["kv_transfer_params"] = vllmPrefillParams
	if x.chat {
		set["max_completion_tokens"] = 1 // vLLM prefers it to max_tokens
	}
	// min_tokens would contradict the one-token budget; the decode keeps them.
	return edit(x.body, set, "stream_options", "min_tokens", "min_completion_tokens")
}

// decodeBody is the decode leg's body: the client's, with the hand-over the
// prefill answered. It returns why there is none instead.
func (s *Sidecar) decodeBody(x *exchange, ans map[string]json.RawMessage) ([]byte, string) {
	if s.opts.Protocol == ProtocolTRTLLM {
		return trtDecodeBody(x, ans)
	}
	params := ans["kv_transfer_params"]
	var flags struct {
		DoRemotePrefill *bool `json:"do_remote_prefill"`
	}
	if len(params) == 0 || params[0] != '{' || json.Unmarshal(params, &flags) != nil ||
		flags.DoRemotePrefill == nil || !*flags.DoRemotePrefill {
		return nil, "the prefill answer has no kv_transfer_params with do_remote_prefill"
	}
	b, err := edit(x.body, map[string]any{"kv_transfer_params": params})
	if err != nil {
		return nil, err.Error()
	}
	return b, ""
}

// trtDecodeBody builds TensorRT-LLM's generation_only request: the context
// answer's first-choice disaggregated_params, re-typed, and its prompt token
// ids in place of the prompt when it returned them.
func trtDecodeBody(x *exchange, ans map[string]json.RawMessage) ([]byte, string) {
	var choices []map[string]json.RawMessage
	var params map[string]json.RawMessage
	if json.Unmarshal(ans["choices"], &choices) != nil || len(choices) == 0 ||
		json.Unmarshal(choices[0]["disaggregated_params"], &params) != nil || params == nil {
		return nil, "the context answer has no disaggregated_params in its first choice"
	}
	params["request_type"] = json.RawMessage(`"generation_only"`)
	set := map[string]any{"disaggregated_params": params}
	if ids := ans["prompt_token_ids"]; len(ids) > 0 && ids[0] == '[' {
		if x.chat {
			set["prompt_token_ids"] = ids
		} else {
			set["prompt"] = ids
		}
	}
	b, err := edit(x.body, set)
	if err != nil {
		return nil, err.Error()
	}
	return b, ""
}

// bootstrapHost is the hint's host as SGLang's mini_lb writes it: an IPv6
// address in brackets.
func bootstrapHost(x *exchange) string {
	a := x.hint.Addr()
	if a.Is6() {
		return "[" + a.String() + "]"
	}
	return a.String()
}

// room draws a bootstrap_room: 63 random bits, as SGLang's mini_lb does.
func (s *Sidecar) room() (uint64, error) {
	var b [8]byte
	if _, err := io.ReadFull(s.opts.Rand, b[:]); err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint64(b[:]) &^ (1 << 63), nil
}

// concurrent runs SGLang's protocol: the same body, with bootstrap_host (the
// hint's host), bootstrap_port and a fresh bootstrap_room, goes to the prefill
// and the decode engine at once. The client gets the decode answer, but only
// once the prefill leg has succeeded; until then the decode answer waits
// unread. When either leg fails the other is dropped, and a failed prefill is
// answered like the sequential protocols' (fallback or 502). Both legs'
// goroutines end before concurrent returns.
func (s *Sidecar) concurrent(w http.ResponseWriter, r *http.Request, x *exchange) {
	room, err := s.room()
	var body []byte
	if err == nil {
		body, err = edit(x.body, map[string]any{
			"bootstrap_host": bootstrapHost(x),
			"bootstrap_port": s.opts.SGLangBootstrapPort,
			"bootstrap_room": room,
		})
	}
	if err != nil {
		s.refuse(w, r, http.StatusInternalServerError, RefusedInternal, "the SGLang requests could not be built")
		return
	}
	prefillCtx, cancelPrefill := context.WithCancel(r.Context())
	defer cancelPrefill()
	decodeCtx, cancelDecode := context.WithCancel(r.Context())
	defer cancelDecode()
	prefilled := make(chan prefillResult, 1)
	decoded := make(chan decodeStart, 1)
	go func() { prefilled <- s.prefill(prefillCtx, r, x, body, false) }()
	go func() { decoded <- s.startDecode(decodeCtx, r, x.header, body) }()

	var p *prefillResult
	var d *decodeStart
	decodeFirst := false // the decode failed while the prefill had not
	for p == nil || d == nil {
		select {
		case res := <-prefilled:
			p = &res
			if p.outcome != OutcomeOK {
				cancelDecode() // it would wait for KV that never comes
			}
		case res := <-decoded:
			d = &res
			if d.err != nil || d.resp.StatusCode < 200 || d.resp.StatusCode > 299 {
				decodeFirst = p == nil || p.outcome == OutcomeOK
				cancelPrefill() // its KV has no taker
			}
		}
	}
	defer d.cancel()
	s.finishPrefill(r, x, *p)
	if p.outcome == OutcomeOK || decodeFirst {
		// The decode answer is the client's, an error status included.
		s.finishDecode(w, r, *d, LegDecode)
		return
	}
	if d.err == nil {
		d.resp.Body.Close()
	}
	dropped := OutcomeAbandoned
	if r.Context().Err() != nil {
		dropped = OutcomeCanceled
	}
	s.legDone(r, LegDecode, dropped, nil)
	s.prefillFailed(w, r, x, *p)
}
