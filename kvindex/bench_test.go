package kvindex

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
)

const (
	benchBS        = 16
	benchWorkers   = 128
	benchGroups    = 64  // shared system prompts
	benchShared    = 128 // blocks of shared system prompt
	benchDepth     = 512 // blocks per sequence and per query
	benchSeqPerWkr = 16  // sequences each worker holds: 128*16*512 = 1,048,576 entries
	benchQueries   = 256
)

// benchFixture is a fleet of 128 worker ranks holding 1M (block, worker) entries:
// each holds 16 sequences of 512 blocks, every sequence a 128-block system prompt
// shared by its group followed by a unique 384-block conversation.
type benchFixture struct {
	ix      *Index
	naive   *naiveIndex
	queries [][]uint64
	// seqs are the sequences the fleet holds, benchSeqPerWkr per worker rank in
	// worker order.
	seqs []benchSeq
}

// benchSeq names one sequence of a benchmark fleet: its system prompt group and
// its conversation (unique in the fleet).
type benchSeq struct{ group, conv int }

var (
	fixtureOnce sync.Once
	fixture     *benchFixture
)

func seqTokens(group, conv int) []uint32 {
	return fillSeqTokens(make([]uint32, benchDepth*benchBS), group, conv)
}

// fillSeqTokens writes the benchDepth*benchBS tokens of sequence conv of group
// into toks and returns it: the group's system prompt, then the conversation.
func fillSeqTokens(toks []uint32, group, conv int) []uint32 {
	toks = toks[:benchDepth*benchBS]
	r := rand.New(rand.NewPCG(uint64(group), 99))
	for i := range benchShared * benchBS {
		toks[i] = uint32(r.IntN(32000))
	}
	r = rand.New(rand.NewPCG(uint64(group), uint64(conv)+1000))
	for i := benchShared * benchBS; i < len(toks); i++ {
		toks[i] = uint32(r.IntN(32000))
	}
	return toks
}

// benchEngineHash is the engine hash the benchmark fleets give block i of
// sequence conv.
func benchEngineHash(conv, i int) uint64 { return uint64(conv)<<20 | uint64(i) + 1 }

func getFixture(b *testing.B) *benchFixture {
	fixtureOnce.Do(func() {
		ix, err := New(Options{BlockSize: benchBS})
		if err != nil {
			panic(err)
		}
		h, _ := NewHasher(benchBS, HashOptions{})
		naive := newNaive()
		r := rand.New(rand.NewPCG(1, 1))
		var all []benchSeq
		for w := range benchWorkers {
			wr := catalog.WorkerRank{WorkerID: fmt.Sprintf("worker-%03d", w)}
			for s := range benchSeqPerWkr {
				hd := benchSeq{group: r.IntN(benchGroups), conv: w*benchSeqPerWkr + s}
				all = append(all, hd)
				toks := seqTokens(hd.group, hd.conv)
				hashes := make([]uint64, benchDepth)
				for i := range hashes {
					hashes[i] = benchEngineHash(hd.conv, i)
				}
				if err := ix.Apply(wr, Event{Kind: EventStored, BlockHashes: hashes, Tokens: toks}); err != nil {
					panic(err)
				}
				naive.add(wr, h.SeqHashes(toks))
			}
		}
		var qs [][]uint64
		for q := range benchQueries {
			var toks []uint32
			switch q % 4 {
			case 0, 1: // a sequence some worker holds in full
				hd := all[r.IntN(len(all))]
				toks = seqTokens(hd.group, hd.conv)
			case 2: // a known system prompt, new conversation
				toks = seqTokens(r.IntN(benchGroups), 1<<30+q)
			default: // nothing shared
				toks = seqTokens(benchGroups+q, q)
			}
			qs = append(qs, h.SeqHashes(toks))
		}
		fixture = &benchFixture{ix: ix, naive: naive, queries: qs, seqs: all}
	})
	return fixture
}

