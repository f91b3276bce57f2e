package kvindex_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/tinylib/msgp/msgp"
)

// This file generates the Dynamo-shaped workload of dynamo_bench_test.go: the
// indexer harness NVIDIA Dynamo published for its KV router, rebuilt. Requests
// have the shape of the Mooncake FAST'25 conversation trace (each hash id names
// 512 tokens) and are stretched to 128-token blocks, four per hash id. Sixteen
// mock engines serve them, each with prefix caching in a prefix-closed LRU
// cache of 16,384 blocks, and publish what they store and evict as vLLM
// msgpack batches. The trace is drawn here, not read from a file: its shape
// (below) is what the benchmarks depend on.
const (
	dynBS      = 128    // tokens per index block and per engine block
	dynStretch = 4      // blocks per trace hash id (512 tokens)
	dynWorkers = 16     // mock engines
	dynCache   = 16384  // blocks each engine caches
	dynVocab   = 128256 // token ids are drawn below this (Llama 3)
	dynMaxIDs  = 374    // the longest request of the trace, in hash ids
)

// mooncakeRequests draws n requests as hash-id sequences (ids numbered in order
// of first use) with the shape of the Mooncake conversation trace:
//
//   - 55% start a new prefix. Half of those are one or two ids long; the rest
//     are log-normal around 33 ids (p90 about 53, p99 about 105).
//   - 45% continue an earlier request, the longer of two drawn uniformly (so a
//     prefix is reused about in proportion to the requests already built on
//     it, long ones more): half keep all of it, half drop up to its last
//     quarter, and then 0 to 4 new ids follow (mostly 1).
//   - No request is longer than 374 ids.
//
// Over 4,096 requests that gives 55% that share no prefix, a mean length of
// 30 ids and a mean shared prefix of 41 ids (the published trace: 55%, 30.5
// and 43.7); TestMooncakeShape holds it there.
func mooncakeRequests(n int, r *rand.Rand) [][]uint32 {
	var next uint32
	fresh := func(ids []uint32, k int) []uint32 {
		for range k {
			ids = append(ids, next)
			next++
		}
		return ids
	}
	reqs := make([][]uint32, 0, n)
	for len(reqs) < n {
		var ids []uint32
		if len(reqs) > 0 && r.IntN(100) < 45 {
			prev := reqs[r.IntN(len(reqs))]
			if o := reqs[r.IntN(len(reqs))]; len(o) > len(prev) {
				prev = o
			}
			keep := len(prev)
			if r.IntN(2) == 0 {
				keep -= r.IntN(len(prev)/4 + 1)
			}
			added := 1
			switch p := r.IntN(100); {
			case p < 10:
				added = 0
			case p < 75:
				added = 1
			case p < 90:
				added = 2
			default:
				added = 3 + r.IntN(2)
			}
			keep = max(1, min(keep, dynMaxIDs-added))
			ids = fresh(append(make([]uint32, 0, keep+added), prev[:keep]...), added)
		} else {
			k := 1 + r.IntN(2)
			if r.IntN(2) == 0 {
				k = int(math.Exp(math.Log(33) + 0.56*r.NormFloat64()))
				k = max(3, min(k, dynMaxIDs))
			}
			ids = fresh(make([]uint32, 0, k), k)
		}
		reqs = append(reqs, ids)
	}
	return reqs
}

// mix64 is the SplitMix64 finaliser.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// dynEngineHashes appends the engine hashes of the blocks of ids: chained, so
// a hash names the whole prefix, and equal on every engine (as vLLM's are).
func dynEngineHashes(dst []uint64, ids []uint32) []uint64 {
	h := uint64(0x5eed)
	for _, id := range ids {
		for s := range uint64(dynStretch) {
			h = mix64(h ^ (uint64(id)*dynStretch + s + 1))
			dst = append(dst, h)
		}
	}
	return dst
}

// dynTokens appends the 128 token ids of block b (hash id b/4, quarter b%4).
func dynTokens(dst []uint32, b uint64) []uint32 {
	x := mix64(b + 0x9e3779b97f4a7c15)
	for range dynBS {
		x += 0x9e3779b97f4a7c15
		dst = append(dst, uint32(mix64(x)%dynVocab))
	}
	return dst
}

