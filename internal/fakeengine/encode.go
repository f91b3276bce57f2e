package fakeengine

import (
	"encoding/binary"
	"fmt"

	"github.com/tinylib/msgp/msgp"
)

// EventKind names a vLLM KV-cache event type.
type EventKind uint8

// Event kinds, named after vLLM's event classes.
const (
	BlockStored EventKind = iota + 1
	BlockRemoved
	AllBlocksCleared
)

// String returns the vLLM class name ("BlockStored", ...), which is also the tag
// written on the wire.
func (k EventKind) String() string {
	switch k {
	case BlockStored:
		return "BlockStored"
	case BlockRemoved:
		return "BlockRemoved"
	case AllBlocksCleared:
		return "AllBlocksCleared"
	default:
		return fmt.Sprintf("EventKind(%d)", uint8(k))
	}
}

// Event is one KV-cache event as the engine publishes it. Fields that do not apply
// to the Kind are ignored. An Event is a plain value; it is not retained by the
// functions that encode it. AppendBatch and AppendEvent are pure and safe for
// concurrent use on values nobody is modifying.
type Event struct {
	Kind EventKind
	// BlockHashes are the engine's 64-bit block hashes (Stored and Removed), in
	// prefix order for Stored. HashFormat decides their wire form.
	BlockHashes []uint64
	// ParentHash is the hash of the block before BlockHashes[0]; written only when
	// HasParent is true, otherwise parent_block_hash is nil (Stored).
	ParentHash uint64
	HasParent  bool
	// TokenIDs are the tokens of every stored block, concatenated (Stored). The
	// encoder does not check len(TokenIDs) == len(BlockHashes)*BlockSize, so tests
	// can send malformed events; PublishEvents does check it.
	TokenIDs []uint32
	// BlockSize is the tokens per block written on the event (Stored).
	BlockSize int
	// LoRAName is written as lora_name; "" is written as nil (Stored).
	LoRAName string
	// Medium is written as medium; "" is written as nil (Stored and Removed).
	Medium string
	// ExtraKeys, when non-nil, holds one entry per block: nil for "no extra keys",
	// otherwise the block's extra keys as strings (LoRA name, cache salt). With
	// Format.ExtraFields and a nil ExtraKeys, one nil entry per block is written.
	ExtraKeys [][]string
	// GroupIdx, SpecKind and SlidingWindow place the event in a KV-cache group of
	// a hybrid model. They are written when HasGroup is true or Format.ExtraFields
	// is set: group_idx (Stored and Removed), kv_cache_spec_kind (Stored;
	// "full_attention" when SpecKind is "") and kv_cache_spec_sliding_window
	// (Stored, only when SlidingWindow > 0).
	GroupIdx      int
	SpecKind      string
	SlidingWindow int
	HasGroup      bool
}

// Batch is one published EventBatch. It is a plain value; AppendBatch only reads it.
type Batch struct {
	// Timestamp in seconds since the Unix epoch (written as float64).
	Timestamp float64
	Events    []Event
	// DPRank is written as data_parallel_rank when HasDPRank is true.
	DPRank    int
	HasDPRank bool
}

// Format says how AppendBatch encodes a batch; a plain, comparable value. The zero
// value is vLLM v0.26+: array batch, map events, uint64 hashes, no optional
// fields. The fields mean what the Options fields of the same names mean, except
// that AppendBatch, which never fails, writes nil where RootParentAbsent cannot
// leave a positional field out, and applies only the batch rule of
// ArrayFullLength to map events.
type Format struct {
	Events          Encoding
	BatchAsMap      bool
	Hashes          HashFormat
	ExtraFields     bool
	RootParent      RootParentForm
	TokenPairs      bool
	ArrayFullLength bool
}

const (
	specKindFullAttention = "full_attention"
	hashBytesLen          = 32
)

// AppendBatch appends the msgpack encoding of b in format f to dst and returns the
// extended slice. It follows msgspec's choices: float64 timestamps, the smallest
// integer form (unsigned for non-negative values), fixstr/str8 strings, nil for
// None, and trailing fields with default values omitted in array form. It never
// fails; it encodes whatever it is given, so tests can build malformed events.
func AppendBatch(dst []byte, b Batch, f Format) []byte {
	// With ArrayFullLength the rank is always there, nil when unset.
	withRank := b.HasDPRank || f.ArrayFullLength
	n := uint32(2)
	if withRank {
		n = 3
	}
	if f.BatchAsMap {
		dst = msgp.AppendMapHeader(dst, n)
		dst = msgp.AppendString(dst, "ts")
		dst = msgp.AppendFloat64(dst, b.Timestamp)
		dst = msgp.AppendString(dst, "events")
		dst = appendEvents(dst, b.Events, f)
		if withRank {
			dst = msgp.AppendString(dst, "data_parallel_rank")
			dst = appendRank(dst, b)
		}
		return dst
	}
	dst = msgp.AppendArrayHeader(dst, n)
	dst = msgp.AppendFloat64(dst, b.Timestamp)
	dst = appendEvents(dst, b.Events, f)
	if withRank {
		dst = appendRank(dst, b)
	}
	return dst
}

