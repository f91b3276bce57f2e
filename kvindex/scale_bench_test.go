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

// The scale fleet is the benchmark fleet of bench_test.go with 8x the worker
// ranks: 1,024 of them, each holding 16 sequences of 512 blocks (a 128-block
// system prompt of one of 64 groups, then a unique 384-block conversation), so
// 8,388,608 (block, worker rank) entries over about 6.3M nodes. It is built
// once per test binary, through Apply, and shared by the Scale benchmarks;
// those that change it put it back as it was.
const (
	scaleWorkers   = 1024
	scaleSeqPerWkr = 16
	scaleQueries   = 256
)

type scaleFixture struct {
	ix      *Index
	workers []catalog.WorkerRank
	seqs    []benchSeq // scaleSeqPerWkr per worker rank, in worker order
	queries [][]uint64
	// build is the wall time of the index's build (generating the tokens and
	// applying them), genTime the part of it that generates the tokens
	// (measured alone beforehand), heapBytes the heap the index holds.
	build     time.Duration
	genTime   time.Duration
	heapBytes int64
}

var (
	scaleOnce       sync.Once
	scale           *scaleFixture
	fleet32Once     sync.Once
	fleet32         *scaleFixture
	scaleNaiveOnce  sync.Once
	scaleNaive      *naiveIndex
	scaleNaiveBytes int64
)

// heapNow returns the live heap after a full collection.
func heapNow() int64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// applySeq stores sequence sq of worker rank w in ix as one stored run of
// benchDepth blocks; toks and hashes are scratch buffers.
func applySeq(ix *Index, w catalog.WorkerRank, sq benchSeq, toks []uint32, hashes []uint64) error {
	for i := range hashes {
		hashes[i] = benchEngineHash(sq.conv, i)
	}
	return ix.Apply(w, Event{Kind: EventStored, BlockHashes: hashes, Tokens: fillSeqTokens(toks, sq.group, sq.conv)})
}

func getScale() *scaleFixture {
	scaleOnce.Do(func() { scale = buildScale(scaleWorkers) })
	return scale
}

// buildScale builds a scale fleet of workers worker ranks (scaleSeqPerWkr
// sequences each, so 8,192 entries a rank) and its queries.
func buildScale(workers int) *scaleFixture {
	f := &scaleFixture{}
	r := rand.New(rand.NewPCG(3, 3))
	for w := range workers {
		f.workers = append(f.workers, catalog.WorkerRank{WorkerID: fmt.Sprintf("worker-%04d", w)})
		for s := range scaleSeqPerWkr {
			f.seqs = append(f.seqs, benchSeq{group: r.IntN(benchGroups), conv: w*scaleSeqPerWkr + s})
		}
	}
	toks := make([]uint32, benchDepth*benchBS)
	hashes := make([]uint64, benchDepth)
	// Token generation alone, to tell it apart from the build below.
	start := time.Now()
	for _, sq := range f.seqs {
		fillSeqTokens(toks, sq.group, sq.conv)
	}
	f.genTime = time.Since(start)

	before := heapNow()
	ix, err := New(Options{BlockSize: benchBS})
	if err != nil {
		panic(err)
	}
	start = time.Now()
	for i, sq := range f.seqs {
		if err := applySeq(ix, f.workers[i/scaleSeqPerWkr], sq, toks, hashes); err != nil {
			panic(err)
		}
	}
	f.build = time.Since(start)
	f.heapBytes = heapNow() - before
	f.ix = ix

	h, _ := NewHasher(benchBS, HashOptions{})
	for q := range scaleQueries {
		var sq benchSeq
		switch q % 4 {
		case 0, 1: // a sequence some worker rank holds in full
			sq = f.seqs[r.IntN(len(f.seqs))]
		case 2: // a known system prompt, new conversation
			sq = benchSeq{group: r.IntN(benchGroups), conv: 1<<30 + q}
		default: // nothing shared
			sq = benchSeq{group: benchGroups + q, conv: q}
		}
		f.queries = append(f.queries, h.SeqHashes(seqTokens(sq.group, sq.conv)))
	}
	return f
}

// getScaleNaive builds the naive baseline of the scale fleet (about 1.5 GB),
// separately from the index so the benchmarks that do not compare with it do
// not pay for it.
func getScaleNaive() *naiveIndex {
	f := getScale()
	scaleNaiveOnce.Do(func() {
		before := heapNow()
		n := newNaive()
		h, _ := NewHasher(benchBS, HashOptions{})
		toks := make([]uint32, benchDepth*benchBS)
		seqs := make([]uint64, 0, benchDepth)
		for i, sq := range f.seqs {
			seqs = h.AppendSeqHashes(seqs[:0], fillSeqTokens(toks, sq.group, sq.conv))
			n.add(f.workers[i/scaleSeqPerWkr], seqs)
		}
		scaleNaiveBytes = heapNow() - before
		scaleNaive = n
	})
	return scaleNaive
}

// BenchmarkScaleFindMatches is BenchmarkFindMatches on the scale fleet: 256
// queries of 512 blocks, 1,024 worker ranks, 8M entries, against the same naive
// map-of-sets baseline.
func BenchmarkScaleFindMatches(b *testing.B) {
	f := getScale()
	benchMatches(b, f.ix, getScaleNaive(), f.queries, scaleWorkers)
}

