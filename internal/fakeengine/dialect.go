package fakeengine

import (
	"fmt"
	"strings"
)

// Dialect is a preset of the wire options, one per engine (or engine version)
// seen in the field. Apply writes it into an Options value, so the preset is
// visible and can still be adjusted field by field before New. The zero Dialect
// is DialectVLLMMap; zero Options are DialectVLLMMap without ExtraFields.
type Dialect uint8

// Dialects, in the order Dialects lists them. Each says what Apply sets; every
// dialect uses an array batch with the DP rank and MediumGPU on its events.
const (
	// DialectVLLMMap is vLLM v0.26 and later: map events with ExtraFields, uint64
	// hashes, nil root parent, seq from 0, replay with the topic frame.
	DialectVLLMMap Dialect = iota
	// DialectVLLMArray is vLLM before v0.26: positional events, uint64 hashes,
	// nil root parent, seq from 0, replay without the topic frame.
	DialectVLLMArray
	// DialectSGLang is SGLang's newest publisher: positional events at full
	// length (ArrayFullLength: medium always written, batch always 3 elements),
	// SHA-256 chained hashes published as int64, replay without the topic frame.
	DialectSGLang
	// DialectSGLangEAGLE is DialectSGLang with token_ids as EAGLE bigrams
	// (TokenPairs).
	DialectSGLangEAGLE
	// DialectTRTLLM is TensorRT-LLM's native ZMQ publisher
	// (kv_cache_events.py, streamingEventSink): map events with exactly vLLM's
	// core keys (type, block_hashes, parent_block_hash, token_ids, block_size,
	// lora_id, medium, lora_name; no group fields), the first 8 bytes of SHA-256
	// radix block keys as signed int64 hashes (so negatives are common), nil root
	// parent, seq from 0, replay with the topic frame. Like every dialect, a
	// request's newly stored blocks form one BlockStored and a partial tail block
	// is never published.
	DialectTRTLLM
	// DialectZeroParent is DialectVLLMArray with the integer 0 as root parent.
	DialectZeroParent
	// DialectFirstSeq1 is DialectVLLMMap with sequence numbers from 1.
	DialectFirstSeq1
	// DialectExternal is the external vLLM-compatible engine met in the field:
	// DialectVLLMArray with the integer 0 as root parent and seq from 1.
	DialectExternal
	// DialectHybrid is DialectVLLMMap for a hybrid model: every change is
	// mirrored into a sliding-window group (HybridGroups).
	DialectHybrid

	numDialects
)

var dialectNames = [numDialects]string{
	DialectVLLMMap:     "vllm-map",
	DialectVLLMArray:   "vllm-array",
	DialectSGLang:      "sglang",
	DialectSGLangEAGLE: "sglang-eagle",
	DialectTRTLLM:      "trtllm",
	DialectZeroParent:  "zero-parent",
	DialectFirstSeq1:   "first-seq-1",
	DialectExternal:    "external",
	DialectHybrid:      "hybrid",
}

var dialectSummaries = [numDialects]string{
	DialectVLLMMap:     "vLLM >= 0.26: map events with group fields, uint64 hashes, replay with topic",
	DialectVLLMArray:   "vLLM < 0.26: positional events, uint64 hashes, replay without topic",
	DialectSGLang:      "SGLang: full-length positional events, SHA-256 int64 hashes, replay without topic",
	DialectSGLangEAGLE: "SGLang with EAGLE: as sglang, token_ids as bigram pairs",
	DialectTRTLLM:      "TensorRT-LLM ZMQ: map events without group fields, SHA-256 radix-key int64 hashes, replay with topic",
	DialectZeroParent:  "vllm-array with the integer 0 as root parent",
	DialectFirstSeq1:   "vllm-map with sequence numbers from 1",
	DialectExternal:    "external vLLM-compatible engine: positional events, root parent 0, seq from 1",
	DialectHybrid:      "vllm-map for a hybrid model: every change mirrored into a sliding-window group",
}

// Dialects returns every dialect, in a stable order (DialectVLLMMap first).
func Dialects() []Dialect {
	out := make([]Dialect, numDialects)
	for i := range out {
		out[i] = Dialect(i)
	}
	return out
}

// String returns the dialect's name, as ParseDialect accepts it ("vllm-map", ...).
func (d Dialect) String() string {
	if d < numDialects {
		return dialectNames[d]
	}
	return fmt.Sprintf("Dialect(%d)", uint8(d))
}

// Summary returns a one-line description of the dialect, for help texts.
func (d Dialect) Summary() string {
	if d < numDialects {
		return dialectSummaries[d]
	}
	return "unknown dialect"
}

// ParseDialect returns the dialect named s (case-insensitive, surrounding space
// ignored). An unknown name gives an error wrapping ErrInvalidArgument that lists
// the known ones.
func ParseDialect(s string) (Dialect, error) {
	name := strings.ToLower(strings.TrimSpace(s))
	for i, n := range dialectNames {
		if n == name {
			return Dialect(i), nil
		}
	}
	return 0, fmt.Errorf("%w: unknown engine dialect %q (want one of %s)",
		ErrInvalidArgument, s, strings.Join(dialectNames[:], ", "))
}

// Apply returns o with the dialect's wire options set: Encoding, BatchAsMap,
// HashFormat, HashScheme, ExtraFields, RootParent, TokenPairs, ArrayFullLength,
// HybridGroups, OmitDPRank, FirstSeq and ReplayLayout. Every other field (sizes,
// topic, endpoints, DPRank, HashSeed, HTTP) is left as it was, and a field can
// still be changed after Apply to depart from the preset. An unknown dialect
// leaves o unchanged.
func (d Dialect) Apply(o Options) Options {
	if d >= numDialects {
		return o
	}
	// The vllm-map baseline; each dialect departs from it.
	o.Encoding, o.BatchAsMap, o.OmitDPRank = EncodingMap, false, false
	o.HashFormat, o.HashScheme = HashUint64, HashSchemeChain
	o.ExtraFields, o.HybridGroups = true, false
	o.RootParent, o.TokenPairs, o.ArrayFullLength = RootParentNil, false, false
	o.FirstSeq, o.ReplayLayout = 0, ReplayWithTopic
	vllmArray := func() {
		o.Encoding, o.ExtraFields, o.ReplayLayout = EncodingArray, false, ReplayNoTopic
	}
	switch d {
	case DialectVLLMArray:
		vllmArray()
	case DialectSGLang, DialectSGLangEAGLE:
		vllmArray()
		o.ArrayFullLength = true
		o.HashFormat, o.HashScheme = HashInt64, HashSchemeSHA256
		o.TokenPairs = d == DialectSGLangEAGLE
	case DialectTRTLLM:
		o.ExtraFields = false
		o.HashFormat, o.HashScheme = HashInt64, HashSchemeRadixKey
	case DialectZeroParent:
		vllmArray()
		o.RootParent = RootParentZero
	case DialectFirstSeq1:
		o.FirstSeq = 1
	case DialectExternal:
		vllmArray()
		o.RootParent, o.FirstSeq = RootParentZero, 1
	case DialectHybrid:
		o.HybridGroups = true
	}
	return o
}
