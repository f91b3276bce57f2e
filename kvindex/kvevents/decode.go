package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"

	"github.com/cespare/xxhash/v2"
	"github.com/tinylib/msgp/msgp"

	"github.com/kvselect/kvselect/kvindex"
)

// Errors returned by this package's decoder and constructors.
var (
	// ErrMalformed reports a payload whose batch envelope cannot be decoded: not an
	// array or map, a missing or mistyped events list, truncated or trailing bytes, a
	// declared length larger than the bytes that remain. Problems inside one event are
	// not errors: the event is skipped and counted (see SkipReason).
	ErrMalformed = errors.New("kvevents: malformed batch")
	// ErrUnknownRank is what an Applier returns for an event of a data-parallel
	// rank its worker does not have; IndexHandler counts it as SkipUnknownRank.
	ErrUnknownRank = errors.New("kvevents: no such data-parallel rank")
	// ErrInvalidOptions reports an options struct that a constructor rejected.
	ErrInvalidOptions = errors.New("kvevents: invalid options")
)

// Default decoder limits (see DecoderOptions).
const (
	DefaultMaxEvents          = 1 << 14
	DefaultMaxBlocksPerEvent  = 1 << 16
	DefaultMaxTokensPerEvent  = 1 << 22
	DefaultMaxInternedStrings = 1024
)

// maxInternedLen is the longest LoRA name or cache salt kept in the intern table;
// longer strings are copied on every use.
const maxInternedLen = 256

// DecoderOptions bounds what one Decoder accepts from untrusted payloads. The zero
// value means the defaults; negative values are rejected by NewDecoder.
type DecoderOptions struct {
	// MaxEvents is the most events decoded from one batch; further events are
	// skipped and counted as SkipLimit. Default DefaultMaxEvents.
	MaxEvents int
	// MaxBlocksPerEvent is the most block hashes one event may carry; a larger event
	// is skipped as SkipLimit. Default DefaultMaxBlocksPerEvent.
	MaxBlocksPerEvent int
	// MaxTokensPerEvent is the most token ids one event may carry (and the largest
	// block size accepted); a larger event is skipped as SkipLimit. Default
	// DefaultMaxTokensPerEvent.
	MaxTokensPerEvent int
	// MaxInternedStrings is the number of distinct LoRA names and cache salts a
	// Decoder keeps so that repeating them costs no allocation. Beyond it, new
	// strings are copied on every use. Default DefaultMaxInternedStrings.
	MaxInternedStrings int
}

// withDefaults validates o and fills in defaults, reporting every problem.
func (o DecoderOptions) withDefaults() (DecoderOptions, error) {
	var errs []error
	check := func(name string, v *int, def int) {
		switch {
		case *v < 0:
			errs = append(errs, fmt.Errorf("%w: %s is %d, want >= 0 (0 means %d)", ErrInvalidOptions, name, *v, def))
		case *v == 0:
			*v = def
		}
	}
	check("MaxEvents", &o.MaxEvents, DefaultMaxEvents)
	check("MaxBlocksPerEvent", &o.MaxBlocksPerEvent, DefaultMaxBlocksPerEvent)
	check("MaxTokensPerEvent", &o.MaxTokensPerEvent, DefaultMaxTokensPerEvent)
	check("MaxInternedStrings", &o.MaxInternedStrings, DefaultMaxInternedStrings)
	return o, errors.Join(errs...)
}

// SkipReason says why an event was not applied. The decoder sets the reasons up to
// SkipLimit; IndexHandler adds the ones the index reports when applying.
type SkipReason uint8

// Reasons for skipping an event.
const (
	// SkipMalformed: the event is not an array or map, lacks its tag or block
	// hashes, or a field has the wrong type.
	SkipMalformed SkipReason = iota
	// SkipUnknownType: the event's tag is not BlockStored, BlockRemoved or
	// AllBlocksCleared.
	SkipUnknownType
	// SkipUnknownMedium: the medium names no known storage tier.
	SkipUnknownMedium
	// SkipNonMainGroup: group_idx is set and not 0 (a secondary KV-cache group of a
	// hybrid model, such as its sliding-window layers).
	SkipNonMainGroup
	// SkipNonMainKind: kv_cache_spec_kind is set and is not a full-attention kind.
	SkipNonMainKind
	// SkipLocality: locality is set and is not LOCAL (remote or unknown blocks fail
	// closed).
	SkipLocality
	// SkipTokenRange: a token id is negative or does not fit 32 bits.
	SkipTokenRange
	// SkipLimit: the event exceeds a DecoderOptions limit.
	SkipLimit
	// SkipUnknownParent: the index does not know the stored run's parent block.
	SkipUnknownParent
	// SkipBlockSize: the event's block size is not a whole multiple of the index's.
	SkipBlockSize
	// SkipTokenCount: the number of token ids does not match blocks x block size.
	SkipTokenCount
	// SkipInvalidEvent: the index rejected the event as inconsistent.
	SkipInvalidEvent
	// SkipApplyError: the index returned an error this package does not classify.
	SkipApplyError
	// SkipNoTokens: a stored event names blocks but carries no token ids
	// (storage-tier publishers announce offloaded copies of blocks by hash
	// only); the router cannot key them.
	SkipNoTokens
	// SkipUnknownRank: the batch names a data-parallel rank the worker does not
	// have (the Applier returned ErrUnknownRank).
	SkipUnknownRank
	// SkipRankFull: the worker rank holds its limit of blocks
	// (kvindex.ErrRankFull).
	SkipRankFull
	// SkipUnknownBlock: a removal named blocks the index does not hold for the
	// worker rank (their store was lost or skipped); the known ones were removed.
	SkipUnknownBlock

	// NumSkipReasons is the number of reasons; SkipReason values index arrays of
	// this length.
	NumSkipReasons = iota
)

var skipReasonNames = [NumSkipReasons]string{
	SkipMalformed:     "malformed",
	SkipUnknownType:   "unknown_type",
	SkipUnknownMedium: "unknown_medium",
	SkipNonMainGroup:  "non_main_group",
	SkipNonMainKind:   "non_main_kind",
	SkipLocality:      "not_local",
	SkipTokenRange:    "token_range",
	SkipLimit:         "limit",
	SkipUnknownParent: "unknown_parent",
	SkipBlockSize:     "block_size",
	SkipTokenCount:    "token_count",
	SkipInvalidEvent:  "invalid_event",
	SkipApplyError:    "apply_error",
	SkipNoTokens:      "no_tokens",
	SkipUnknownRank:   "unknown_rank",
	SkipRankFull:      "rank_full",
	SkipUnknownBlock:  "unknown_block",
}

