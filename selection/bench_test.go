package selection

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/benchfleet"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/reservation"
)

// benchService builds a service with an exact index fed directly: n workers of
// 16-token blocks, each holding 32 cached prompts of 2k tokens from 8 shared
// system prompts, so lookups walk real shared prefixes. mod, when set, edits the
// configuration.
func benchService(b *testing.B, n int, mod func(*Config)) (*SelectionService, [][]uint32) {
	return benchServiceFeed(b, n, mod, false, nil)
}

// benchServiceClock is benchService on the clock now.
func benchServiceClock(b *testing.B, n int, mod func(*Config), now func() time.Time) (*SelectionService, [][]uint32) {
	return benchServiceWith(b, n, mod, func(bld *SelectionServiceBuilder) *SelectionServiceBuilder { return bld.ExternalEvents().Clock(now) })
}

// benchServiceFeed is benchService; with feed, the service runs its built-in
// event feed (a bind listener on loopback that no engine dials) and judges its
// feeds, so bookings pay for the feed checks; tracer, when set, traces every
// decision.
func benchServiceFeed(b *testing.B, n int, mod func(*Config), feed bool, tracer Tracer) (*SelectionService, [][]uint32) {
	return benchServiceWith(b, n, mod, func(bld *SelectionServiceBuilder) *SelectionServiceBuilder {
		if feed {
			bld = bld.BindEvents("tcp://127.0.0.1:0")
		} else {
			bld = bld.ExternalEvents()
		}
		if tracer != nil {
			bld = bld.Tracer(tracer)
		}
		return bld
	})
}

// benchServiceWith is benchService with the builder edited by opt.
func benchServiceWith(b *testing.B, n int, mod func(*Config), opt func(*SelectionServiceBuilder) *SelectionServiceBuilder) (*SelectionService, [][]uint32) {
	cfg := DefaultConfig(16)
	if mod != nil {
		mod(&cfg)
	}
	s, err := opt(NewSelectionServiceBuilder(cfg)).SweepInterval(-1).Rand(rand.NewPCG(1, 1)).Build(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = s.Close() })
	prompts, err := benchfleet.Warm(benchfleet.Service{Upsert: s.Workers().Upsert, ApplyEvent: s.Events().Apply}, benchfleet.Fleet{Workers: n, PerWorker: 32, Fresh: 64})
	if err != nil {
		b.Fatal(err)
	}
	return s, prompts
}

// BenchmarkSelectAndReserve books and frees a 2k-token prompt against n workers
// with a warm index; p50-ns is the median of one SelectAndReserve + Free.
// workers=64/queued is the in-run baseline: the same with queueing on (a
// threshold no worker reaches), so the decision runs under the model's lock.
// workers=64/feed-checks runs the built-in feed with its checks (compare with
// workers=64).
func BenchmarkSelectAndReserve(b *testing.B) {
	for _, bc := range []struct {
		name string
		n    int
		mod  func(*Config)
		feed bool
		// sessions gives each request one of 256 session ids (soft pins):
		// the table's cost, against workers=64.
		sessions bool
		// tracer traces every decision (a tracer that records nothing):
		// the cost of the hooks, against workers=64.
		tracer Tracer
	}{
		{"workers=8", 8, nil, false, false, nil},
		{"workers=64", 64, nil, false, false, nil},
		{"workers=64/queued", 64, queuedConfig, false, false, nil},
		{"workers=64/feed-checks", 64, nil, true, false, nil},
		{"workers=64/sessions", 64, nil, false, true, nil},
		{"workers=64/traced", 64, nil, false, false, nopTracer{}},
		{"workers=512", 512, nil, false, false, nil},
	} {
		b.Run(bc.name, func(b *testing.B) {
			s, prompts := benchServiceFeed(b, bc.n, bc.mod, bc.feed, bc.tracer)
			ctx := context.Background()
			ids := benchIDs("r")
			var sessions []string
			if bc.sessions {
				for i := range 256 {
					sessions = append(sessions, fmt.Sprintf("session-%d", i))
				}
			}
			durs := make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			i := 0
			for b.Loop() {
				start := time.Now()
				req := Request{ReservationID: ids[i%len(ids)], Tokens: prompts[i%len(prompts)]}
				if sessions != nil {
					req.SessionID = sessions[i%len(sessions)]
				}
				res, err := s.SelectAndReserve(ctx, req)
				if err != nil {
					b.Fatal(err)
				}
				if err := s.Reservations().Free(res.ReservationID); err != nil {
					b.Fatal(err)
				}
				durs = append(durs, time.Since(start))
				i++
			}
			slices.Sort(durs)
			b.ReportMetric(float64(durs[len(durs)/2].Nanoseconds()), "p50-ns")
		})
	}
}