// naiveIndex is the baseline: a map from sequence hash to the set of worker ranks
// holding it, walked block by block with a shrinking candidate set.
type naiveIndex struct {
	m map[uint64]map[catalog.WorkerRank]struct{}
}

func newNaive() *naiveIndex { return &naiveIndex{m: map[uint64]map[catalog.WorkerRank]struct{}{}} }

func (n *naiveIndex) add(w catalog.WorkerRank, seqs []uint64) {
	for _, s := range seqs {
		set := n.m[s]
		if set == nil {
			set = map[catalog.WorkerRank]struct{}{}
			n.m[s] = set
		}
		set[w] = struct{}{}
	}
}

func (n *naiveIndex) findMatches(seqs []uint64) map[catalog.WorkerRank]int {
	out := map[catalog.WorkerRank]int{}
	if len(seqs) == 0 {
		return out
	}
	cand := map[catalog.WorkerRank]struct{}{}
	for w := range n.m[seqs[0]] {
		cand[w] = struct{}{}
	}
	d := 1
	for ; d < len(seqs) && len(cand) > 0; d++ {
		set := n.m[seqs[d]]
		for w := range cand {
			if _, ok := set[w]; !ok {
				delete(cand, w)
				out[w] = d
			}
		}
	}
	for w := range cand {
		out[w] = d
	}
	return out
}

// BenchmarkFindMatches runs the same 256 queries of 512 blocks against the Index
// and the naive map-of-sets baseline over 1M entries and 128 worker ranks. ns/op is
// per query; p50-ns is the median query time.
func BenchmarkFindMatches(b *testing.B) {
	f := getFixture(b)
	benchMatches(b, f.ix, f.naive, f.queries, benchWorkers)
}

// benchMatches checks that ix and naive agree on every query, then times both
// on them, round robin: "index" and "naive" sub-benchmarks, ns/op per query,
// p50-ns and p99-ns its distribution.
func benchMatches(b *testing.B, ix *Index, naive *naiveIndex, queries [][]uint64, workers int) {
	// The two must agree before their speed is compared.
	for _, q := range queries {
		got := ix.FindMatches(q, MatchOptions{})
		want := naive.findMatches(q)
		if len(got) != len(want) {
			b.Fatalf("index found %d worker ranks, baseline %d", len(got), len(want))
		}
		for _, m := range got {
			if want[m.Worker] != m.Device {
				b.Fatalf("%v: index %d, baseline %d", m.Worker, m.Device, want[m.Worker])
			}
		}
	}
	b.Run("index", func(b *testing.B) {
		b.ReportAllocs()
		buf := make([]Match, 0, workers)
		durs := make([]time.Duration, 0, b.N)
		i := 0
		for b.Loop() {
			q := queries[i%len(queries)]
			start := time.Now()
			buf = ix.AppendMatches(buf[:0], q, MatchOptions{})
			durs = append(durs, time.Since(start))
			i++
		}
		reportP50(b, durs)
	})
	b.Run("naive", func(b *testing.B) {
		b.ReportAllocs()
		durs := make([]time.Duration, 0, b.N)
		i := 0
		for b.Loop() {
			q := queries[i%len(queries)]
			start := time.Now()
			_ = naive.findMatches(q)
			durs = append(durs, time.Since(start))
			i++
		}
		reportP50(b, durs)
	})
}