// ByDesign reports whether events skipped for r are left out on purpose, not
// lost: events of another cache group or kind, of remote blocks, or of a type
// this package does not know (newer engines). The other reasons mean the index
// is missing something the engine holds (or holds something it lost).
func (r SkipReason) ByDesign() bool {
	switch r {
	case SkipUnknownType, SkipNonMainGroup, SkipNonMainKind, SkipLocality, SkipNoTokens:
		return true
	}
	return false
}

// String returns a short snake_case name, suitable as a metrics label.
func (r SkipReason) String() string {
	if int(r) < len(skipReasonNames) {
		return skipReasonNames[r]
	}
	return "skip_reason(" + strconv.Itoa(int(r)) + ")"
}

// keep is the internal "not skipped" result of the field parsers.
const keep SkipReason = math.MaxUint8

// Batch is one decoded engine batch. It is owned by the Decoder that returned it and
// is valid only until that Decoder's next Decode call, which reuses its memory
// (Events and the slices inside them included). Copy what must outlive it.
type Batch struct {
	// Timestamp is the engine's wall-clock time of the batch in seconds since the
	// Unix epoch (0 when absent).
	Timestamp float64
	// DPRank is the data-parallel rank stamped on the batch; meaningful only when
	// HasDPRank is true.
	DPRank    int
	HasDPRank bool
	// Events are the decoded events, in batch order, without the skipped ones.
	Events []kvindex.Event
	// Skipped counts the events left out, by reason.
	Skipped [NumSkipReasons]int
}

// SkippedTotal returns the number of events left out of the batch.
func (b *Batch) SkippedTotal() int {
	n := 0
	for _, c := range b.Skipped {
		n += c
	}
	return n
}

// span locates one event's slices inside the Decoder's shared buffers.
type span struct {
	hOff, hLen int
	tOff, tLen int
	xOff, xLen int
}

// Decoder turns msgpack KV-event batches into kvindex Events. It keeps its buffers
// between calls, so decoding allocates nothing in steady state. A Decoder is not
// safe for concurrent use: give each source goroutine its own.
type Decoder struct {
	opts DecoderOptions

	batch  Batch
	spans  []span
	hashes []uint64
	tokens []uint32
	extra  []uint64

	intern  map[string]string
	scratch []byte
	digest  xxhash.Digest
}

// NewDecoder returns a Decoder with the given limits. It returns an error wrapping
// ErrInvalidOptions when an option is negative.
func NewDecoder(opts DecoderOptions) (*Decoder, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Decoder{opts: o, intern: make(map[string]string)}, nil
}

// Decode parses one batch payload (the third frame of an engine message).
//
// The batch may be an array [ts, events] or [ts, events, dp_rank] (dp_rank may be
// nil; further elements are ignored) or a map with the keys "ts", "events" and one
// of "data_parallel_rank", "dp_rank" or "attn_dp_rank" (other keys are ignored).
// See the package documentation for the accepted event encodings and the mapping
// of their fields.
//
// Decode returns an error wrapping ErrMalformed when the envelope is unusable; in
// that case nothing of the batch should be applied. An event that cannot be used is
// left out and counted in Batch.Skipped without affecting the other events. The
// returned Batch is valid until the next call to Decode.
func (d *Decoder) Decode(payload []byte) (*Batch, error) {
	d.reset()
	var (
		rest []byte
		err  error
	)
	switch t := msgp.NextType(payload); t {
	case msgp.ArrayType:
		rest, err = d.decodeArrayBatch(payload)
	case msgp.MapType:
		rest, err = d.decodeMapBatch(payload)
	case msgp.InvalidType:
		if len(payload) == 0 {
			return nil, fmt.Errorf("%w: empty payload", ErrMalformed)
		}
		return nil, fmt.Errorf("%w: invalid leading byte 0x%02x", ErrMalformed, payload[0])
	default:
		return nil, fmt.Errorf("%w: batch is %s, want array or map", ErrMalformed, t)
	}
	if err != nil {
		d.reset()
		return nil, err
	}
	if len(rest) != 0 {
		d.reset()
		return nil, fmt.Errorf("%w: %d trailing bytes after the batch", ErrMalformed, len(rest))
	}
	d.finish()
	return &d.batch, nil
}

func (d *Decoder) reset() {
	clear(d.batch.Events) // drop references to old strings
	d.batch = Batch{Events: d.batch.Events[:0]}
	d.spans = d.spans[:0]
	d.hashes = d.hashes[:0]
	d.tokens = d.tokens[:0]
	d.extra = d.extra[:0]
}

// finish points every event's slices into the shared buffers. It runs once all
// events are decoded, because appending to the buffers may move them. The slices
// are capped so that an Applier appending to one cannot overwrite its neighbour.
func (d *Decoder) finish() {
	for i := range d.batch.Events {
		ev, s := &d.batch.Events[i], d.spans[i]
		if s.hLen > 0 {
			ev.BlockHashes = d.hashes[s.hOff : s.hOff+s.hLen : s.hOff+s.hLen]
		}
		if s.tLen > 0 {
			ev.Tokens = d.tokens[s.tOff : s.tOff+s.tLen : s.tOff+s.tLen]
		}
		if s.xLen > 0 {
			ev.Extra = d.extra[s.xOff : s.xOff+s.xLen : s.xOff+s.xLen]
		}
	}
}

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrMalformed}, args...)...)
}

