package kvevents

import (
	"github.com/tinylib/msgp/msgp"

	"github.com/kvselect/kvselect/kvindex"
)

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
