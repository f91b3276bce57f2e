package binfmt_test

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvselect/kvselect/internal/binfmt"
)

// A format writes a record with the append side and reads it back with a
// Decoder, checking the error once at the end; a record cut short, or one
// with a field out of its bounds, fails with a sentinel the format maps to
// its own error.
func Example() {
	errCorrupt := errors.New("record: corrupt")
	record := binfmt.AppendString(nil, "worker-a")
	record = binary.AppendUvarint(record, 3)
	record = binary.LittleEndian.AppendUint64(record, 0xfeed)
	record = binfmt.AppendChecksum(record, record)

	decode := func(b []byte) error {
		d := binfmt.NewDecoder(b)
		name := d.String(16)
		rank := d.Uvarint(1 << 16)
		hash := d.U64()
		sum := d.U32()
		if err := d.End(); err != nil {
			return fmt.Errorf("%w: byte %d: %w", errCorrupt, d.Offset(), err)
		}
		if binfmt.Checksum(b[:len(b)-4]) != sum {
			return fmt.Errorf("%w: checksum", errCorrupt)
		}
		fmt.Printf("%s rank %d holds %#x\n", name, rank, hash)
		return nil
	}
	fmt.Println(decode(record))
	fmt.Println(decode(record[:12]))
	fmt.Println(decode(append(binfmt.AppendString(nil, "a name too long for the format"), record[9:]...)))
	flipped := append([]byte(nil), record...)
	flipped[10] ^= 1
	fmt.Println(decode(flipped))
	// Output:
	// worker-a rank 3 holds 0xfeed
	// <nil>
	// record: corrupt: byte 10: input ends inside a 64-bit value
	// record: corrupt: byte 0: value out of range
	// record: corrupt: checksum
}
