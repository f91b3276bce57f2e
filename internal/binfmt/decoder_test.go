package binfmt_test

import (
	"encoding/binary"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/binfmt"
)

var sentinels = []error{binfmt.ErrTruncated, binfmt.ErrOverflow, binfmt.ErrRange, binfmt.ErrTrailing}

// wrapsOne reports whether err wraps exactly one of the sentinels.
func wrapsOne(err error) bool {
	n := 0
	for _, s := range sentinels {
		if errors.Is(err, s) {
			n++
		}
	}
	return n == 1
}

// Every value the append side (and encoding/binary) writes reads back, in
// order, and the decode ends exactly at the end.
func TestDecoderReadsWhatIsWritten(t *testing.T) {
	var b []byte
	b = append(b, 0xab)
	b = binary.LittleEndian.AppendUint32(b, 0xdeadbeef)
	b = binary.LittleEndian.AppendUint64(b, 1<<63|5)
	b = binary.AppendUvarint(b, math.MaxUint64)
	b = binary.AppendVarint(b, math.MinInt64)
	b = binfmt.AppendString(b, "worker-7")
	b = binfmt.AppendBytes(b, []byte{1, 2, 3})
	b = binary.AppendUvarint(b, 2) // a count of two 4-byte items
	b = binary.LittleEndian.AppendUint32(b, 10)
	b = binary.LittleEndian.AppendUint32(b, 20)
	b = append(b, "tail"...)

	d := binfmt.NewDecoder(b)
	require.Equal(t, byte(0xab), d.U8())
	require.Equal(t, uint32(0xdeadbeef), d.U32())
	require.Equal(t, uint64(1<<63|5), d.U64())
	require.Equal(t, uint64(math.MaxUint64), d.Uvarint(math.MaxUint64))
	require.Equal(t, int64(math.MinInt64), d.Varint())
	require.Equal(t, "worker-7", d.String(8), "a string exactly at its limit")
	require.Equal(t, []byte{1, 2, 3}, d.Bytes(3))
	n := d.Count(4)
	require.Equal(t, 2, n)
	for _, want := range []uint32{10, 20} {
		require.Equal(t, want, d.U32())
	}
	require.Equal(t, 4, d.Len())
	require.Equal(t, []byte("tail"), d.Next(4))
	require.NoError(t, d.End())
	require.Equal(t, len(b), d.Offset())
	require.Zero(t, d.Len())

	var zero binfmt.Decoder
	require.NoError(t, zero.End(), "the zero Decoder is an empty input")
	require.Empty(t, zero.Next(0))
}

// Each read fails with its sentinel, naming what the input ended inside, and
// consumes nothing; the error wraps exactly one sentinel.
func TestDecoderFailures(t *testing.T) {
	overlong := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02} // 65 bits
	for _, c := range []struct {
		name string
		in   []byte
		read func(*binfmt.Decoder)
		want error
		msg  string
	}{
		{"byte", nil, func(d *binfmt.Decoder) { d.U8() }, binfmt.ErrTruncated, "inside a byte"},
		{"u32", []byte{1, 2, 3}, func(d *binfmt.Decoder) { d.U32() }, binfmt.ErrTruncated, "inside a 32-bit value"},
		{"u64", []byte{1, 2, 3, 4, 5, 6, 7}, func(d *binfmt.Decoder) { d.U64() }, binfmt.ErrTruncated, "inside a 64-bit value"},
		{"uvarint ends", []byte{0x80, 0x80}, func(d *binfmt.Decoder) { d.Uvarint(math.MaxUint64) }, binfmt.ErrTruncated, "inside a varint"},
		{"uvarint empty", nil, func(d *binfmt.Decoder) { d.Uvarint(math.MaxUint64) }, binfmt.ErrTruncated, "inside a varint"},
		{"uvarint 65 bits", overlong, func(d *binfmt.Decoder) { d.Uvarint(math.MaxUint64) }, binfmt.ErrOverflow, "64 bits"},
		{"uvarint over limit", []byte{0x81, 0x01}, func(d *binfmt.Decoder) { d.Uvarint(128) }, binfmt.ErrRange, "out of range"},
		{"varint ends", []byte{0x80}, func(d *binfmt.Decoder) { d.Varint() }, binfmt.ErrTruncated, "inside a varint"},
		{"varint 65 bits", overlong, func(d *binfmt.Decoder) { d.Varint() }, binfmt.ErrOverflow, "64 bits"},
		{"next", []byte{1, 2}, func(d *binfmt.Decoder) { d.Next(3) }, binfmt.ErrTruncated, "inside a run of bytes"},
		{"next negative", []byte{1, 2}, func(d *binfmt.Decoder) { d.Next(-1) }, binfmt.ErrTruncated, "inside a run of bytes"},
		{"string over limit", binfmt.AppendString(nil, "abcd"), func(d *binfmt.Decoder) { d.String(3) }, binfmt.ErrRange, "out of range"},
		{"string past the end", []byte{5, 'a', 'b'}, func(d *binfmt.Decoder) { d.String(10) }, binfmt.ErrTruncated, "inside a run of bytes"},
		{"bytes past the end", []byte{5, 'a', 'b'}, func(d *binfmt.Decoder) { d.Bytes(10) }, binfmt.ErrTruncated, "inside a run of bytes"},
		// 3 items of 2 bytes need 6 bytes; the count's own byte and 4 more are 5.
		{"count beyond the bytes", []byte{3, 0, 0, 0, 0}, func(d *binfmt.Decoder) { d.Count(2) }, binfmt.ErrRange, "out of range"},
		{"count ends", []byte{0x80}, func(d *binfmt.Decoder) { d.Count(1) }, binfmt.ErrTruncated, "inside a varint"},
		{"trailing", []byte{1}, func(d *binfmt.Decoder) { d.End() }, binfmt.ErrTrailing, "after the end"},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := binfmt.NewDecoder(c.in)
			c.read(&d)
			err := d.Err()
			require.ErrorIs(t, err, c.want)
			require.True(t, wrapsOne(err), "%v wraps one sentinel", err)
			require.ErrorContains(t, err, c.msg)
			require.Zero(t, d.Offset(), "a failed read consumes nothing")
			require.Equal(t, len(c.in), d.Len())
		})
	}

	// The count's bound counts the bytes before it: 2 items of 2 bytes in
	// the count's byte and 4 more pass, though only 4 are left after it.
	d := binfmt.NewDecoder([]byte{2, 0, 0, 0, 0})
	require.Equal(t, 2, d.Count(2))
	require.NoError(t, d.Err())
}

