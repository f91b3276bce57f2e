package kvindex

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"slices"
	"testing"
	"unsafe"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

// TestSameHoldersMark drives an index with 150 worker ranks, so holder sets
// span three words, on every tier, with prefix stores and removals of random
// ranges. After every step it requires that exactly the nodes that are their
// parent's only child and have their parent's holders on every tier carry
// markSame, recomputed here from the slots themselves, and every few steps
// that lookups agree with the oracle. With removed workers too (odd seeds),
// marks must still imply equal holders, and may be missing.
func TestSameHoldersMark(t *testing.T) {
	workers := make([]catalog.WorkerRank, 150)
	for i := range workers {
		workers[i] = catalog.WorkerRank{WorkerID: fmt.Sprintf("m%03d", i/2), Rank: i % 2}
	}
	for seed := range uint64(4) {
		drops := seed%2 == 1
		t.Run(fmt.Sprintf("%d/drops=%v", seed, drops), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 33))
			docs := newDocs(r)
			ix := mustIndex(t, oracleBS)
			o := newOracle(oracleBS)
			nEngine := len(docs[0]) / oracleBS
			for step := range 2500 {
				// Few workers at first, so stores pile up on shared prefixes.
				w := workers[r.IntN(min(len(workers), 20+step/10))]
				d := r.IntN(len(docs))
				tier := TierDevice
				if r.IntN(5) == 0 {
					tier = Tier(1 + r.IntN(2))
				}
				ops := 19
				if drops {
					ops = 20
				}
				switch op := r.IntN(ops); {
				case op < 11: // a prefix of a document, from its first block
					n := 1 + r.IntN(nEngine)
					ev := Event{Kind: EventStored, Tier: tier, Tokens: slices.Clone(docs[d][:n*oracleBS])}
					for j := range n {
						ev.BlockHashes = append(ev.BlockHashes, engineHash(d, j, 1, ""))
					}
					require.Equal(t, o.apply(w, ev), ix.Apply(w, ev) == nil, "step %d", step)
				case op < 19: // a range of blocks, tail first or head first
					from := r.IntN(nEngine)
					ev := Event{Kind: EventRemoved, Tier: tier}
					for j := from; j < min(nEngine, from+1+r.IntN(12)); j++ {
						ev.BlockHashes = append(ev.BlockHashes, engineHash(d, j, 1, ""))
					}
					if r.IntN(2) == 0 {
						slices.Reverse(ev.BlockHashes)
					}
					if o.apply(w, ev) {
						require.NoError(t, ix.Apply(w, ev))
					} else {
						require.ErrorIs(t, ix.Apply(w, ev), ErrUnknownBlock)
					}
				default:
					for k := range o.workers {
						if k.WorkerID == w.WorkerID {
							delete(o.workers, k)
						}
					}
					ix.RemoveWorker(w.WorkerID)
				}
				checkMarks(t, ix, !drops)
				if step%5 == 0 {
					h, _ := NewHasher(oracleBS, HashOptions{})
					toks := slices.Clone(docs[d])
					if r.IntN(2) == 0 {
						toks[r.IntN(len(toks))] = 99999
					}
					seqs := h.SeqHashes(toks)
					got := ix.FindMatches(seqs, MatchOptions{})
					sortMatches(got)
					require.Equal(t, o.findMatches(seqs, nil), got, "step %d", step)
				}
			}
		})
	}
}

// checkMarks requires markSame only on nodes that are their parent's only
// child and have the same holder slots as their parent on every tier, and
// when exact on all of them.
func checkMarks(t *testing.T, ix *Index, exact bool) {
	t.Helper()
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	tr := &ix.t
	var walk func(id nodeID)
	walk = func(id nodeID) {
		n := tr.at(id)
		var kids []nodeID
		for _, c := range tr.children(n) {
			kids = append(kids, c)
		}
		for _, cid := range kids {
			c := tr.at(cid)
			require.Equal(t, id, c.parent(), "parent of node %#x", c.key)
			want := id != rootID && n.child == cid && slices.Equal(holderSlots(tr, c), holderSlots(tr, n))
			if exact || c.same() {
				require.Equal(t, want, c.same(), "mark of node %#x", c.key)
			}
			walk(cid)
		}
	}
	walk(rootID)
}

// holderSlots lists n's holders as tier*1e6+slot, in order.
func holderSlots(tr *tree, n *node) []int {
	var out []int
	add := func(tier int, ws []sword) {
		for _, w := range ws {
			for b := w.bits; b != 0; b &= b - 1 {
				out = append(out, tier*1_000_000+int(w.idx)*64+bits.TrailingZeros64(b))
			}
		}
	}
	add(0, tr.devWords(n))
	if e := tr.extOf(n); e != nil {
		add(1, e.host.words())
		add(2, e.disk.words())
	}
	return out
}

// TestNodeLayout: devWords reads a node's inline word as a sword (idx and
// bits where sword has them, up in sword's padding), and a node is 32 bytes,
// what the memory estimate counts.
func TestNodeLayout(t *testing.T) {
	require.Equal(t, unsafe.Offsetof(sword{}.idx), unsafe.Offsetof(node{}.idx))
	require.Equal(t, unsafe.Offsetof(sword{}.bits), unsafe.Offsetof(node{}.bits))
	require.Equal(t, unsafe.Sizeof(sword{}), unsafe.Offsetof(node{}.bits)+unsafe.Sizeof(node{}.bits))
	require.Equal(t, uintptr(nodeBytes), unsafe.Sizeof(node{}))
	require.Equal(t, uintptr(blockSlotBytes), unsafe.Sizeof(blockSlot{}))
}