// dynEngine is a mock engine's prefix cache: an LRU list of blocks. A request
// touches its blocks deepest first, so a parent is always more recent than its
// children and evicting from the cold end never leaves a cached block without
// its parent.
type dynEngine struct {
	blocks map[uint64]*dynEntry
	head   dynEntry // head.next is the most recent block, head.prev the least
}

// dynEntry is one cached block: its engine hash, its parent's (when it has
// one), and its dynTokens id.
type dynEntry struct {
	hash, parent uint64
	hasParent    bool
	id           uint64
	prev, next   *dynEntry
}

func newDynEngine() *dynEngine {
	e := &dynEngine{blocks: make(map[uint64]*dynEntry, dynCache)}
	e.head.prev, e.head.next = &e.head, &e.head
	return e
}

// cached returns how many leading blocks of hs the engine holds.
func (e *dynEngine) cached(hs []uint64) int {
	k := 0
	for k < len(hs) && e.blocks[hs[k]] != nil {
		k++
	}
	return k
}

func (e *dynEngine) front(x *dynEntry) {
	if x.prev != nil {
		x.prev.next, x.next.prev = x.next, x.prev
	}
	x.prev, x.next = &e.head, e.head.next
	e.head.next.prev = x
	e.head.next = x
}

// serve runs a request of hash ids ids, whose blocks have the engine hashes
// hs, on the engine: it keeps the cached prefix, evicts the least recent
// blocks to make room for the rest, and stores the rest. It appends the
// evicted hashes to removed and returns them and the length of the cached
// prefix.
func (e *dynEngine) serve(ids []uint32, hs []uint64, removed []uint64) ([]uint64, int) {
	k := e.cached(hs)
	for i := k - 1; i >= 0; i-- {
		e.front(e.blocks[hs[i]])
	}
	for len(e.blocks)+len(hs)-k > dynCache {
		x := e.head.prev
		x.prev.next, x.next.prev = x.next, x.prev
		delete(e.blocks, x.hash)
		removed = append(removed, x.hash)
	}
	for i := len(hs) - 1; i >= 0; i-- {
		x := e.blocks[hs[i]]
		if x == nil {
			x = &dynEntry{hash: hs[i], id: dynBlockID(ids, i)}
			if i > 0 {
				x.parent, x.hasParent = hs[i-1], true
			}
			e.blocks[hs[i]] = x
		}
		e.front(x)
	}
	return removed, k
}

// contents appends the cached blocks to dst, most recent first, so that every
// block comes after its parent.
func (e *dynEngine) contents(dst []dynEntry) []dynEntry {
	for x := e.head.next; x != &e.head; x = x.next {
		dst = append(dst, dynEntry{hash: x.hash, parent: x.parent, hasParent: x.hasParent, id: x.id})
	}
	return dst
}

// dynStep is what serving one request published: the engine, the blocks it
// evicted, and the blocks it stored (blocks from..len(ids)*4 of the request).
type dynStep struct {
	worker  int
	req     int
	from    int
	removed []uint64
}

// dynRoute serves reqs[from:to] on the engines and appends the steps to
// steps. A request goes to the engine that caches the longest prefix of it; to
// the next engine round robin when none caches any, and for one request in
// four anyway (the load balancing a router mixes into KV-aware routing).
func dynRoute(steps []dynStep, reqs [][]uint32, from, to int, engines []*dynEngine, r *rand.Rand) []dynStep {
	var hs []uint64
	rr := from
	for i := from; i < to; i++ {
		ids := reqs[i]
		hs = dynEngineHashes(hs[:0], ids)
		best, bestK := -1, 0
		for w, e := range engines {
			if k := e.cached(hs); k > bestK {
				best, bestK = w, k
			}
		}
		if best < 0 || r.IntN(4) == 0 {
			best = rr % len(engines)
			rr++
		}
		removed, k := engines[best].serve(ids, hs, nil)
		steps = append(steps, dynStep{worker: best, req: i, from: k, removed: removed})
	}
	return steps
}

