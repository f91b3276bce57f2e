package fakeengine

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/kvselect/kvselect/internal/enginemodel"
)

// Errors returned by the engine. They are wrapped with context; test with errors.Is.
var (
	// ErrInvalidOptions: New was given options that fail validation. The message
	// lists every problem.
	ErrInvalidOptions = errors.New("fakeengine: invalid options")
	// ErrInvalidArgument: PublishEvents was given an event it cannot encode (unknown
	// kind, token count that does not match the hashes, ...), SendFrames no frame,
	// or ParseDialect an unknown name.
	ErrInvalidArgument = errors.New("fakeengine: invalid argument")
	// ErrAlreadyStarted: Start was called on an engine that is running.
	ErrAlreadyStarted = errors.New("fakeengine: already started")
	// ErrNotStarted: the call needs the sockets that Start creates.
	ErrNotStarted = errors.New("fakeengine: not started")
	// ErrClosed: the engine has been closed.
	ErrClosed = errors.New("fakeengine: closed")
	// ErrSocket: binding, dialling or sending on a ZMQ socket failed.
	ErrSocket = errors.New("fakeengine: socket error")
)

// Encoding selects how KV-cache events are encoded inside a batch.
type Encoding uint8

const (
	// EncodingMap encodes each event as a msgpack map whose first key is "type",
	// as vLLM does from v0.26 on. It is the default.
	EncodingMap Encoding = iota
	// EncodingArray encodes each event as a tagged positional array
	// ["BlockStored", hashes, parent, ...], as vLLM did before v0.26 (and SGLang
	// still does).
	EncodingArray
)

// String returns "map" or "array".
func (e Encoding) String() string {
	switch e {
	case EncodingMap:
		return "map"
	case EncodingArray:
		return "array"
	default:
		return fmt.Sprintf("Encoding(%d)", uint8(e))
	}
}

// HashFormat selects how block hashes appear on the wire. Whatever the format, a
// consumer that normalises hashes the usual way (uint64 as is, int64 reinterpreted
// as two's complement, bytes: the last 8 bytes big-endian) recovers the engine's
// 64-bit hash exactly.
type HashFormat uint8

const (
	// HashUint64 writes the hash as an unsigned msgpack integer in its smallest
	// form (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1). Default.
	HashUint64 HashFormat = iota
	// HashInt64 writes the hash reinterpreted as a signed 64-bit integer, so half
	// of the hashes are negative (SGLang, Dynamo's TRT-LLM bridge).
	HashInt64
	// HashBytes32 writes a 32-byte msgpack bin, like a SHA-256 digest in vLLM's
	// bytes mode: 24 deterministic filler bytes followed by the hash big-endian.
	HashBytes32
)

// String returns "uint64", "int64" or "bytes32".
func (h HashFormat) String() string {
	switch h {
	case HashUint64:
		return "uint64"
	case HashInt64:
		return "int64"
	case HashBytes32:
		return "bytes32"
	default:
		return fmt.Sprintf("HashFormat(%d)", uint8(h))
	}
}

// ReplayLayout selects the frames of replay replies.
type ReplayLayout uint8

const (
	// ReplayWithTopic answers [topic, seq, payload] per batch and ends with
	// ["", END, ""] (vLLM v0.26+). Default.
	ReplayWithTopic ReplayLayout = iota
	// ReplayNoTopic answers [seq, payload] per batch and ends with [END, ""]
	// (vLLM before v0.26, SGLang).
	ReplayNoTopic
)

// String returns "with-topic" or "no-topic".
func (l ReplayLayout) String() string {
	switch l {
	case ReplayWithTopic:
		return "with-topic"
	case ReplayNoTopic:
		return "no-topic"
	default:
		return fmt.Sprintf("ReplayLayout(%d)", uint8(l))
	}
}

// RootParentForm selects how a stored run that starts a sequence (no parent block)
// spells its parent_block_hash.
type RootParentForm uint8

const (
	// RootParentNil writes nil, as vLLM and SGLang do. Default.
	RootParentNil RootParentForm = iota
	// RootParentAbsent leaves the parent_block_hash key out of the event. Map events
	// only: a positional field cannot be left out (AppendBatch writes nil there).
	RootParentAbsent
	// RootParentZero writes the integer 0, as some array-form encoders outside vLLM
	// do. A consumer that reads it as a block hash looks up a parent that no engine
	// ever stored.
	RootParentZero
)