func (d *Decoder) decodeArrayBatch(b []byte) ([]byte, error) {
	n, b, err := msgp.ReadArrayHeaderBytes(b)
	if err != nil {
		return nil, malformed("batch header: %v", err)
	}
	if n < 2 {
		return nil, malformed("batch array has %d elements, want 2 or 3", n)
	}
	if uint64(n) > uint64(len(b)) {
		return nil, malformed("batch array declares %d elements in %d bytes", n, len(b))
	}
	if d.batch.Timestamp, b, err = readTimestamp(b); err != nil {
		return nil, err
	}
	if b, err = d.decodeEvents(b); err != nil {
		return nil, err
	}
	if n >= 3 {
		if d.batch.DPRank, d.batch.HasDPRank, b, err = readDPRank(b); err != nil {
			return nil, err
		}
	}
	for i := uint32(3); i < n; i++ {
		if b, err = skipValue(b); err != nil {
			return nil, malformed("batch element %d: %v", i, err)
		}
	}
	return b, nil
}

func (d *Decoder) decodeMapBatch(b []byte) ([]byte, error) {
	n, b, err := msgp.ReadMapHeaderBytes(b)
	if err != nil {
		return nil, malformed("batch header: %v", err)
	}
	if 2*uint64(n) > uint64(len(b)) {
		return nil, malformed("batch map declares %d entries in %d bytes", n, len(b))
	}
	sawEvents := false
	for i := uint32(0); i < n; i++ {
		var key []byte
		if msgp.NextType(b) == msgp.StrType {
			if key, b, err = msgp.ReadStringZC(b); err != nil {
				return nil, malformed("batch key: %v", err)
			}
		} else if b, err = skipValue(b); err != nil {
			return nil, malformed("batch key: %v", err)
		}
		switch string(key) {
		case "ts":
			d.batch.Timestamp, b, err = readTimestamp(b)
		case "events":
			if sawEvents {
				return nil, malformed("duplicate events key")
			}
			sawEvents = true
			b, err = d.decodeEvents(b)
		case "data_parallel_rank", "dp_rank", "attn_dp_rank":
			var (
				r   int
				has bool
			)
			r, has, b, err = readDPRank(b)
			if has {
				d.batch.DPRank, d.batch.HasDPRank = r, true
			}
		default:
			if b, err = skipValue(b); err != nil {
				err = malformed("batch value: %v", err)
			}
		}
		if err != nil {
			return nil, err
		}
	}
	if !sawEvents {
		return nil, malformed("batch map has no events key")
	}
	return b, nil
}

func readTimestamp(b []byte) (float64, []byte, error) {
	switch msgp.NextType(b) {
	case msgp.Float64Type:
		f, rest, err := msgp.ReadFloat64Bytes(b)
		if err != nil {
			return 0, nil, malformed("timestamp: %v", err)
		}
		return f, rest, nil
	case msgp.Float32Type:
		f, rest, err := msgp.ReadFloat32Bytes(b)
		if err != nil {
			return 0, nil, malformed("timestamp: %v", err)
		}
		return float64(f), rest, nil
	case msgp.IntType:
		i, rest, err := msgp.ReadInt64Bytes(b)
		if err != nil {
			return 0, nil, malformed("timestamp: %v", err)
		}
		return float64(i), rest, nil
	case msgp.UintType:
		u, rest, err := msgp.ReadUint64Bytes(b)
		if err != nil {
			return 0, nil, malformed("timestamp: %v", err)
		}
		return float64(u), rest, nil
	case msgp.NilType:
		return 0, b[1:], nil
	default:
		return 0, nil, malformed("timestamp is %s, want a number", msgp.NextType(b))
	}
}

func readDPRank(b []byte) (rank int, has bool, rest []byte, err error) {
	v, isNil, rest, ok := readInt(b)
	if !ok {
		return 0, false, nil, malformed("data-parallel rank is %s, want an integer or nil", msgp.NextType(b))
	}
	if isNil {
		return 0, false, rest, nil
	}
	if v < 0 || v > math.MaxInt32 {
		return 0, false, nil, malformed("data-parallel rank %d out of range", v)
	}
	return int(v), true, rest, nil
}

// decodeEvents reads the events array. An event that cannot be used is skipped by
// finding its extent structurally, so it does not cost the events after it.
func (d *Decoder) decodeEvents(b []byte) ([]byte, error) {
	n, b, err := msgp.ReadArrayHeaderBytes(b)
	if err != nil {
		return nil, malformed("events: %v", err)
	}
	if uint64(n) > uint64(len(b)) {
		return nil, malformed("events array declares %d events in %d bytes", n, len(b))
	}
	for i := uint32(0); i < n; i++ {
		r := SkipLimit
		if len(d.batch.Events) < d.opts.MaxEvents {
			var rest []byte
			if rest, r = d.decodeEvent(b); r == keep {
				b = rest
				continue
			}
		}
		rest, err := skipValue(b)
		if err != nil {
			return nil, malformed("event %d: %v", i, err)
		}
		b = rest
		d.batch.Skipped[r]++
	}
	return b, nil
}

// eventFields collects one event's fields before they are checked and committed.
type eventFields struct {
	kind       kvindex.EventKind
	known      bool // the tag names a known kind
	tagged     bool // a tag was present
	tier       kvindex.Tier
	sawHashes  bool
	sawTokens  bool
	hOff, hLen int
	tOff, tLen int
	parent     uint64
	hasParent  bool
	blockSize  int
	loraName   []byte
	loraID     []byte // raw msgpack of a legacy lora_id, nil when absent or nil
	cacheSalt  []byte
	extraKeys  []byte // raw msgpack of extra_keys, nil when absent or nil
}

// decodeEvent parses the event at the start of b and appends it to the batch,
// returning the bytes after it and keep; or it returns why the event must be
// skipped, with the buffers rolled back (the caller then finds the event's end).
// A successful parse consumes exactly one msgpack value, so no separate pass over
// the event is needed.
func (d *Decoder) decodeEvent(b []byte) ([]byte, SkipReason) {
	nh, nt, nx := len(d.hashes), len(d.tokens), len(d.extra)
	f := eventFields{hOff: nh, tOff: nt}
	var (
		rest []byte
		r    SkipReason
	)
	switch msgp.NextType(b) {
	case msgp.ArrayType:
		rest, r = d.parseArrayEvent(b, &f)
	case msgp.MapType:
		rest, r = d.parseMapEvent(b, &f)
	case msgp.BinType:
		// Some publishers (llm-d's storage-tier one) encode each event on its own
		// and send the bytes: decode them as the event, which must fill them.
		inner, after, err := msgp.ReadBytesZC(b)
		if err != nil {
			r = SkipMalformed
			break
		}
		var tail []byte
		switch msgp.NextType(inner) {
		case msgp.ArrayType:
			tail, r = d.parseArrayEvent(inner, &f)
		case msgp.MapType:
			tail, r = d.parseMapEvent(inner, &f)
		default:
			r = SkipMalformed
		}
		if r == keep && len(tail) != 0 {
			r = SkipMalformed
		}
		rest = after
	default:
		r = SkipMalformed
	}
	if r == keep {
		r = d.commit(&f)
	}
	if r != keep {
		d.hashes, d.tokens, d.extra = d.hashes[:nh], d.tokens[:nt], d.extra[:nx]
		return nil, r
	}
	return rest, keep
}

