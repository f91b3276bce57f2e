package selection

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
)

func rankSetOf(keys ...catalog.WorkerRank) *rankSet {
	rs := &rankSet{pos: map[catalog.WorkerRank]int32{}}
	for i, k := range keys {
		rs.pos[k] = int32(i)
	}
	return rs
}

func TestResolveReusesOnlyWhatStillHolds(t *testing.T) {
	a, b, c := catalog.WorkerRank{WorkerID: "a"}, catalog.WorkerRank{WorkerID: "b"}, catalog.WorkerRank{WorkerID: "c"}
	a1 := catalog.WorkerRank{WorkerID: "a", Rank: 1}
	rs := rankSetOf(a, b, a1)
	sc := &evalScratch{}
	resolve := func(rs *rankSet, ws ...catalog.WorkerRank) []int32 {
		sc.matches = sc.matches[:0]
		for _, w := range ws {
			sc.matches = append(sc.matches, kvindex.Match{Worker: w})
		}
		sc.resolve(rs)
		require.Same(t, rs, sc.rs)
		return sc.matchIdx
	}
	require.Equal(t, []int32{0, 1}, resolve(rs, a, b))
	require.Equal(t, []int32{0, 1}, resolve(rs, a, b), "the same matches again")
	require.Equal(t, []int32{1, 0}, resolve(rs, b, a), "another order")
	require.Equal(t, []int32{1, 2, -1}, resolve(rs, b, a1, c), "another rank of a worker, and a worker not schedulable")
	require.Equal(t, []int32{1}, resolve(rs, b))
	// A new rank set (the catalog changed) never reuses the old indices.
	rs2 := rankSetOf(b, c)
	require.Equal(t, []int32{0, 1}, resolve(rs2, b, c))
	require.Equal(t, []int32{-1, 0}, resolve(rs2, a, b))
}
