package reservation

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/kvselect/kvselect/catalog"
)

// benchLedger returns a ledger with nWorkers worker ranks, each holding perWorker
// bookings of 128 hashes. Every booking shares a per-group prefix of 64 blocks
// (eight groups across the workers) and has 64 blocks of its own, so requests
// overlap some workers and not others, as they do in production.
func benchLedger(b *testing.B, nWorkers, perWorker int) (*Ledger, []catalog.WorkerRank) {
	return benchLedgerShared(b, nWorkers, perWorker, 8)
}

// benchLedgerShared is benchLedger with the 64-block prefixes spread over groups
// groups; with one group every booking on every worker shares them (a system
// prompt common to all traffic).
func benchLedgerShared(b *testing.B, nWorkers, perWorker, groups int) (*Ledger, []catalog.WorkerRank) {
	b.Helper()
	l, err := New(Options{Now: newFakeClock().Now})
	if err != nil {
		b.Fatal(err)
	}
	workers := make([]catalog.WorkerRank, nWorkers)
	next := uint64(1 << 32)
	for i := range workers {
		workers[i] = catalog.WorkerRank{WorkerID: fmt.Sprintf("pod-%03d", i)}
		for j := range perWorker {
			seqs := make([]uint64, 128)
			for k := range 64 {
				seqs[k] = uint64((3+i%groups)*1000 + k)
			}
			for k := 64; k < 128; k++ {
				seqs[k] = next
				next++
			}
			err := l.Book(Booking{ID: ID(fmt.Sprintf("bg-%d-%d", i, j)), Worker: workers[i], SeqHashes: seqs, PrefillTokens: 512})
			if err != nil {
				b.Fatal(err)
			}
		}
	}
	return l, workers
}

// request returns 128 hashes whose first 64 are the prefix of the bookings of
// group 0 (worker ranks 0, 8, 16, ... with eight groups, every worker rank with
// one) and whose last 64 no booking has.
func request() []uint64 {
	seqs := make([]uint64, 128)
	for k := range seqs {
		seqs[k] = uint64(3*1000 + k)
	}
	return seqs
}

func BenchmarkBookFree(b *testing.B) {
	for _, bc := range []struct {
		name              string
		workers, bookings int
		groups            int
		private           bool // book the request's 128 blocks as PrivateBlocks, no hashes
	}{
		{"empty", 1, 0, 8, false},
		{"64workers", 64, 4, 8, false},
		{"512workers/prefix-on-all", 512, 4, 1, false},
		{"64workers/private", 64, 4, 8, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			l, workers := benchLedgerShared(b, bc.workers, bc.bookings, bc.groups)
			seqs, private := request(), 0
			if bc.private {
				seqs, private = nil, len(seqs)
			}
			ids := make([]string, 1024)
			for i := range ids {
				ids[i] = fmt.Sprint("req-", i)
			}
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				id := ids[i%len(ids)]
				if err := l.Book(Booking{ID: ID(id), Worker: workers[i%len(workers)], SeqHashes: seqs, PrivateBlocks: private, PrefillTokens: 2048}); err != nil {
					b.Fatal(err)
				}
				if err := l.Free(ID(id)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkBookFreeFresh is BenchmarkBookFree/64workers with a request whose
// last 64 hashes no booking ever had (a prompt never seen again), so every
// booking inserts them into the block index and the sweeps remove them: the
// cost when idle entries are never re-activated.
func BenchmarkBookFreeFresh(b *testing.B) {
	l, workers := benchLedger(b, 64, 4)
	seqs := request()
	next := uint64(1 << 48)
	ids := make([]string, 1024)
	for i := range ids {
		ids[i] = fmt.Sprint("req-", i)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		for k := 64; k < len(seqs); k++ {
			seqs[k] = next
			next++
		}
		id := ids[i%len(ids)]
		if err := l.Book(Booking{ID: ID(id), Worker: workers[i%len(workers)], SeqHashes: seqs, PrefillTokens: 2048}); err != nil {
			b.Fatal(err)
		}
		if err := l.Free(ID(id)); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkAppendLoads(b *testing.B) {
	for _, n := range []int{8, 64, 512} {
		b.Run(fmt.Sprintf("%dworkers", n), func(b *testing.B) {
			l, workers := benchLedger(b, n, 4)
			seqs := request()
			dst := make([]CandidateLoad, 0, n)
			b.ReportAllocs()
			for b.Loop() {
				dst = l.AppendLoads(dst[:0], workers, seqs)
			}
			if dst[0].NewBlocks != 64 || dst[1].NewBlocks != 128 {
				b.Fatalf("new blocks %d and %d, want 64 and 128", dst[0].NewBlocks, dst[1].NewBlocks)
			}
		})
	}
	// resolved: AppendRankLoads on handles from AppendRanks, as the selection
	// service calls it (no lookup by name per candidate).
	b.Run("64workers/resolved", func(b *testing.B) {
		l, workers := benchLedger(b, 64, 4)
		ranks := l.AppendRanks(nil, workers)
		seqs := request()
		dst := make([]CandidateLoad, 0, len(ranks))
		b.ReportAllocs()
		for b.Loop() {
			dst = l.AppendRankLoads(dst[:0], ranks, seqs)
		}
		if dst[0].NewBlocks != 64 || dst[1].NewBlocks != 128 {
			b.Fatalf("new blocks %d and %d, want 64 and 128", dst[0].NewBlocks, dst[1].NewBlocks)
		}
	})
	b.Run("512workers/prefix-on-all", func(b *testing.B) {
		l, workers := benchLedgerShared(b, 512, 4, 1)
		seqs := request()
		dst := make([]CandidateLoad, 0, len(workers))
		b.ReportAllocs()
		for b.Loop() {
			dst = l.AppendLoads(dst[:0], workers, seqs)
		}
		if dst[0].NewBlocks != 64 || dst[511].NewBlocks != 64 {
			b.Fatalf("new blocks %d and %d, want 64", dst[0].NewBlocks, dst[511].NewBlocks)
		}
	})
}

// BenchmarkNaiveNewBlocks is the baseline AppendLoads replaces, on the
// BenchmarkAppendLoads/64workers ledger: a map of active hashes per worker and
// one lookup per (worker, hash).
func BenchmarkNaiveNewBlocks(b *testing.B) {
	const n = 64
	sets := make([]map[uint64]int32, n)
	for i := range sets {
		sets[i] = map[uint64]int32{}
		for j := range 4 {
			for k := range 64 {
				sets[i][uint64((3+i%8)*1000+k)]++
			}
			for k := range 64 {
				sets[i][uint64(i*1_000_000+j*1000+k)+1<<32]++
			}
		}
	}
	seqs := request()
	b.ReportAllocs()
	total := 0
	for b.Loop() {
		for _, s := range sets {
			for _, h := range seqs {
				if _, ok := s[h]; !ok {
					total++
				}
			}
		}
	}
	_ = total
}

func BenchmarkBookFreeParallel(b *testing.B) {
	l, workers := benchLedger(b, 64, 4)
	seqs := request()
	var g atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		me := g.Add(1)
		ids := make([]string, 64)
		for i := range ids {
			ids[i] = fmt.Sprintf("p%d-%d", me, i)
		}
		for i := 0; pb.Next(); i++ {
			id := ids[i%len(ids)]
			if err := l.Book(Booking{ID: ID(id), Worker: workers[i%len(workers)], SeqHashes: seqs, PrefillTokens: 2048}); err != nil {
				b.Fatal(err)
			}
			if err := l.Free(ID(id)); err != nil {
				b.Fatal(err)
			}
		}
	})
}