// benchIDs returns 4,096 reservation ids, prefix then a number: the ids a
// benchmark cycles through (each is freed before it comes round again).
func benchIDs(prefix string) []reservation.ID {
	ids := make([]reservation.ID, 4096)
	for i := range ids {
		ids[i] = reservation.ID(fmt.Sprintf("%s%d", prefix, i))
	}
	return ids
}

// bookFree books tokens as id on s, frees it, and returns how long the two
// took.
func bookFree(ctx context.Context, b *testing.B, s *SelectionService, id reservation.ID, tokens []uint32) time.Duration {
	start := time.Now()
	res, err := s.SelectAndReserve(ctx, Request{ReservationID: id, Tokens: tokens})
	if err != nil {
		b.Fatal(err)
	}
	if err := s.Reservations().Free(res.ReservationID); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

// BenchmarkPredictiveCost is SelectAndReserve + Free at 64 workers under
// Dynamo's cost and under the predictive one (a prefill clock read per
// candidate) before its calibration is ready, calibrated, and calibrated in
// same-instant runs of four told of two peers (each decision of a run but the
// first prices its peers' bookings: selection.Peers), requests going to each
// service in turn so that all see the same machine moment by moment: the
// x/dynamo metrics are the ratios of their times, steadier than
// sub-benchmarks run one after the other.
func BenchmarkPredictiveCost(b *testing.B) {
	dyn, prompts := benchService(b, 64, func(c *Config) { c.Cost = CostDynamo })
	pred, _ := benchService(b, 64, func(c *Config) { c.Cost = CostPredictive })
	cal, _ := benchService(b, 64, func(c *Config) { c.Cost = CostPredictive })
	clk := newFakeClock()
	burst, _ := benchServiceClock(b, 64, func(c *Config) { c.Cost = CostPredictive }, clk.Now)
	if err := burst.Replicas().SetPeers(Peers{Count: 2, Position: 1, Window: time.Millisecond}); err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	for _, s := range []*SelectionService{cal, burst} { // calibrate: 64 completed prefills
		for i := range 64 {
			res, err := s.SelectAndReserve(ctx, Request{Tokens: prompts[i%len(prompts)]})
			if err != nil {
				b.Fatal(err)
			}
			clk.Advance(time.Millisecond + time.Duration(i%7)*time.Microsecond)
			if err := s.Reservations().PrefillComplete(res.ReservationID); err != nil {
				b.Fatal(err)
			}
			if err := s.Reservations().Free(res.ReservationID); err != nil {
				b.Fatal(err)
			}
		}
		if !s.Stats().Calibration.Ready {
			b.Fatal("the calibration is not ready")
		}
	}
	ids := benchIDs("r")
	run := func(s *SelectionService) func(int) time.Duration {
		return func(i int) time.Duration { return bookFree(ctx, b, s, ids[i%len(ids)], prompts[i%len(prompts)]) }
	}
	bookBurst := run(burst)
	burstRun := func(i int) time.Duration {
		d := bookBurst(i)
		if i%4 == 3 {
			clk.Advance(time.Second) // the next run of four
		}
		return d
	}
	times := interleaved(b, run(dyn), run(pred), run(cal), burstRun)
	dynT := sum(times[0])
	b.ReportMetric(float64(dynT.Nanoseconds())/float64(b.N), "dynamo-ns/op")
	b.ReportMetric(float64(sum(times[1]))/float64(dynT), "predictive/dynamo")
	b.ReportMetric(float64(sum(times[2]))/float64(dynT), "calibrated/dynamo")
	b.ReportMetric(float64(sum(times[3]))/float64(dynT), "burst/dynamo")
}

// interleaved runs each of runs once per iteration of b's loop, a different
// one first each time (a later one finds the prompt's memory warm), so that
// all see the same machine moment by moment, and returns each one's times,
// in the order of the iterations.
func interleaved(b *testing.B, runs ...func(i int) time.Duration) [][]time.Duration {
	times := make([][]time.Duration, len(runs))
	for k := range times {
		times[k] = make([]time.Duration, 0, b.N)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		for k := range runs {
			j := (k + i) % len(runs)
			times[j] = append(times[j], runs[j](i))
		}
	}
	return times
}

// sum adds ds up.
func sum(ds []time.Duration) (t time.Duration) {
	for _, d := range ds {
		t += d
	}
	return t
}

// median sorts ds and returns its middle.
func median(ds []time.Duration) time.Duration {
	slices.Sort(ds)
	return ds[len(ds)/2]
}

// BenchmarkSelectAndReserveParallel runs the same with RunParallel: throughput
// should grow with GOMAXPROCS (compare -cpu 1,2).
func BenchmarkSelectAndReserveParallel(b *testing.B) {
	s, prompts := benchService(b, 64, nil)
	runParallelBookings(b, s, prompts)
}

// BenchmarkSelectAndReserveParallelQueued is the same with queueing on (a
// threshold no worker reaches), so every decision runs under the model's lock:
// the in-run baseline of the lock-free path.
func BenchmarkSelectAndReserveParallelQueued(b *testing.B) {
	s, prompts := benchService(b, 64, queuedConfig)
	runParallelBookings(b, s, prompts)
}

// BenchmarkSelectAndReserveScaling measures how SelectAndReserve + Free
// throughput grows from one goroutine to two, alternating the two in short
// phases (2000 operations per goroutine) so that both see the same state of a
// shared, noisy machine; speedup-x is the median over iterations of the
// two-goroutine throughput divided by the one-goroutine throughput. shared runs
// both goroutines on one service; independent gives each its own (nothing
// shared: how far this machine scales at all). Needs -cpu 2 or more.
func BenchmarkSelectAndReserveScaling(b *testing.B) {
	for _, mode := range []string{"shared", "independent"} {
		b.Run(mode, func(b *testing.B) {
			if runtime.GOMAXPROCS(0) < 2 {
				b.Skip("needs GOMAXPROCS >= 2 (-cpu 2)")
			}
			type svc struct {
				s       *SelectionService
				prompts [][]uint32
			}
			svcs := make([]svc, 1, 2)
			svcs[0].s, svcs[0].prompts = benchService(b, 64, nil)
			if mode == "independent" {
				s, p := benchService(b, 64, nil)
				svcs = append(svcs, svc{s, p})
			}
			ctx := context.Background()
			var next atomic.Uint64
			run := func(v svc, ops int) {
				for range ops {
					i := next.Add(1)
					res, err := v.s.SelectAndReserve(ctx, Request{ReservationID: reservation.ID(fmt.Sprint(i)), Tokens: v.prompts[int(i)%len(v.prompts)]})
					if err != nil {
						b.Error(err)
						return
					}
					_ = v.s.Reservations().Free(res.ReservationID)
				}
			}
			const ops = 2000
			var speedups []float64
			b.ReportAllocs()
			for b.Loop() {
				start := time.Now()
				run(svcs[0], ops)
				one := time.Since(start)
				var wg sync.WaitGroup
				start = time.Now()
				for g := range 2 {
					wg.Go(func() { run(svcs[g%len(svcs)], ops) })
				}
				wg.Wait()
				two := time.Since(start)
				speedups = append(speedups, 2*one.Seconds()/two.Seconds())
			}
			slices.Sort(speedups)
			b.ReportMetric(speedups[len(speedups)/2], "speedup-x")
		})
	}
}

// queuedConfig turns queueing on with a threshold no worker reaches.
func queuedConfig(c *Config) { high := 1e9; c.QueueThreshold = &high }

func runParallelBookings(b *testing.B, s *SelectionService, prompts [][]uint32) {
	ctx := context.Background()
	var next atomic.Uint64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			i := next.Add(1)
			res, err := s.SelectAndReserve(ctx, Request{ReservationID: reservation.ID(fmt.Sprint(i)), Tokens: prompts[int(i)%len(prompts)]})
			if err != nil {
				b.Error(err)
				return
			}
			_ = s.Reservations().Free(res.ReservationID)
		}
	})
}