func kindOf(tag []byte) (kvindex.EventKind, bool) {
	switch string(tag) {
	case "BlockStored":
		return kvindex.EventStored, true
	case "BlockRemoved":
		return kvindex.EventRemoved, true
	case "AllBlocksCleared":
		return kvindex.EventCleared, true
	}
	return 0, false
}

// Positions of BlockStored fields in the array encoding (0 is the tag).
const (
	posStoredHashes = iota + 1
	posStoredParent
	posStoredTokens
	posStoredBlockSize
	posStoredLoRAID
	posStoredMedium
	posStoredLoRAName // SGLang: a metadata map in this slot
	posStoredExtraKeys
	posStoredGroup
	posStoredKind
)

// Positions of BlockRemoved fields in the array encoding.
const (
	posRemovedHashes = iota + 1
	posRemovedMedium
	posRemovedGroup
)

func (d *Decoder) parseArrayEvent(b []byte, f *eventFields) ([]byte, SkipReason) {
	n, b, err := msgp.ReadArrayHeaderBytes(b)
	if err != nil || n == 0 || uint64(n) > uint64(len(b)) {
		return nil, SkipMalformed
	}
	tag, b, err := msgp.ReadStringZC(b)
	if err != nil {
		return nil, SkipMalformed
	}
	f.tagged = true
	if f.kind, f.known = kindOf(tag); !f.known {
		return nil, SkipUnknownType
	}
	for pos := uint32(1); pos < n; pos++ {
		r := keep
		switch f.kind {
		case kvindex.EventStored:
			switch pos {
			case posStoredHashes:
				b, r = d.readHashes(b, f)
			case posStoredParent:
				b, r = readParent(b, f)
			case posStoredTokens:
				b, r = d.readTokens(b, f)
			case posStoredBlockSize:
				b, r = d.readBlockSize(b, f)
			case posStoredLoRAID:
				b, r = readLoRAID(b, f)
			case posStoredMedium:
				b, r = readMedium(b, f)
			case posStoredLoRAName:
				b, r = readLoRANameOrMetadata(b, f)
			case posStoredExtraKeys:
				b, r = readExtraKeys(b, f)
			case posStoredGroup:
				b, r = readGroup(b)
			case posStoredKind:
				b, r = readSpecKind(b)
			default:
				b, r = skipField(b)
			}
		case kvindex.EventRemoved:
			switch pos {
			case posRemovedHashes:
				b, r = d.readHashes(b, f)
			case posRemovedMedium:
				b, r = readMedium(b, f)
			case posRemovedGroup:
				b, r = readGroup(b)
			default:
				b, r = skipField(b)
			}
		default:
			b, r = skipField(b)
		}
		if r != keep {
			return nil, r
		}
	}
	return b, keep
}

func (d *Decoder) parseMapEvent(b []byte, f *eventFields) ([]byte, SkipReason) {
	n, b, err := msgp.ReadMapHeaderBytes(b)
	if err != nil || 2*uint64(n) > uint64(len(b)) {
		return nil, SkipMalformed
	}
	var seen uint16 // one bit per field key, to reject duplicates
	for i := uint32(0); i < n; i++ {
		if msgp.NextType(b) != msgp.StrType {
			return nil, SkipMalformed
		}
		var key []byte
		if key, b, err = msgp.ReadStringZC(b); err != nil {
			return nil, SkipMalformed
		}
		bit := uint16(0)
		r := keep
		val := b
		switch string(key) {
		case "type":
			bit = 1 << 0
			var tag []byte
			if tag, b, err = msgp.ReadStringZC(b); err != nil {
				return nil, SkipMalformed
			}
			f.tagged = true
			if f.kind, f.known = kindOf(tag); !f.known {
				return nil, SkipUnknownType
			}
		case "block_hashes":
			bit = 1 << 1
			b, r = d.readHashes(b, f)
		case "parent_block_hash":
			bit = 1 << 2
			b, r = readParent(b, f)
		case "token_ids":
			bit = 1 << 3
			b, r = d.readTokens(b, f)
		case "block_size":
			bit = 1 << 4
			b, r = d.readBlockSize(b, f)
		case "lora_id":
			bit = 1 << 5
			b, r = readLoRAID(b, f)
		case "medium":
			bit = 1 << 6
			b, r = readMedium(b, f)
		case "lora_name":
			bit = 1 << 7
			b, r = readOptString(b, &f.loraName)
		case "extra_keys":
			bit = 1 << 8
			b, r = readExtraKeys(b, f)
		case "group_idx":
			bit = 1 << 9
			b, r = readGroup(b)
		case "kv_cache_spec_kind":
			bit = 1 << 10
			b, r = readSpecKind(b)
		case "locality":
			bit = 1 << 11
			b, r = readLocality(b)
		case "cache_salt":
			bit = 1 << 12
			b, r = readOptString(b, &f.cacheSalt)
		case "metadata":
			bit = 1 << 13
			b, r = readMetadata(b, f)
		default: // kv_cache_spec_sliding_window and anything newer
			b, r = skipField(b)
		}
		if seen&bit != 0 {
			return nil, SkipMalformed
		}
		seen |= bit
		if r != keep {
			// A filter decision needs the tag to be meaningful: an unknown type
			// outranks it, so finish reading the tag if it is still ahead.
			if r != SkipMalformed && !f.tagged {
				rest, err := skipValue(val)
				if err != nil {
					return nil, SkipMalformed
				}
				if t := d.findMapTag(rest, n-i-1); t != keep {
					return nil, t
				}
			}
			return nil, r
		}
	}
	if !f.tagged {
		return nil, SkipMalformed
	}
	if !f.known {
		return nil, SkipUnknownType
	}
	return b, keep
}

