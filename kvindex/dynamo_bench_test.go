package kvindex_test

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"runtime/metrics"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/kvindex/kvevents"
)

// The Dynamo-shaped benchmarks (workload: dynamo_trace_test.go). The trace's
// first dynWarm requests are served by the 16 mock engines and their batches
// applied through a kvevents.IndexHandler, one source per engine; ballast
// worker ranks are applied between them (through Index.Apply: they only fill
// the index) until it holds the target entries. Lookups are the next
// dynQueries requests; writes replay the first dynSegment of those.
const (
	dynRequests = dynWarm + dynQueries
	dynWarm     = 12288
	dynQueries  = 8192
	dynSegment  = 1024

	// A ballast rank holds 128 sequences of 128 blocks: a 16-block system
	// prompt of one of 64 groups, then 112 blocks of its own (16,384
	// entries).
	ballastSeqs   = 128
	ballastPrompt = 16
	ballastTail   = 112
	ballastGroups = 64
	ballastBlocks = ballastGroups*ballastPrompt + ballastSeqs*ballastTail
)

// dynTrace is the generated trace, routed: the requests, the step of each,
// and each engine's cache after the warm-up. Built once per test binary.
type dynTrace struct {
	reqs  [][]uint32
	steps []dynStep
	// batches are the vLLM batches of the steps after the warm-up.
	batches [][]byte
	warmed  [dynWorkers][]dynEntry
	engines []catalog.WorkerRank
}

var (
	dynTraceOnce sync.Once
	dynTr        *dynTrace
	dynFixOnce   [2]sync.Once
	dynFix       [2]*dynFixture
)

func getDynTrace() *dynTrace {
	dynTraceOnce.Do(func() {
		tr := &dynTrace{reqs: mooncakeRequests(dynRequests, rand.New(rand.NewPCG(25, 128)))}
		engines := make([]*dynEngine, dynWorkers)
		for w := range engines {
			engines[w] = newDynEngine()
			tr.engines = append(tr.engines, catalog.WorkerRank{WorkerID: fmt.Sprintf("engine-%02d", w)})
		}
		r := rand.New(rand.NewPCG(16, 16384))
		tr.steps = dynRoute(make([]dynStep, 0, dynRequests), tr.reqs, 0, dynWarm, engines, r)
		for w, e := range engines {
			tr.warmed[w] = e.contents(nil)
		}
		tr.steps = dynRoute(tr.steps, tr.reqs, dynWarm, dynRequests, engines, r)
		var (
			hs   []uint64
			toks []uint32
		)
		for _, st := range tr.steps[dynWarm:] {
			var batch []byte
			batch, hs, toks = appendDynBatch(nil, st, tr.reqs[st.req], hs, toks)
			tr.batches = append(tr.batches, batch)
		}
		dynTr = tr
	})
	return dynTr
}

// dynFixture is the index of the lookup benchmarks at one size.
type dynFixture struct {
	ix      *kvindex.Index
	h       *kvevents.IndexHandler
	queries [][]uint64
	// next is the first query whose request's batch is not applied yet; seq
	// the next sequence number of each engine's source.
	next int
	seq  [dynWorkers]uint64
	// blocks is the mean query length, heapBytes the heap the index (with
	// its handler) holds.
	blocks    float64
	heapBytes int64
}

// ballast applies ballast rank b's sequences to ix through Apply.
type ballast struct {
	ix     *kvindex.Index
	toks   []uint32
	hashes []uint64
}

