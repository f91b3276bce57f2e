package binfmt_test

import (
	"encoding/binary"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/binfmt"
)

// value is one read's result, for comparing two decodes.
type value struct {
	op  byte
	u   uint64
	i   int64
	s   string
	err bool
}

// readProgram runs the reads prog names (op%8 the read, op/8 its bound)
// over in, checking the Decoder's invariants after each, and returns what
// they read up to and including the first failure.
func readProgram(t *testing.T, prog, in []byte) []value {
	d := binfmt.NewDecoder(in)
	var out []value
	for _, op := range prog {
		before := d.Offset()
		failed := d.Err() != nil
		limit := int(op / 8)
		v := value{op: op}
		switch op % 8 {
		case 0:
			v.u = uint64(d.U8())
		case 1:
			v.u = uint64(d.U32())
		case 2:
			v.u = d.U64()
		case 3:
			v.u = d.Uvarint(uint64(limit) * 1000)
		case 4:
			v.i = d.Varint()
		case 5:
			v.s = d.String(limit)
		case 6:
			b := d.Bytes(limit)
			require.Equal(t, len(b), cap(b), "a returned slice is clipped")
			v.s = string(b)
		case 7:
			v.u = uint64(d.Count(1 + limit))
		}
		require.Equal(t, len(in), d.Offset()+d.Len())
		if failed || d.Err() != nil {
			require.Equal(t, before, d.Offset(), "a failed read consumes nothing")
			require.Zero(t, v.u)
			require.Zero(t, v.i)
			require.Empty(t, v.s)
		}
		if d.Err() != nil {
			require.True(t, wrapsOne(d.Err()), "%v", d.Err())
			v.err = true
			return append(out, v)
		}
		out = append(out, v)
	}
	return out
}

// encode writes vs back canonically (varints at their shortest), with the
// items a Count announced as zero bytes.
func encode(vs []value) []byte {
	var b []byte
	for _, v := range vs {
		switch v.op % 8 {
		case 0:
			b = append(b, byte(v.u))
		case 1:
			b = binary.LittleEndian.AppendUint32(b, uint32(v.u))
		case 2:
			b = binary.LittleEndian.AppendUint64(b, v.u)
		case 3:
			b = binary.AppendUvarint(b, v.u)
		case 4:
			b = binary.AppendVarint(b, v.i)
		case 5:
			b = binfmt.AppendString(b, v.s)
		case 6:
			b = binfmt.AppendBytes(b, []byte(v.s))
		case 7:
			b = binary.AppendUvarint(b, v.u)
		}
	}
	return b
}

// FuzzDecoder runs a program of reads over arbitrary bytes: the Decoder
// never panics, never reads or returns past its input, fails only with one
// sentinel and consumes nothing once failed; what it read, written back
// canonically, reads back the same.
func FuzzDecoder(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5 + 8*4, 6 + 8*4, 7}, []byte("\x07\x01\x02\x03\x04\x01\x02\x03\x04\x05\x06\x07\x08\x96\x01\x03\x04abcd\x02xy\x00"))
	f.Add([]byte{3, 3, 3}, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02})
	f.Add([]byte{7 + 8*3, 5}, []byte{200, 1, 0, 0})
	f.Add([]byte{}, []byte("trailing"))
	f.Fuzz(func(t *testing.T, prog, in []byte) {
		vs := readProgram(t, prog, in)
		if len(vs) > 0 && vs[len(vs)-1].err {
			vs = vs[:len(vs)-1]
		}
		// The Count's items, skipped by the program, are absent from the
		// re-encoding: read it back with bounds that ignore them.
		again := binfmt.NewDecoder(encode(vs))
		for _, v := range vs {
			var got value
			got.op = v.op
			switch v.op % 8 {
			case 0:
				got.u = uint64(again.U8())
			case 1:
				got.u = uint64(again.U32())
			case 2:
				got.u = again.U64()
			case 3, 7:
				got.u = again.Uvarint(math.MaxUint64)
			case 4:
				got.i = again.Varint()
			case 5:
				got.s = again.String(math.MaxInt)
			case 6:
				got.s = string(again.Bytes(math.MaxInt))
			}
			require.Equal(t, v, got)
		}
		require.NoError(t, again.End())
	})
}