// nopTracer traces nothing: what the hooks cost a decision.
type nopTracer struct{}

func (nopTracer) StartDecision(context.Context, string, bool) DecisionSpan { return nopTracer{} }
func (nopTracer) End(*Decision, error)                                     {}

// fleetBench is a scale fleet for BenchmarkSelectAndReserveFleet, built once
// per test binary and size.
type fleetBench struct {
	s       *SelectionService
	prompts [][]uint32
}

var fleets = map[int]*fleetBench{}

// benchFleet builds n worker ranks (workers of 8 data-parallel ranks) where a
// prompt touches about the same number of ranks at every size: rank i caches
// one 1k-token conversation on the 512-token system prompt of group i mod
// n/8 (8 ranks per group), and n/4 background bookings of such
// conversations, never freed, load random ranks (so loads differ and about
// two ranks hold a request's blocks in the ledger). The requests are new
// 2k-token conversations on the groups' system prompts.
func benchFleet(b *testing.B, n int) *fleetBench {
	if f := fleets[n]; f != nil {
		return f
	}
	f := buildBenchFleet(b, n, nil)
	fleets[n] = f
	return f
}

// buildBenchFleet builds benchFleet's fleet of n ranks on a service with
// the policy seams seams sets (when set), left on the full scan.
func buildBenchFleet(b *testing.B, n int, seams func(*SelectionServiceBuilder)) *fleetBench {
	bld := NewSelectionServiceBuilder(DefaultConfig(16)).ExternalEvents().SweepInterval(-1).Rand(rand.NewPCG(1, 1))
	if seams != nil {
		seams(bld)
	}
	s, err := bld.Build(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	groups := n / 8
	r := rand.New(rand.NewPCG(7, uint64(n)))
	system := make([][]uint32, groups)
	for g := range system {
		system[g] = make([]uint32, 512)
		for j := range system[g] {
			system[g][j] = uint32(r.IntN(32000))
		}
	}
	conv := func(g, length int) []uint32 {
		p := append([]uint32(nil), system[g]...)
		for len(p) < length {
			p = append(p, uint32(r.IntN(32000)))
		}
		return p
	}
	for w := range n / 8 {
		id := fmt.Sprintf("w%05d", w)
		if _, err := s.Workers().Upsert(catalog.Worker{ID: id, Endpoint: fmt.Sprintf("10.%d.%d.%d:8000", w/62500, w/250%250, w%250+1), DPSize: 8, BlockSize: 16, MaxNumBatchedTokens: 8192}); err != nil {
			b.Fatal(err)
		}
	}
	var engine uint64
	for i := range n {
		wr := catalog.WorkerRank{WorkerID: fmt.Sprintf("w%05d", i/8), Rank: i % 8}
		p := conv(i%groups, 1024)
		hs := make([]uint64, len(p)/16)
		for j := range hs {
			engine++
			hs[j] = engine
		}
		if err := s.Events().Apply(wr, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: hs, Tokens: p}); err != nil {
			b.Fatal(err)
		}
	}
	ctx := context.Background()
	s.scan = scanFull // the background bookings go where the policy sends them either way
	for k := range n / 4 {
		if _, err := s.SelectAndReserve(ctx, Request{ReservationID: reservation.ID(fmt.Sprintf("bg%d", k)), Tokens: conv(r.IntN(groups), 256+r.IntN(1792))}); err != nil {
			b.Fatal(err)
		}
	}
	f := &fleetBench{s: s}
	for k := range 128 {
		f.prompts = append(f.prompts, conv(k%groups, 2048))
	}
	return f
}

