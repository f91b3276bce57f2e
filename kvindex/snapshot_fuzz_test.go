package kvindex

import (
	"bytes"
	"errors"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzReadSnapshot feeds ReadSnapshot arbitrary bytes, and the same bytes with
// their checksums repaired so that mutations reach the payload parser. It must
// never panic, never allocate much more than its input (the bounds are small
// here), fail only with the snapshot sentinels and no index, and when it
// succeeds return a consistent index that round-trips.
func FuzzReadSnapshot(f *testing.F) {
	f.Add(smallSnapshot(f))
	f.Add(writeSnapshot(f, mustIndex(f, 16), nil))
	for seed := range uint64(3) {
		sg := newSnapGen(seed)
		f.Add(writeSnapshot(f, randomIndex(f, sg, 300), sg.sources()))
	}
	opts := ReadOptions{MaxBytes: 1 << 20, MaxWorkerRanks: 64, MaxNodes: 1 << 14, MaxBlocks: 1 << 14, MaxStringLen: 64}
	f.Fuzz(func(t *testing.T, data []byte) {
		inputs := [][]byte{data}
		if len(data) >= snapHeaderLen+4 {
			inputs = append(inputs, seal(append(make([]byte, snapHeaderLen), data[snapHeaderLen:len(data)-4]...)))
		}
		for _, in := range inputs {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			ix, src, err := ReadSnapshot(bytes.NewReader(in), opts)
			runtime.ReadMemStats(&after)
			require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20+512*len(in)), "bytes allocated for %d bytes of input", len(in))
			if err != nil {
				require.True(t, errors.Is(err, ErrSnapshotCorrupt) || errors.Is(err, ErrSnapshotVersion) || errors.Is(err, ErrSnapshotLimit), "unexpected error: %v", err)
				require.Nil(t, ix)
				require.Nil(t, src)
				continue
			}
			checkLoaded(t, ix)
			again, src2 := readSnapshot(t, writeSnapshot(t, ix, src))
			equalIndexes(t, ix, again)
			require.Equal(t, src, src2)
		}
	})
}