// String returns "nil", "absent" or "zero".
func (r RootParentForm) String() string {
	switch r {
	case RootParentNil:
		return "nil"
	case RootParentAbsent:
		return "absent"
	case RootParentZero:
		return "zero"
	default:
		return fmt.Sprintf("RootParentForm(%d)", uint8(r))
	}
}

// HashScheme selects how the engine derives its 64-bit block hashes from a
// request's tokens. Every scheme chains: a block's hash depends on all the blocks
// before it, its own tokens and the request's LoRA name (every block) and cache
// salt (first block). BlockHashes always returns the published values.
type HashScheme uint8

const (
	// HashSchemeChain is the fake engine's own chain: XXH64 seeded with HashSeed
	// over the parent hash and the block's tokens. Default.
	HashSchemeChain HashScheme = iota
	// HashSchemeSHA256 is SGLang's: SHA-256 over the previous block's digest (none
	// for the first block) and the block's tokens as uint32 little-endian; the
	// published id is the digest's first 8 bytes big-endian, which SGLang writes as
	// a signed int64 (pair it with HashInt64). It ignores HashSeed: like real SGLang
	// instances, two engines publish the same ids for the same tokens.
	HashSchemeSHA256
	// HashSchemeRadixKey mimics TensorRT-LLM: each block has a 32-byte radix key,
	// SHA-256 over its parent's key (HashSeed, le64, for the first block) and the
	// block's tokens, and the published id is the key's first 8 bytes big-endian,
	// which TensorRT-LLM writes as a signed int64 (pair it with HashInt64; ids of
	// 2^63 and above then appear negative).
	HashSchemeRadixKey
)

// String returns "chain", "sha256" or "radix-key".
func (h HashScheme) String() string {
	switch h {
	case HashSchemeChain:
		return "chain"
	case HashSchemeSHA256:
		return "sha256"
	case HashSchemeRadixKey:
		return "radix-key"
	default:
		return fmt.Sprintf("HashScheme(%d)", uint8(h))
	}
}

// PubMode selects whether the PUB socket binds or dials.
type PubMode uint8

const (
	// PubBind binds the PUB socket (vLLM's usual setup; consumers dial it). Default.
	PubBind PubMode = iota
	// PubDial dials the PUB socket into a consumer's bound SUB (Start retries the
	// dial DialAttempts times). The connection is not re-established if the
	// consumer goes away later.
	PubDial
)

// String returns "bind" or "dial".
func (m PubMode) String() string {
	switch m {
	case PubBind:
		return "bind"
	case PubDial:
		return "dial"
	default:
		return fmt.Sprintf("PubMode(%d)", uint8(m))
	}
}

// Defaults applied by New to zero-valued fields.
const (
	DefaultBlockSize      = 16
	DefaultCapacityBlocks = 1024
	DefaultTopic          = "kv@127.0.0.1@fake-model"
	DefaultReplayBuffer   = 10000
	DefaultBindEndpoint   = "tcp://127.0.0.1:0"
	DefaultDialAttempts   = 50
	DefaultDialBackoff    = 20 * time.Millisecond
	// DefaultHashSeed seeds the engine's block hashes. It is unrelated to any
	// router's seed: engine hashes are opaque ids to a consumer.
	DefaultHashSeed uint64 = 0x6661_6b65_656e_6731
	// MediumGPU is the medium Serve writes on its events.
	MediumGPU = "GPU"
	// MirrorGroup, MirrorSpecKind and MirrorSlidingWindow describe the second
	// KV-cache group that HybridGroups mirrors every change into.
	MirrorGroup         = 1
	MirrorSpecKind      = "sliding_window"
	MirrorSlidingWindow = 128

	// Defaults of the HTTP server (see Options.EnableHTTP).
	DefaultHTTPAddr        = "127.0.0.1:0"
	DefaultModel           = "fake-model"
	DefaultMaxModelLen     = 32768
	DefaultOutputTokens    = 16
	DefaultTTFTBase        = time.Millisecond
	DefaultPerTokenPrefill = 20 * time.Microsecond

	// Defaults of disaggregated serving (see PDRole).
	DefaultEngineID      = "fake-engine"
	DefaultKVHoldTimeout = 30 * time.Second
	DefaultKVWaitTimeout = 30 * time.Second
)

