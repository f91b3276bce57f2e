// Package tokenize obtains, for an OpenAI request, the exact token ids the
// engine will compute for it, by asking a tokenizer service that belongs to the
// backend (the engine itself or a renderer running the same tokenizer and chat
// template). KV-aware routing hashes these ids into blocks; ids that differ from
// the engine's by a single template token give block hashes that never match.
//
// # Protocols
//
// A Client speaks one protocol, chosen by name:
//
//	vllm-render    POST {base}/v1/chat/completions/render or {base}/v1/completions/render,
//	               the body forwarded unchanged; the answer is one vLLM GenerateRequest
//	               (chat) or a list of them, one per prompt (completions); token_ids
//	               are the ids, features (multimodal hashes and placeholders),
//	               cache_salt and sampling_params.max_tokens are kept as extras.
//	vllm-tokenize  POST {base}/tokenize with the chat fields the template reads
//	               (messages, add_generation_prompt, continue_final_message,
//	               add_special_tokens, chat_template, chat_template_kwargs, tools,
//	               mm_processor_kwargs) or with the prompt; answer {"tokens": [...]}.
//	sglang         POST {base}/tokenize with messages (+ tools, tool_choice,
//	               reasoning_effort, continue_final_message, chat_template_kwargs)
//	               or prompt; answer {"tokens": [...] or [[...], ...]}.
//	sglang-renderer POST {base}/v1/chat/completions/render or
//	               {base}/v1/completions/render, the body forwarded unchanged;
//	               the answer is one SGLang GenerateRequest (chat) or a list of
//	               them (completions: one per prompt, and per choice when n > 1);
//	               input_ids are the ids, cache_salt and
//	               sampling_params.max_new_tokens are kept as extras.
//
// The render protocols (vllm-render, sglang-renderer) are the exact choice:
// the service runs generation's own preprocessing. sglang-renderer is the
// contract of SGLang's CPU-only renderer, the sglang-renderer binary, which
// serves both routes in render-only mode (launched without --engine-url)
// and when it fronts an engine. Read in sgl-project/sglang:
// rust/sglang-renderer/src/http/render.rs (the routes; a chat body with
// n > 1 is refused with 400), rust/sglang-renderer/src/sampling.rs
// (max_new_tokens), rust/sglang-frontend/src/http/render.rs (a completions
// answer per prompt and choice); and in ai-dynamo/dynamo, whose standalone
// EPP speaks it under the same name:
// deploy/inference-gateway/ext-proc/src/sglang_renderer_client.rs (chat
// only, the body unchanged, input_ids read) and epp_standalone_config.rs
// (DYN_EPP_TOKENIZER_PROTOCOL=sglang-renderer).
// The tokenize endpoints reproduce the preprocessing from the fields listed, with
// the same add_special_tokens and add_generation_prompt defaults as the OpenAI
// endpoints. A completions prompt that already is token ids is returned without
// calling the service on those two. A completions request with several prompts
// yields the first prompt's ids (Result.PromptCount tells how many there were).
//
// # Errors
//
// Every failure wraps one sentinel, which HTTPStatus maps to the status a gateway
// answers with: ErrBadRequest 400 (unsupported path, a body that is not a JSON
// object or is too large, a 400, 413 or 422 from the service), of which
// ErrPromptTooLong is 413 (a prompt of more than Options.MaxPromptTokens ids, in
// the answer or in the request, refused before they are stored), ErrUnavailable
// 503 (connection refused or reset, DNS failure, 429), ErrTimeout 504 (per-call
// timeout, the caller's deadline, 408), ErrUpstream 502 (5xx, any other 4xx such
// as 404 or 401, which say the service is misconfigured, a refused redirect, an
// answer that is truncated, too large, not JSON, of the wrong shape, without
// tokens, or holding an id outside [0, 2^32-1]) and ErrCanceled 499 (the caller
// went away). Errors quote the service's error message (at most 200 bytes),
// never the request body.
//
// # Caching
//
// NewCache wraps any Tokenizer with a ristretto cache bounded by bytes (4 per
// token, the entry's copy of the request, a fixed per-entry overhead) and
// singleflight: concurrent callers
// with the same request share one upstream call, and each stops waiting when its
// own context ends. The shared call runs detached from the cancellation of the
// caller that started it, bounded by CacheOptions.CallTimeout, and is canceled
// by Close. Errors are never cached. Ristretto stores asynchronously and admits
// by a frequency estimate, so the first repeat of a request may still miss.
//
// The cache is safe, i.e. a hit returns what the service would answer now, as
// long as the service's answer is a function of what the key covers. The key
// covers the protocol, the model, the request's model, the path and the full body
// byte for byte: the messages, the tools, chat_template, chat_template_kwargs,
// add_generation_prompt, continue_final_message, add_special_tokens, multimodal
// content and every other field a chat template or a renderer can read are all
// in the body. What the key does not cover is the service's own configuration
// (tokenizer files, default chat template); a Cache therefore serves one backend
// deployment, and a new model revision needs a new Cache (or a TTL). The
// xxhash64 key only locates a candidate entry: each entry keeps its own copy of
// the request (model, path, body) and a hit requires them to be byte-equal to
// the caller's, so no hash collision, accidental or crafted, can return another
// request's ids. Entries are charged for that copy.
//
// Hits return a copy: callers may modify the Result without affecting the cache
// or other callers. The copy is one allocation of 4 bytes per token. With
// CacheOptions.ShareResults, hits return the cached slices themselves (no
// allocation), and the caller promises to treat them as read-only; a gateway
// that only hashes the ids should set it. See BenchmarkCachedTokenize for the
// cost of both.
//
// # Pools
//
// One tokenizer URL is a single point of failure. NewPool puts several
// endpoints (typically the pool's own engine pods, each of which serves its
// model's render or tokenize endpoint) behind one Tokenizer: calls go round
// robin to the endpoints whose circuit is closed; an endpoint's failure
// (ErrUnavailable, its own ErrTimeout, ErrUpstream) fails the call over to
// the next one; PoolOptions.Failures failures in a row open its circuit for
// PoolOptions.OpenFor, after which one call probes it; and a call slower than
// the PoolOptions.HedgeQuantile of the recent ones (at least
// PoolOptions.HedgeMin) is sent to a second endpoint too, the first answer
// winning and the other canceled. The request's own faults (ErrBadRequest)
// and the caller's (ErrCanceled, its deadline) are returned at once. When
// every endpoint failed, the last error is returned wrapped: routing without
// tokens is the caller's degraded mode. Pool.Stats counts failovers, hedges,
// exhaustion and each endpoint's calls, failures and circuit, and PoolOptions.Logger gets a
// WARN as a circuit opens (and an INFO as it closes). Wrap the Pool in
// a Cache, not each endpoint: a hit then costs no endpoint at all, and give
// the Cache Pool.CallTimeout so a call has room to fail over. NewClientPool
// builds a Client per base URL (a setting's list: ParseBaseURLs) and the
// Pool over them; ServiceFailed is the failure class both the Pool and a
// gateway's degraded mode act on. Pool.SetBaseURLs replaces a client pool's
// URLs while it serves, so that the pool follows a discovery of the
// engines: an endpoint that stays keeps its Client, circuit and counters, a
// new one starts closed, a removed one's Client is closed; a pool may start
// and run empty, its calls then failing with ErrUnavailable.
//
// # Concurrency
//
// Client, Cache and Pool are safe for concurrent use; SetBaseURLs may run
// while calls are in flight (a call reads the endpoint set once per
// endpoint it picks, and a replaced set is never modified). A Pool's hedged
// call runs on a goroutine that the Tokenize call which started it cancels
// and waits for before it returns. A Client starts no goroutine of
// its own; the transport it owns keeps idle keep-alive connections, which Close
// releases. NewCache starts ristretto's maintenance goroutine, and each upstream
// call a miss starts runs on a goroutine the Cache tracks; Cache.Close cancels
// the calls in progress, waits for them and stops the maintenance goroutine.
// Nothing outlives Close. Tokenize never blocks longer than its caller's context
// allows, whoever started the call it waits for.
//
// # Invariants
//
//   - A Result returned without error holds only ids in [0, 2^32-1] decoded from
//     a JSON integer; no response body, however malformed, makes this package
//     panic (FuzzParseResponse).
//   - A request's body is sent only to the configured base URL, with
//     Content-Type and Accept as the only headers besides the transport's own
//     (Host, Content-Length, User-Agent); redirects are never followed.
//   - A Result served from the cache answers a request byte-equal to the
//     caller's, and (unless ShareResults) never aliases the cached one.
package tokenize
