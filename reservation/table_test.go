package reservation

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestBlockTable checks the hash table against a Go map under random inserts and
// removals, with keys from a small range (long probe runs, wrap-around at the end
// of the slot array) and from the whole range, through growth and shrinking.
func TestBlockTable(t *testing.T) {
	for _, keys := range []struct {
		name string
		gen  func(*rand.Rand) uint64
	}{
		{"dense", func(r *rand.Rand) uint64 { return uint64(r.IntN(8000)) }},
		{"sparse", func(r *rand.Rand) uint64 { return r.Uint64() >> uint(r.IntN(64)) }},
	} {
		t.Run(keys.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, 2))
			tb := newBlockTable()
			tb.seed = 0 // unseeded: small keys cluster more
			want := map[uint64]int32{}
			check := func() {
				require.Equal(t, len(want), tb.len())
				got := map[uint64]int32{}
				tb.all(func(h uint64, i int32) { got[h] = i })
				require.Equal(t, want, got)
				for h, v := range want {
					i, ok := tb.get(h)
					require.True(t, ok)
					require.Equal(t, v, i)
				}
				require.LessOrEqual(t, 2*tb.len(), len(tb.slots))
			}
			maxSize := 0
			for step := range 40000 {
				// Phases: grow to a few thousand keys, then drain.
				grow := (step/10000)%2 == 0
				h := keys.gen(rng)
				if grow == (rng.IntN(4) != 0) {
					tb.reserve()
					pos, ok := tb.find(h)
					_, present := want[h]
					require.Equal(t, present, ok)
					if !ok {
						tb.insertAt(pos, h, int32(step))
						want[h] = int32(step)
					}
				} else if len(want) > 0 {
					for k := range want { // remove an arbitrary present key
						h = k
						break
					}
					tb.remove(h)
					delete(want, h)
					_, ok := tb.get(h)
					require.False(t, ok)
				}
				maxSize = max(maxSize, len(tb.slots))
				if step%500 == 0 {
					check()
				}
			}
			check()
			for k := range want {
				tb.remove(k)
				delete(want, k)
			}
			check()
			require.Greater(t, maxSize, shrinkFloor)
			require.Equal(t, shrinkFloor, len(tb.slots), "an empty table shrinks back to the floor")
		})
	}
}