// Options configures an Engine. The zero value is valid and means every default.
// New copies the options and never modifies the caller's value; the Engine never
// calls Now concurrently with itself (it is called under the engine's mutex).
type Options struct {
	// BlockSize is the number of tokens per cache block. Default 16; must be >= 1.
	BlockSize int
	// CapacityBlocks is the size of the LRU prefix cache in blocks. Default 1024;
	// must be >= 1.
	CapacityBlocks int

	// Topic is frame 0 of every live message and the topic frame of replay replies
	// in the ReplayWithTopic layout. Default "kv@127.0.0.1@fake-model" (the llm-d
	// convention). Use EmptyTopic for vLLM's own default, the empty topic.
	Topic string
	// EmptyTopic sends an empty topic frame. Conflicts with a non-empty Topic.
	EmptyTopic bool

	// Encoding of the events: EncodingMap (default, vLLM v0.26+) or EncodingArray.
	Encoding Encoding
	// BatchAsMap encodes the batch itself as a map {ts, events,
	// data_parallel_rank} instead of the usual array [ts, events, dp_rank].
	BatchAsMap bool
	// HashFormat of block hashes on the wire. Default HashUint64.
	HashFormat HashFormat
	// ExtraFields adds the fields recent vLLM emits with non-default values:
	// extra_keys (one nil entry per block unless the request has a LoRA or salt),
	// group_idx 0 and kv_cache_spec_kind "full_attention" on BlockStored, and
	// group_idx 0 on BlockRemoved. Without it, extra_keys is written only when a
	// block has extra keys (LoRA name on every block, cache salt on block 0).
	ExtraFields bool
	// RootParent is how a stored run without a parent spells parent_block_hash.
	// Default RootParentNil; RootParentAbsent needs EncodingMap.
	RootParent RootParentForm
	// TokenPairs writes token_ids in SGLang's EAGLE bigram form, one pair per
	// token, [t(i), t(i+1)] (a block of n tokens is n pairs; the last looks
	// ahead into the next block, see appendTokenIDs); a consumer takes the
	// first element of every pair. Needs BlockSize >= 2.
	TokenPairs bool
	// ArrayFullLength writes events the way SGLang's newest encoder does (no
	// omit_defaults on its own fields): a positional BlockStored always carries
	// every field up to medium, [tag, block_hashes, parent_block_hash, token_ids,
	// block_size, lora_id, medium], and vLLM's later fields (lora_name,
	// extra_keys, the group fields) only as far as one of them is set; the batch
	// array always has 3 elements (nil rank with OmitDPRank). Needs EncodingArray.
	ArrayFullLength bool
	// HybridGroups makes Serve publish a hybrid model's two KV-cache groups:
	// every stored run and removal of the main group (written with group_idx 0,
	// kv_cache_spec_kind "full_attention") is followed by the same event for
	// group MirrorGroup (kv_cache_spec_kind MirrorSpecKind and, on stored runs,
	// kv_cache_spec_sliding_window MirrorSlidingWindow), with the same tokens and
	// different block hashes derived from the main ones. Works with both
	// encodings (array positions 9 to 11). The mirror group is not modelled:
	// Snapshot, HeldPrefix, Blocks and BlockHashes describe group 0 only.
	HybridGroups bool

	// DPRank is the data-parallel rank written into every batch. Default 0; must
	// be >= 0.
	DPRank int
	// OmitDPRank leaves the rank out of batches (a 2-element batch array, as
	// older engines and omit_defaults produce when the rank is unset).
	OmitDPRank bool

	// PubMode: PubBind (default) or PubDial.
	PubMode PubMode
	// PubEndpoint is the address the PUB socket binds (PubBind; default
	// "tcp://127.0.0.1:0", an ephemeral loopback port) or dials (PubDial;
	// required).
	PubEndpoint string
	// DialAttempts bounds the dial attempts in PubDial mode. Default 50; must be
	// >= 1. Only meaningful with PubDial.
	DialAttempts int
	// DialBackoff is the wait between dial attempts. Default 20ms; must be >= 0.
	DialBackoff time.Duration

	// EnableReplay binds a ROUTER socket that answers replay requests.
	EnableReplay bool
	// ReplayEndpoint is the address the ROUTER binds. Default "tcp://127.0.0.1:0".
	// Only meaningful with EnableReplay.
	ReplayEndpoint string
	// ReplayLayout of replay replies. Default ReplayWithTopic.
	ReplayLayout ReplayLayout
	// ReplayBuffer is the number of past batches kept for replay. Default 10000
	// (vLLM's buffer_steps); must be >= 1. Batches are kept even when replay is not
	// enabled, so Buffered can report them.
	ReplayBuffer int

	// HashSeed seeds the engine's block hashes. Default DefaultHashSeed (0 means
	// the default). Two engines with the same seed emit the same hashes for the
	// same tokens, which is useful to check that a consumer keeps engine hashes per
	// worker. HashSchemeSHA256 ignores it.
	HashSeed uint64
	// HashScheme is how block hashes are derived. Default HashSchemeChain.
	HashScheme HashScheme

	// FirstSeq is the sequence number of the first batch, and the one Restart goes
	// back to (some engines number from 1). Default 0; must not be EndSeq.
	FirstSeq uint64

	// Now is the clock for batch timestamps and the "created" field of HTTP
	// answers. Default time.Now.
	Now func() time.Time

	// EnableHTTP makes Start serve the OpenAI-compatible HTTP API (see Handler)
	// on HTTPAddr, and Close stop it. Handler works without it.
	EnableHTTP bool
	// HTTPAddr is the host:port the HTTP server listens on. Default
	// "127.0.0.1:0", an ephemeral loopback port (see HTTPEndpoint). Only
	// meaningful with EnableHTTP; must be empty when HTTPListener is set.
	HTTPAddr string
	// HTTPListener, when set, is a listener the caller opened (so its port can
	// be named, in a workers file or a topic, before the engine starts): Start
	// serves on it instead of listening on HTTPAddr, and Close closes it. A
	// failed Start leaves it open. Only meaningful with EnableHTTP.
	HTTPListener net.Listener
	// Model is the served model name. A request whose "model" is set to
	// anything else is answered 404, as vLLM does. Default "fake-model".
	Model string
	// MaxModelLen is the context length: a request whose prompt plus output
	// budget exceeds it is answered 400. /tokenize reports it. Default 32768;
	// must be > OutputTokens.
	MaxModelLen int
	// OutputTokens is the number of tokens generated for a request without
	// max_tokens (or max_completion_tokens). Default 16; must be >= 1.
	OutputTokens int
	// TTFTBase and PerTokenPrefill give the reported time to first token of
	// a request: TTFTBase + PerTokenPrefill * (prompt tokens not served from
	// the prefix cache), the TTFT of a request alone on an engine without the
	// step's fixed cost. They are also the defaults of Timing's
	// RequestOverhead and PrefillToken. Defaults 1ms and 20us; must be >= 0
	// (0 means the default).
	TTFTBase        time.Duration
	PerTokenPrefill time.Duration
	// SleepTTFT makes the engine run its scheduler model (Timing, package
	// enginemodel: vLLM's steps with a token budget, chunked prefill, decodes
	// and prefills sharing steps) in real time between Start and Close: each
	// completion request joins it at arrival with its uncached prompt tokens
	// and max_tokens outputs, its first byte waits for its first token and
	// its streamed tokens follow the model's steps; a client that goes away
	// leaves it. Such an answer's usage.simulated_ttft_ms (and the
	// x-fake-ttft-ms header of a whole answer) is the model's TTFT; a
	// streamed answer's header, sent before the first token, keeps the
	// formula. A handler served without Start waits the formula's TTFT
	// instead. By default nothing waits: the TTFT is only reported, so tests
	// run at full speed.
	SleepTTFT bool
	// Timing is the scheduler model a SleepTTFT engine runs. Zero fields take
	// enginemodel's defaults (steps of at most 8192 tokens, 1024 seats, 2 ms a
	// step, 50 us a decoding request), except RequestOverhead (TTFTBase) and
	// PrefillToken (PerTokenPrefill); Speed 0.5 makes an engine twice as
	// slow. Cached must be nil: the engine's cache is read at arrival.
	Timing enginemodel.Params
	// TokenInterval is a real wait between two streamed tokens of an engine
	// that does not run the model (SleepTTFT engines stream at their model's
	// steps); it ends early when the client goes away. Default 0: no wait;
	// must be >= 0.
	TokenInterval time.Duration

	// PDRole is the engine's part in disaggregated prefill/decode serving (see
	// pd.go and the package doc). Default PDRoleAny.
	PDRole PDRole
	// EngineID names the engine in the transfer parameters it hands out (vLLM's
	// remote_engine_id); a pull that names another engine is refused. Default
	// "fake-engine".
	EngineID string
	// AdvertiseAddr is the host:port decode engines pull this engine's KV from
	// (vLLM's remote_host and remote_port, TensorRT-LLM's opaque state). Default:
	// HTTPEndpoint when the engine serves HTTP itself, else the Host the prefill
	// request was sent to.
	AdvertiseAddr string
	// TransferPerBlock is the simulated KV transfer time of one pulled block; a
	// decode leg's TTFT adds it per block it pulls. Default 0; must be >= 0.
	TransferPerBlock time.Duration
	// KVHoldTimeout is how long a prefill leg's blocks wait to be pulled (vLLM's
	// kv_lease_duration); an SGLang prefill waits that long for its decode.
	// Default 30s; must be >= 0 (0 means the default).
	KVHoldTimeout time.Duration
	// KVWaitTimeout bounds a decode leg's pull, and its wait for an SGLang prefill
	// to reach the bootstrap room. Default 30s; must be >= 0 (0 means the default).
	KVWaitTimeout time.Duration
}

