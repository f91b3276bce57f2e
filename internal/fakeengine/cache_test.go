package fakeengine

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// newCacheEngine returns an engine that is never started: Serve updates the cache
// and numbers batches into the replay buffer, which the tests read directly.
func newCacheEngine(t *testing.T, o Options) *Engine {
	t.Helper()
	e, err := New(o)
	require.NoError(t, err)
	return e
}

// lastBatch decodes the newest buffered batch.
func lastBatch(t *testing.T, e *Engine) decoded {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	require.Positive(t, e.ring.n)
	return decodeBatch(t, e.ring.at(e.ring.n-1).payload)
}

func TestServeHitsAndStores(t *testing.T) {
	e := newCacheEngine(t, Options{BlockSize: 4, CapacityBlocks: 16})
	a := seqTokens(1, 14) // 3 complete blocks, 2 tokens of tail ignored
	ha := e.BlockHashes(a, "", "")
	require.Len(t, ha, 3)

	r, err := e.Serve(Request{Tokens: a})
	require.NoError(t, err)
	require.Equal(t, Result{CachedBlocks: 0, StoredBlocks: 3, Published: true, Seq: 0}, r)
	d := lastBatch(t, e)
	require.Len(t, d.events, 1)
	ev := d.events[0]
	require.Equal(t, "BlockStored", ev["type"])
	require.Equal(t, ha, asHashes(t, ev["block_hashes"]))
	require.Nil(t, ev["parent_block_hash"])
	require.Equal(t, a[:12], asTokens(t, ev["token_ids"]))
	require.Equal(t, int64(4), asInt(t, ev["block_size"]))
	require.Equal(t, "GPU", ev["medium"])
	require.Nil(t, ev["lora_name"])

	// The same prompt again: all hits, nothing published.
	r, err = e.Serve(Request{Tokens: a})
	require.NoError(t, err)
	require.Equal(t, Result{CachedBlocks: 3}, r)
	require.Equal(t, uint64(1), e.NextSeq())

	// An extension: 3 hits, one new block chained to the last hit.
	ext := append(a[:12:12], 50, 51, 52, 53)
	r, err = e.Serve(Request{Tokens: ext})
	require.NoError(t, err)
	require.Equal(t, Result{CachedBlocks: 3, StoredBlocks: 1, Published: true, Seq: 1}, r)
	hext := e.BlockHashes(ext, "", "")
	require.Equal(t, ha, hext[:3], "hashes chain from the prefix")
	ev = lastBatch(t, e).events[0]
	require.Equal(t, hext[3:], asHashes(t, ev["block_hashes"]))
	require.Equal(t, ha[2], asHash(t, ev["parent_block_hash"]))
	require.Equal(t, []uint32{50, 51, 52, 53}, asTokens(t, ev["token_ids"]))

	require.Equal(t, 4, e.Blocks())
	require.Equal(t, 3, e.HeldPrefix(a, "", ""))
	require.Equal(t, 4, e.HeldPrefix(ext, "", ""))
	require.Equal(t, 0, e.HeldPrefix(seqTokens(2, 14), "", ""))
	require.Equal(t, 0, e.HeldPrefix(a[:3], "", ""), "no complete block")

	// A request with no complete block changes nothing.
	r, err = e.Serve(Request{Tokens: a[:3]})
	require.NoError(t, err)
	require.Equal(t, Result{}, r)
}

func TestServeEvictsTailFirst(t *testing.T) {
	e := newCacheEngine(t, Options{BlockSize: 2, CapacityBlocks: 4})
	a := seqTokens(0, 8)
	ha := e.BlockHashes(a, "", "")
	_, err := e.Serve(Request{Tokens: a})
	require.NoError(t, err)
	require.Equal(t, 4, e.Blocks())

	b := seqTokens(100, 4)
	r, err := e.Serve(Request{Tokens: b})
	require.NoError(t, err)
	require.Equal(t, Result{StoredBlocks: 2, EvictedBlocks: 2, Published: true, Seq: 1}, r)
	d := lastBatch(t, e)
	require.Len(t, d.events, 2)
	require.Equal(t, "BlockRemoved", d.events[0]["type"])
	require.Equal(t, []uint64{ha[3], ha[2]}, asHashes(t, d.events[0]["block_hashes"]), "tail block first")
	require.Equal(t, "GPU", d.events[0]["medium"])
	require.Equal(t, "BlockStored", d.events[1]["type"])
	require.Equal(t, 2, e.HeldPrefix(a, "", ""))
	require.Equal(t, 2, e.HeldPrefix(b, "", ""))
	require.Equal(t, 4, e.Blocks())
}