// appendDynBatch appends the vLLM batch of step st: [ts, [events]], with a
// BlockRemoved event of the evicted blocks and a BlockStored event of the
// stored ones, each present when non-empty. hs and toks are scratch.
func appendDynBatch(b []byte, st dynStep, ids []uint32, hs []uint64, toks []uint32) ([]byte, []uint64, []uint32) {
	hs = dynEngineHashes(hs[:0], ids)
	n := uint32(0)
	if len(st.removed) > 0 {
		n++
	}
	if st.from < len(hs) {
		n++
	}
	b = msgp.AppendArrayHeader(b, 2)
	b = msgp.AppendFloat64(b, 1760000000.5)
	b = msgp.AppendArrayHeader(b, n)
	if len(st.removed) > 0 {
		b = appendRemoved(b, st.removed)
	}
	if st.from < len(hs) {
		b = msgp.AppendArrayHeader(b, 7)
		b = msgp.AppendString(b, "BlockStored")
		b = msgp.AppendArrayHeader(b, uint32(len(hs)-st.from))
		for _, h := range hs[st.from:] {
			b = msgp.AppendUint64(b, h)
		}
		if st.from > 0 {
			b = msgp.AppendUint64(b, hs[st.from-1])
		} else {
			b = msgp.AppendNil(b)
		}
		toks = toks[:0]
		for i := st.from; i < len(hs); i++ {
			toks = dynTokens(toks, dynBlockID(ids, i))
		}
		b = msgp.AppendArrayHeader(b, uint32(len(toks)))
		for _, t := range toks {
			b = msgp.AppendUint32(b, t)
		}
		b = msgp.AppendInt(b, dynBS)
		b = msgp.AppendNil(b)
		b = msgp.AppendString(b, "GPU")
	}
	return b, hs, toks
}

// appendRemoved appends a BlockRemoved event of hashes on the GPU.
func appendRemoved(b []byte, hashes []uint64) []byte {
	b = msgp.AppendArrayHeader(b, 3)
	b = msgp.AppendString(b, "BlockRemoved")
	b = msgp.AppendArrayHeader(b, uint32(len(hashes)))
	for _, h := range hashes {
		b = msgp.AppendUint64(b, h)
	}
	return msgp.AppendString(b, "GPU")
}

// dynBlockID names block i of a request of ids for dynTokens: its hash id and
// quarter.
func dynBlockID(ids []uint32, i int) uint64 {
	return uint64(ids[i/dynStretch])*dynStretch + uint64(i%dynStretch)
}

// TestMooncakeShape pins the generated trace's shape to the published
// trace's, so a change of the generator cannot move the benchmark silently:
// the share of requests that start a new prefix, the mean length, and the
// mean shared prefix of the others.
func TestMooncakeShape(t *testing.T) {
	reqs := mooncakeRequests(4096, rand.New(rand.NewPCG(25, 33)))
	seen := map[uint32]bool{}
	freshReqs, ids, shared, sharing := 0, 0, 0, 0
	for _, q := range reqs {
		k := 0
		for k < len(q) && seen[q[k]] {
			k++
		}
		if k == 0 {
			freshReqs++
		} else {
			shared += k
			sharing++
		}
		ids += len(q)
		for _, id := range q {
			seen[id] = true
		}
	}
	freshShare := float64(freshReqs) / float64(len(reqs))
	meanLen := float64(ids) / float64(len(reqs))
	meanShared := float64(shared) / float64(sharing)
	t.Logf("new prefixes %.2f, mean length %.1f ids, mean shared prefix %.1f ids", freshShare, meanLen, meanShared)
	if freshShare < 0.5 || freshShare > 0.6 {
		t.Errorf("%.2f of requests start a new prefix, want 0.50-0.60 (trace: 0.55)", freshShare)
	}
	if meanLen < 24 || meanLen > 48 {
		t.Errorf("mean request length %.1f ids, want 24-48 (trace: 30.5)", meanLen)
	}
	if meanShared < 25 || meanShared > 70 {
		t.Errorf("mean shared prefix %.1f ids, want 25-70 (trace: 43.7)", meanShared)
	}
}
