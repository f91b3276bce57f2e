// Package kvevents keeps a kvindex.Index true to what inference engines hold in
// their KV caches, by consuming the KV-cache events the engines publish over
// ZeroMQ (vLLM, SGLang, and TensorRT-LLM through a vLLM-compatible publisher).
//
// The package has two layers. The decoder (Decoder, Batch) is pure: payload bytes
// in, kvindex.Event values out, no I/O. The transport (see Transport below) owns the
// sockets, sequence numbers and replay, and hands each source's payloads, in order,
// to a Handler. IndexHandler is the Handler that decodes them and applies the events
// to an Applier (a *kvindex.Index).
//
// # Wire format
//
// A payload is one msgpack batch, either an array [ts, events] or
// [ts, events, dp_rank] (dp_rank may be nil) or a map with the keys "ts", "events"
// and "data_parallel_rank", "dp_rank" or "attn_dp_rank". A batch's dp_rank, when
// present, overrides the rank its source was registered with.
//
// docs/ENGINES.md lists, engine by engine, what each sends and where that was
// read; this comment says what the decoder accepts.
//
// Each event is either a tagged positional array (vLLM before 0.26, SGLang):
//
//	["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//	 lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
//	 kv_cache_spec_sliding_window]
//	["BlockRemoved", block_hashes, medium, group_idx]
//	["AllBlocksCleared"]
//
// where trailing fields may be missing (short SGLang tuples end at lora_id or
// medium) and further elements are ignored, or a map with a "type" key (vLLM 0.26
// and later) whose other keys carry the same field names, plus "locality",
// "cache_salt" and "metadata"; unknown keys are ignored. Position 7 of a stored
// array may also hold SGLang's metadata map {"cache_salt": ...} instead of a LoRA
// name. An event may also arrive as msgpack bytes holding one encoded event
// (llm-d's storage-tier publisher); the bytes are decoded as that event.
//
// Field mapping:
//
//   - Block hashes (and the parent hash) may be unsigned integers (kept as is),
//     signed integers (reinterpreted as two's complement) or bytes (the last 8
//     bytes read big-endian, shorter ones left-padded with zeros), so both of
//     vLLM's hash modes yield the same 64-bit value. A parent that is nil,
//     absent, or 0 (as some array-form encoders write for a root block) means
//     the run starts a sequence; 0 is never looked up as a block.
//   - token_ids must be integers in [0, 2^32). The bigram form
//     [[a,b],[b,c],...] is flattened to a, b, c, ...
//   - medium, case-insensitively: absent, nil, "", GPU, CUDA, DEVICE and HBM are
//     kvindex.TierDevice; CPU, CPU_PINNED, HOST and DRAM are TierHost; DISK,
//     LOCAL_DISK, SSD, NVME, FILE, FS, FILE_SYSTEM, STORAGE, SHARED_STORAGE, OBJ,
//     OBJECT, OBJECT_STORE and EXTERNAL are TierDisk. Anything else skips the
//     event (SkipUnknownMedium).
//   - block_size nil or 0 means the index's block size.
//   - A stored event with block hashes and no token ids (offloading connectors
//     announce copies of blocks on another tier that way) cannot be keyed by the
//     router and is skipped as SkipNoTokens.
//   - lora_name is the LoRA name. When only the legacy lora_id is set (and is not
//     0 or empty), the LoRA name becomes "lora-id:<id>", so blocks of such an
//     adapter never match requests for the base model.
//   - cache_salt (map key, or SGLang metadata) is the cache salt.
//   - extra_keys holds one entry per block. An entry that is nil or empty, or that
//     only repeats the LoRA name, contributes nothing. In the first block of a
//     sequence, a plain string that is not a 64-hex-digit digest is vLLM's cache
//     salt and becomes the event's CacheSalt when it has none. Every other key is
//     folded into a non-zero 64-bit digest (XXH64 of its msgpack bytes) in
//     Event.Extra, so blocks that carry multimodal or embedding keys never match
//     token-only requests. Extra stays nil when no block has such keys.
//
// Events that describe something other than the local, main attention cache are
// skipped and counted: group_idx set and not 0 (SkipNonMainGroup),
// kv_cache_spec_kind other than full_attention, mla_attention or
// sink_full_attention (SkipNonMainKind), locality other than LOCAL (SkipLocality;
// absent is accepted). Unknown event types are skipped too (SkipUnknownType).
// Hybrid models: only the full-attention group (group 0) builds prefix
// matches. Blocks of a sliding-window, mamba-like or other group never extend
// them, because such a group does not keep a whole prefix: a request can reuse
// the main group's blocks only as far as the engine also holds the other
// groups' state, which the router does not model, so a match may overcount
// for such models. These skips (SkipNonMainGroup, SkipNonMainKind,
// SkipLocality), those of unknown event types (SkipUnknownType, newer engines)
// and of stores without token ids (SkipNoTokens) are by design and are not
// warned about.
//
// # Feed health
//
// Every skip is counted per source and reason (HandlerStats.Skipped). Skips
// that mean the index lost something (every reason that is not by design, and
// undecodable batches) are logged: the first at once, then at most one line per
// source and reason a minute, with the count since the previous line. A removal that names blocks the index does not hold is
// SkipUnknownBlock (its known blocks are still removed), never "applied".
// Stored events are counted apart (StoresApplied, StoresRejected) so that a
// consumer can judge a feed by the share of stores it loses; the selection
// service does (see its FeedHealth).
//
// # Untrusted input
//
// Payloads come from the network. A malformed event (wrong field type, missing
// block hashes, token ids out of range) is skipped and counted; it never spoils
// the other events of its batch, because the decoder then finds the event's end
// from the msgpack structure alone and carries on with the next one. A malformed
// envelope, or an event whose structure itself is broken (truncated), fails the
// whole batch with ErrMalformed. Declared lengths are checked against the
// remaining bytes before anything is reserved, so a few hostile bytes cannot make
// the decoder allocate; nesting depth costs no stack; DecoderOptions bounds events
// per batch, blocks and tokens per event.
//
// # Concurrency
//
// A Decoder is single-goroutine and reuses its memory: the Batch it returns is
// valid until its next Decode call. IndexHandler is safe for concurrent use across
// sources; calls for one source must not overlap (the Handler contract), which the
// transport guarantees by running each source on one goroutine. Its counters are
// atomics, readable at any time through Stats.
//
// # Block sizes
//
// A stored event's block size must equal the index's or be a whole multiple of it
// (each engine block then becomes several index blocks, split by the index). Any
// other size is rejected and counted as SkipBlockSize, and the first occurrence per
// source is logged: a misconfigured block size never silently builds an empty
// index.
//
// # Transport
//
// A Feed carries batches from engine publishers to a Handler. Each source is one
// (worker, data-parallel rank): the Feed dials its PUB endpoint with a SUB socket
// subscribed to every topic, or (Bind) engines dial a SUB socket the Feed binds and
// messages are attributed to worker ranks by topic ("kv@<host>[:port]@<model>" by
// default, see TopicWorker) or by a caller's function. A live message is exactly
// [topic, seq (8 bytes, big-endian), payload]; anything else is counted and skipped.
// go-zeromq gives up dialing on its own, so every source redials in its own loop
// with jittered exponential backoff (FeedOptions.ReconnectMin..ReconnectMax).
//
// go-zeromq trusts its peers (a declared frame size is allocated as is, a short
// READY is sliced past its end, a listener shakes hands inline with no
// deadline), so every tcp:// connection, dialed or accepted, goes through a ZMTP
// guard (internal/zmtpguard) that validates each inbound byte first: frames up
// to 64 MiB, handshakes within 5 s on a goroutine per accepted peer, at most 256
// connections per listener, a deadline on every write. A violation closes that connection;
// Feed.Refused counts them by reason and the Logger gets one line per reason a
// minute. A bind listener also asks BindConfig.Admit whether a peer may speak at
// all and BindConfig.Peer whether a message's topic may come from it. Peers
// gives all three (Attribute, Admit, Peer) from the known workers' endpoints:
// a topic names the one worker at its host (or host:port), a peer is admitted
// only from a worker's address, and a topic only from its own worker's; the
// selection service keeps one in step with its catalog. OffsetPort gives the
// endpoint of a data-parallel rank from its first rank's, as vLLM numbers
// them.
//
// # Ownership and concurrency
//
// NewFeed starts nothing. Run starts every source and listener, including those
// added later, and returns only after every goroutine it started has exited and
// every socket is closed. Per source, one goroutine reads the socket into a bounded
// queue and one goroutine calls the Handler, so calls for one source never overlap
// and arrive in sequence order, while different sources run in parallel.
// AddSource, RemoveSource, ResumeSource, Bind and Stats are safe from any
// goroutine, before and during Run (not from inside a Handler call). RemoveSource returns once the
// source's goroutines have exited; it leaves the index untouched (the owner
// clears it, for instance with Handler.ResetSource). Stats reads atomics only. A Handler must not keep a payload after
// its call returns.
//
// # Sequence semantics
//
// Per source the Feed keeps a watermark, the last seq applied. A source with a
// replay endpoint starts with a replay from seq 0, before any live batch, so a
// router that starts (or restarts) next to a warm, idle engine knows its cache at
// once; an engine that is not reachable yet fails that replay harmlessly (the
// first live batch then drives the source). Engines number their first batch 0
// (vLLM, SGLang, TensorRT-LLM) or 1 (some vLLM-compatible publishers): either is
// a clean start. A first batch with a higher seq, or a batch beyond
// watermark+1, opens a gap: with a replay endpoint the
// Feed asks the engine's ROUTER, through a DEALER, for every buffered batch from
// the first missing seq (["", start]; replies with or without the topic frame; the
// stream ends at seq -1 or an empty payload), applies those it lacks in order, then
// drains the live batches that queued meanwhile, dropping any at or below the
// watermark: no seq is applied twice, and a replayed batch is never applied after a
// later live one. A replay that starts late, skips, stops short, fails or times out
// (2 s without a reply, 2 min in total) counts the missing
// batches as lost and marks the source degraded; so does a gap without a replay
// endpoint, including a start in the middle of a stream, since the history before
// it is unknown. A degraded source keeps being applied; the flag says its index
// entries may be stale or incomplete (a lost removal is not undone: clearing would
// orphan every later store, whose parent would be unknown). A seq lower than the
// previous live seq means the engine restarted: the Feed calls Handler.ResetSource
// and starts over from that batch (replaying from 0 when it is > 0 and a replay
// endpoint is known). A live batch numbered more than 100000 beyond the
// watermark (ten times vLLM's replay buffer) is suspect (one forged or corrupt
// frame must not mark a million batches lost, nor become the baseline that
// makes the real stream look like a restart): it is dropped and counted
// (SourceStats.Suspect), unless 3 consecutive batches number on from it, which
// resets the source and starts over there. When a source's queue stays full for
// 100 ms, its
// queued batches are dropped, Handler.ResetSource is called and the source
// resynchronises: a replay from 0 when possible, otherwise from the next live
// batch, degraded. A reset clears the degraded flag. ResetSource is called only for
// a restart, a confirmed jump, an overflow and an endpoint change (AddSource with
// a new config).
//
// ResumeSource makes a source go on after a given seq, as if it had applied
// everything up to it: typically a joining router that loaded a peer's index
// snapshot. On the source's apply goroutine the caller's install function
// replaces what the Handler holds of the source (instead of ResetSource), the
// seq becomes the watermark, and a replay from that seq (inclusive, to check
// the stream is the one recorded) applies what came after, before any further
// live batch; batches the source applied live before are applied again onto
// the installed state. A replay that starts beyond seq+1 counts the rest as
// lost (degraded); one that returns nothing from seq on means the engine
// restarted since: the source resets and replays from 0 (ResumesRefused).
// Without a replay endpoint the live stream decides, as on any gap. A resume
// set before Run takes the place of the source's first replay.
package kvevents
