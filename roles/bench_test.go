package roles

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/selection"
)

const (
	benchWorkers = 32   // per role
	benchBlock   = 16   // tokens per block
	benchPrompt  = 2048 // tokens per prompt
)

// benchPrompts returns 64 prompts of 2k tokens sharing 8 system prompts of 1k
// tokens.
func benchPrompts() [][]uint32 {
	r := rand.New(rand.NewPCG(5, 5))
	system := make([][]uint32, 8)
	for i := range system {
		system[i] = make([]uint32, benchPrompt/2)
		for j := range system[i] {
			system[i][j] = uint32(r.IntN(32000))
		}
	}
	out := make([][]uint32, 64)
	for i := range out {
		p := append([]uint32(nil), system[i%8]...)
		for len(p) < benchPrompt {
			p = append(p, uint32(r.IntN(32000)))
		}
		out[i] = p
	}
	return out
}

// benchRoles builds the selectors of a mode with benchWorkers workers per role
// and a warm index: every worker with KV events has cached four of the prompts.
func benchRoles(b *testing.B, mode TopologyMode, prompts [][]uint32) *RoleSelectors {
	b.Helper()
	rs, err := New(context.Background(), RoleOptions{
		Mode: mode,
		Base: selection.DefaultConfig(benchBlock),
		Configure: func(r Role, sb *selection.SelectionServiceBuilder) {
			sb.Rand(rand.NewPCG(1, uint64(r))).SweepInterval(-1).ExternalEvents()
		},
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = rs.Close() })
	var ws []catalog.Worker
	for _, role := range mode.Roles() {
		label := role.String()
		for i := range benchWorkers {
			w := catalog.Worker{
				ID: fmt.Sprintf("%s-%02d", label, i), Endpoint: fmt.Sprintf("10.%d.0.%d:8000", role, i+1),
				DPSize: 1, BlockSize: benchBlock, Labels: map[string]string{DefaultRoleLabel: label},
			}
			ws = append(ws, w)
		}
	}
	if _, err := rs.Reconcile(ws); err != nil {
		b.Fatal(err)
	}
	for _, role := range mode.Roles() {
		svc := rs.Service(role)
		if !rs.profiles[role].Config.UseKVEvents {
			continue
		}
		for i, rec := range svc.Workers().List() {
			for k := range 4 {
				p := prompts[(i*4+k)%len(prompts)]
				hs := make([]uint64, len(p)/benchBlock)
				for j := range hs {
					hs[j] = uint64(i*4+k)<<20 | uint64(j) + 1
				}
				ev := kvindex.Event{Kind: kvindex.EventStored, BlockHashes: hs, Tokens: p}
				if err := svc.Events().Apply(catalog.WorkerRank{WorkerID: rec.Worker.ID}, ev); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	return rs
}

// BenchmarkSingleSelectAndReserve is one aggregated request's routing life on
// one service: SelectAndReserve, PrefillComplete, Reservations.Free.
func BenchmarkSingleSelectAndReserve(b *testing.B) {
	prompts := benchPrompts()
	rs := benchRoles(b, ModeAggregated, prompts)
	svc := rs.Service(Aggregated)
	ctx := context.Background()
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		res, err := svc.SelectAndReserve(ctx, selection.Request{Tokens: prompts[i%len(prompts)]})
		if err != nil {
			b.Fatal(err)
		}
		_ = svc.Reservations().PrefillComplete(res.ReservationID)
		_ = svc.Reservations().Free(res.ReservationID)
		i++
	}
}

// BenchmarkPairBook is one disaggregated request's routing life: Book (both
// legs, concurrently), Handoff, Complete. Acceptance: <= 2x
// BenchmarkSingleSelectAndReserve.
func BenchmarkPairBook(b *testing.B) {
	prompts := benchPrompts()
	rs := benchRoles(b, ModeDisaggregated, prompts)
	pb, err := NewPairBooker(rs, BookerOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer pb.Close()
	ctx := context.Background()
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		plan, err := pb.Book(ctx, selection.Request{Tokens: prompts[i%len(prompts)]})
		if err != nil {
			b.Fatal(err)
		}
		_ = plan.PrefillComplete()
		_ = plan.Done()
		i++
	}
}

// BenchmarkAggregatedBook is BenchmarkSingleSelectAndReserve through a
// PairBooker in aggregated mode: the booker's own overhead.
func BenchmarkAggregatedBook(b *testing.B) {
	prompts := benchPrompts()
	rs := benchRoles(b, ModeAggregated, prompts)
	pb, err := NewPairBooker(rs, BookerOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer pb.Close()
	ctx := context.Background()
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		plan, err := pb.Book(ctx, selection.Request{Tokens: prompts[i%len(prompts)]})
		if err != nil {
			b.Fatal(err)
		}
		_ = plan.PrefillComplete()
		_ = plan.Done()
		i++
	}
}

// BenchmarkPairVsSingle interleaves a single booking and a pair booking per
// iteration, so that both see the same load from whatever else shares the
// machine, and reports the mean cost of each booking (SelectAndReserve; Book)
// and of each settlement (PrefillComplete and Reservations.Free; Handoff and
// Complete), with the ratios. The acceptance bound applies to book-ratio:
// a pair booking costs at most twice a single SelectAndReserve.
func BenchmarkPairVsSingle(b *testing.B) {
	prompts := benchPrompts()
	svc := benchRoles(b, ModeAggregated, prompts).Service(Aggregated)
	pb, err := NewPairBooker(benchRoles(b, ModeDisaggregated, prompts), BookerOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer pb.Close()
	ctx := context.Background()
	var singleBook, singleSettle, pairBook, pairSettle time.Duration
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		req := selection.Request{Tokens: prompts[i%len(prompts)]}
		t0 := time.Now()
		res, err := svc.SelectAndReserve(ctx, req)
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		_ = svc.Reservations().PrefillComplete(res.ReservationID)
		_ = svc.Reservations().Free(res.ReservationID)
		t2 := time.Now()
		plan, err := pb.Book(ctx, req)
		if err != nil {
			b.Fatal(err)
		}
		t3 := time.Now()
		_ = plan.PrefillComplete()
		_ = plan.Done()
		t4 := time.Now()
		singleBook += t1.Sub(t0)
		singleSettle += t2.Sub(t1)
		pairBook += t3.Sub(t2)
		pairSettle += t4.Sub(t3)
		i++
	}
	n := float64(i)
	b.ReportMetric(float64(singleBook.Nanoseconds())/n, "single-book-ns")
	b.ReportMetric(float64(pairBook.Nanoseconds())/n, "pair-book-ns")
	b.ReportMetric(float64(pairBook)/float64(singleBook), "book-ratio")
	b.ReportMetric(float64(pairBook+pairSettle)/float64(singleBook+singleSettle), "life-ratio")
}