// withDefaults returns a validated copy of o with defaults applied.
func (o Options) withDefaults() (Options, error) {
	var problems []string
	if o.BlockSize == 0 {
		o.BlockSize = DefaultBlockSize
	} else if o.BlockSize < 0 {
		problems = append(problems, fmt.Sprintf("BlockSize %d < 1", o.BlockSize))
	}
	if o.CapacityBlocks == 0 {
		o.CapacityBlocks = DefaultCapacityBlocks
	} else if o.CapacityBlocks < 0 {
		problems = append(problems, fmt.Sprintf("CapacityBlocks %d < 1", o.CapacityBlocks))
	}
	switch {
	case o.EmptyTopic && o.Topic != "":
		problems = append(problems, fmt.Sprintf("EmptyTopic conflicts with Topic %q", o.Topic))
	case !o.EmptyTopic && o.Topic == "":
		o.Topic = DefaultTopic
	}
	if o.Encoding > EncodingArray {
		problems = append(problems, fmt.Sprintf("unknown Encoding %d", o.Encoding))
	}
	if o.HashFormat > HashBytes32 {
		problems = append(problems, fmt.Sprintf("unknown HashFormat %d", o.HashFormat))
	}
	switch {
	case o.RootParent > RootParentZero:
		problems = append(problems, fmt.Sprintf("unknown RootParent %d", o.RootParent))
	case o.RootParent == RootParentAbsent && o.Encoding == EncodingArray:
		problems = append(problems, "RootParentAbsent needs EncodingMap (a positional field cannot be left out)")
	}
	if o.TokenPairs && o.BlockSize == 1 {
		problems = append(problems, "TokenPairs needs BlockSize >= 2 (one token has no pair)")
	}
	if o.ArrayFullLength && o.Encoding != EncodingArray {
		problems = append(problems, "ArrayFullLength needs EncodingArray")
	}
	if o.HashScheme > HashSchemeRadixKey {
		problems = append(problems, fmt.Sprintf("unknown HashScheme %d", o.HashScheme))
	}
	if o.FirstSeq == EndSeq {
		problems = append(problems, "FirstSeq is EndSeq, the replay end marker")
	}
	if o.DPRank < 0 {
		problems = append(problems, fmt.Sprintf("DPRank %d < 0", o.DPRank))
	}
	switch o.PubMode {
	case PubBind:
		if o.PubEndpoint == "" {
			o.PubEndpoint = DefaultBindEndpoint
		}
	case PubDial:
		if o.PubEndpoint == "" {
			problems = append(problems, "PubDial needs a PubEndpoint")
		}
	default:
		problems = append(problems, fmt.Sprintf("unknown PubMode %d", o.PubMode))
	}
	if o.PubEndpoint != "" && !strings.Contains(o.PubEndpoint, "://") {
		problems = append(problems, fmt.Sprintf("PubEndpoint %q is not transport://address", o.PubEndpoint))
	}
	if o.DialAttempts == 0 {
		o.DialAttempts = DefaultDialAttempts
	} else if o.DialAttempts < 0 {
		problems = append(problems, fmt.Sprintf("DialAttempts %d < 1", o.DialAttempts))
	}
	if o.DialBackoff == 0 {
		o.DialBackoff = DefaultDialBackoff
	} else if o.DialBackoff < 0 {
		problems = append(problems, fmt.Sprintf("DialBackoff %v < 0", o.DialBackoff))
	}
	if o.ReplayEndpoint == "" {
		o.ReplayEndpoint = DefaultBindEndpoint
	} else if !strings.Contains(o.ReplayEndpoint, "://") {
		problems = append(problems, fmt.Sprintf("ReplayEndpoint %q is not transport://address", o.ReplayEndpoint))
	}
	if o.ReplayLayout > ReplayNoTopic {
		problems = append(problems, fmt.Sprintf("unknown ReplayLayout %d", o.ReplayLayout))
	}
	if o.ReplayBuffer == 0 {
		o.ReplayBuffer = DefaultReplayBuffer
	} else if o.ReplayBuffer < 0 {
		problems = append(problems, fmt.Sprintf("ReplayBuffer %d < 1", o.ReplayBuffer))
	}
	if o.HashSeed == 0 {
		o.HashSeed = DefaultHashSeed
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	problems = o.httpDefaults(problems)
	if len(problems) > 0 {
		return Options{}, fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
	}
	return o, nil
}

// timingDefaults fills Timing (after TTFTBase and PerTokenPrefill) and
// appends its problems.
func (o *Options) timingDefaults(problems []string) []string {
	if o.Timing.Cached != nil {
		return append(problems, "Timing.Cached must be nil (the engine reads its cache at arrival)")
	}
	if o.Timing.RequestOverhead == 0 {
		o.Timing.RequestOverhead = o.TTFTBase
	}
	if o.Timing.PrefillToken == 0 {
		o.Timing.PrefillToken = o.PerTokenPrefill
	}
	m, err := enginemodel.New(o.Timing)
	if err != nil {
		return append(problems, "Timing: "+strings.TrimPrefix(err.Error(), enginemodel.ErrInvalidParams.Error()+": "))
	}
	o.Timing = m.Params()
	return problems
}

// format returns the wire format the options describe.
func (o Options) format() Format {
	return Format{
		Events:          o.Encoding,
		BatchAsMap:      o.BatchAsMap,
		Hashes:          o.HashFormat,
		ExtraFields:     o.ExtraFields,
		RootParent:      o.RootParent,
		TokenPairs:      o.TokenPairs,
		ArrayFullLength: o.ArrayFullLength,
	}
}

// httpDefaults applies the defaults of the HTTP fields and appends their problems.
func (o *Options) httpDefaults(problems []string) []string {
	switch {
	case o.HTTPListener != nil && o.HTTPAddr != "":
		problems = append(problems, fmt.Sprintf("HTTPAddr %q and HTTPListener are both set", o.HTTPAddr))
	case o.HTTPListener != nil:
	case o.HTTPAddr == "":
		o.HTTPAddr = DefaultHTTPAddr
	default:
		if _, _, err := net.SplitHostPort(o.HTTPAddr); err != nil {
			problems = append(problems, fmt.Sprintf("HTTPAddr %q is not host:port", o.HTTPAddr))
		}
	}
	if o.Model == "" {
		o.Model = DefaultModel
	}
	if o.OutputTokens == 0 {
		o.OutputTokens = DefaultOutputTokens
	} else if o.OutputTokens < 0 {
		problems = append(problems, fmt.Sprintf("OutputTokens %d < 1", o.OutputTokens))
	}
	if o.MaxModelLen == 0 {
		o.MaxModelLen = DefaultMaxModelLen
	}
	if o.MaxModelLen <= o.OutputTokens {
		problems = append(problems, fmt.Sprintf("MaxModelLen %d <= OutputTokens %d", o.MaxModelLen, o.OutputTokens))
	}
	if o.TTFTBase == 0 {
		o.TTFTBase = DefaultTTFTBase
	} else if o.TTFTBase < 0 {
		problems = append(problems, fmt.Sprintf("TTFTBase %v < 0", o.TTFTBase))
	}
	if o.PerTokenPrefill == 0 {
		o.PerTokenPrefill = DefaultPerTokenPrefill
	} else if o.PerTokenPrefill < 0 {
		problems = append(problems, fmt.Sprintf("PerTokenPrefill %v < 0", o.PerTokenPrefill))
	}
	if o.TokenInterval < 0 {
		problems = append(problems, fmt.Sprintf("TokenInterval %v < 0", o.TokenInterval))
	}
	problems = o.timingDefaults(problems)
	return o.pdDefaults(problems)
}