func appendRank(dst []byte, b Batch) []byte {
	if !b.HasDPRank {
		return msgp.AppendNil(dst)
	}
	return appendInt(dst, int64(b.DPRank))
}

func appendEvents(dst []byte, evs []Event, f Format) []byte {
	dst = msgp.AppendArrayHeader(dst, uint32(len(evs)))
	for i := range evs {
		dst = AppendEvent(dst, &evs[i], f)
	}
	return dst
}

// AppendEvent appends the msgpack encoding of one event in format f (f.BatchAsMap
// is ignored). An unknown Kind is written with its String() tag and no fields.
func AppendEvent(dst []byte, ev *Event, f Format) []byte {
	switch ev.Kind {
	case BlockStored:
		return appendStored(dst, ev, f)
	case BlockRemoved:
		return appendRemoved(dst, ev, f)
	default:
		if f.Events == EncodingArray {
			dst = msgp.AppendArrayHeader(dst, 1)
		} else {
			dst = msgp.AppendMapHeader(dst, 1)
			dst = msgp.AppendString(dst, "type")
		}
		return msgp.AppendString(dst, ev.Kind.String())
	}
}

// Fields of a BlockStored, in vLLM's declaration order, which is also their
// position in the array encoding (0 is the tag). Fields up to storedLoRAName have
// no default and are always written (SGLang stops at storedMedium); the others
// default to nil and are written only when set.
const (
	storedType = iota
	storedHashes
	storedParent
	storedTokens
	storedBlockSize
	storedLoRAID
	storedMedium
	storedLoRAName
	storedExtraKeys
	storedGroup
	storedSpecKind
	storedWindow
	numStoredFields
)

var storedKeys = [numStoredFields]string{
	"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
	"medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
	"kv_cache_spec_sliding_window",
}

// appendStored writes a BlockStored. A map gets the always-present fields and the
// set optional ones; an array gets every position up to the last field written,
// nil standing in for the unset ones before it.
func appendStored(dst []byte, ev *Event, f Format) []byte {
	arr := f.Events == EncodingArray
	group := ev.HasGroup || f.ExtraFields
	var present [numStoredFields]bool
	for i := range storedExtraKeys {
		present[i] = true
	}
	switch {
	case arr && f.ArrayFullLength:
		present[storedLoRAName] = ev.LoRAName != ""
	case !arr && !ev.HasParent && f.RootParent == RootParentAbsent:
		present[storedParent] = false
	}
	present[storedExtraKeys] = ev.ExtraKeys != nil || f.ExtraFields
	present[storedGroup], present[storedSpecKind] = group, group
	present[storedWindow] = group && ev.SlidingWindow > 0
	if arr {
		last := storedType
		for i, p := range present {
			if p {
				last = i
			}
		}
		for i := range last {
			present[i] = true
		}
	}
	n := uint32(0)
	for _, p := range present {
		if p {
			n++
		}
	}
	if arr {
		dst = msgp.AppendArrayHeader(dst, n)
	} else {
		dst = msgp.AppendMapHeader(dst, n)
	}
	for i, p := range present {
		if !p {
			continue
		}
		if !arr {
			dst = msgp.AppendString(dst, storedKeys[i])
		}
		switch i {
		case storedType:
			dst = msgp.AppendString(dst, "BlockStored")
		case storedHashes:
			dst = appendHashes(dst, ev.BlockHashes, f.Hashes)
		case storedParent:
			switch {
			case ev.HasParent:
				dst = appendHash(dst, ev.ParentHash, f.Hashes)
			case f.RootParent == RootParentZero:
				dst = msgp.AppendUint64(dst, 0)
			default:
				dst = msgp.AppendNil(dst)
			}
		case storedTokens:
			dst = appendTokenIDs(dst, ev.TokenIDs, f.TokenPairs)
		case storedBlockSize:
			dst = appendInt(dst, int64(ev.BlockSize))
		case storedLoRAID:
			dst = msgp.AppendNil(dst)
		case storedMedium:
			dst = appendOptString(dst, ev.Medium)
		case storedLoRAName:
			dst = appendOptString(dst, ev.LoRAName)
		case storedExtraKeys:
			if ev.ExtraKeys != nil || f.ExtraFields {
				dst = appendExtraKeys(dst, ev)
			} else {
				dst = msgp.AppendNil(dst)
			}
		case storedGroup:
			dst = appendGroup(dst, ev, group)
		case storedSpecKind:
			switch {
			case !group:
				dst = msgp.AppendNil(dst)
			case ev.SpecKind == "":
				dst = msgp.AppendString(dst, specKindFullAttention)
			default:
				dst = msgp.AppendString(dst, ev.SpecKind)
			}
		case storedWindow:
			dst = appendInt(dst, int64(ev.SlidingWindow))
		}
	}
	return dst
}