// BenchmarkSelectAndReserveFleet is SelectAndReserve + Free at fleet scale:
// ranks=N/default is the default decision (the sparse one from 128 ranks, the
// full scan below), ranks=N/full-scan the same service forced to evaluate
// every rank (the same-run baseline); p50-ns is the median of one
// SelectAndReserve + Free.
func BenchmarkSelectAndReserveFleet(b *testing.B) {
	for _, n := range []int{64, 512, 4096, 16384} {
		for _, mode := range []struct {
			name string
			scan scanMode
		}{{"default", scanAuto}, {"full-scan", scanFull}} {
			b.Run(fmt.Sprintf("ranks=%d/%s", n, mode.name), func(b *testing.B) {
				f := benchFleet(b, n)
				f.s.scan = mode.scan
				ctx := context.Background()
				ids := benchIDs("r")
				durs := make([]time.Duration, 0, b.N)
				b.ReportAllocs()
				b.ResetTimer()
				i := 0
				for b.Loop() {
					start := time.Now()
					res, err := f.s.SelectAndReserve(ctx, Request{ReservationID: ids[i%len(ids)], Tokens: f.prompts[i%len(f.prompts)]})
					if err != nil {
						b.Fatal(err)
					}
					if err := f.s.Reservations().Free(res.ReservationID); err != nil {
						b.Fatal(err)
					}
					durs = append(durs, time.Since(start))
					i++
				}
				slices.Sort(durs)
				b.ReportMetric(float64(durs[len(durs)/2].Nanoseconds()), "p50-ns")
			})
		}
	}
	// ranks=N/alternating alternates requests between the 64-rank fleet and
	// the N-rank one (default decisions, each first half of the time) so that
	// both see the same machine moment by moment: x-ranks64 is the ratio of their
	// p50s, steadier than two sub-benchmarks run one after the other.
	for _, n := range []int{4096, 16384} {
		b.Run(fmt.Sprintf("ranks=%d/alternating", n), func(b *testing.B) {
			small, big := benchFleet(b, 64), benchFleet(b, n)
			small.s.scan, big.s.scan = scanAuto, scanAuto
			ctx := context.Background()
			ids := benchIDs("v")
			once := func(f *fleetBench) func(int) time.Duration {
				return func(i int) time.Duration { return bookFree(ctx, b, f.s, ids[i%len(ids)], f.prompts[i%len(f.prompts)]) }
			}
			times := interleaved(b, once(small), once(big))
			ps, pb := median(times[0]), median(times[1])
			b.ReportMetric(float64(pb.Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(ps.Nanoseconds()), "ranks64-p50-ns")
			b.ReportMetric(float64(pb)/float64(ps), "x-ranks64")
		})
	}
}