func TestServeLRUAcrossRequests(t *testing.T) {
	e := newCacheEngine(t, Options{BlockSize: 1, CapacityBlocks: 6})
	a, b, c := seqTokens(0, 3), seqTokens(10, 3), seqTokens(20, 2)
	hb := e.BlockHashes(b, "", "")
	for _, p := range [][]uint32{a, b, a} {
		_, err := e.Serve(Request{Tokens: p})
		require.NoError(t, err)
	}
	// a was used last, so b is the least recently used; its tail goes first.
	r, err := e.Serve(Request{Tokens: c})
	require.NoError(t, err)
	require.Equal(t, 2, r.EvictedBlocks)
	require.Equal(t, []uint64{hb[2], hb[1]}, asHashes(t, lastBatch(t, e).events[0]["block_hashes"]))
	require.Equal(t, 3, e.HeldPrefix(a, "", ""))
	require.Equal(t, 1, e.HeldPrefix(b, "", ""))
	require.Equal(t, 2, e.HeldPrefix(c, "", ""))
}

func TestServeNeverEvictsItsOwnBlocks(t *testing.T) {
	e := newCacheEngine(t, Options{BlockSize: 1, CapacityBlocks: 4})
	a, b := seqTokens(0, 2), seqTokens(10, 2)
	hb := e.BlockHashes(b, "", "")
	for _, p := range [][]uint32{a, b} {
		_, err := e.Serve(Request{Tokens: p})
		require.NoError(t, err)
	}
	// a's blocks are the least recently used, but the extension uses them.
	ext := seqTokens(0, 4)
	r, err := e.Serve(Request{Tokens: ext})
	require.NoError(t, err)
	require.Equal(t, Result{CachedBlocks: 2, StoredBlocks: 2, EvictedBlocks: 2, Published: true, Seq: 2}, r)
	require.Equal(t, []uint64{hb[1], hb[0]}, asHashes(t, lastBatch(t, e).events[0]["block_hashes"]))
	require.Equal(t, 4, e.HeldPrefix(ext, "", ""))
	require.Equal(t, 0, e.HeldPrefix(b, "", ""))
}

func TestServeRequestLargerThanCache(t *testing.T) {
	e := newCacheEngine(t, Options{BlockSize: 1, CapacityBlocks: 3})
	_, err := e.Serve(Request{Tokens: seqTokens(50, 2)})
	require.NoError(t, err)
	big := seqTokens(0, 5)
	r, err := e.Serve(Request{Tokens: big})
	require.NoError(t, err)
	require.Equal(t, Result{StoredBlocks: 3, EvictedBlocks: 2, Published: true, Seq: 1}, r)
	require.Equal(t, 3, e.Blocks())
	require.Equal(t, 3, e.HeldPrefix(big, "", ""))
}