func (bl *ballast) rank(b int) error {
	w := catalog.WorkerRank{WorkerID: fmt.Sprintf("ballast-%04d", b)}
	stored := [ballastGroups]bool{}
	for s := range ballastSeqs {
		g := (b*ballastSeqs + s*7) % ballastGroups
		promptID := func(i int) uint64 { return 1<<41 + uint64(g*ballastPrompt+i) }
		tailID := func(i int) uint64 { return 1<<42 + uint64((b*ballastSeqs+s)*ballastTail+i) }
		// Engine hashes are the rank's own; a group's prompt has the same
		// ones in both of the rank's sequences of the group, so the second
		// continues the first's. Tokens are shared across ranks.
		hash := func(id uint64) uint64 { return mix64(id ^ uint64(b)<<48) }
		bl.toks, bl.hashes = bl.toks[:0], bl.hashes[:0]
		ev := kvindex.Event{Kind: kvindex.EventStored}
		if stored[g] {
			ev.ParentHash, ev.HasParent = hash(promptID(ballastPrompt-1)), true
		} else {
			for i := range ballastPrompt {
				bl.hashes = append(bl.hashes, hash(promptID(i)))
				bl.toks = dynTokens(bl.toks, promptID(i))
			}
			stored[g] = true
		}
		for i := range ballastTail {
			bl.hashes = append(bl.hashes, hash(tailID(i)))
			bl.toks = dynTokens(bl.toks, tailID(i))
		}
		ev.BlockHashes, ev.Tokens = bl.hashes, bl.toks
		if err := bl.ix.Apply(w, ev); err != nil {
			return err
		}
	}
	return nil
}

// newDynIndex returns an index of blocks of 128 tokens holding the trace's
// warm-up (through h, when replay is set) and ballast ranks until it holds
// about target entries (the 16 engines hold up to 262,144).
func newDynIndex(tb testing.TB, target int, replay bool) (*kvindex.Index, *kvevents.IndexHandler, [dynWorkers]uint64) {
	tr := getDynTrace()
	ix, err := kvindex.New(kvindex.Options{BlockSize: dynBS})
	if err != nil {
		tb.Fatal(err)
	}
	h, err := kvevents.NewIndexHandler(ix, kvevents.HandlerOptions{BlockSize: dynBS})
	if err != nil {
		tb.Fatal(err)
	}
	ranks := max(0, (target-dynWorkers*dynCache+ballastBlocks-1)/ballastBlocks)
	bl := &ballast{ix: ix}
	var (
		buf  []byte
		hs   []uint64
		toks []uint32
		seq  [dynWorkers]uint64
	)
	done := 0
	for i := range dynWarm {
		if replay {
			st := tr.steps[i]
			buf, hs, toks = appendDynBatch(buf[:0], st, tr.reqs[st.req], hs, toks)
			h.HandleBatch(tr.engines[st.worker], seq[st.worker], buf)
			seq[st.worker]++
		}
		for ; done < (i+1)*ranks/dynWarm; done++ {
			if err := bl.rank(done); err != nil {
				tb.Fatal(err)
			}
		}
	}
	for _, w := range tr.engines {
		if st := h.Stats(w); st.SkippedTotal() != 0 || st.DecodeErrors != 0 {
			tb.Fatalf("%s: %+v", w, st)
		}
	}
	return ix, h, seq
}

func getDynFixture(b *testing.B, i, target int) *dynFixture {
	dynFixOnce[i].Do(func() {
		tr := getDynTrace()
		before := heapNowExt()
		ix, h, seq := newDynIndex(b, target, true)
		f := &dynFixture{ix: ix, h: h, seq: seq, heapBytes: heapNowExt() - before}
		hasher, err := kvindex.NewHasher(dynBS, kvindex.HashOptions{})
		if err != nil {
			b.Fatal(err)
		}
		var toks []uint32
		total := 0
		for _, ids := range tr.reqs[dynWarm:] {
			toks = toks[:0]
			for k := range len(ids) * dynStretch {
				toks = dynTokens(toks, dynBlockID(ids, k))
			}
			q := hasher.SeqHashes(toks)
			f.queries = append(f.queries, q)
			total += len(q)
		}
		f.blocks = float64(total) / float64(len(f.queries))
		dynFix[i] = f
	})
	return dynFix[i]
}