// appendGroup writes group_idx: the event's group, or nil when no group is written.
func appendGroup(dst []byte, ev *Event, group bool) []byte {
	if !group {
		return msgp.AppendNil(dst)
	}
	return appendInt(dst, int64(ev.GroupIdx))
}

// appendTokenIDs writes token_ids, as a flat array or, with pairs, as SGLang's
// EAGLE bigrams: one pair per token, [t(i), t(i+1)], the last one looking ahead
// into the next block, whose first token the event does not carry; the fake
// repeats t(n-1) there.
func appendTokenIDs(dst []byte, tokens []uint32, pairs bool) []byte {
	dst = msgp.AppendArrayHeader(dst, uint32(len(tokens)))
	for i, t := range tokens {
		if !pairs {
			dst = msgp.AppendUint32(dst, t)
			continue
		}
		next := t
		if i+1 < len(tokens) {
			next = tokens[i+1]
		}
		dst = msgp.AppendArrayHeader(dst, 2)
		dst = msgp.AppendUint32(dst, t)
		dst = msgp.AppendUint32(dst, next)
	}
	return dst
}

// appendRemoved writes a BlockRemoved: type, block_hashes, medium, then the
// defaulted group_idx.
func appendRemoved(dst []byte, ev *Event, f Format) []byte {
	group := ev.HasGroup || f.ExtraFields
	n := uint32(3)
	if group {
		n = 4
	}
	arr := f.Events == EncodingArray
	if arr {
		dst = msgp.AppendArrayHeader(dst, n)
	} else {
		dst = msgp.AppendMapHeader(dst, n)
		dst = msgp.AppendString(dst, "type")
	}
	dst = msgp.AppendString(dst, "BlockRemoved")
	if !arr {
		dst = msgp.AppendString(dst, "block_hashes")
	}
	dst = appendHashes(dst, ev.BlockHashes, f.Hashes)
	if !arr {
		dst = msgp.AppendString(dst, "medium")
	}
	dst = appendOptString(dst, ev.Medium)
	if group {
		if !arr {
			dst = msgp.AppendString(dst, "group_idx")
		}
		dst = appendGroup(dst, ev, true)
	}
	return dst
}

func appendExtraKeys(dst []byte, ev *Event) []byte {
	if ev.ExtraKeys == nil {
		dst = msgp.AppendArrayHeader(dst, uint32(len(ev.BlockHashes)))
		for range ev.BlockHashes {
			dst = msgp.AppendNil(dst)
		}
		return dst
	}
	dst = msgp.AppendArrayHeader(dst, uint32(len(ev.ExtraKeys)))
	for _, keys := range ev.ExtraKeys {
		if keys == nil {
			dst = msgp.AppendNil(dst)
			continue
		}
		dst = msgp.AppendArrayHeader(dst, uint32(len(keys)))
		for _, k := range keys {
			dst = msgp.AppendString(dst, k)
		}
	}
	return dst
}

func appendHashes(dst []byte, hs []uint64, hf HashFormat) []byte {
	dst = msgp.AppendArrayHeader(dst, uint32(len(hs)))
	for _, h := range hs {
		dst = appendHash(dst, h, hf)
	}
	return dst
}

// appendHash writes one block hash in the requested wire form.
func appendHash(dst []byte, h uint64, hf HashFormat) []byte {
	switch hf {
	case HashInt64:
		return appendInt(dst, int64(h))
	case HashBytes32:
		var digest [hashBytesLen]byte
		HashDigest(digest[:], h)
		return msgp.AppendBytes(dst, digest[:])
	default:
		return msgp.AppendUint64(dst, h)
	}
}

// HashDigest fills dst (which must be 32 bytes) with the bytes-mode form of hash
// h: 24 filler bytes derived from h, then h big-endian in the last 8 bytes. A
// consumer that reads the first 8 bytes instead of the last gets a wrong value.
func HashDigest(dst []byte, h uint64) {
	_ = dst[hashBytesLen-1]
	x := h
	for i := 0; i < 3; i++ {
		x = splitmix64(x)
		binary.BigEndian.PutUint64(dst[i*8:], x)
	}
	binary.BigEndian.PutUint64(dst[24:], h)
}

func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// appendInt writes an integer the way msgspec does: the smallest unsigned form for
// non-negative values, the smallest signed form for negative ones.
func appendInt(dst []byte, v int64) []byte {
	if v >= 0 {
		return msgp.AppendUint64(dst, uint64(v))
	}
	return msgp.AppendInt64(dst, v)
}

func appendOptString(dst []byte, s string) []byte {
	if s == "" {
		return msgp.AppendNil(dst)
	}
	return msgp.AppendString(dst, s)
}