func TestServeLoRAAndSaltIsolate(t *testing.T) {
	e := newCacheEngine(t, Options{BlockSize: 2, CapacityBlocks: 16})
	p := seqTokens(0, 6)
	plain := e.BlockHashes(p, "", "")
	lora := e.BlockHashes(p, "ad1", "")
	salted := e.BlockHashes(p, "", "tenant")
	require.NotEqual(t, plain[0], lora[0])
	require.NotEqual(t, plain[0], salted[0])
	require.NotEqual(t, lora[0], salted[0])

	_, err := e.Serve(Request{Tokens: p, LoRAName: "ad1", CacheSalt: "tenant"})
	require.NoError(t, err)
	ev := lastBatch(t, e).events[0]
	require.Equal(t, "ad1", ev["lora_name"])
	require.Equal(t, []any{[]any{"ad1", "tenant"}, []any{"ad1"}, []any{"ad1"}}, ev["extra_keys"])
	require.Equal(t, 3, e.HeldPrefix(p, "ad1", "tenant"))
	require.Equal(t, 0, e.HeldPrefix(p, "", ""))
	require.Equal(t, 0, e.HeldPrefix(p, "ad1", ""))
	require.Equal(t, 0, e.HeldPrefix(p, "", "tenant"))

	// A salted extension: the salt sits on block 0 only, which is not in this run.
	_, err = e.Serve(Request{Tokens: seqTokens(0, 8), CacheSalt: "tenant"})
	require.NoError(t, err)
	_, err = e.Serve(Request{Tokens: seqTokens(0, 10), CacheSalt: "tenant"})
	require.NoError(t, err)
	_, has := lastBatch(t, e).events[0]["extra_keys"]
	require.False(t, has)
}

func TestSeedChangesHashes(t *testing.T) {
	a := newCacheEngine(t, Options{})
	b := newCacheEngine(t, Options{})
	c := newCacheEngine(t, Options{HashSeed: 42})
	p := seqTokens(0, 32)
	require.Equal(t, a.BlockHashes(p, "", ""), b.BlockHashes(p, "", ""))
	require.NotEqual(t, a.BlockHashes(p, "", ""), c.BlockHashes(p, "", ""))
}

// TestServeRandomAgainstEvents drives random requests and checks the invariants
// and that replaying the published events into a plain set reproduces the cache.
func TestServeRandomAgainstEvents(t *testing.T) {
	formats := []Options{
		{Encoding: EncodingMap}, {Encoding: EncodingArray, HashFormat: HashInt64},
		{BatchAsMap: true, HashFormat: HashBytes32, ExtraFields: true},
		{RootParent: RootParentAbsent},
	}
	for _, d := range Dialects() {
		formats = append(formats, d.Apply(Options{}))
	}
	for _, f := range formats {
		f.BlockSize, f.CapacityBlocks, f.ReplayBuffer = 2, 12, 100000
		e := newCacheEngine(t, f)
		rng := rand.New(rand.NewPCG(1, 2))
		held := map[uint64]uint64{} // engine hash -> parent (0 for roots) from events
		applied := 0
		for i := 0; i < 2000; i++ {
			// Prompts share prefixes: a few roots, random lengths.
			root := rng.IntN(4)
			n := rng.IntN(16)
			p := make([]uint32, n)
			for j := range p {
				p[j] = uint32(root*1000 + j)
				if j > 6 && rng.IntN(3) == 0 {
					p[j] += uint32(rng.IntN(3)) * 100
				}
			}
			lora := []string{"", "", "l1"}[rng.IntN(3)]
			_, err := e.Serve(Request{Tokens: p, LoRAName: lora})
			require.NoError(t, err)

			e.mu.Lock()
			for ; applied < e.ring.n; applied++ {
				d := decodeBatch(t, e.ring.at(applied).payload)
				for _, ev := range d.events {
					if g := ev["group_idx"]; g != nil && asInt(t, g) == MirrorGroup {
						continue // HybridGroups' mirror, outside the cache model
					}
					switch ev["type"] {
					case "BlockRemoved":
						for _, h := range asHashes(t, ev["block_hashes"]) {
							_, ok := held[h]
							require.True(t, ok, "removal of a block never stored")
							delete(held, h)
						}
					case "BlockStored":
						parent := uint64(0)
						root := ev["parent_block_hash"] == nil ||
							f.RootParent == RootParentZero && asHash(t, ev["parent_block_hash"]) == 0
						require.Len(t, asTokens(t, ev["token_ids"]), 2*len(asHashes(t, ev["block_hashes"])))
						if !root {
							parent = asHash(t, ev["parent_block_hash"])
							_, ok := held[parent]
							require.True(t, ok, "store with an unknown parent")
						}
						for _, h := range asHashes(t, ev["block_hashes"]) {
							held[h] = parent
							parent = h
						}
					}
				}
			}
			e.mu.Unlock()

			snap := e.Snapshot()
			require.LessOrEqual(t, len(snap), 12)
			require.Len(t, held, len(snap))
			seen := map[uint64]bool{}
			for _, b := range snap {
				_, ok := held[b.Hash]
				require.True(t, ok, "cached block not announced")
				if b.HasParent {
					require.True(t, seen[b.ParentHash], "parent listed before child")
					require.Equal(t, b.ParentHash, held[b.Hash])
				} else {
					require.Zero(t, held[b.Hash])
				}
				seen[b.Hash] = true
			}
			require.Equal(t, min(len(p)/2, 12), e.HeldPrefix(p, lora, ""), "a served prompt is held")
		}
	}
}