// findMapTag scans the remaining n entries of an event map for its "type" and
// returns SkipUnknownType or SkipMalformed when the tag is unknown or absent, keep
// otherwise.
func (d *Decoder) findMapTag(b []byte, n uint32) SkipReason {
	for i := uint32(0); i < n; i++ {
		key, rest, err := msgp.ReadStringZC(b)
		if err != nil {
			return SkipMalformed
		}
		if string(key) == "type" {
			tag, _, err := msgp.ReadStringZC(rest)
			if err != nil {
				return SkipMalformed
			}
			if _, ok := kindOf(tag); !ok {
				return SkipUnknownType
			}
			return keep
		}
		if b, err = skipValue(rest); err != nil {
			return SkipMalformed
		}
	}
	return SkipMalformed
}

// commit checks the collected fields and appends the event.
func (d *Decoder) commit(f *eventFields) SkipReason {
	ev := kvindex.Event{Kind: f.kind, Tier: f.tier}
	switch f.kind {
	case kvindex.EventStored:
		if !f.sawHashes {
			return SkipMalformed
		}
		if f.tLen == 0 && f.hLen > 0 {
			return SkipNoTokens
		}
		ev.ParentHash, ev.HasParent = f.parent, f.hasParent
		ev.BlockSize = f.blockSize
		ev.LoRAName = d.internBytes(f.loraName)
		if ev.LoRAName == "" && f.loraID != nil {
			name, ok := d.legacyLoRAName(f.loraID)
			if !ok {
				return SkipMalformed
			}
			ev.LoRAName = name
		}
		ev.CacheSalt = d.internBytes(f.cacheSalt)
		if f.extraKeys != nil {
			if r := d.readExtras(f, &ev); r != keep {
				return r
			}
		}
	case kvindex.EventRemoved:
		if !f.sawHashes {
			return SkipMalformed
		}
	case kvindex.EventCleared:
		ev.Tier = kvindex.TierDevice
	}
	var s span
	switch f.kind {
	case kvindex.EventStored:
		s = span{hOff: f.hOff, hLen: f.hLen, tOff: f.tOff, tLen: f.tLen}
	case kvindex.EventRemoved:
		s = span{hOff: f.hOff, hLen: f.hLen}
	}
	if ev.Extra != nil {
		s.xLen = len(ev.Extra)
		s.xOff = len(d.extra) - s.xLen
		ev.Extra = nil // set by finish
	}
	d.batch.Events = append(d.batch.Events, ev)
	d.spans = append(d.spans, s)
	return keep
}

// --- field readers: each consumes one value and returns keep or a skip reason ---

func skipField(b []byte) ([]byte, SkipReason) {
	rest, err := skipValue(b)
	if err != nil {
		return nil, SkipMalformed
	}
	return rest, keep
}

// readInt reads an integer of any width, or nil. ok is false for other types and
// for unsigned values above MaxInt64.
func readInt(b []byte) (v int64, isNil bool, rest []byte, ok bool) {
	switch msgp.NextType(b) {
	case msgp.IntType:
		v, rest, err := msgp.ReadInt64Bytes(b)
		return v, false, rest, err == nil
	case msgp.UintType:
		u, rest, err := msgp.ReadUint64Bytes(b)
		if err != nil || u > math.MaxInt64 {
			return 0, false, nil, false
		}
		return int64(u), false, rest, true
	case msgp.NilType:
		return 0, true, b[1:], true
	}
	return 0, false, nil, false
}

// readHash reads one block hash: an unsigned integer as is, a signed one
// reinterpreted as two's complement, bytes as their last 8 bytes big-endian
// (shorter byte strings are left-padded with zeros).
func readHash(b []byte) (uint64, []byte, bool) {
	switch msgp.NextType(b) {
	case msgp.UintType:
		u, rest, err := msgp.ReadUint64Bytes(b)
		return u, rest, err == nil
	case msgp.IntType:
		i, rest, err := msgp.ReadInt64Bytes(b)
		return uint64(i), rest, err == nil
	case msgp.BinType:
		v, rest, err := msgp.ReadBytesZC(b)
		if err != nil {
			return 0, nil, false
		}
		if len(v) > 8 {
			v = v[len(v)-8:]
		}
		var h uint64
		for _, c := range v {
			h = h<<8 | uint64(c)
		}
		return h, rest, true
	}
	return 0, nil, false
}

func (d *Decoder) readHashes(b []byte, f *eventFields) ([]byte, SkipReason) {
	if f.sawHashes {
		return nil, SkipMalformed
	}
	f.sawHashes = true
	n, b, err := msgp.ReadArrayHeaderBytes(b)
	if err != nil || uint64(n) > uint64(len(b)) {
		return nil, SkipMalformed
	}
	if uint64(n) > uint64(d.opts.MaxBlocksPerEvent) {
		return nil, SkipLimit
	}
	d.hashes = slices.Grow(d.hashes, int(n))
	for i := uint32(0); i < n; i++ {
		var (
			h  uint64
			ok bool
		)
		if h, b, ok = readHash(b); !ok {
			return nil, SkipMalformed
		}
		d.hashes = append(d.hashes, h)
	}
	f.hOff, f.hLen = len(d.hashes)-int(n), int(n)
	return b, keep
}

func readParent(b []byte, f *eventFields) ([]byte, SkipReason) {
	if msgp.IsNil(b) {
		f.hasParent = false
		return b[1:], keep
	}
	h, rest, ok := readHash(b)
	if !ok {
		return nil, SkipMalformed
	}
	// Array-form encoders write 0 (or zero bytes) for a run that starts the
	// sequence; 0 is never looked up as a block.
	f.parent, f.hasParent = h, h != 0
	return rest, keep
}