// BenchmarkFleetFindMatches runs the scale fleet's queries on the scale
// fleet (8M entries, 1,024 worker ranks) and on one four times its size (32M
// entries, 4,096 worker ranks, about 2 GB, built on first use in about four
// times the scale fleet's build-s), with no baseline: the 32M fleet is where
// every block of a shared system prompt has holders in about a thousand
// worker ranks. ns/op is per query; p50-ns and p99-ns its distribution,
// heap-B/entry the heap per entry measured around the build.
func BenchmarkFleetFindMatches(b *testing.B) {
	for _, c := range []struct {
		name string
		get  func() *scaleFixture
	}{
		{"entries=8M/ranks=1024", getScale},
		{"entries=32M/ranks=4096", func() *scaleFixture {
			fleet32Once.Do(func() { fleet32 = buildScale(4 * scaleWorkers) })
			return fleet32
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			f := c.get()
			st := f.ix.Stats()
			buf := make([]Match, 0, st.WorkerRanks)
			const ring = 1 << 20
			durs := make([]time.Duration, ring)
			b.ReportAllocs()
			n, matches := 0, 0
			for b.Loop() {
				q := f.queries[n%len(f.queries)]
				start := time.Now()
				buf = f.ix.AppendMatches(buf[:0], q, MatchOptions{})
				durs[n%ring] = time.Since(start)
				matches += len(buf)
				n++
			}
			b.ReportMetric(float64(matches)/float64(n), "matches")
			durs = durs[:min(n, ring)]
			slices.Sort(durs)
			b.ReportMetric(float64(durs[len(durs)/2].Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(durs[len(durs)*99/100].Nanoseconds()), "p99-ns")
			b.ReportMetric(float64(f.heapBytes)/float64(st.Entries), "heap-B/entry")
			b.ReportMetric(float64(st.Entries), "entries")
			b.ReportMetric(f.build.Seconds(), "build-s")
		})
	}
}

// BenchmarkScaleMemory reports the heap per (block, worker rank) entry of the
// scale fleet, measured from the runtime's heap statistics around its build:
// "index" for the Index (with its own estimate, and the build time), "naive"
// for the baseline's map of sets.
func BenchmarkScaleMemory(b *testing.B) {
	f := getScale()
	entries := float64(f.ix.Stats().Entries)
	b.Run("index", func(b *testing.B) {
		for b.Loop() {
		}
		b.ReportMetric(float64(f.heapBytes)/entries, "heap-B/entry")
		b.ReportMetric(float64(f.ix.Stats().ApproxBytes)/entries, "est-B/entry")
		b.ReportMetric(entries, "entries")
		b.ReportMetric(f.build.Seconds(), "build-s")
		b.ReportMetric(entries/(f.build-f.genTime).Seconds(), "blocks/s")
		b.ReportMetric(f.genTime.Seconds(), "tokens-s")
	})
	b.Run("naive", func(b *testing.B) {
		getScaleNaive()
		for b.Loop() {
		}
		b.ReportMetric(float64(scaleNaiveBytes)/entries, "heap-B/entry")
	})
}

// BenchmarkScaleRemoveWorker removes one worker rank holding 8,192 blocks (16
// sequences of 512), then stores them again with the timer stopped, round
// robin over the fleet's worker ranks: on the 1M-entry fleet of 128 worker
// ranks and on the 8M-entry scale fleet of 1,024. The per-worker work is the
// same; the two figures differ only by what the fleet's size costs.
func BenchmarkScaleRemoveWorker(b *testing.B) {
	type fleet struct {
		ix      *Index
		workers []catalog.WorkerRank
		seqs    []benchSeq
		perWkr  int
	}
	small := func() fleet {
		f := getFixture(b)
		ws := make([]catalog.WorkerRank, benchWorkers)
		for w := range ws {
			ws[w] = catalog.WorkerRank{WorkerID: fmt.Sprintf("worker-%03d", w)}
		}
		return fleet{f.ix, ws, f.seqs, benchSeqPerWkr}
	}
	big := func() fleet {
		f := getScale()
		return fleet{f.ix, f.workers, f.seqs, scaleSeqPerWkr}
	}
	for _, c := range []struct {
		name string
		get  func() fleet
	}{{"entries=1M", small}, {"entries=8M", big}} {
		b.Run(c.name, func(b *testing.B) {
			f := c.get()
			toks := make([]uint32, benchDepth*benchBS)
			hashes := make([]uint64, benchDepth)
			entries := f.ix.Stats().Entries
			durs := make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				k := i % len(f.workers)
				start := time.Now()
				if f.ix.RemoveWorker(f.workers[k].WorkerID) != 1 {
					b.Fatalf("%s not removed", f.workers[k])
				}
				durs = append(durs, time.Since(start))
				b.StopTimer()
				for _, sq := range f.seqs[k*f.perWkr : (k+1)*f.perWkr] {
					if err := applySeq(f.ix, f.workers[k], sq, toks, hashes); err != nil {
						b.Fatal(err)
					}
				}
				b.StartTimer()
			}
			b.StopTimer()
			if got := f.ix.Stats().Entries; got != entries {
				b.Fatalf("%d entries after the benchmark, %d before", got, entries)
			}
			reportP50(b, durs)
		})
	}
}
