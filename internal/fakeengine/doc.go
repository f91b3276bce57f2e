// Package fakeengine is a vLLM-like inference engine for tests: it keeps an LRU
// prefix cache of token blocks and publishes every change to it as KV-cache event
// batches over real ZeroMQ sockets, the way vLLM's ZMQ publisher does, so the
// kvevents feed and the index can be checked against a known truth.
//
// One job: be the worker in integration tests. Serve simulates a request (hits,
// stores, LRU evictions) and publishes one batch describing the change; HeldPrefix,
// Blocks and Snapshot report what the cache really holds, which is what a
// consumer's index should converge to.
//
// # Wire behaviour
//
//   - PUB socket, bound (default, tcp://127.0.0.1:0) or dialled into a consumer's
//     bound SUB (PubDial, retried a bounded number of times).
//   - Every live message has three frames: topic, sequence number (8 bytes
//     big-endian), msgpack payload. Sequence numbers start at FirstSeq (default
//     0) and grow by one per batch; Restart sets them back to FirstSeq.
//   - The payload is an EventBatch [ts, events, dp_rank] (or a map with
//     BatchAsMap); events are maps with a "type" key (vLLM v0.26+, the default) or
//     tagged positional arrays (EncodingArray); hashes are uint64, int64 or 32-byte
//     bin (HashFormat), derived by the engine's own XXH64 chain, SGLang's SHA-256
//     chain or TensorRT-LLM-like SHA-256 radix keys (HashScheme). Lower-level
//     options change one trait each: RootParent (a root run's parent as nil, left
//     out or 0), TokenPairs (EAGLE bigram token_ids), ArrayFullLength (SGLang's
//     positional layout and a batch that always has 3 elements), ExtraFields
//     (vLLM's defaulted fields) and HybridGroups (every change mirrored into a
//     sliding-window group 1). AppendBatch exposes the encoder.
//   - A Dialect presets those options for one engine seen in the field: vllm-map
//     (vLLM v0.26+), vllm-array (older vLLM), sglang, sglang-eagle, trtllm,
//     zero-parent, first-seq-1, external and hybrid (Dialects lists them,
//     ParseDialect reads a name, Apply writes the preset into an Options value).
//     Whatever the dialect, Serve publishes a request's newly stored blocks as
//     one BlockStored and never publishes a partial block.
//   - Optional ROUTER replay server: a request [identity, "", start_seq] gets every
//     buffered batch with seq >= start_seq, in order, then an end marker with seq
//     0xffffffffffffffff and an empty payload, with or without the topic frame
//     (ReplayLayout). Malformed requests are ignored.
//   - Faults: DropNext (numbered and buffered but not sent live), CorruptNext (live
//     copy garbled, buffer keeps the good one), Restart, DropReplay,
//     TruncateReplay; PublishEvents, PublishPayload and SendFrames send hand-made
//     batches and frames.
//
// # Concurrency
//
// An Engine is safe for concurrent use. One mutex guards the cache, the sequence
// counter, the replay buffer, the faults and the counters; Serve and the Publish
// methods number a batch and hand it to the PUB socket while holding it, so
// sequence order equals publish order. Start and Close are serialised with each
// other. The only goroutines the engine starts are the replay server (when
// EnableReplay is set), the HTTP server with its connections (when
// EnableHTTP is set) and the scheduler model's stepper (when SleepTTFT is
// set; it has its own mutex, and wakes at the model's next step or when a
// request joins or leaves); Close stops them and waits for them, and for
// every HTTP handler in flight. The HTTP counters have their own mutex, and so has the P/D
// bookkeeping (held transfers, bootstrap rooms). BootstrapHandler runs on a
// server the caller owns. go-zeromq v0.17.0 itself
// leaves one goroutine per PUB socket after Close (see LeakyZMQFunction), which
// goleak-based tests must ignore.
//
// The constructor starts nothing. Before Start, Serve still updates the cache and
// numbers batches into the replay buffer, but sends nothing live; this makes the
// cache model usable without sockets.
//
// # Invariants
//
//   - The cache never holds more than CapacityBlocks blocks.
//   - A cached block's parent is cached: a request's blocks are touched from the
//     last to the first, so a prefix is always more recently used than its
//     extensions and LRU eviction removes tail blocks before their prefixes. A
//     block used by the request being served is never evicted for it.
//   - Every numbered batch is in the replay buffer (until it rolls over, Restart
//     or TruncateReplay), whatever faults did to its live copy.
//   - Whatever the HashFormat, the usual consumer normalisation of a block hash
//     (uint64 as is, int64 reinterpreted, bytes: last 8 bytes big-endian) yields
//     the engine's 64-bit hash in its HashScheme, as returned by BlockHashes.
//   - The cache model is the main KV-cache group (group_idx 0): with
//     HybridGroups, the mirror group's events never reach Snapshot, HeldPrefix
//     or Blocks.
//
// # HTTP
//
// With EnableHTTP, Start also serves an OpenAI-compatible API on HTTPAddr or
// on a listener the caller opened, HTTPListener (HTTPEndpoint reports the
// bound host:port; Handler is the same API for a caller's own server):
//
//   - POST /v1/chat/completions and /v1/completions, JSON or SSE ("stream":
//     true: one chunk per generated token, the chat role chunk first, a usage
//     chunk with stream_options.include_usage, then "data: [DONE]"). Each prompt
//     goes through Serve, so the cache changes and KV events are exactly those of
//     a direct Serve call. The answer carries usage.prompt_tokens_details.
//     cached_tokens (the leading complete cached blocks times the block size)
//     and the simulated TTFT (usage.simulated_ttft_ms and the x-fake-ttft-ms
//     header, next to x-fake-prompt-tokens and x-fake-cached-tokens):
//     TTFTBase + PerTokenPrefill * uncached prompt tokens, only reported. The
//     output is max_tokens (default OutputTokens) words of dummy text,
//     finish_reason "length"; streamed tokens are TokenInterval apart.
//   - With SleepTTFT the engine really takes its time: it runs the scheduler
//     model of package enginemodel (Options.Timing: vLLM V1's steps, with a
//     token budget, chunked prefill, decodes and prefills sharing steps, a
//     fixed per-request overhead, a Speed for slower engines) in real time
//     between Start and Close. A request joins it at arrival with its
//     uncached prompt tokens (after a decode leg's simulated transfer) and
//     max_tokens outputs; its first byte waits for its first token, its
//     streamed tokens follow the model's steps, a whole answer waits for the
//     last one, and a client that goes away leaves the model. Requests sent
//     together therefore queue and slow each other, as on a real engine. The
//     model's TTFT replaces the formula in usage.simulated_ttft_ms and in a
//     whole answer's header (a stream's header, sent first, keeps the
//     formula; HTTPStats.TTFTTotal and the metrics sum the formula). A
//     handler served without Start waits the formula's TTFT instead.
//   - POST /v1/chat/completions/render (one vLLM GenerateRequest) and
//     /v1/completions/render (a list, one per prompt), POST /tokenize ({count,
//     max_model_len, tokens, token_strs}), in vLLM's shapes; they never touch the
//     cache.
//   - POST PullPath (/fake/kv/pull): a decode engine takes a prefill leg's held
//     KV (see Disaggregated serving below).
//   - GET /health, GET /v1/models, GET /metrics. The metrics are counters in the
//     Prometheus text format, labelled model_name: fake_prefix_cache_queries_total
//     and fake_prefix_cache_hits_total count prompt tokens (as vLLM's
//     prefix_cache_queries and prefix_cache_hits do), fake_requests_total,
//     fake_requests_running, fake_generation_tokens_total,
//     fake_request_errors_total, fake_kv_cache_blocks,
//     fake_kv_cache_capacity_blocks and the fake_simulated_ttft_seconds summary
//     (sum and count). HTTPStats returns the same counters and more: computed,
//     transferred and aborted requests, and the P/D legs below.
//   - Errors are vLLM's ErrorResponse {"error": {message, type, param, code}}: 404
//     for a "model" other than Options.Model, 400 for a malformed body, 413 for a
//     body over 16 MiB, 503 after Close.
//
// # Disaggregated serving
//
// A completion request can be one leg of a prefill/decode exchange, in vLLM's,
// SGLang's or TensorRT-LLM's wire form (pd.go has the details):
//
//   - vLLM: kv_transfer_params.do_remote_decode makes a prefill leg (one prompt,
//     not streamed) whose answer carries kv_transfer_params naming the engine
//     (EngineID, AdvertiseAddr) and its block hashes as remote_block_ids; the
//     engine holds them for KVHoldTimeout. do_remote_prefill with those
//     parameters makes a decode leg, which pulls them over HTTP (POST PullPath
//     on the prefill engine, once per hold) before answering.
//   - SGLang: bootstrap_host, bootstrap_port and bootstrap_room, the same on
//     both legs; PDRole says which one the engine serves. The prefill opens the
//     room once computed and waits (KVHoldTimeout) for the decode before it
//     answers (streamed or not, as asked), while the decode asks
//     the prefill engine's BootstrapHandler for the room (KVWaitTimeout).
//   - TensorRT-LLM: disaggregated_params.request_type context_only makes a
//     prefill leg whose first choice carries disaggregated_params (an
//     encoded_opaque_state naming the engine), and prompt_token_ids;
//     generation_only with those parameters makes a decode leg that pulls.
//
// A decode leg checks that the KV it took is its own prompt's, does not
// compute those tokens again (TransferredTokens; the TTFT adds
// TransferPerBlock per pulled block instead of their prefill) and reuses what
// it has cached. PDRolePrefill and PDRoleDecode refuse the other kind of leg
// (400), as they do a P/D leg with several prompts, a streamed vLLM or
// TensorRT-LLM prefill leg, or fields of two protocols. A transfer that fails
// is answered 502 (an SGLang prefill nobody took in time, 504); a client that
// goes away during any of these waits is an abort (HTTPStats.Aborted).
//
// Prompts are tokenized by a deterministic toy tokenizer that the package
// exports (Tokenize, CompletionTokens, ApplyChatTemplate), so tests can compute
// the ids the server uses: words and punctuation hash into [FirstWordToken,
// VocabSize), and the chat template is TokenBOS, then per message a role token,
// the content's tokens and TokenEndOfTurn, then TokenAssistant. Messages that
// are equal give equal leading ids, so a shared system prompt is a shared prefix.
package fakeengine
