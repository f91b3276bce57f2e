package kvevents

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/tinylib/msgp/msgp"
)

// TestReadTokenIDsMatchesOneByOne: readTokenIDs, which inlines the forms
// ids usually take, reads what readToken reads one id at a time, whether it
// tells the 16- and 32-bit forms apart by a branch or reads them two at a
// time (mixed), for ids in every integer form msgpack has (the unsigned ones
// it inlines, the signed ones and uint64 through readToken), with the last
// ids of a run in its last 5 bytes, and for runs of ids all in the 16- and
// 32-bit forms; it counts the ids in the 32-bit form, and refuses the same
// runs (a negative id, one past 2^32-1, a value that is no integer) for the
// same reason.
func TestReadTokenIDsMatchesOneByOne(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	pure := false // every id in the 16- or 32-bit form, as a large vocabulary's are
	appendID := func(b []byte, v uint32) []byte {
		if pure {
			return msgp.AppendUint64(b, 256+uint64(v)%(1<<20))
		}
		switch r.IntN(6) {
		case 0:
			return msgp.AppendUint64(b, uint64(v)) // the shortest unsigned form
		case 1:
			return msgp.AppendInt64(b, int64(v)) // the shortest signed form
		case 2:
			return append(b, 0xcf, 0, 0, 0, 0, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
		case 3:
			return append(b, 0xd3, 0, 0, 0, 0, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
		case 4:
			return append(b, 0xce, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
		default:
			return msgp.AppendUint64(b, uint64(v%200))
		}
	}
	oneByOne := func(b []byte, n int) ([]uint32, []byte, SkipReason) {
		out := make([]uint32, n)
		for i := range out {
			v, rest, why := readToken(b)
			if why != keep {
				return nil, nil, why
			}
			out[i], b = v, rest
		}
		return out, b, keep
	}
	for run := range 2000 {
		n := r.IntN(40)
		pure = run%5 == 4
		var b []byte
		for range n {
			v := r.Uint32()
			if r.IntN(2) == 0 {
				v %= 128256
			}
			b = appendID(b, v)
		}
		switch run % 10 { // a bad id somewhere, sometimes
		case 1:
			if n > 0 {
				b = msgp.AppendInt64(b[:0], -int64(1+r.IntN(1000)))
				for range n - 1 {
					b = appendID(b, r.Uint32())
				}
			}
		case 2:
			b = msgp.AppendUint64(b, math.MaxUint32+1)
			n++
		case 3:
			b = msgp.AppendString(b, "x")
			n++
		}
		b = append(b, 0xc0, 0x93) // what follows the ids: left as it is
		want, wantRest, wantWhy := oneByOne(b, n)
		for _, mixed := range []bool{false, true} {
			got := make([]uint32, n)
			rest, wide, why := readTokenIDs(b, got, mixed)
			require.Equal(t, wantWhy, why, "run %d, mixed %v", run, mixed)
			if why == keep {
				require.Equal(t, want, got, "run %d, mixed %v", run, mixed)
				require.Equal(t, wantRest, rest, "run %d, mixed %v", run, mixed)
				require.Equal(t, wideIDs(b, n), wide, "run %d, mixed %v", run, mixed)
			}
		}
	}
}

// wideIDs counts the first n ids of b that are in the 32-bit unsigned form,
// reading them one at a time.
func wideIDs(b []byte, n int) int {
	wide := 0
	for range n {
		if b[0] == 0xce {
			wide++
		}
		_, b, _ = readToken(b)
	}
	return wide
}