func TestTimestampFromClock(t *testing.T) {
	at := time.Unix(1760000000, 500_000_000)
	e := newCacheEngine(t, Options{Now: func() time.Time { return at }, DPRank: 2})
	_, err := e.Serve(Request{Tokens: seqTokens(0, 16)})
	require.NoError(t, err)
	d := lastBatch(t, e)
	require.Equal(t, 1760000000.5, d.ts)
	require.Equal(t, int64(2), asInt(t, d.dp))

	e = newCacheEngine(t, Options{OmitDPRank: true})
	_, err = e.Serve(Request{Tokens: seqTokens(0, 16)})
	require.NoError(t, err)
	require.False(t, lastBatch(t, e).hasDP)
}

func TestResetPrefixCache(t *testing.T) {
	e := newCacheEngine(t, Options{BlockSize: 2})
	_, err := e.Serve(Request{Tokens: seqTokens(0, 8)})
	require.NoError(t, err)
	seq, err := e.ResetPrefixCache()
	require.NoError(t, err)
	require.Equal(t, uint64(1), seq)
	require.Zero(t, e.Blocks())
	d := lastBatch(t, e)
	require.Equal(t, []map[string]any{{"type": "AllBlocksCleared"}}, d.events)
}

func TestReplayRing(t *testing.T) {
	r := replayRing{capacity: 3}
	require.Nil(t, r.since(0))
	for s := uint64(0); s < 5; s++ {
		r.push(replayEntry{seq: s})
	}
	seqs := func(es []replayEntry) []uint64 {
		var out []uint64
		for _, e := range es {
			out = append(out, e.seq)
		}
		return out
	}
	require.Equal(t, []uint64{2, 3, 4}, seqs(r.since(0)))
	require.Equal(t, []uint64{3, 4}, seqs(r.since(3)))
	require.Empty(t, r.since(5))
	r.dropBefore(4)
	require.Equal(t, []uint64{4}, seqs(r.since(0)))
	r.push(replayEntry{seq: 5})
	r.push(replayEntry{seq: 6})
	r.push(replayEntry{seq: 7})
	require.Equal(t, []uint64{5, 6, 7}, seqs(r.since(0)))
	o, n, ok := r.oldestNewest()
	require.True(t, ok)
	require.Equal(t, [2]uint64{5, 7}, [2]uint64{o, n})
	r.clear()
	require.Nil(t, r.since(0))
	r.push(replayEntry{seq: 0})
	require.Equal(t, []uint64{0}, seqs(r.since(0)))

	// Truncating a ring that has not reached its capacity must not shrink it.
	r = replayRing{capacity: 5}
	for s := uint64(0); s < 3; s++ {
		r.push(replayEntry{seq: s})
	}
	r.dropBefore(1)
	for s := uint64(3); s < 8; s++ {
		r.push(replayEntry{seq: s})
	}
	require.Equal(t, []uint64{3, 4, 5, 6, 7}, seqs(r.since(0)))
}

