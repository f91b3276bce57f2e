package reservation

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
)

// TestAppendRequestLoads checks AppendRequestLoads against AppendRankLoads over
// every worker rank: the ranks named come first with the same loads, and the
// rest are exactly the other ranks holding any of the request's hashes, with
// the same loads and new blocks; worker ranks are removed and re-added on the
// way, so slots are reused.
func TestAppendRequestLoads(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	var raised []catalog.WorkerRank
	l := newLedger(t, Options{OnRaise: func(w catalog.WorkerRank) { raised = append(raised, w) }})
	var keys []catalog.WorkerRank
	for w := range 12 {
		for k := range 1 + r.IntN(3) {
			keys = append(keys, wr(fmt.Sprintf("w%d", w), k))
		}
	}
	seqs := func() []uint64 {
		out := make([]uint64, r.IntN(12))
		for i := range out {
			out[i] = uint64(1 + r.IntN(40))
		}
		return out
	}
	var live []string
	for step := range 400 {
		switch op := r.IntN(8); {
		case op < 4:
			id := fmt.Sprintf("b%d", step)
			w := keys[r.IntN(len(keys))]
			raised = raised[:0]
			require.NoError(t, l.Book(Booking{ID: ID(id), Worker: w, SeqHashes: seqs(), PrivateBlocks: r.IntN(2), PrefillTokens: r.IntN(50)}))
			require.Equal(t, []catalog.WorkerRank{w}, raised)
			live = append(live, id)
		case op < 6 && len(live) > 0:
			j := r.IntN(len(live))
			_ = l.Free(ID(live[j]))
			live = slices.Delete(live, j, j+1)
		case op == 6:
			l.RemoveWorker(keys[r.IntN(len(keys))].WorkerID)
		}
		refs := l.AppendRanks(nil, keys)
		req := seqs()
		all := l.AppendRankLoads(nil, refs, req)
		named := r.Perm(len(refs))[:r.IntN(len(refs))]
		var sub []Rank
		for _, i := range named {
			sub = append(sub, refs[i])
		}
		got, distinct := l.AppendRequestLoads(nil, sub, req)
		uniq := map[uint64]bool{}
		for _, h := range req {
			uniq[h] = true
		}
		require.Equal(t, len(uniq), distinct)
		for k, i := range named {
			require.Equal(t, all[i], got[k], "step %d", step)
		}
		want := map[catalog.WorkerRank]CandidateLoad{}
		for i, c := range all {
			if !slices.Contains(named, i) && c.NewBlocks < distinct {
				want[c.Worker] = c
			}
		}
		extra := map[catalog.WorkerRank]CandidateLoad{}
		for _, c := range got[len(named):] {
			extra[c.Worker] = c
		}
		require.Equal(t, want, extra, "step %d", step)
		ld, st := l.RankLoad(refs[0])
		require.Equal(t, all[0].Load, ld)
		require.Equal(t, all[0].Stamp, st)
	}
}