// The first failure sticks: later reads return zero values and consume
// nothing, Offset stays at the failed value, a later Fail changes nothing,
// and a caller's Fail is latched like the decoder's own.
func TestDecoderLatchesTheFirstFailure(t *testing.T) {
	in := append(binary.AppendUvarint([]byte{7}, 300), 0xff) // a byte, a uvarint, then a varint cut short
	d := binfmt.NewDecoder(in)
	require.Equal(t, byte(7), d.U8())
	require.Equal(t, uint64(300), d.Uvarint(math.MaxUint64))
	require.Zero(t, d.Varint())
	first := d.Err()
	require.ErrorIs(t, first, binfmt.ErrTruncated)
	at := d.Offset()
	require.Equal(t, 3, at, "the offset of the varint that failed")

	require.Zero(t, d.U8())
	require.Zero(t, d.U32())
	require.Zero(t, d.U64())
	require.Zero(t, d.Uvarint(math.MaxUint64))
	require.Zero(t, d.Count(1))
	require.Empty(t, d.String(10))
	require.Nil(t, d.Bytes(10))
	require.Nil(t, d.Next(0))
	d.Fail(errors.New("later"))
	require.Equal(t, first, d.End())
	require.Equal(t, at, d.Offset())
	require.Equal(t, 1, d.Len())

	mine := errors.New("name does not parse")
	d = binfmt.NewDecoder([]byte{1, 2})
	d.Fail(mine)
	require.Zero(t, d.U8(), "a caller's failure stops the reads too")
	require.Equal(t, mine, d.End())
	require.Zero(t, d.Offset())
}

// What Next and Bytes return aliases the input, but appending to it cannot
// overwrite the bytes that follow.
func TestDecoderSlicesAreClipped(t *testing.T) {
	in := binfmt.AppendBytes(nil, []byte("ab"))
	in = append(in, 'c', 'd')
	d := binfmt.NewDecoder(in)
	b := d.Bytes(2)
	require.Equal(t, 2, cap(b))
	_ = append(b, 'X')
	n := d.Next(1)
	require.Equal(t, 1, cap(n))
	_ = append(n, 'Y')
	require.Equal(t, "\x02abcd", string(in))
	b[0] = 'A'
	require.Equal(t, "\x02Abcd", string(in), "the slices alias the input")
}

// Decoding allocates only the strings it returns, and a failing decode
// nothing at all, its error included.
func TestDecoderAllocations(t *testing.T) {
	var good []byte
	good = binary.AppendUvarint(good, 1<<40)
	good = binary.LittleEndian.AppendUint64(good, 9)
	good = binfmt.AppendBytes(good, []byte("payload"))
	good = binfmt.AppendString(good, "")
	allocs := testing.AllocsPerRun(100, func() {
		d := binfmt.NewDecoder(good)
		d.Uvarint(math.MaxUint64)
		d.U64()
		d.Bytes(100)
		d.String(100)
		if d.End() != nil {
			t.Fatal(d.Err())
		}
	})
	require.Zero(t, allocs)

	bad := [][]byte{nil, {0x80}, {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}, {200, 1}, {1, 2, 3}}
	allocs = testing.AllocsPerRun(100, func() {
		for _, in := range bad {
			d := binfmt.NewDecoder(in)
			d.Uvarint(100)
			d.String(100)
			d.U32()
			if d.End() == nil {
				t.Fatal("decoded garbage")
			}
		}
	})
	require.Zero(t, allocs)
}

func TestUvarintLen(t *testing.T) {
	xs := []uint64{0, math.MaxUint64, 1<<63 + 5}
	for k := 1; k < 64; k++ {
		xs = append(xs, 1<<k-1, 1<<k)
	}
	for _, x := range xs {
		require.Len(t, binary.AppendUvarint(nil, x), binfmt.UvarintLen(x), "%d", x)
	}
	for _, s := range []string{"", "a", strings.Repeat("x", 127), strings.Repeat("x", 128), strings.Repeat("x", 1<<14)} {
		require.Len(t, binfmt.AppendString(nil, s), binfmt.StringLen(s), "%d bytes", len(s))
		require.Equal(t, binfmt.AppendString(nil, s), binfmt.AppendBytes(nil, []byte(s)))
	}
}