func TestOptionsValidation(t *testing.T) {
	e, err := New(Options{})
	require.NoError(t, err)
	o := e.Options()
	require.Equal(t, DefaultBlockSize, o.BlockSize)
	require.Equal(t, DefaultCapacityBlocks, o.CapacityBlocks)
	require.Equal(t, DefaultTopic, o.Topic)
	require.Equal(t, DefaultReplayBuffer, o.ReplayBuffer)
	require.Equal(t, DefaultBindEndpoint, o.PubEndpoint)
	require.Equal(t, DefaultBindEndpoint, o.ReplayEndpoint)
	require.Equal(t, DefaultHashSeed, o.HashSeed)
	require.NotNil(t, o.Now)

	e, err = New(Options{EmptyTopic: true})
	require.NoError(t, err)
	require.Empty(t, e.Topic())

	_, err = New(Options{
		BlockSize: -1, CapacityBlocks: -2, EmptyTopic: true, Topic: "x", Encoding: 9, HashFormat: 9,
		DPRank: -1, PubMode: PubDial, DialAttempts: -1, DialBackoff: -1, ReplayEndpoint: "nope",
		ReplayLayout: 9, ReplayBuffer: -1,
	})
	require.ErrorIs(t, err, ErrInvalidOptions)
	for _, want := range []string{"BlockSize", "CapacityBlocks", "EmptyTopic", "Encoding", "HashFormat",
		"DPRank", "PubEndpoint", "DialAttempts", "DialBackoff", "ReplayEndpoint", "ReplayLayout", "ReplayBuffer"} {
		require.Contains(t, err.Error(), want)
	}
	_, err = New(Options{PubMode: 7})
	require.ErrorIs(t, err, ErrInvalidOptions)
}

func TestPublishEventsChecks(t *testing.T) {
	e := newCacheEngine(t, Options{})
	_, err := e.PublishEvents(Event{Kind: 0})
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = e.PublishEvents(Event{Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{1}, BlockSize: 2})
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = e.PublishEvents(Event{Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{1}, BlockSize: 1,
		ExtraKeys: [][]string{nil, nil}})
	require.ErrorIs(t, err, ErrInvalidArgument)
	seq, err := e.PublishEvents(Event{Kind: BlockRemoved, BlockHashes: []uint64{12345}})
	require.NoError(t, err)
	require.Zero(t, seq)
	require.Equal(t, []uint64{12345}, asHashes(t, lastBatch(t, e).events[0]["block_hashes"]))
	require.ErrorIs(t, e.SendFrames([]byte("x")), ErrNotStarted)
	require.ErrorIs(t, e.SendFrames(), ErrInvalidArgument)
}

func BenchmarkServe(b *testing.B) {
	e, err := New(Options{CapacityBlocks: 4096, ReplayBuffer: 16})
	require.NoError(b, err)
	prompts := make([][]uint32, 64)
	for i := range prompts {
		prompts[i] = seqTokens(i%8*10000, 512+i*16)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if _, err := e.Serve(Request{Tokens: prompts[i%len(prompts)]}); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

func TestReplayRingRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for round := 0; round < 50; round++ {
		capacity := 1 + rng.IntN(8)
		r := replayRing{capacity: capacity}
		var oracle []uint64
		next := uint64(0)
		for op := 0; op < 200; op++ {
			switch x := rng.IntN(20); {
			case x == 0:
				r.clear()
				oracle, next = nil, 0
			case x < 3:
				before := next - min(next, uint64(rng.IntN(4)))
				r.dropBefore(before)
				for len(oracle) > 0 && oracle[0] < before {
					oracle = oracle[1:]
				}
			default:
				r.push(replayEntry{seq: next})
				oracle = append(oracle, next)
				if len(oracle) > capacity {
					oracle = oracle[1:]
				}
				next++
			}
			var got []uint64
			for _, e := range r.since(0) {
				got = append(got, e.seq)
			}
			if len(oracle) == 0 {
				require.Empty(t, got)
				continue
			}
			require.Equal(t, oracle, got)
			from := oracle[0] + uint64(rng.IntN(len(oracle)+1))
			require.Len(t, r.since(from), len(oracle)-int(from-oracle[0]))
		}
	}
}
