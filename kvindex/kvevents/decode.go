package kvevents

import (
	"errors"
	"fmt"
	"math"

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
	// mixedIDs: the last event's token ids took the 16- and 32-bit forms
	// in a mix (readTokenIDs)
	mixedIDs bool
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
