package kvevents

import (
	"slices"

	"github.com/cespare/xxhash/v2"
	"github.com/tinylib/msgp/msgp"

	"github.com/kvselect/kvselect/kvindex"
)

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
