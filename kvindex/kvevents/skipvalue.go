package kvevents

import (
	"encoding/binary"
	"errors"
)

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
