// Package sidecar is the decode sidecar of disaggregated (prefill/decode)
// serving: an http.Handler that sits in front of the local decode engine and,
// when the Endpoint Picker chose a prefill worker for a request, runs the
// engines' P/D protocol before the decode engine answers the client.
//
// One job: turn one client request plus the EPP's x-prefiller-host-port hint
// into the prefill and decode legs of the configured protocol, and nothing
// else. Without a hint every request (GET /v1/models, /health, anything) is
// proxied to the decode engine as it came.
//
//   - vLLM NIXL (ProtocolVLLMNIXL): POST the client's body to the hinted engine
//     with kv_transfer_params {do_remote_decode: true, ...}, stream false,
//     max_tokens 1 (and max_completion_tokens 1 for chat), without
//     stream_options, min_tokens and min_completion_tokens; read the whole
//     answer (MaxPrefillResponseBytes) and take its kv_transfer_params; POST the
//     client's body with those parameters to the decode engine and relay its
//     answer.
//   - SGLang (ProtocolSGLang): the client's body with bootstrap_host (the
//     hint's host), bootstrap_port (SGLangBootstrapPort) and a random 63-bit
//     bootstrap_room goes to both engines at once; the decode answer is relayed
//     once the prefill leg has succeeded.
//   - TensorRT-LLM (ProtocolTRTLLM): a context_only request (disaggregated_params
//     {request_type: "context_only"}, not streamed, max_tokens 1), then a
//     generation_only one carrying the first choice's disaggregated_params (and
//     the returned prompt_token_ids in place of the prompt).
//
// A hint that is empty, repeated, a list, not an IP literal host:port in
// canonical form, an address that must not be dialled (catalog.NotRoutable:
// unspecified, multicast, link-local, broadcast, a cloud metadata service,
// also carried in a NAT64 or 6to4 address; or outside AllowedPrefillPrefixes),
// or, with HintKey, unsigned, forged, expired, replayed, signed for another
// sidecar (HintAudience, HeaderDestination) or path, or issued before the
// sidecar started (package pdhint) is answered 502 with the OpenAI error code
// invalid_epp_metadata. A client that sets the protocol's own hand-over
// fields, several choices (n) or a batch of completions prompts is refused 400
// before any leg; a body that is too large (413) or late (BodyReadTimeout,
// 408) too. A failed or timed-out prefill leg falls back to a local prefill
// (FallbackLocal: the original request, unchanged, to the decode engine) or is
// answered 502 with a fixed message naming the kind of failure.
// docs/SIDECAR.md has the sources, the variables and the failure table.
//
// # Concurrency
//
// A Sidecar is safe for concurrent use: ServeHTTP keeps its state on the
// request's goroutine, and the counters (Stats) and the hint verifier's replay
// cache have their own mutexes. New starts nothing. The only goroutines the
// sidecar starts are SGLang's two legs, one each per request, which ServeHTTP
// waits for before it returns. Every leg runs under a context derived from the
// client's request, so a client that goes away cancels both legs, and under its
// deadline (PrefillTimeout, DecodeTimeout); a decode or pass-through leg is
// also canceled when its engine sends nothing for ReadIdleTimeout (a timer
// per leg, reset by the relaying goroutine and stopped when the leg ends).
// Close releases the idle connections of the sidecar's own transport.
//
// # Invariants
//
//   - No orchestration header (x-prefiller-host-port, the signature, the EPP's
//     other x-gateway-* routing headers, x-kvselect-*) reaches an engine, on any
//     leg; hop-by-hop headers never cross the sidecar.
//   - The prefill leg goes to the hinted endpoint only, never follows a
//     redirect, and its answer is read at most MaxPrefillResponseBytes.
//     Nothing it answered reaches the client: not an error body (it may quote
//     the prompt), a status line or a transport error (which may quote a
//     service's banner). Its failures are answered with fixed messages and
//     logged with their detail.
//   - A refusal before any leg is the connection's last answer (Connection:
//     close, the read deadline past due): it goes out at once, without
//     reading the rest of the body, and the connection closes, so a client
//     that stalls in its body holds nothing past BodyReadTimeout.
//   - The client gets the decode engine's answer byte for byte (usage
//     included), event streams flushed as each chunk arrives; an engine failure
//     after the headers went out aborts the client's connection
//     (http.ErrAbortHandler) instead of ending the answer cleanly.
//   - Every refusal is counted by reason (Stats.BadHints, Stats.Refused) and
//     logged; every leg is counted by outcome (Stats.Legs).
package sidecar
