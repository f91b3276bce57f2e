package kvevents

import (
	"encoding/binary"
	"math"
	"slices"
	"strconv"
	"unsafe"

	"github.com/tinylib/msgp/msgp"

	"github.com/kvselect/kvselect/kvindex"
)

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
		// Inline the form engine hashes nearly always take: uint64.
		if len(b) >= 9 && b[0] == 0xcf {
			d.hashes = append(d.hashes, binary.BigEndian.Uint64(b[1:]))
			b = b[9:]
			continue
		}
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

// readTokenIDs reads len(out) token ids into out, and counts those in the
// 32-bit unsigned form (wide). mixed chooses how it tells the 16-bit form
// (ids from 256) from the 32-bit one (from 65,536), what nearly every id of
// a large vocabulary takes: by a branch, the fastest where one form
// dominates (1.1 ns an id: the branch predictor runs ahead along the ids),
// or, when they come mixed, without one (readMixedIDs). A large
// vocabulary's ids take the two forms about equally often and in no order a
// predictor could learn (Llama 3's 128,256: 51% and 49%): a branch,
// mispredicted every other time, cost 4.8 ns an id.
func readTokenIDs(b []byte, out []uint32, mixed bool) (rest []byte, wide int, _ SkipReason) {
	if mixed {
		return readMixedIDs(b, out)
	}
	p := 0 // the next id's offset in b
	for i := range out {
		// Inline the forms ids take (msgpack writes the shortest):
		// 16 and 32 bits, then a positive fixint. Five bytes left cover
		// any of them.
		if p+5 <= len(b) {
			switch c := b[p]; {
			case c == 0xcd:
				out[i] = uint32(b[p+1])<<8 | uint32(b[p+2])
				p += 3
				continue
			case c == 0xce:
				out[i] = binary.BigEndian.Uint32(b[p+1 : p+5])
				p += 5
				wide++
				continue
			case c <= 0x7f:
				out[i] = uint32(c)
				p++
				continue
			}
		}
		t, next, w, r := readTokenAt(b, p)
		if r != keep {
			return nil, 0, r
		}
		out[i], p, wide = t, next, wide+w
	}
	return b[p:], wide, keep
}

// readMixedIDs is readTokenIDs for ids that come in the 16- and 32-bit
// forms in no predictable order. It reads them two at a time: one at a
// time, the next id's offset waits for this one's form byte (a load, then
// its length), mispredicted as a branch or computed in arithmetic. The
// second id's form byte is at 3 or 5, both read at once with the first's,
// and the first's form picks one by a shift: a pair's offset waits for one
// load, not two. 1.6 ns an id against 2.5 one at a time without a branch.
// Any other form is read alone, and the pairs go on after it.
func readMixedIDs(b []byte, out []uint32) (rest []byte, wide int, _ SkipReason) {
	base := unsafe.Pointer(unsafe.SliceData(b))
	p, i := 0, 0 // the next id's offset in b, and its index in out
	for i < len(out) {
		// Ten bytes hold any pair, and the loads read no further: the
		// bounds are checked here, once a pair.
		for i+1 < len(out) && p+10 <= len(b) {
			c1 := uint(*(*byte)(unsafe.Add(base, p)))
			// Bytes 3 to 6: the second form byte is byte 3 after a
			// 16-bit id (0xcd: bit 1 clear), byte 5 after a 32-bit one.
			ahead := binary.LittleEndian.Uint32((*[4]byte)(unsafe.Add(base, p+3))[:])
			w1, w2 := c1-0xcd, uint(byte(ahead>>(c1<<3&16)))-0xcd
			if w1|w2 > 1 {
				break
			}
			q := p + 3 + 2*int(w1)
			out[i] = binary.BigEndian.Uint32((*[4]byte)(unsafe.Add(base, p+1))[:]) >> ((16 - 16*w1) & 31)
			out[i+1] = binary.BigEndian.Uint32((*[4]byte)(unsafe.Add(base, q+1))[:]) >> ((16 - 16*w2) & 31)
			p = q + 3 + 2*int(w2)
			wide += int(w1 + w2)
			i += 2
		}
		if i == len(out) {
			break
		}
		t, next, w, r := readTokenAt(b, p)
		if r != keep {
			return nil, 0, r
		}
		out[i], p, wide = t, next, wide+w
		i++
	}
	return b[p:], wide, keep
}

// readTokenAt reads the id at b[p:] in any form, and returns it, the
// offset after it and 1 when it is in the 32-bit unsigned form (0
// otherwise). It takes and returns the offset by value: a caller whose
// offset had its address taken would keep it in memory, and every id's
// offset would wait for a store and a load.
func readTokenAt(b []byte, p int) (t uint32, next, wide int, _ SkipReason) {
	t, rest, r := readToken(b[p:])
	if r != keep {
		return 0, 0, 0, r
	}
	if b[p] == 0xce {
		wide = 1
	}
	return t, len(b) - len(rest), wide, keep
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
	if !bigram {
		var (
			r    SkipReason
			wide int
		)
		if b, wide, r = readTokenIDs(b, d.tokens[start:start+int(n)], d.mixedIDs); r != keep {
			return nil, r
		}
		// The next event's ids are read as these came: mixed when
		// neither form had 7 in 8 of them.
		d.mixedIDs = min(wide, int(n)-wide) > int(n)/8
		d.tokens = d.tokens[:start+int(n)]
		f.tOff, f.tLen = start, int(n)
		return b, keep
	}
	var ahead uint32 // the second element of the previous pair
	for i := uint32(0); i < n; i++ {
		var (
			m uint32
			r SkipReason
		)
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