// readToken reads one token id; it must be an integer in [0, 2^32).
func readToken(b []byte) (uint32, []byte, SkipReason) {
	// Fast path: positive fixint and the unsigned forms msgspec writes.
	if len(b) > 0 {
		switch c := b[0]; {
		case c <= 0x7f:
			return uint32(c), b[1:], keep
		case c == 0xcc && len(b) >= 2:
			return uint32(b[1]), b[2:], keep
		case c == 0xcd && len(b) >= 3:
			return uint32(b[1])<<8 | uint32(b[2]), b[3:], keep
		case c == 0xce && len(b) >= 5:
			return uint32(b[1])<<24 | uint32(b[2])<<16 | uint32(b[3])<<8 | uint32(b[4]), b[5:], keep
		}
	}
	v, isNil, rest, ok := readInt(b)
	switch {
	case !ok && msgp.NextType(b) == msgp.UintType:
		return 0, nil, SkipTokenRange // above MaxInt64
	case !ok || isNil:
		return 0, nil, SkipMalformed
	case v < 0 || v > math.MaxUint32:
		return 0, nil, SkipTokenRange
	}
	return uint32(v), rest, keep
}

// readTokens reads token_ids: an array of ints, or SGLang's bigram (EAGLE) form
// [[t0,t1],[t1,t2],...,[t(n-1),t(n)]], one pair per token position, whose tokens
// are the first elements t0..t(n-1) (the last pair looks one token ahead, into
// the next block). Consecutive pairs must overlap.
func (d *Decoder) readTokens(b []byte, f *eventFields) ([]byte, SkipReason) {
	if f.sawTokens {
		return nil, SkipMalformed
	}
	f.sawTokens = true
	if msgp.IsNil(b) {
		return b[1:], keep
	}
	n, b, err := msgp.ReadArrayHeaderBytes(b)
	if err != nil || uint64(n) > uint64(len(b)) {
		return nil, SkipMalformed
	}
	if n == 0 {
		return b, keep
	}
	bigram := msgp.NextType(b) == msgp.ArrayType
	count := uint64(n)
	if count > uint64(d.opts.MaxTokensPerEvent) {
		return nil, SkipLimit
	}
	d.tokens = slices.Grow(d.tokens, int(count))
	start := len(d.tokens)
	var ahead uint32 // the second element of the previous pair
	for i := uint32(0); i < n; i++ {
		var (
			t uint32
			r SkipReason
		)
		if !bigram {
			// Inline the two forms nearly every token id takes.
			if len(b) >= 5 && b[0] == 0xce {
				d.tokens = append(d.tokens, binary.BigEndian.Uint32(b[1:]))
				b = b[5:]
				continue
			}
			if len(b) > 0 && b[0] <= 0x7f {
				d.tokens = append(d.tokens, uint32(b[0]))
				b = b[1:]
				continue
			}
			if t, b, r = readToken(b); r != keep {
				return nil, r
			}
			d.tokens = append(d.tokens, t)
			continue
		}
		var m uint32
		if m, b, err = msgp.ReadArrayHeaderBytes(b); err != nil || m != 2 {
			return nil, SkipMalformed
		}
		var first uint32
		if first, b, r = readToken(b); r != keep {
			return nil, r
		}
		if i > 0 && first != ahead {
			return nil, SkipMalformed // not overlapping pairs
		}
		d.tokens = append(d.tokens, first)
		if ahead, b, r = readToken(b); r != keep {
			return nil, r
		}
	}
	f.tOff, f.tLen = start, len(d.tokens)-start
	return b, keep
}

func (d *Decoder) readBlockSize(b []byte, f *eventFields) ([]byte, SkipReason) {
	v, isNil, rest, ok := readInt(b)
	switch {
	case !ok:
		return nil, SkipMalformed
	case isNil || v == 0: // 0: offload connectors that leave it unset
		f.blockSize = 0
	case v < 0:
		return nil, SkipMalformed
	case v > int64(d.opts.MaxTokensPerEvent):
		return nil, SkipLimit
	default:
		f.blockSize = int(v)
	}
	return rest, keep
}

func readLoRAID(b []byte, f *eventFields) ([]byte, SkipReason) {
	switch msgp.NextType(b) {
	case msgp.NilType:
		f.loraID = nil
		return b[1:], keep
	case msgp.IntType, msgp.UintType, msgp.StrType:
		rest, err := skipValue(b)
		if err != nil {
			return nil, SkipMalformed
		}
		f.loraID = b[:len(b)-len(rest)]
		return rest, keep
	}
	return nil, SkipMalformed
}

// readOptString reads a string or nil into *dst (nil for nil).
func readOptString(b []byte, dst *[]byte) ([]byte, SkipReason) {
	if msgp.IsNil(b) {
		*dst = nil
		return b[1:], keep
	}
	s, rest, err := msgp.ReadStringZC(b)
	if err != nil {
		return nil, SkipMalformed
	}
	*dst = s
	return rest, keep
}

// readLoRANameOrMetadata reads array position 7: vLLM's lora_name, or the metadata
// map ({"cache_salt": ...}) that salted SGLang events put there.
func readLoRANameOrMetadata(b []byte, f *eventFields) ([]byte, SkipReason) {
	if msgp.NextType(b) == msgp.MapType {
		return readMetadata(b, f)
	}
	return readOptString(b, &f.loraName)
}

// readMetadata reads SGLang's metadata map; only "cache_salt" is used.
func readMetadata(b []byte, f *eventFields) ([]byte, SkipReason) {
	if msgp.IsNil(b) {
		return b[1:], keep
	}
	n, b, err := msgp.ReadMapHeaderBytes(b)
	if err != nil || 2*uint64(n) > uint64(len(b)) {
		return nil, SkipMalformed
	}
	for i := uint32(0); i < n; i++ {
		var key []byte
		if key, b, err = msgp.ReadStringZC(b); err != nil {
			return nil, SkipMalformed
		}
		r := keep
		if string(key) == "cache_salt" {
			b, r = readOptString(b, &f.cacheSalt)
		} else {
			b, r = skipField(b)
		}
		if r != keep {
			return nil, r
		}
	}
	return b, keep
}

func readExtraKeys(b []byte, f *eventFields) ([]byte, SkipReason) {
	switch msgp.NextType(b) {
	case msgp.NilType:
		f.extraKeys = nil
		return b[1:], keep
	case msgp.ArrayType:
		rest, err := skipValue(b)
		if err != nil {
			return nil, SkipMalformed
		}
		f.extraKeys = b[:len(b)-len(rest)]
		return rest, keep
	}
	return nil, SkipMalformed
}

