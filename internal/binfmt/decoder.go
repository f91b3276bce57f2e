package binfmt

import "encoding/binary"

// Decoder reads values off the front of a byte slice and latches its first
// failure (see the package doc). The zero value decodes an empty input.
type Decoder struct {
	b    []byte // what is left
	size int    // the input's length
	err  error
}

// NewDecoder returns a Decoder over b. It keeps b, and what Next and Bytes
// return aliases it.
func NewDecoder(b []byte) Decoder { return Decoder{b: b, size: len(b)} }

// Err returns the first failure, or nil.
func (d *Decoder) Err() error { return d.err }

// Fail latches err unless a failure is latched already; later reads return
// zero values. A format calls it for what the toolkit cannot see: a field
// out of the format's range, a name that does not parse.
func (d *Decoder) Fail(err error) {
	if d.err == nil {
		d.err = err
	}
}

// Len returns the number of bytes left.
func (d *Decoder) Len() int { return len(d.b) }

// Offset returns the number of bytes consumed. After a failure it stays
// where the failed read started (a read consumes nothing unless it
// succeeds), or where the caller's Fail found it.
func (d *Decoder) Offset() int { return d.size - len(d.b) }

// End latches ErrTrailing if bytes are left and nothing failed, and returns
// Err.
func (d *Decoder) End() error {
	if d.err == nil && len(d.b) > 0 {
		d.err = ErrTrailing
	}
	return d.err
}

// U8 reads one byte.
func (d *Decoder) U8() byte {
	if d.err != nil || len(d.b) < 1 {
		d.Fail(errShortByte)
		return 0
	}
	v := d.b[0]
	d.b = d.b[1:]
	return v
}

// U32 reads a little-endian uint32.
func (d *Decoder) U32() uint32 {
	if d.err != nil || len(d.b) < 4 {
		d.Fail(errShortU32)
		return 0
	}
	v := binary.LittleEndian.Uint32(d.b)
	d.b = d.b[4:]
	return v
}

// U64 reads a little-endian uint64.
func (d *Decoder) U64() uint64 {
	if d.err != nil || len(d.b) < 8 {
		d.Fail(errShortU64)
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b)
	d.b = d.b[8:]
	return v
}

// Uvarint reads a uvarint no larger than limit (math.MaxUint64: any). Past
// the input it is ErrTruncated, over 64 bits ErrOverflow, over limit
// ErrRange.
func (d *Decoder) Uvarint(limit uint64) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	switch {
	case n == 0:
		d.err = errShortVarint
		return 0
	case n < 0:
		d.err = ErrOverflow
		return 0
	case v > limit:
		d.err = ErrRange
		return 0
	}
	d.b = d.b[n:]
	return v
}

// Varint reads a zigzag varint: ErrTruncated past the input, ErrOverflow
// over 64 bits.
func (d *Decoder) Varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b)
	switch {
	case n == 0:
		d.err = errShortVarint
		return 0
	case n < 0:
		d.err = ErrOverflow
		return 0
	}
	d.b = d.b[n:]
	return v
}

// Count reads a uvarint count of items that take at least minSize bytes
// each (minSize >= 1), so at most what the bytes left before it can hold:
// a larger count is ErrRange, refused before the caller allocates for it.
func (d *Decoder) Count(minSize int) int {
	return int(d.Uvarint(uint64(len(d.b) / minSize)))
}

// Next returns the next n bytes (ErrTruncated if fewer are left), aliasing
// the input with their capacity clipped.
func (d *Decoder) Next(n int) []byte {
	if d.err != nil || uint(n) > uint(len(d.b)) {
		d.Fail(errShortBytes)
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

// Bytes reads a length-prefixed run of at most limit bytes (a longer length
// is ErrRange), aliasing the input like Next. On failure it consumes
// nothing, its length included.
func (d *Decoder) Bytes(limit int) []byte {
	start := d.b
	v := d.Next(int(d.Uvarint(uint64(limit))))
	if d.err != nil {
		d.b = start
	}
	return v
}

// String reads a length-prefixed string of at most limit bytes (a longer
// length is ErrRange) and copies it.
func (d *Decoder) String(limit int) string {
	return string(d.Bytes(limit))
}