// heapNowExt returns the live heap after a full collection.
func heapNowExt() int64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// BenchmarkDynamoFindMatches looks up the Dynamo-shaped trace's requests
// after its warm-up in an index of 1M and of 8M entries, in two ways:
//
//   - static: the lookups alone, over and over, on the index as the warm-up
//     left it. ns/op is per lookup.
//   - replay: as a router meets them, each request's lookup followed by its
//     engine's batch (decoded and applied), while the trace lasts (8,192
//     requests: run it with -benchtime 8192x; further lookups repeat the
//     trace's without batches). ns/op counts the batches too; lookup-ns is
//     the mean lookup.
//
// p50-ns and p99-ns are the lookups' distribution, blocks the mean request
// length, matched the mean longest device match, heap-B/entry the heap the
// index (and its handler) held after the warm-up. Every run starts from the
// warm-up's caches: one after a replay puts the engines back first, so that
// with -count each replay run replays the trace.
func BenchmarkDynamoFindMatches(b *testing.B) {
	for i, target := range []int{1 << 20, 8 << 20} {
		for _, mode := range []string{"static", "replay"} {
			b.Run(fmt.Sprintf("entries=%dM/%s", target>>20, mode), func(b *testing.B) {
				f := getDynFixture(b, i, target)
				benchDynLookups(b, f, mode == "replay")
			})
		}
	}
}

