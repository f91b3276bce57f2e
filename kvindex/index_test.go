package kvindex

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

func mustIndex(t testing.TB, bs int) *Index {
	ix, err := New(Options{BlockSize: bs})
	require.NoError(t, err)
	return ix
}

func seqsOf(t testing.TB, bs int, toks []uint32) []uint64 {
	h, err := NewHasher(bs, HashOptions{})
	require.NoError(t, err)
	return h.SeqHashes(toks)
}

func only(ms []Match, w catalog.WorkerRank) Match {
	for _, m := range ms {
		if m.Worker == w {
			return m
		}
	}
	return Match{Worker: w}
}

func TestNewRejectsBadBlockSize(t *testing.T) {
	for _, bs := range []int{0, -16} {
		_, err := New(Options{BlockSize: bs})
		require.ErrorIs(t, err, ErrBlockSize)
	}
}

func TestBadInputIsCountedNotFatal(t *testing.T) {
	ix := mustIndex(t, 2)
	w := catalog.WorkerRank{WorkerID: "w"}
	// Empty events, unknown removes and clears change nothing and are counted;
	// an unknown remove says so.
	require.NoError(t, ix.Apply(w, Event{Kind: EventStored}))
	require.ErrorIs(t, ix.Apply(w, Event{Kind: EventRemoved, BlockHashes: []uint64{1, 2}}), ErrUnknownBlock)
	ix.ClearRank(w)
	require.Equal(t, 0, ix.RemoveWorker("nobody"))
	require.Empty(t, ix.FindMatches(nil, MatchOptions{}))
	require.Empty(t, ix.FindMatches([]uint64{}, MatchOptions{}))

	cases := []struct {
		name string
		w    catalog.WorkerRank
		ev   Event
		err  error
	}{
		{"empty worker", catalog.WorkerRank{}, Event{Kind: EventCleared}, ErrInvalidEvent},
		{"negative rank", catalog.WorkerRank{WorkerID: "w", Rank: -1}, Event{Kind: EventCleared}, ErrInvalidEvent},
		{"bad kind", w, Event{Kind: 9}, ErrInvalidEvent},
		{"bad tier", w, Event{Kind: EventStored, Tier: 7}, ErrInvalidEvent},
		{"short tokens", w, Event{Kind: EventStored, BlockHashes: []uint64{1}, Tokens: []uint32{1}}, ErrTokenCount},
		{"long tokens", w, Event{Kind: EventStored, BlockHashes: []uint64{1}, Tokens: []uint32{1, 2, 3}}, ErrTokenCount},
		{"odd block size", w, Event{Kind: EventStored, BlockHashes: []uint64{1}, Tokens: []uint32{1, 2, 3}, BlockSize: 3}, ErrBlockSize},
		{"negative block size", w, Event{Kind: EventStored, BlockHashes: []uint64{1}, BlockSize: -2}, ErrBlockSize},
		{"self parent", w, Event{Kind: EventStored, BlockHashes: []uint64{1}, Tokens: []uint32{1, 2}, HasParent: true, ParentHash: 1}, ErrInvalidEvent},
		{"repeated hash", w, Event{Kind: EventStored, BlockHashes: []uint64{1, 1}, Tokens: []uint32{1, 2, 3, 4}}, ErrInvalidEvent},
		{"extra length", w, Event{Kind: EventStored, BlockHashes: []uint64{1}, Tokens: []uint32{1, 2}, Extra: []uint64{1, 2}}, ErrInvalidEvent},
		{"unknown parent", w, Event{Kind: EventStored, BlockHashes: []uint64{5}, Tokens: []uint32{1, 2}, HasParent: true, ParentHash: 4}, ErrUnknownParent},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.ErrorIs(t, ix.Apply(c.w, c.ev), c.err)
		})
	}
	st := ix.Stats()
	require.Zero(t, st.Nodes)
	require.Zero(t, st.Entries)
	require.Zero(t, st.WorkerRanks)
	require.EqualValues(t, 1, st.DroppedUnknownParent)
	require.EqualValues(t, 2, st.UnknownRemoves)
	require.EqualValues(t, 2, st.UnknownClears)
	require.EqualValues(t, 1, st.EmptyEvents)
	require.EqualValues(t, 11, st.Rejected)
}

