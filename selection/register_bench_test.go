package selection

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
)

// registerWorkers returns n complete one-rank workers on distinct private
// endpoints, the shape discovery hands the service.
func registerWorkers(n int) []catalog.Worker {
	ws := make([]catalog.Worker, n)
	for i := range ws {
		ws[i] = catalog.Worker{
			ID:       fmt.Sprintf("ns/vllm-%06d", i),
			Endpoint: fmt.Sprintf("10.%d.%d.1:8000", i>>8&0xff, i&0xff),
			DPSize:   1, BlockSize: 16, TotalKVBlocks: 4096, MaxNumBatchedTokens: 8192,
		}
	}
	return ws
}

// registerOnce builds a service (KV events applied by the caller, so no
// event source is started for a worker), upserts ws one by one, and books one
// SelectAndReserve, which decides among them all (it checks that the
// decision's candidates were every worker). It returns the time from the
// first upsert to that booking, and stops b's timer around the service's
// build and close, which are not counted.
func registerOnce(b *testing.B, ws []catalog.Worker) time.Duration {
	b.Helper()
	b.StopTimer()
	defer b.StartTimer()
	s, err := NewSelectionServiceBuilder(DefaultConfig(16)).ExternalEvents().SweepInterval(-1).
		Rand(rand.NewPCG(1, 1)).Build(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	b.StartTimer()
	defer b.StopTimer()
	start := time.Now()
	for _, w := range ws {
		if _, err := s.Workers().Upsert(w); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := s.SelectAndReserve(context.Background(), Request{Tokens: make([]uint32, 64)}); err != nil {
		b.Fatal(err)
	}
	d := time.Since(start)
	// The decision above saw every worker: its candidates are them all.
	if got := len(s.partition(catalog.DefaultModel).ranksOf().ranks); got != len(ws) {
		b.Fatalf("%d schedulable ranks, want %d", got, len(ws))
	}
	return d
}

// BenchmarkRegisterWorkers is a discovery's first snapshot through the
// library: n workers upserted one by one until the service can pick any of
// them (Workers().Upsert costs O(1) amortised; the model's candidates are built
// once, at the first decision). ns/op is one whole registration of n
// workers, the collector's work included. workers=10000 also reports its
// time over workers=1000's last, measured before it in the same run
// (x-workers1000). The budget: 10,000 workers in under 2 s, at most ~12x
// the 1,000-worker figure.
//
// Each size runs in runs of its own: a lone registration of 1,000 workers
// allocates less than the collector's smallest heap goal (4 MB), so
// interleaved with registrations of 10,000 it would pay for no collection
// at all, or for all of theirs, and the ratio would measure the collector's
// state more than the registration.
func BenchmarkRegisterWorkers(b *testing.B) {
	var perOp1000 time.Duration // workers=1000's last figure in this run
	for _, ws := range [][]catalog.Worker{registerWorkers(1_000), registerWorkers(10_000)} {
		b.Run(fmt.Sprintf("workers=%d", len(ws)), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				registerOnce(b, ws)
			}
			perOp := b.Elapsed() / time.Duration(b.N)
			switch {
			case len(ws) == 1_000:
				perOp1000 = perOp
			case perOp1000 > 0:
				b.ReportMetric(float64(perOp)/float64(perOp1000), "x-workers1000")
			}
		})
	}
}
