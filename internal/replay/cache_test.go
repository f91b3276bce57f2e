package replay

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestLRUCacheStoreAndEvictTailsFirst(t *testing.T) {
	c := newLRUCache(5)
	cached, added, ev := c.Store([]uint64{1, 2, 3}, nil)
	require.Equal(t, 0, cached)
	require.Equal(t, 3, added)
	require.Empty(t, ev)
	require.Equal(t, []uint64{1, 2, 3}, c.Keys(), "the first block is the most recent")

	// A sibling sequence shares 1, 2: only 4 is new.
	cached, added, ev = c.Store([]uint64{1, 2, 4}, nil)
	require.Equal(t, 2, cached)
	require.Equal(t, 1, added)
	require.Empty(t, ev)
	require.Equal(t, []uint64{1, 2, 4, 3}, c.Keys())

	// A new sequence of three needs two evictions: the least recent leaves go
	// first (3, then 4), never the shared prefix.
	cached, added, ev = c.Store([]uint64{7, 8, 9}, nil)
	require.Equal(t, 0, cached)
	require.Equal(t, 3, added)
	require.Equal(t, []uint64{3, 4}, ev)
	require.Equal(t, []uint64{7, 8, 9, 1, 2}, c.Keys())
	require.Equal(t, 5, c.Len())
	require.Equal(t, 2, c.Prefix([]uint64{1, 2, 3}))
	require.Equal(t, 0, c.Prefix([]uint64{3, 1}))

	// Touch refreshes without adding.
	c.Touch([]uint64{1, 2})
	require.Equal(t, []uint64{1, 2, 7, 8, 9}, c.Keys())
	require.True(t, c.Contains(9))

	// A sequence longer than the cache keeps only its leading capacity blocks.
	cached, added, ev = c.Store([]uint64{1, 2, 10, 11, 12, 13, 14}, nil)
	require.Equal(t, 2, cached)
	require.Equal(t, 3, added)
	require.Equal(t, []uint64{9, 8, 7}, ev)
	require.Equal(t, []uint64{1, 2, 10, 11, 12}, c.Keys())
}

// Under random stores of sequences from a prefix tree, every cached block's
// parent is cached (caches hold leading runs), the size never exceeds the
// capacity, and the reported stores and evictions account for the contents.
func TestLRUCacheInvariants(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const capacity = 40
	c := newLRUCache(capacity)
	parent := map[uint64]uint64{} // key -> parent key (0 = root); keys start at 1
	next := uint64(1)
	var seqs [][]uint64
	held := map[uint64]bool{}
	for range 2000 {
		var seq []uint64
		if len(seqs) > 0 && rng.IntN(3) > 0 { // extend or branch an old sequence
			old := seqs[rng.IntN(len(seqs))]
			seq = append(seq, old[:rng.IntN(len(old)+1)]...)
		}
		for range 1 + rng.IntN(8) {
			k := next
			next++
			if len(seq) > 0 {
				parent[k] = seq[len(seq)-1]
			}
			seq = append(seq, k)
		}
		seqs = append(seqs, seq)
		cached, added, ev := c.Store(seq, nil)
		require.Equal(t, c.Prefix(seq[:min(len(seq), capacity)]), cached+added)
		for _, k := range ev {
			require.True(t, held[k], "evicted a block it did not hold")
			delete(held, k)
		}
		for _, k := range seq[cached : cached+added] {
			require.False(t, held[k])
			held[k] = true
		}
		require.LessOrEqual(t, c.Len(), capacity)
		require.Equal(t, len(held), c.Len())
		for k := range held {
			require.True(t, c.Contains(k))
			if p, ok := parent[k]; ok {
				require.True(t, held[p], "block %d cached without its parent %d", k, p)
			}
		}
	}
}
