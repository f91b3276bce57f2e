package kvindex

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

// TestLoadRanksAll: loading every worker rank of a peer's snapshot into an
// index that holds other blocks (some of the same ranks, some of others)
// makes it equal to the peer's index entry by entry, encode to the same
// bytes, and keep behaving alike under the same further events.
func TestLoadRanksAll(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			sg := newSnapGen(seed)
			orig := randomIndex(t, sg, 200+sg.r.IntN(1200))
			sources := sg.sources()
			peer, _ := readSnapshot(t, writeSnapshot(t, orig, sources))

			other := newSnapGen(seed + 1000)
			other.workers = append(slices.Clone(sg.workers), catalog.WorkerRank{WorkerID: "zz"})
			target := randomIndex(t, other, 300)
			all := slices.Collect(maps.Keys(rankBlocks(target)))
			for _, w := range sg.workers {
				if !slices.Contains(all, w) {
					all = append(all, w)
				}
			}
			for _, w := range all {
				target.SetRankLimit(w.WorkerID, 0)
			}
			orig.mu.RLock()
			for w, n := range orig.limits {
				target.SetRankLimit(w, n)
			}
			orig.mu.RUnlock()

			want := 0
			for _, n := range rankBlocks(orig) {
				want += n[0] + n[1] + n[2]
			}
			require.Equal(t, want, target.LoadRanks(peer, all))
			checkLoaded(t, target)
			equalIndexes(t, orig, target)
			require.Equal(t, writeSnapshot(t, orig, sources), writeSnapshot(t, target, sources))
			for i := range 300 {
				op := sg.op()
				require.Equal(t, op.apply(orig), op.apply(target), "further op %d", i)
			}
			equalIndexes(t, orig, target)
		})
	}
}

// TestLoadRanksSome: loading some ranks replaces exactly those: they answer
// every query as in the peer's index, the others as before, and the tree's
// bookkeeping stays exact.
func TestLoadRanksSome(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			sg := newSnapGen(seed)
			orig := randomIndex(t, sg, 200+sg.r.IntN(1200))
			peer, _ := readSnapshot(t, writeSnapshot(t, orig, nil))
			other := newSnapGen(seed + 2000)
			other.workers = sg.workers
			target := randomIndex(t, other, 600)
			before, _ := readSnapshot(t, writeSnapshot(t, target, nil))

			var some []catalog.WorkerRank
			for i, w := range sg.workers {
				if i%2 == 0 {
					some = append(some, w)
				}
			}
			target.LoadRanks(peer, some)
			checkLoaded(t, target)
			ob, bb, tb := rankBlocks(orig), rankBlocks(before), rankBlocks(target)
			for _, w := range sg.workers {
				src := bb
				if slices.Contains(some, w) {
					src = ob
				}
				require.Equal(t, src[w], tb[w], "blocks of %v", w)
			}
			nonEmpty := 0
			for range 300 {
				seqs, _ := sg.query()
				want := map[catalog.WorkerRank]Match{}
				for _, m := range orig.FindMatches(seqs, MatchOptions{}) {
					if slices.Contains(some, m.Worker) {
						want[m.Worker] = m
					}
				}
				for _, m := range before.FindMatches(seqs, MatchOptions{}) {
					if !slices.Contains(some, m.Worker) {
						want[m.Worker] = m
					}
				}
				got := map[catalog.WorkerRank]Match{}
				for _, m := range target.FindMatches(seqs, MatchOptions{}) {
					got[m.Worker] = m
				}
				require.Equal(t, want, got)
				nonEmpty += len(got)
			}
			require.Positive(t, nonEmpty)
		})
	}
}

func TestLoadRanksItself(t *testing.T) {
	ix := mustIndex(t, 4)
	require.Panics(t, func() { ix.LoadRanks(ix, nil) })
}