// TestLongRunRepeats covers the repeat check of runs longer than 32 blocks,
// which puts the hashes in a set instead of comparing every pair: hashes
// that differ only in their high bits, or are 0, and a set emptied between
// runs (the same hashes again, on other worker ranks, are no repeat).
func TestLongRunRepeats(t *testing.T) {
	ix := mustIndex(t, 1)
	w := catalog.WorkerRank{WorkerID: "w"}
	run := func() Event {
		ev := Event{Kind: EventStored, Tokens: make([]uint32, 40)}
		for i := range 40 {
			ev.BlockHashes = append(ev.BlockHashes, uint64(i)<<44)
			ev.Tokens[i] = uint32(i)
		}
		return ev
	}
	for i := range 3 {
		require.NoError(t, ix.Apply(catalog.WorkerRank{WorkerID: "other", Rank: i}, run()))
	}
	ix.RemoveWorker("other")
	repeated := run()
	repeated.BlockHashes[35] = repeated.BlockHashes[3]
	require.ErrorIs(t, ix.Apply(w, repeated), ErrInvalidEvent)
	selfParent := run()
	selfParent.HasParent, selfParent.ParentHash = true, selfParent.BlockHashes[33]
	require.ErrorIs(t, ix.Apply(w, selfParent), ErrInvalidEvent)
	require.Zero(t, ix.Stats().Entries)
	require.NoError(t, ix.Apply(w, run()))
	require.Equal(t, 40, ix.Stats().Entries)
	require.EqualValues(t, 2, ix.Stats().Rejected)
}

func TestUnknownParentIsNotPlacedAtRoot(t *testing.T) {
	ix := mustIndex(t, 2)
	w := catalog.WorkerRank{WorkerID: "w"}
	toks := []uint32{1, 2, 3, 4}
	// Block 2 arrives without block 1: applying it at the root would claim the
	// worker holds a prefix starting with tokens 3,4.
	require.ErrorIs(t, ix.Apply(w, Event{Kind: EventStored, HasParent: true, ParentHash: 10, BlockHashes: []uint64{11}, Tokens: toks[2:]}), ErrUnknownParent)
	require.Empty(t, ix.FindMatches(seqsOf(t, 2, toks[2:]), MatchOptions{}))
	require.Empty(t, ix.FindMatches(seqsOf(t, 2, toks), MatchOptions{}))
}

func TestEngineBlockSplitting(t *testing.T) {
	ix := mustIndex(t, 2)
	w := catalog.WorkerRank{WorkerID: "w"}
	toks := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	// Engine blocks of 4 tokens = two index blocks each.
	require.NoError(t, ix.Apply(w, Event{Kind: EventStored, BlockSize: 4, BlockHashes: []uint64{100, 200}, Tokens: toks}))
	require.Equal(t, 4, only(ix.FindMatches(seqsOf(t, 2, toks), MatchOptions{}), w).Device)
	// A request sharing 3 index blocks (6 tokens) matches 3, finer than the engine.
	req := []uint32{1, 2, 3, 4, 5, 6, 0, 0}
	require.Equal(t, 3, only(ix.FindMatches(seqsOf(t, 2, req), MatchOptions{}), w).Device)
	// Removing engine block 200 removes index blocks 3 and 4.
	require.NoError(t, ix.Apply(w, Event{Kind: EventRemoved, BlockHashes: []uint64{200}}))
	require.Equal(t, 2, only(ix.FindMatches(seqsOf(t, 2, toks), MatchOptions{}), w).Device)
	require.Equal(t, 2, ix.Stats().Nodes)
	// A different engine block size for the same worker rank is rejected while it
	// holds blocks.
	require.ErrorIs(t, ix.Apply(w, Event{Kind: EventStored, BlockSize: 2, BlockHashes: []uint64{7}, Tokens: toks[:2]}), ErrBlockSize)
}