func readGroup(b []byte) ([]byte, SkipReason) {
	v, isNil, rest, ok := readInt(b)
	switch {
	case !ok:
		return nil, SkipMalformed
	case !isNil && v != 0:
		return nil, SkipNonMainGroup
	}
	return rest, keep
}

// upperASCII copies s upper-cased into buf and returns the filled part, or nil when
// s does not fit.
func upperASCII(buf []byte, s []byte) []byte {
	if len(s) > len(buf) {
		return nil
	}
	for i, c := range s {
		if 'a' <= c && c <= 'z' {
			c -= 'a' - 'A'
		}
		buf[i] = c
	}
	return buf[:len(s)]
}

func readSpecKind(b []byte) ([]byte, SkipReason) {
	var s []byte
	rest, r := readOptString(b, &s)
	if r != keep || s == nil {
		return rest, r
	}
	var buf [32]byte
	switch string(upperASCII(buf[:], s)) {
	case "FULL_ATTENTION", "MLA_ATTENTION", "SINK_FULL_ATTENTION":
		return rest, keep
	}
	return nil, SkipNonMainKind
}

func readLocality(b []byte) ([]byte, SkipReason) {
	var s []byte
	rest, r := readOptString(b, &s)
	if r != keep || s == nil {
		return rest, r
	}
	var buf [8]byte
	if string(upperASCII(buf[:], s)) != "LOCAL" {
		return nil, SkipLocality
	}
	return rest, keep
}

// tierOf maps an engine medium name to a tier (case-insensitive):
//
//	"", GPU, CUDA, DEVICE, HBM                               -> TierDevice
//	CPU, CPU_PINNED, HOST, DRAM                              -> TierHost
//	DISK, LOCAL_DISK, SSD, NVME, FILE, FS, FILE_SYSTEM, STORAGE,
//	SHARED_STORAGE, OBJ, OBJECT, OBJECT_STORE, EXTERNAL      -> TierDisk
func tierOf(medium []byte) (kvindex.Tier, bool) {
	var buf [16]byte
	up := upperASCII(buf[:], medium)
	if up == nil {
		return 0, false
	}
	switch string(up) {
	case "", "GPU", "CUDA", "DEVICE", "HBM":
		return kvindex.TierDevice, true
	case "CPU", "CPU_PINNED", "HOST", "DRAM":
		return kvindex.TierHost, true
	case "DISK", "LOCAL_DISK", "SSD", "NVME", "FILE", "FS", "FILE_SYSTEM", "STORAGE", "SHARED_STORAGE",
		"OBJ", "OBJECT", "OBJECT_STORE", "EXTERNAL":
		return kvindex.TierDisk, true
	}
	return 0, false
}

func readMedium(b []byte, f *eventFields) ([]byte, SkipReason) {
	var s []byte
	rest, r := readOptString(b, &s)
	if r != keep {
		return rest, r
	}
	t, ok := tierOf(s)
	if !ok {
		return nil, SkipUnknownMedium
	}
	f.tier = t
	return rest, keep
}

// --- strings ---

// internBytes returns b as a string, sharing one copy per distinct value while the
// intern table has room.
func (d *Decoder) internBytes(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	if s, ok := d.intern[string(b)]; ok {
		return s
	}
	s := string(b)
	if len(b) <= maxInternedLen && len(d.intern) < d.opts.MaxInternedStrings {
		d.intern[s] = s
	}
	return s
}

// legacyLoRAName turns a legacy lora_id (integer or string) into the LoRA name
// "lora-id:<id>", so blocks of an adapter identified only by id never match
// base-model requests. A nil id, 0 (engines number adapters from 1) and "" yield
// "".
func (d *Decoder) legacyLoRAName(raw []byte) (string, bool) {
	d.scratch = append(d.scratch[:0], "lora-id:"...)
	switch msgp.NextType(raw) {
	case msgp.StrType:
		s, _, err := msgp.ReadStringZC(raw)
		if err != nil {
			return "", false
		}
		if len(s) == 0 {
			return "", true
		}
		d.scratch = append(d.scratch, s...)
	default:
		v, isNil, _, ok := readInt(raw)
		if !ok {
			// An unsigned id above MaxInt64: keep its decimal form.
			u, _, err := msgp.ReadUint64Bytes(raw)
			if err != nil {
				return "", false
			}
			d.scratch = strconv.AppendUint(d.scratch, u, 10)
			break
		}
		if isNil || v == 0 {
			return "", true
		}
		d.scratch = strconv.AppendInt(d.scratch, v, 10)
	}
	return d.internBytes(d.scratch), true
}

// --- extra keys ---

// readExtras turns extra_keys (one entry per block) into per-block digests.
//
// Each entry is nil or an array of keys. Keys that the event already expresses are
// left out: a string equal to the LoRA name, and, in the first block of a sequence
// (no parent), a plain string that is not a 64-hex-digit content digest: vLLM's
// cache salt, which becomes CacheSalt when the event has none. Every other key
// (multimodal identifiers, prompt-embedding digests, other strings) is folded, in
// order, into a 64-bit XXH64 digest of its msgpack bytes; an entry with nothing
// left yields 0. When every block yields 0, Extra stays nil.
func (d *Decoder) readExtras(f *eventFields, ev *kvindex.Event) SkipReason {
	n, b, err := msgp.ReadArrayHeaderBytes(f.extraKeys)
	if err != nil || uint64(n) > uint64(len(b)) {
		return SkipMalformed
	}
	start := len(d.extra)
	nonZero := false
	d.extra = slices.Grow(d.extra, int(n))
	for i := uint32(0); i < n; i++ {
		rest, err := skipValue(b)
		if err != nil {
			return SkipMalformed
		}
		entry := b[:len(b)-len(rest)]
		b = rest
		x, r := d.entryDigest(entry, i == 0 && !f.hasParent, ev)
		if r != keep {
			return r
		}
		nonZero = nonZero || x != 0
		d.extra = append(d.extra, x)
	}
	if !nonZero {
		d.extra = d.extra[:start]
		return keep
	}
	if int(n) != f.hLen {
		return SkipMalformed
	}
	ev.Extra = d.extra[start:]
	return keep
}

