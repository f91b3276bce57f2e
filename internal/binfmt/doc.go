// Package binfmt is the toolkit the library's two binary formats are built
// with: kvindex's index snapshot and replica's wire. It holds a bounded
// decoder over a byte slice, the append side of its varints and
// length-prefixed strings with their encoded sizes, CRC-32C checksums, and
// reads of an exact number of bytes from an io.Reader that allocate only as
// the bytes arrive. It defines no format: magic, versions, field order, the
// bounds of each field and the errors a caller sees stay with the format's
// package.
//
// # Encoding
//
// Integers are little-endian. A uvarint is an unsigned LEB128 varint
// (encoding/binary's Uvarint), a varint its zigzag form (Varint). A string,
// or a run of bytes, is a uvarint length and that many bytes. A checksum is
// the CRC-32C (Castagnoli) of a run of bytes, written after them as a
// little-endian uint32.
//
// # Decoding
//
// A Decoder reads values off the front of its input and latches its first
// failure: from then on every read returns the zero value and consumes
// nothing, so a caller reads a whole structure, checks Err once, and Offset
// still names the byte where the failure happened. A length or a count is
// checked against the bytes left, and against the caller's bound, before it
// is returned, so a caller that allocates for it allocates no more than its
// input justifies.
//
// A failure is the error a caller passed to Fail, or one wrapping exactly one
// of ErrTruncated, ErrOverflow, ErrRange and ErrTrailing; ReadFull and ReadN
// report a stream that ends early as ErrTruncated. Each format wraps or maps
// them under its own sentinels, so their text names the bytes, not this
// package, which a user of the format cannot import. The failure values are
// built once: a failing Decoder allocates nothing.
//
// # Concurrency
//
// A Decoder is a value owned by one goroutine. The functions hold no state
// and are safe for concurrent use.
//
// # Invariants
//
//   - A Decoder never reads outside its input, and what it returns never
//     extends past it: slices (Next, Bytes) alias the input with their
//     capacity clipped, so appending to one cannot overwrite the bytes after
//     it.
//   - For every x, UvarintLen(x) is len(binary.AppendUvarint(nil, x)), and
//     StringLen(s) is len(AppendString(nil, s)): a format sizes a message with
//     them before writing it.
package binfmt