func TestTiersExtendTheDeviceMatch(t *testing.T) {
	ix := mustIndex(t, 1)
	w := catalog.WorkerRank{WorkerID: "w"}
	toks := []uint32{1, 2, 3, 4, 5}
	hs := []uint64{11, 12, 13, 14, 15}
	// Device holds blocks 1-2, host holds 1-4, disk holds 1-5.
	require.NoError(t, ix.Apply(w, Event{Kind: EventStored, BlockHashes: hs[:2], Tokens: toks[:2]}))
	require.NoError(t, ix.Apply(w, Event{Kind: EventStored, Tier: TierHost, BlockHashes: hs[:4], Tokens: toks[:4]}))
	require.NoError(t, ix.Apply(w, Event{Kind: EventStored, Tier: TierDisk, BlockHashes: hs, Tokens: toks}))
	m := only(ix.FindMatches(seqsOf(t, 1, toks), MatchOptions{}), w)
	require.Equal(t, Match{Worker: w, Device: 2, Host: 2, Disk: 1}, m)
	require.Equal(t, 5, m.Total())
	// A host store may chain from a device parent.
	w2 := catalog.WorkerRank{WorkerID: "w2"}
	require.NoError(t, ix.Apply(w2, Event{Kind: EventStored, BlockHashes: hs[:1], Tokens: toks[:1]}))
	require.NoError(t, ix.Apply(w2, Event{Kind: EventStored, Tier: TierHost, HasParent: true, ParentHash: 11, BlockHashes: hs[1:3], Tokens: toks[1:3]}))
	require.Equal(t, Match{Worker: w2, Device: 1, Host: 2}, only(ix.FindMatches(seqsOf(t, 1, toks), MatchOptions{}), w2))
	// Removing the device copy of block 1 leaves it on host only.
	require.NoError(t, ix.Apply(w, Event{Kind: EventRemoved, Tier: TierDevice, BlockHashes: hs[:1]}))
	require.Equal(t, Match{Worker: w, Device: 0, Host: 4, Disk: 1}, only(ix.FindMatches(seqsOf(t, 1, toks), MatchOptions{}), w))
}

func TestDuplicateStoresNeedMatchingRemoves(t *testing.T) {
	ix := mustIndex(t, 1)
	w := catalog.WorkerRank{WorkerID: "w"}
	ev := Event{Kind: EventStored, BlockHashes: []uint64{1}, Tokens: []uint32{9}}
	require.NoError(t, ix.Apply(w, ev))
	require.NoError(t, ix.Apply(w, ev))
	rm := Event{Kind: EventRemoved, BlockHashes: []uint64{1}}
	require.NoError(t, ix.Apply(w, rm))
	require.Len(t, ix.FindMatches(seqsOf(t, 1, []uint32{9}), MatchOptions{}), 1)
	require.NoError(t, ix.Apply(w, rm))
	require.Empty(t, ix.FindMatches(seqsOf(t, 1, []uint32{9}), MatchOptions{}))
	require.EqualValues(t, 1, ix.Stats().DuplicateStores)
}

func TestLoRAAndSaltIsolate(t *testing.T) {
	ix := mustIndex(t, 2)
	w := catalog.WorkerRank{WorkerID: "w"}
	toks := []uint32{1, 2, 3, 4}
	require.NoError(t, ix.Apply(w, Event{Kind: EventStored, BlockHashes: []uint64{1, 2}, Tokens: toks, LoRAName: "sql"}))
	require.Empty(t, ix.FindMatches(seqsOf(t, 2, toks), MatchOptions{}))
	h, _ := NewHasher(2, HashOptions{LoRAName: "sql"})
	require.Equal(t, 2, only(ix.FindMatches(h.SeqHashes(toks), MatchOptions{}), w).Device)
	salted, _ := NewHasher(2, HashOptions{LoRAName: "sql", CacheSalt: "t1"})
	require.Empty(t, ix.FindMatches(salted.SeqHashes(toks), MatchOptions{}))

	// The salt seeds the first block only: a run that continues a salted chain
	// carries no salt (vLLM puts it in block 0's extra keys) and still matches.
	w2 := catalog.WorkerRank{WorkerID: "w2"}
	require.NoError(t, ix.Apply(w2, Event{Kind: EventStored, BlockHashes: []uint64{1}, Tokens: toks[:2], CacheSalt: "t1"}))
	require.NoError(t, ix.Apply(w2, Event{Kind: EventStored, HasParent: true, ParentHash: 1, BlockHashes: []uint64{2}, Tokens: toks[2:]}))
	plain, _ := NewHasher(2, HashOptions{CacheSalt: "t1"})
	require.Equal(t, 2, only(ix.FindMatches(plain.SeqHashes(toks), MatchOptions{}), w2).Device)
	unsalted, _ := NewHasher(2, HashOptions{})
	require.Empty(t, ix.FindMatches(unsalted.SeqHashes(toks), MatchOptions{}))
}