func (d *Decoder) entryDigest(entry []byte, first bool, ev *kvindex.Event) (uint64, SkipReason) {
	switch msgp.NextType(entry) {
	case msgp.NilType:
		return 0, keep
	case msgp.ArrayType:
	default:
		return digestNonZero(xxhash.Sum64(entry)), keep
	}
	m, b, err := msgp.ReadArrayHeaderBytes(entry)
	if err != nil {
		return 0, SkipMalformed
	}
	folded := false
	d.digest.Reset()
	for j := uint32(0); j < m; j++ {
		rest, err := skipValue(b)
		if err != nil {
			return 0, SkipMalformed
		}
		key := b[:len(b)-len(rest)]
		b = rest
		if msgp.NextType(key) == msgp.StrType {
			s, _, err := msgp.ReadStringZC(key)
			if err != nil {
				return 0, SkipMalformed
			}
			if ev.LoRAName != "" && string(s) == ev.LoRAName {
				continue
			}
			if first && len(s) > 0 && !isHexDigest(s) {
				if ev.CacheSalt == "" {
					ev.CacheSalt = d.internBytes(s)
					continue
				}
				if string(s) == ev.CacheSalt {
					continue
				}
			}
		}
		_, _ = d.digest.Write(key)
		folded = true
	}
	if !folded {
		return 0, keep
	}
	return digestNonZero(d.digest.Sum64()), keep
}

func digestNonZero(x uint64) uint64 {
	if x == 0 {
		return 1
	}
	return x
}

// isHexDigest reports whether s is 64 hex digits (a SHA-256 content identifier).
func isHexDigest(s []byte) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// --- structural skipping ---

var (
	errShort  = errors.New("truncated value")
	errPrefix = errors.New("invalid type byte")
)

// skipValue returns b after its first msgpack value. It walks iteratively with a
// count of values still to skip, so hostile nesting costs no stack, and it fails as
// soon as the declared values cannot fit in the remaining bytes (every value takes
// at least one byte), so huge declared lengths cost nothing.
func skipValue(b []byte) ([]byte, error) {
	pending := uint64(1)
	for pending > 0 {
		if len(b) == 0 {
			return nil, errShort
		}
		c := b[0]
		e := skipTable[c]
		var total, kids uint64
		switch e.kind {
		case skFixed:
			total = uint64(e.head)
		case skFixStr:
			total = 1 + uint64(c&0x1f)
		case skFixArray:
			total, kids = 1, uint64(c&0x0f)
		case skFixMap:
			total, kids = 1, 2*uint64(c&0x0f)
		case skInvalid:
			return nil, errPrefix
		default: // a length field of e.width bytes follows the type byte
			if len(b) < int(e.head) {
				return nil, errShort
			}
			var n uint64
			switch e.width {
			case 1:
				n = uint64(b[1])
			case 2:
				n = uint64(binary.BigEndian.Uint16(b[1:]))
			default:
				n = uint64(binary.BigEndian.Uint32(b[1:]))
			}
			switch e.kind {
			case skBody:
				total = uint64(e.head) + n
			case skArray:
				total, kids = uint64(e.head), n
			default: // skMap
				total, kids = uint64(e.head), 2*n
			}
		}
		if uint64(len(b)) < total {
			return nil, errShort
		}
		b = b[total:]
		pending = pending - 1 + kids
		if pending > uint64(len(b)) {
			return nil, errShort
		}
	}
	return b, nil
}

// Kinds of msgpack type bytes, for skipValue.
const (
	skFixed    uint8 = iota // head bytes in all
	skFixStr                // fixstr: length in the type byte
	skFixArray              // fixarray: count in the type byte
	skFixMap                // fixmap: pair count in the type byte
	skBody                  // head bytes, then a body whose length is the width-byte field
	skArray                 // head bytes, then as many values as the width-byte field says
	skMap                   // head bytes, then twice as many values as the field says
	skInvalid               // 0xc1, never used
)

type skipEntry struct {
	kind  uint8
	head  uint8 // bytes before the body or the children
	width uint8 // bytes of the length field after the type byte (var-length kinds)
}

// skipTable describes every msgpack type byte.
var skipTable = func() (t [256]skipEntry) {
	for c := range 256 {
		switch {
		case c <= 0x7f || c >= 0xe0:
			t[c] = skipEntry{kind: skFixed, head: 1}
		case c <= 0x8f:
			t[c] = skipEntry{kind: skFixMap}
		case c <= 0x9f:
			t[c] = skipEntry{kind: skFixArray}
		case c <= 0xbf:
			t[c] = skipEntry{kind: skFixStr}
		}
	}
	fixed := map[int]uint8{
		0xc0: 1, 0xc2: 1, 0xc3: 1, // nil, false, true
		0xca: 5, 0xcb: 9, // float32, float64
		0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9, // uint8..64
		0xd0: 2, 0xd1: 3, 0xd2: 5, 0xd3: 9, // int8..64
		0xd4: 3, 0xd5: 4, 0xd6: 6, 0xd7: 10, 0xd8: 18, // fixext 1..16: type byte, ext type, data
	}
	for c, n := range fixed {
		t[c] = skipEntry{kind: skFixed, head: n}
	}
	t[0xc1] = skipEntry{kind: skInvalid}
	for _, c := range []int{0xc4, 0xd9} { // bin8, str8
		t[c] = skipEntry{kind: skBody, head: 2, width: 1}
	}
	for _, c := range []int{0xc5, 0xda} { // bin16, str16
		t[c] = skipEntry{kind: skBody, head: 3, width: 2}
	}
	for _, c := range []int{0xc6, 0xdb} { // bin32, str32
		t[c] = skipEntry{kind: skBody, head: 5, width: 4}
	}
	t[0xc7] = skipEntry{kind: skBody, head: 3, width: 1} // ext8: length, ext type
	t[0xc8] = skipEntry{kind: skBody, head: 4, width: 2} // ext16
	t[0xc9] = skipEntry{kind: skBody, head: 6, width: 4} // ext32
	t[0xdc] = skipEntry{kind: skArray, head: 3, width: 2}
	t[0xdd] = skipEntry{kind: skArray, head: 5, width: 4}
	t[0xde] = skipEntry{kind: skMap, head: 3, width: 2}
	t[0xdf] = skipEntry{kind: skMap, head: 5, width: 4}
	return t
}()
