package selection

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSparseWithScopedFiltersMatchesFullScan is the sparse decision's model
// test with one or two scoped filters (of either kind, each judging the
// workers of its scope by their load or rank) and, half of the time, a
// scoped cost term: the sparse decision finds the full scan's costs, ties,
// margin and pin, counts the same exclusions per filter, and refuses with
// the same error when a filter leaves no candidate; none of it takes the
// full scan.
func TestSparseWithScopedFiltersMatchesFullScan(t *testing.T) {
	for seed := range uint64(40) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { checkSparseScopedFilters(t, seed, 40) })
	}
}

// FuzzSparseWithScopedFilters is the model test with scoped filters from
// any seed.
func FuzzSparseWithScopedFilters(f *testing.F) {
	f.Add(uint64(3))
	f.Add(uint64(41))
	f.Fuzz(func(t *testing.T, seed uint64) { checkSparseScopedFilters(t, seed, 30) })
}

// checkSparseScopedFilters runs the model test of seed with its random
// scoped filters and term.
func checkSparseScopedFilters(t *testing.T, seed uint64, steps int) {
	r := rand.New(rand.NewPCG(seed, 123))
	var filters []*tableFilter
	for range 1 + r.IntN(2) {
		f := &tableFilter{workers: map[string]bool{}, mode: FilterScope(r.IntN(2)), cond: r.IntN(4)}
		for w := range 14 {
			if r.IntN(3) == 0 {
				f.workers[fmt.Sprintf("w%d", w)] = true
			}
		}
		filters = append(filters, f)
	}
	var term *tableTerm
	if r.IntN(2) == 0 {
		term = &tableTerm{price: map[string]float64{}}
		for w := range 14 {
			if r.IntN(3) == 0 {
				term.price[fmt.Sprintf("w%d", w)] = []float64{-3, -0.5, 0.25, 2, 40}[r.IntN(5)]
			}
		}
	}
	s := checkSparseModelWith(t, seed, steps, func(b *SelectionServiceBuilder) {
		for i, f := range filters {
			b.Filter(fmt.Sprintf("f%d", i), f)
		}
		if term != nil {
			b.CostTerm("table", term)
		}
	})
	require.Zero(t, s.Stats().PolicyFullScans, "scoped filters keep the sparse decision")
}

// tableFilter is a ScopedFilter over a fixed set of workers: AdmitsOnly, it
// admits those of them that meet its condition; RefusesOnly, it refuses
// those of them that do not.
type tableFilter struct {
	workers map[string]bool
	mode    FilterScope
	cond    int // 0: always; 1: an even number of active requests; 2: rank 0; 3: never
}

func (f *tableFilter) meets(c *Scored) bool {
	switch f.cond {
	case 1:
		return c.ActiveRequests%2 == 0
	case 2:
		return c.Rank == 0
	case 3:
		return false
	}
	return true
}

func (f *tableFilter) Admit(_ context.Context, _ *Request, c *Scored) bool {
	if f.mode == AdmitsOnly {
		return f.workers[c.WorkerID] && f.meets(c)
	}
	return !f.workers[c.WorkerID] || f.meets(c)
}

func (f *tableFilter) Scope(_ context.Context, _ *Request, dst []string) ([]string, FilterScope) {
	for w := range f.workers {
		dst = append(dst, w)
	}
	return dst, f.mode
}

var _ ScopedFilter = (*tableFilter)(nil)