func TestRemoveWorkerAndChurnLeaveNothingBehind(t *testing.T) {
	ix := mustIndex(t, 4)
	toks := make([]uint32, 4*64)
	for i := range toks {
		toks[i] = uint32(i)
	}
	for round := range 50 {
		for r := range 3 {
			w := catalog.WorkerRank{WorkerID: fmt.Sprintf("pod-%d", round%5), Rank: r}
			hs := make([]uint64, 64)
			for i := range hs {
				hs[i] = uint64(round*1000 + i + 1)
			}
			toks[0] = uint32(round) // every round a new prefix
			require.NoError(t, ix.Apply(w, Event{Kind: EventStored, BlockHashes: hs, Tokens: toks}))
		}
		if round%5 == 4 {
			for p := range 5 {
				require.Equal(t, 3, ix.RemoveWorker(fmt.Sprintf("pod-%d", p)))
			}
			st := ix.Stats()
			require.Zero(t, st.Nodes)
			require.Zero(t, st.Entries)
			require.Zero(t, st.WorkerRanks)
			require.Zero(t, ix.t.rootKids.count())
			require.Empty(t, ix.t.extra)
		}
	}
}

func TestSlotsAreReused(t *testing.T) {
	ix := mustIndex(t, 1)
	for i := range 1000 {
		w := catalog.WorkerRank{WorkerID: fmt.Sprint(i)}
		require.NoError(t, ix.Apply(w, Event{Kind: EventStored, BlockHashes: []uint64{1}, Tokens: []uint32{uint32(i)}}))
		ix.ClearRank(w)
	}
	require.LessOrEqual(t, len(ix.t.slots), 1)
}

func TestManyWorkersShareABlock(t *testing.T) {
	ix := mustIndex(t, 2)
	toks := []uint32{1, 2, 3, 4}
	for i := range 300 { // several bitset words
		w := catalog.WorkerRank{WorkerID: fmt.Sprintf("w%03d", i)}
		n := 1 + i%2
		require.NoError(t, ix.Apply(w, Event{Kind: EventStored, BlockHashes: []uint64{1, 2}[:n], Tokens: toks[:2*n]}))
	}
	ms := ix.FindMatches(seqsOf(t, 2, toks), MatchOptions{})
	require.Len(t, ms, 300)
	for _, m := range ms {
		var i int
		_, _ = fmt.Sscanf(m.Worker.WorkerID, "w%d", &i)
		require.Equal(t, 1+i%2, m.Device, m.Worker)
	}
	sub := []catalog.WorkerRank{{WorkerID: "w007"}, {WorkerID: "w200"}, {WorkerID: "missing"}}
	ms = ix.FindMatches(seqsOf(t, 2, toks), MatchOptions{Candidates: sub})
	sortMatches(ms)
	require.Equal(t, []Match{{Worker: sub[0], Device: 2}, {Worker: sub[1], Device: 1}}, ms)
	require.Empty(t, ix.FindMatches(seqsOf(t, 2, toks), MatchOptions{Candidates: []catalog.WorkerRank{}}))
}

