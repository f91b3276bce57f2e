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
//     big-endian), msgpack payload. Sequence numbers start at 0 and grow by one per
//     batch; Restart sets them back to 0.
//   - The payload is an EventBatch [ts, events, dp_rank] (or a map with
//     BatchAsMap); events are maps with a "type" key (vLLM v0.26+, the default) or
//     tagged positional arrays (EncodingArray); hashes are uint64, int64 or 32-byte
//     bin (HashFormat). AppendBatch exposes the encoder.
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
// other. The only goroutine the engine starts is the replay server (when
// EnableReplay is set); Close stops it and waits for it. go-zeromq v0.17.0 itself
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
//     the engine's 64-bit hash, as returned by BlockHashes.
//
// # Later: HTTP
//
// The engine will also serve HTTP (OpenAI-compatible completions, vLLM render and
// tokenize endpoints, a time-to-first-token model) for end-to-end EPP tests. That
// belongs in separate files (an http.Handler method and options added to Options
// with zero-value defaults) and reuses Serve for the cache effect of a request, so
// the API above does not change.
package fakeengine