func reportP50(b *testing.B, durs []time.Duration) {
	if len(durs) == 0 {
		return
	}
	slices.Sort(durs)
	b.ReportMetric(float64(durs[len(durs)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(durs[len(durs)*99/100].Nanoseconds()), "p99-ns")
}

// BenchmarkHashPrompt hashes an 8k-token prompt (512 blocks of 16) into a reused
// buffer.
func BenchmarkHashPrompt(b *testing.B) {
	h, _ := NewHasher(16, HashOptions{})
	toks := seqTokens(1, 1)
	buf := make([]uint64, 0, 512)
	b.ReportAllocs()
	b.SetBytes(int64(len(toks) * 4))
	for b.Loop() {
		buf = h.AppendSeqHashes(buf[:0], toks)
	}
}

// BenchmarkApplyStored applies BlockStored events of 16 blocks x 16 tokens that
// extend per-worker chains, removing old runs so the index stays bounded; the
// blocks/s metric counts stored blocks.
func BenchmarkApplyStored(b *testing.B) {
	ix, _ := New(Options{BlockSize: 16})
	r := rand.New(rand.NewPCG(2, 2))
	const runs = 1024
	evs := make([]Event, runs)
	for i := range evs {
		toks := make([]uint32, 16*16)
		for j := range toks {
			toks[j] = uint32(r.IntN(32000))
		}
		hs := make([]uint64, 16)
		for j := range hs {
			hs[j] = uint64(i)<<8 | uint64(j) + 1
		}
		evs[i] = Event{Kind: EventStored, BlockHashes: hs, Tokens: toks}
	}
	workers := make([]catalog.WorkerRank, 8)
	for i := range workers {
		workers[i] = catalog.WorkerRank{WorkerID: fmt.Sprintf("w%d", i)}
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		w := workers[i%len(workers)]
		ev := evs[i%runs]
		if err := ix.Apply(w, ev); err != nil {
			b.Fatal(err)
		}
		if i >= runs {
			old := evs[(i-runs/2)%runs]
			_ = ix.Apply(workers[(i-runs/2)%len(workers)], Event{Kind: EventRemoved, BlockHashes: old.BlockHashes})
		}
		i++
	}
	b.ReportMetric(float64(b.N)*16/b.Elapsed().Seconds(), "blocks/s")
}

// BenchmarkIndexMemory reports the heap bytes per (block, worker rank) entry of the
// 1M-entry fixture, measured from the runtime's heap statistics, next to the
// index's own estimate. Two shapes: the shared-prefix fleet, and the worst case of
// one worker rank per block.
func BenchmarkIndexMemory(b *testing.B) {
	for _, shape := range []string{"fleet", "unshared"} {
		b.Run(shape, func(b *testing.B) {
			for b.Loop() {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				ix, _ := New(Options{BlockSize: benchBS})
				r := rand.New(rand.NewPCG(7, 7))
				for w := range benchWorkers {
					wr := catalog.WorkerRank{WorkerID: fmt.Sprintf("worker-%03d", w)}
					for s := range benchSeqPerWkr {
						group := r.IntN(benchGroups)
						if shape == "unshared" {
							group = benchGroups + w*benchSeqPerWkr + s
						}
						toks := seqTokens(group, w*benchSeqPerWkr+s)
						hs := make([]uint64, benchDepth)
						for i := range hs {
							hs[i] = uint64(w*benchSeqPerWkr+s)<<20 | uint64(i) + 1
						}
						_ = ix.Apply(wr, Event{Kind: EventStored, BlockHashes: hs, Tokens: toks})
					}
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				st := ix.Stats()
				b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(st.Entries), "heap-B/entry")
				b.ReportMetric(float64(st.ApproxBytes)/float64(st.Entries), "est-B/entry")
				b.ReportMetric(float64(st.Entries), "entries")
				runtime.KeepAlive(ix)
			}
		})
	}
}

// BenchmarkBlockHash compares the one-shot block hash with the xxhash package's
// streaming digest on one 16-token block, in the same run.
func BenchmarkBlockHash(b *testing.B) {
	toks := seqTokens(2, 2)[:16]
	b.Run("oneshot", func(b *testing.B) {
		b.ReportAllocs()
		var sink uint64
		for b.Loop() {
			sink += blockHash(1337, toks, 0)
		}
		_ = sink
	})
	b.Run("digest", func(b *testing.B) {
		b.ReportAllocs()
		var sink uint64
		for b.Loop() {
			sink += blockHash(1337, toks, 1) // the extra digest forces the streaming path
		}
		_ = sink
	})
}