// TestConcurrentLookupsNeverOvercount runs writers that grow and then shrink their
// worker's chain while readers look up the full chain. Each writer keeps a log of
// upper bounds on what a lookup may see: it raises the bound before a store and
// lowers it after a remove. A lookup's answer must not exceed the largest bound
// logged while it ran, so lookups may lag the writer but never run ahead of it.
func TestConcurrentLookupsNeverOvercount(t *testing.T) {
	const bs, depth, writers, readers, rounds = 2, 64, 4, 4, 5
	ix := mustIndex(t, bs)
	toks := make([]uint32, bs*depth)
	for i := range toks {
		toks[i] = uint32(i * 7)
	}
	seqs := seqsOf(t, bs, toks)
	var (
		bounds   [writers][rounds*2*depth + 2]atomic.Int64
		versions [writers]atomic.Int64
	)
	publish := func(w int, bound int64) {
		v := versions[w].Load() + 1
		bounds[w][v].Store(bound)
		versions[w].Store(v)
	}
	var wg sync.WaitGroup
	done := make(chan struct{})
	var violations, nonEmpty atomic.Int64
	// Writers hold their first full chain until a reader has seen a match, so the
	// test cannot pass with readers that never overlapped a stored chain.
	saw := make(chan struct{})
	var sawOnce sync.Once
	for r := range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]Match, 0, writers)
			for i := 0; ; i++ {
				select {
				case <-done:
					return
				default:
				}
				var before [writers]int64
				for w := range writers {
					before[w] = versions[w].Load()
				}
				buf = ix.AppendMatches(buf[:0], seqs, MatchOptions{StopAtOne: (i+r)%3 == 0})
				for _, m := range buf {
					var w int
					_, _ = fmt.Sscanf(m.Worker.WorkerID, "w%d", &w)
					limit := int64(0)
					for v := before[w]; v <= versions[w].Load(); v++ {
						limit = max(limit, bounds[w][v].Load())
					}
					if int64(m.Device) > limit {
						violations.Add(1)
					}
					if m.Device > 0 {
						nonEmpty.Add(1)
						sawOnce.Do(func() { close(saw) })
					}
				}
			}
		}()
	}
	var wwg sync.WaitGroup
	for w := range writers {
		wwg.Add(1)
		go func() {
			defer wwg.Done()
			wr := catalog.WorkerRank{WorkerID: fmt.Sprintf("w%d", w)}
			for round := range rounds {
				for i := range depth {
					ev := Event{Kind: EventStored, BlockHashes: []uint64{uint64(i + 1)}, Tokens: toks[i*bs : (i+1)*bs]}
					if i > 0 {
						ev.HasParent, ev.ParentHash = true, uint64(i)
					}
					publish(w, int64(i+1))
					if err := ix.Apply(wr, ev); err != nil {
						t.Error(err)
						return
					}
				}
				if round == 0 {
					select {
					case <-saw:
					case <-time.After(10 * time.Second):
						t.Error("no reader saw a stored chain")
						return
					}
				}
				for i := depth - 1; i >= 0; i-- {
					if err := ix.Apply(wr, Event{Kind: EventRemoved, BlockHashes: []uint64{uint64(i + 1)}}); err != nil {
						t.Error(err)
						return
					}
					publish(w, int64(i))
				}
			}
		}()
	}
	wwg.Wait()
	close(done)
	wg.Wait()
	require.Zero(t, violations.Load())
	require.Positive(t, nonEmpty.Load(), "readers never saw a match: the test proves nothing")
	require.Zero(t, ix.Stats().Nodes)
}

func TestApproxTTLAndRefresh(t *testing.T) {
	now := time.Unix(100, 0)
	a, err := NewApprox(ApproxOptions{TTL: 10 * time.Second, Now: func() time.Time { return now }})
	require.NoError(t, err)
	toks := []uint32{1, 2, 3, 4, 5, 6}
	seqs := seqsOf(t, 2, toks)
	w := catalog.WorkerRank{WorkerID: "a"}
	a.Record(w, seqs)
	a.Record(catalog.WorkerRank{WorkerID: "b"}, seqs[:1])
	require.Len(t, a.FindMatches(seqs, MatchOptions{}), 2)
	now = now.Add(6 * time.Second)
	a.Record(w, seqs[:2]) // refresh the first two blocks only
	now = now.Add(5 * time.Second)
	ms := a.FindMatches(seqs, MatchOptions{})
	require.Equal(t, []Match{{Worker: w, Device: 2}}, ms)
	now = now.Add(10 * time.Second)
	require.Empty(t, a.FindMatches(seqs, MatchOptions{}))
	st := a.stats()
	require.Zero(t, st.Entries)
	require.Zero(t, st.Nodes)
	require.EqualValues(t, 4, st.Expired)
}

