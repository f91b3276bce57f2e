package kvindex

import "github.com/kvselect/kvselect/catalog"

// ScaleFleet returns the 8M-entry scale fleet of scale_bench_test.go (built on
// first use) to the package's external benchmarks, with one of its worker
// ranks and the engine hash of the last block of that rank's first sequence,
// a parent to extend. Whoever changes the index puts it back as it was.
func ScaleFleet() (ix *Index, w catalog.WorkerRank, parent uint64) {
	f := getScale()
	return f.ix, f.workers[0], benchEngineHash(f.seqs[0].conv, benchDepth-1)
}