func benchDynLookups(b *testing.B, f *dynFixture, replay bool) {
	tr := getDynTrace()
	if f.next > 0 {
		// An earlier run (-count) replayed the trace: back to the
		// warm-up's caches.
		resetDynEngines(b, f.ix, tr)
		f.next = 0
	}
	st := f.ix.Stats()
	buf := make([]kvindex.Match, 0, st.WorkerRanks)
	matched := 0
	if !replay {
		for _, q := range f.queries {
			best := 0
			for _, m := range f.ix.AppendMatches(buf[:0], q, kvindex.MatchOptions{}) {
				best = max(best, m.Device)
			}
			matched += best
		}
	}
	const ring = 1 << 20
	durs := make([]time.Duration, ring)
	var lookup time.Duration
	b.ReportAllocs()
	n, first := 0, f.next
	for b.Loop() {
		k := (first + n) % len(f.queries)
		start := time.Now()
		buf = f.ix.AppendMatches(buf[:0], f.queries[k], kvindex.MatchOptions{})
		d := time.Since(start)
		durs[n%ring] = d
		lookup += d
		n++
		if replay && f.next < len(f.queries) {
			best := 0
			for _, m := range buf {
				best = max(best, m.Device)
			}
			matched += best
			step := tr.steps[dynWarm+f.next]
			f.h.HandleBatch(tr.engines[step.worker], f.seq[step.worker], tr.batches[f.next])
			f.seq[step.worker]++
			f.next++
		}
	}
	durs = durs[:min(n, ring)]
	slices.Sort(durs)
	b.ReportMetric(float64(durs[len(durs)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(durs[len(durs)*99/100].Nanoseconds()), "p99-ns")
	b.ReportMetric(float64(lookup.Nanoseconds())/float64(n), "lookup-ns")
	b.ReportMetric(f.blocks, "blocks")
	if replay {
		b.ReportMetric(float64(matched)/float64(max(1, f.next-first)), "matched")
	} else {
		b.ReportMetric(float64(matched)/float64(len(f.queries)), "matched")
	}
	b.ReportMetric(float64(st.Entries), "entries")
	b.ReportMetric(float64(f.heapBytes)/float64(st.Entries), "heap-B/entry")
}

// BenchmarkDynamoApplySources replays the write segment of the Dynamo-shaped
// trace (the 1,024 requests after the warm-up: their vLLM batches, decoded and
// applied through one IndexHandler) into an index of 1M entries, from one
// goroutine on one core (GOMAXPROCS=1) and then from two on two (engines 0-7
// and 8-15, each in trace order), on the same state: before each replay the
// 16 engines are reset to their caches after the warm-up. blocks/s-1 and
// blocks/s-2 count stored blocks per second of replay; speedup is the median
// over the operations of the ratio of the two replay times (the cores may be
// shared: the median keeps a neighbour's burst out). cpu-2/1 is the median
// ratio of the process CPU time the two replays took (1 when two sources
// waste nothing on each other), lock-wait-% the share of the two goroutines'
// time spent blocked on a mutex (the index's: the replay takes no other); on
// a busy machine, where speedup is capped by the cores the neighbours leave,
// those two tell what the index costs. speedup-apart is the same two halves
// replayed into two separate indexes of the same state, sharing nothing:
// how far this machine scales this work (its cores, caches and memory
// bandwidth), and of-apart is speedup over it, what sharing one index
// costs. Build with -race off. ns/op counts the resets too; read the
// metrics.
func BenchmarkDynamoApplySources(b *testing.B) {
	tr := getDynTrace()
	ix, h, _ := newDynIndex(b, 1<<20, false)
	ix2, h2, _ := newDynIndex(b, 1<<20, false) // the apart replay's second index
	seg, payloads := tr.steps[dynWarm:dynWarm+dynSegment], tr.batches[:dynSegment]
	stored := 0
	for _, st := range seg {
		stored += len(tr.reqs[st.req])*dynStretch - st.from
	}
	var seq, seq2 [dynWorkers]uint64 // the next batch of each engine, by handler
	reset := func(ix *kvindex.Index) { resetDynEngines(b, ix, tr) }
	replay := func(h *kvevents.IndexHandler, seq *[dynWorkers]uint64, part func(w int) bool) {
		for i, st := range seg {
			if part(st.worker) {
				h.HandleBatch(tr.engines[st.worker], seq[st.worker], payloads[i])
				seq[st.worker]++
			}
		}
	}
	all := func(int) bool { return true }
	first, second := func(w int) bool { return w < dynWorkers/2 }, func(w int) bool { return w >= dynWorkers/2 }
	var (
		one, two      time.Duration
		ratios, apart []float64
		cpus          []float64
		wait          float64
	)
	procs := runtime.GOMAXPROCS(0)
	defer runtime.GOMAXPROCS(procs)
	for b.Loop() {
		reset(ix)
		runtime.GOMAXPROCS(1)
		c0, start := cpuTime(), time.Now()
		replay(h, &seq, all)
		d1, c1 := time.Since(start), cpuTime()-c0
		runtime.GOMAXPROCS(max(2, procs))

		reset(ix)
		var wg sync.WaitGroup
		w0, c0 := mutexWait(), cpuTime()
		start = time.Now()
		wg.Go(func() { replay(h, &seq, first) })
		wg.Go(func() { replay(h, &seq, second) })
		wg.Wait()
		d2, c2 := time.Since(start), cpuTime()-c0
		wait += mutexWait() - w0

		reset(ix)
		reset(ix2)
		start = time.Now()
		wg.Go(func() { replay(h, &seq, first) })
		wg.Go(func() { replay(h2, &seq2, second) })
		wg.Wait()
		apart = append(apart, d1.Seconds()/time.Since(start).Seconds())
		one, two = one+d1, two+d2
		ratios = append(ratios, d1.Seconds()/d2.Seconds())
		cpu := 0.0 // where the platform does not tell cpuTime
		if c1 > 0 {
			cpu = c2 / c1
		}
		cpus = append(cpus, cpu)
	}
	for _, w := range tr.engines {
		for _, h := range []*kvevents.IndexHandler{h, h2} {
			if st := h.Stats(w); st.SkippedTotal() != 0 || st.DecodeErrors != 0 {
				b.Fatalf("%s: %+v", w, st)
			}
		}
	}
	runs := float64(b.N)
	b.ReportMetric(float64(stored)*runs/one.Seconds(), "blocks/s-1")
	b.ReportMetric(float64(stored)*runs/two.Seconds(), "blocks/s-2")
	slices.Sort(ratios)
	b.ReportMetric(ratios[len(ratios)/2], "speedup")
	slices.Sort(apart)
	b.ReportMetric(apart[len(apart)/2], "speedup-apart")
	b.ReportMetric(ratios[len(ratios)/2]/apart[len(apart)/2], "of-apart")
	slices.Sort(cpus)
	if cpus[0] > 0 {
		b.ReportMetric(cpus[len(cpus)/2], "cpu-2/1")
	}
	b.ReportMetric(100*wait/(2*two.Seconds()), "lock-wait-%")
}

// resetDynEngines puts the 16 engines' ranks of ix back to their caches
// after the warm-up (the ballast ranks are never replayed).
func resetDynEngines(tb testing.TB, ix *kvindex.Index, tr *dynTrace) {
	var toks []uint32
	for w, rank := range tr.engines {
		ix.ClearRank(rank)
		for _, e := range tr.warmed[w] {
			toks = dynTokens(toks[:0], e.id)
			ev := kvindex.Event{Kind: kvindex.EventStored, BlockHashes: []uint64{e.hash},
				ParentHash: e.parent, HasParent: e.hasParent, Tokens: toks}
			if err := ix.Apply(rank, ev); err != nil {
				tb.Fatal(err)
			}
		}
	}
}

// mutexWait returns the seconds goroutines have spent blocked on sync.Mutex
// and sync.RWMutex so far.
func mutexWait() float64 {
	s := []metrics.Sample{{Name: "/sync/mutex/wait/total:seconds"}}
	metrics.Read(s)
	return s[0].Value.Float64()
}

// BenchmarkDynamoLookupsUnderFeed looks up the Dynamo-shaped trace's
// requests in the 1M-entry index while one goroutine replays the write
// segment (BenchmarkDynamoApplySources's, 16 engines' batches in trace order)
// through a handler: as an EPP's request path meets its engines' feeds. Run
// it with -cpu 2: one core for the lookups, one for the feed.
//
//   - feed=shared: the feed applies into the index the lookups read, so a
//     lookup may wait for an event's tree part.
//   - feed=apart: the feed applies into a separate index of the same state,
//     so the machine is as busy and nothing is shared: the baseline.
//
// Each operation resets the feed's engines to the warm-up's caches and
// replays the segment once, looking up meanwhile. p50-ns, p99-ns and
// p999-ns are the lookups' distribution over every operation, lookups/op
// how many ran beside one replay. ns/op, B/op and allocs/op count the resets
// and the feed too (the lookups append into one reused buffer and allocate
// nothing: BenchmarkDynamoFindMatches reports them alone).
func BenchmarkDynamoLookupsUnderFeed(b *testing.B) {
	tr := getDynTrace()
	f := getDynFixture(b, 0, 1<<20)
	for _, mode := range []string{"shared", "apart"} {
		b.Run("feed="+mode, func(b *testing.B) {
			ix, h := f.ix, f.h
			if mode == "apart" {
				ix, h, _ = newDynIndex(b, 1<<20, false)
			}
			var seq [dynWorkers]uint64 // continues f's: one handler, one numbering
			if mode == "shared" {
				seq = f.seq
			}
			seg := tr.steps[dynWarm : dynWarm+dynSegment]
			buf := make([]kvindex.Match, 0, 64)
			durs := make([]time.Duration, 0, 1<<20)
			runs := 0
			b.ReportAllocs()
			for b.Loop() {
				resetDynEngines(b, ix, tr)
				var (
					done atomic.Bool
					wg   sync.WaitGroup
				)
				wg.Go(func() {
					for i, st := range seg {
						h.HandleBatch(tr.engines[st.worker], seq[st.worker], tr.batches[i])
						seq[st.worker]++
					}
					done.Store(true)
				})
				for k := 0; !done.Load(); k++ {
					start := time.Now()
					buf = f.ix.AppendMatches(buf[:0], f.queries[k%len(f.queries)], kvindex.MatchOptions{})
					durs = append(durs, time.Since(start))
				}
				wg.Wait()
				runs++
			}
			if mode == "shared" {
				// The fixture's engines are past the segment now: the
				// replay benchmark resets them first.
				f.seq, f.next = seq, dynSegment
			}
			slices.Sort(durs)
			b.ReportMetric(float64(durs[len(durs)/2].Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(durs[len(durs)*99/100].Nanoseconds()), "p99-ns")
			b.ReportMetric(float64(durs[len(durs)*999/1000].Nanoseconds()), "p999-ns")
			b.ReportMetric(float64(len(durs))/float64(runs), "lookups/op")
		})
	}
}