func TestApproxSizeCapPrunesDeepestFirst(t *testing.T) {
	now := time.Unix(0, 0)
	a, err := NewApprox(ApproxOptions{MaxBlocks: 10, Now: func() time.Time { return now }})
	require.NoError(t, err)
	toks := make([]uint32, 20)
	for i := range toks {
		toks[i] = uint32(i)
	}
	seqs := seqsOf(t, 2, toks) // 10 blocks
	w := catalog.WorkerRank{WorkerID: "a"}
	a.Record(w, seqs)
	require.Equal(t, 10, a.stats().Entries)
	now = now.Add(time.Second)
	other := seqsOf(t, 2, []uint32{99, 98})
	a.Record(catalog.WorkerRank{WorkerID: "b"}, other) // 11 > 10: prune to 8
	st := a.stats()
	require.Equal(t, 8, st.Entries)
	require.EqualValues(t, 3, st.Pruned)
	// The oldest request lost its three deepest blocks, not a middle one.
	require.Equal(t, 7, only(a.FindMatches(seqs, MatchOptions{}), w).Device)
	require.Len(t, a.FindMatches(other, MatchOptions{}), 1)
	require.Equal(t, 1, a.RemoveWorker("a"))
	require.Equal(t, 1, a.stats().Entries)
}

func TestApproxOptions(t *testing.T) {
	_, err := NewApprox(ApproxOptions{TTL: -1, MaxBlocks: -1})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "TTL")
	require.ErrorContains(t, err, "MaxBlocks")
	_, err = NewApprox(ApproxOptions{MaxBlocks: MaxNodes/2 + 1})
	require.ErrorIs(t, err, ErrInvalidOptions, "more than the tree can hold while it prunes")
	_, err = NewApprox(ApproxOptions{MaxBlocks: MaxNodes / 2})
	require.NoError(t, err)
	a, err := NewApprox(ApproxOptions{})
	require.NoError(t, err)
	require.Equal(t, DefaultApproxTTL, a.ttl)
	require.Equal(t, DefaultApproxMaxBlocks, a.max)
	a.Record(catalog.WorkerRank{}, []uint64{1}) // invalid worker: ignored
	a.Record(catalog.WorkerRank{WorkerID: "x"}, nil)
	require.Zero(t, a.stats().Entries)
}

func TestRankLimitRefusesStoresBeyondIt(t *testing.T) {
	ix, err := New(Options{BlockSize: 1, MaxBlocksPerRank: 3})
	require.NoError(t, err)
	w := catalog.WorkerRank{WorkerID: "w"}
	store := func(w catalog.WorkerRank, hs ...uint64) error {
		toks := make([]uint32, len(hs))
		for i, h := range hs {
			toks[i] = uint32(h)
		}
		return ix.Apply(w, Event{Kind: EventStored, BlockHashes: hs, Tokens: toks})
	}
	require.NoError(t, store(w, 1, 2))
	require.ErrorIs(t, store(w, 3, 4), ErrRankFull, "2 held + 2 > 3")
	require.NoError(t, store(w, 5))
	require.ErrorIs(t, store(w, 6), ErrRankFull)
	require.ErrorIs(t, store(catalog.WorkerRank{WorkerID: "x"}, 1, 2, 3, 4), ErrRankFull, "one run beyond the limit")
	// Another tier has its own count; a removal makes room.
	require.NoError(t, ix.Apply(w, Event{Kind: EventStored, Tier: TierHost, BlockHashes: []uint64{7}, Tokens: []uint32{7}}))
	require.NoError(t, ix.Apply(w, Event{Kind: EventRemoved, BlockHashes: []uint64{5}}))
	require.NoError(t, store(w, 6))

	// A per-worker limit wins over the default, and is forgotten with the worker.
	ix.SetRankLimit("big", 10)
	require.NoError(t, store(catalog.WorkerRank{WorkerID: "big", Rank: 1}, 1, 2, 3, 4, 5, 6))
	require.Equal(t, 1, ix.RemoveWorker("big"))
	require.ErrorIs(t, store(catalog.WorkerRank{WorkerID: "big"}, 1, 2, 3, 4), ErrRankFull)
	ix.SetRankLimit("big", 10)
	ix.SetRankLimit("big", 0)
	require.ErrorIs(t, store(catalog.WorkerRank{WorkerID: "big"}, 1, 2, 3, 4), ErrRankFull)

	_, err = New(Options{BlockSize: 1, MaxBlocksPerRank: -1})
	require.Error(t, err)
}

// TestIndexFullRefusesStores: a stored run that could take the tree past its
// node limit (MaxNodes; 5 here) is refused whole, and a worker rank it would
// have created is not left registered.
func TestIndexFullRefusesStores(t *testing.T) {
	ix, err := New(Options{BlockSize: 1})
	require.NoError(t, err)
	ix.maxNodes = 5
	store := func(w string, parent uint64, hs ...uint64) error {
		ev := Event{Kind: EventStored, BlockHashes: hs, Tokens: make([]uint32, len(hs)), HasParent: parent != 0, ParentHash: parent}
		for i, h := range hs {
			ev.Tokens[i] = uint32(h)
		}
		return ix.Apply(catalog.WorkerRank{WorkerID: w}, ev)
	}
	require.NoError(t, store("a", 0, 1, 2, 3))
	require.ErrorIs(t, store("b", 0, 11, 12, 13), ErrIndexFull, "3 nodes and 3 more > 5")
	st := ix.Stats()
	require.Equal(t, 3, st.Nodes)
	require.Equal(t, 1, st.WorkerRanks)
	require.Empty(t, ix.FindMatches(seqsOf(t, 1, []uint32{11, 12, 13}), MatchOptions{}))
	require.ErrorIs(t, store("a", 3, 4, 5, 6), ErrIndexFull, "an extension of a held run too")
	require.NoError(t, store("a", 3, 4, 5), "exactly at the limit")
	require.Equal(t, 5, ix.Stats().Nodes)
	require.NoError(t, ix.Apply(catalog.WorkerRank{WorkerID: "a"}, Event{Kind: EventRemoved, BlockHashes: []uint64{5, 4}}))
	require.NoError(t, store("b", 0, 11, 12), "removals make room")
}

func TestOnStoredSeesTheRouterKeysOfEveryStoredBlock(t *testing.T) {
	var got [][]uint64
	var who []catalog.WorkerRank
	ix, err := New(Options{BlockSize: 2, OnStored: func(w catalog.WorkerRank, keys []uint64) {
		who = append(who, w)
		got = append(got, append([]uint64(nil), keys...))
	}})
	require.NoError(t, err)
	w := catalog.WorkerRank{WorkerID: "w", Rank: 1}
	toks := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	want := seqsOf(t, 2, toks)
	// Engine blocks of 4 tokens, stored in two runs: every index block's key,
	// in order, the second run chained to the first.
	require.NoError(t, ix.Apply(w, Event{Kind: EventStored, BlockSize: 4, BlockHashes: []uint64{10}, Tokens: toks[:4]}))
	require.NoError(t, ix.Apply(w, Event{Kind: EventStored, BlockSize: 4, BlockHashes: []uint64{11}, HasParent: true, ParentHash: 10, Tokens: toks[4:]}))
	require.Equal(t, [][]uint64{want[:2], want[2:]}, got)
	require.Equal(t, []catalog.WorkerRank{w, w}, who)
	// A refused run calls nothing.
	require.ErrorIs(t, ix.Apply(w, Event{Kind: EventStored, BlockSize: 4, BlockHashes: []uint64{12}, HasParent: true, ParentHash: 99, Tokens: toks[:4]}), ErrUnknownParent)
	require.Len(t, got, 2)
}
