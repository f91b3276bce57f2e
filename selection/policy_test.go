package selection

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/reservation"
)

// policyService builds a service with KV events applied by hand (block size
// 4), a fake clock, a fixed seed and the seams seams sets, with workers a, b
// and c (labels gpu=h100 on a and b, gpu=a10 on c); b's engine holds the
// first two blocks of policyPrompt.
func policyService(t testing.TB, mod func(*Config), seams func(*SelectionServiceBuilder)) *SelectionService {
	t.Helper()
	cfg := DefaultConfig(4)
	if mod != nil {
		mod(&cfg)
	}
	b := NewSelectionServiceBuilder(cfg).ExternalEvents().Clock(newFakeClock().Now).Rand(rand.NewPCG(3, 4)).SweepInterval(-1)
	if seams != nil {
		seams(b)
	}
	s, err := b.Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	for i, id := range []string{"a", "b", "c"} {
		gpu := "h100"
		if id == "c" {
			gpu = "a10"
		}
		rec, err := s.Workers().Upsert(catalog.Worker{ID: id, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1, BlockSize: 4,
			MaxNumBatchedTokens: 100, Labels: map[string]string{"gpu": gpu}})
		require.NoError(t, err)
		require.Equal(t, catalog.Schedulable, rec.Lifecycle, rec.Reasons)
	}
	require.NoError(t, s.Events().Apply(catalog.WorkerRank{WorkerID: "b"}, kvindex.Event{
		Kind: kvindex.EventStored, BlockHashes: []uint64{1, 2}, Tokens: policyPrompt[:8],
	}))
	return s
}

var policyPrompt = toks(12, 7)

// labelFilter admits the workers whose label key is value.
func labelFilter(key, value string) Filter {
	return FilterFunc(func(_ context.Context, _ *Request, c *Scored) bool { return c.Labels[key] == value })
}

func TestFilterExcludesWithItsReason(t *testing.T) {
	s := policyService(t, nil, func(b *SelectionServiceBuilder) {
		b.Filter("h100", labelFilter("gpu", "h100")).
			Filter("not-b", FilterFunc(func(_ context.Context, req *Request, c *Scored) bool {
				return c.WorkerID != "b" || req.LoRAName == ""
			}))
	})
	ctx := context.Background()

	// c is filtered out: b, which caches the prompt, wins.
	res, err := s.SelectAndReserve(ctx, Request{Tokens: policyPrompt})
	require.NoError(t, err)
	require.Equal(t, "b", res.WorkerID)
	require.NoError(t, s.Reservations().Free(res.ReservationID))
	require.Equal(t, map[string]uint64{"h100": 1, "not-b": 0}, s.Stats().Filtered)

	// The second filter leaves a only.
	res, err = s.SelectAndReserve(ctx, Request{Tokens: policyPrompt, LoRAName: "x"})
	require.NoError(t, err)
	require.Equal(t, "a", res.WorkerID)
	require.NoError(t, s.Reservations().Free(res.ReservationID))

	// PotentialLoads sees what the filters keep, and counts nothing.
	scored, err := s.PotentialLoads(ctx, Request{Tokens: policyPrompt})
	require.NoError(t, err)
	require.Len(t, scored, 2)
	require.Equal(t, map[string]string{"gpu": "h100"}, scored[0].Labels)
	require.Equal(t, "10.0.0.1:8000", scored[0].Endpoint)
	require.Equal(t, map[string]uint64{"h100": 2, "not-b": 1}, s.Stats().Filtered)
	requireIdle(t, s)
}

func TestFilterThatExcludesEveryoneNamesItself(t *testing.T) {
	s := policyService(t, nil, func(b *SelectionServiceBuilder) {
		b.Filter("gpu", labelFilter("gpu", "h100")).Filter("lora", FilterFunc(func(_ context.Context, req *Request, c *Scored) bool {
			return req.LoRAName == "" || c.Labels["lora"] == req.LoRAName
		}))
	})
	ctx := context.Background()
	for _, call := range []func() error{
		func() error { _, err := s.Book(ctx, Request{Tokens: policyPrompt, LoRAName: "sql"}); return err },
		func() error {
			_, err := s.SelectAndReserve(ctx, Request{Tokens: policyPrompt, LoRAName: "sql"})
			return err
		},
		func() error { _, err := s.Select(ctx, Request{Tokens: policyPrompt, LoRAName: "sql"}); return err },
		func() error {
			_, err := s.PotentialLoads(ctx, Request{Tokens: policyPrompt, LoRAName: "sql"})
			return err
		},
	} {
		err := call()
		require.ErrorIs(t, err, ErrNoEndpoints)
		require.Equal(t, "filtered:lora", RefusalReason(err))
		require.Equal(t, http.StatusServiceUnavailable, HTTPStatus(err))
		require.ErrorContains(t, err, `filter "lora" excluded all 2 candidates`)
	}
	st := s.Stats()
	require.Equal(t, map[string]uint64{"gpu": 3, "lora": 6}, st.Filtered) // three decisions, PotentialLoads not counted
	require.EqualValues(t, 3, st.Rejected)
	requireIdle(t, s)
}

func TestFilterSeesLabelChanges(t *testing.T) {
	s := policyService(t, nil, func(b *SelectionServiceBuilder) { b.Filter("a10", labelFilter("gpu", "a10")) })
	res, err := s.Select(context.Background(), Request{Tokens: policyPrompt})
	require.NoError(t, err)
	require.Equal(t, "c", res.WorkerID)
	_, err = s.Workers().Upsert(catalog.Worker{ID: "c", Endpoint: "10.0.0.3:8000", DPSize: 1, BlockSize: 4, Labels: map[string]string{"gpu": "h100"}})
	require.NoError(t, err)
	_, err = s.Select(context.Background(), Request{Tokens: policyPrompt})
	require.Equal(t, "filtered:a10", RefusalReason(err))
}

// With filters, ejection yields among the candidates they keep, as it does
// among all candidates without them.
func TestFilterAndEjection(t *testing.T) {
	s := policyService(t, nil, func(b *SelectionServiceBuilder) {
		b.Filter("not-c", FilterFunc(func(_ context.Context, _ *Request, c *Scored) bool { return c.WorkerID != "c" }))
	})
	ctx := context.Background()
	require.NoError(t, s.Workers().MarkFailed("b"))
	res, err := s.Select(ctx, Request{Tokens: policyPrompt})
	require.NoError(t, err)
	require.Equal(t, "a", res.WorkerID, "b is ejected")
	require.NoError(t, s.Workers().MarkFailed("a"))
	res, err = s.Select(ctx, Request{Tokens: policyPrompt})
	require.NoError(t, err)
	require.Equal(t, "b", res.WorkerID, "every kept worker is ejected: ejection yields, and c stays filtered out")
}

func TestCostTermChangesThePick(t *testing.T) {
	for _, model := range []CostModel{CostDynamo, CostPredictive} {
		t.Run(fmt.Sprint(model), func(t *testing.T) {
			mod := func(c *Config) { c.Cost = model }
			ctx := context.Background()
			plain := policyService(t, mod, nil)
			before := costsOf(t, plain, Request{Tokens: policyPrompt})
			res, err := plain.Select(ctx, Request{Tokens: policyPrompt})
			require.NoError(t, err)
			require.Equal(t, "b", res.WorkerID, "b caches the prompt")

			var seen []Scored
			var mu sync.Mutex
			s := policyService(t, mod, func(b *SelectionServiceBuilder) {
				b.CostTerm("gpu", CostTermFunc(func(_ context.Context, _ *Request, c *Scored) float64 {
					mu.Lock()
					seen = append(seen, *c)
					mu.Unlock()
					if c.WorkerID == "b" {
						if c.Predicted {
							return 10 // seconds
						}
						return 100 // blocks
					}
					return 0
				})).CostTerm("prefer-a", CostTermFunc(func(_ context.Context, _ *Request, c *Scored) float64 {
					if c.WorkerID == "a" {
						return -0.5 * c.Cost // the cost so far, terms before it included
					}
					return 0
				}))
			})
			after := costsOf(t, s, Request{Tokens: policyPrompt})
			require.InDelta(t, before["b"]+map[bool]float64{true: 10, false: 100}[model == CostPredictive], after["b"], 1e-9)
			require.InDelta(t, before["a"]/2, after["a"], 1e-9)
			require.InDelta(t, before["c"], after["c"], 1e-9)
			for _, v := range seen {
				require.Equal(t, model == CostPredictive, v.Predicted)
				require.Equal(t, v.WorkerID == "b", v.Overlap.Device == 2, v)
			}

			res, err = s.SelectAndReserve(ctx, Request{Tokens: policyPrompt, Fallbacks: 2})
			require.NoError(t, err)
			require.Equal(t, "a", res.WorkerID)
			require.InDelta(t, after["a"], res.Cost, 1e-9, "the result's cost has the terms")
			require.Equal(t, "c", res.Fallbacks[0].WorkerID, "fallbacks are ordered with the terms too")
			require.InDelta(t, after["c"], res.Fallbacks[0].Cost, 1e-9)
			require.InDelta(t, after["b"], res.Fallbacks[1].Cost, 1e-9)
			require.NoError(t, s.Reservations().Free(res.ReservationID))
		})
	}
}

func TestCostTermMustBeFinite(t *testing.T) {
	for _, v := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		s := policyService(t, nil, func(b *SelectionServiceBuilder) {
			b.CostTerm("broken", CostTermFunc(func(context.Context, *Request, *Scored) float64 { return v }))
		})
		_, err := s.SelectAndReserve(context.Background(), Request{Tokens: policyPrompt})
		require.ErrorIs(t, err, ErrPolicy)
		require.ErrorContains(t, err, `cost term "broken"`)
		require.Equal(t, http.StatusInternalServerError, HTTPStatus(err))
		requireIdle(t, s)
	}
}

func TestPickerIsUsed(t *testing.T) {
	var got []Scored
	s := policyService(t, nil, func(b *SelectionServiceBuilder) {
		b.CostTerm("c-first", CostTermFunc(func(_ context.Context, _ *Request, c *Scored) float64 {
			if c.WorkerID == "c" {
				return -1000
			}
			return 0
		})).Picker(PickerFunc(func(_ context.Context, req *Request, cands []Scored) int {
			got = slices.Clone(cands)
			if req.LoRAName == "out-of-range" {
				return len(cands)
			}
			// The costliest: what the pick by cost would never take.
			return slices.IndexFunc(cands, func(c Scored) bool {
				return c.Cost == slices.MaxFunc(cands, func(x, y Scored) int { return cmpFloat(x.Cost, y.Cost) }).Cost
			})
		}))
	})
	ctx := context.Background()
	res, err := s.SelectAndReserve(ctx, Request{Tokens: policyPrompt})
	require.NoError(t, err)
	require.Len(t, got, 3)
	require.Equal(t, []string{"a", "b", "c"}, []string{got[0].WorkerID, got[1].WorkerID, got[2].WorkerID}, "sorted by worker")
	require.Less(t, got[2].Cost, got[1].Cost, "with the terms")
	require.Equal(t, "a", res.WorkerID, "a costs most: no cache, no credit")
	require.NoError(t, s.Reservations().Free(res.ReservationID))

	_, err = s.SelectAndReserve(ctx, Request{Tokens: policyPrompt, LoRAName: "out-of-range"})
	require.ErrorIs(t, err, ErrPolicy)
	require.ErrorContains(t, err, "the picker chose candidate 3 of 3")
	requireIdle(t, s)
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// A session's pin is chosen before the picker.
func TestPickerComesAfterTheSessionPin(t *testing.T) {
	s := policyService(t, func(c *Config) { c.Sessions.Mode = SessionHard }, func(b *SelectionServiceBuilder) {
		b.Picker(PickerFunc(func(_ context.Context, _ *Request, cands []Scored) int { return 0 })) // a
	})
	ctx := context.Background()
	p := s.partition(catalog.DefaultModel)
	p.sessions.put("s1", catalog.WorkerRank{WorkerID: "c"}, s.now().UnixNano())
	res, err := s.Select(ctx, Request{Tokens: policyPrompt, SessionID: "s1"})
	require.NoError(t, err)
	require.Equal(t, "c", res.WorkerID)
	res, err = s.Select(ctx, Request{Tokens: policyPrompt})
	require.NoError(t, err)
	require.Equal(t, "a", res.WorkerID)
}

type tenantKey struct{}

func TestClassifierRefusesWithItsReason(t *testing.T) {
	var calls int
	var mu sync.Mutex
	s := policyService(t, nil, func(b *SelectionServiceBuilder) {
		b.Classifier(ClassifierFunc(func(ctx context.Context, req *Request) Admission {
			mu.Lock()
			calls++
			mu.Unlock()
			if ctx.Value(tenantKey{}) == "blocked" {
				return Admission{Refuse: "Tenant Quota!"}
			}
			return Admission{Priority: req.Priority}
		}))
	})
	blocked := context.WithValue(context.Background(), tenantKey{}, "blocked")
	for _, call := range []func() error{
		func() error { _, err := s.Book(blocked, Request{Tokens: policyPrompt}); return err },
		func() error { _, err := s.SelectAndReserve(blocked, Request{Tokens: policyPrompt}); return err },
		func() error { _, err := s.Select(blocked, Request{Tokens: policyPrompt}); return err },
	} {
		err := call()
		require.ErrorIs(t, err, ErrRefused)
		require.Equal(t, "classifier:tenant_quota_", RefusalReason(err))
		require.Equal(t, http.StatusTooManyRequests, HTTPStatus(err))
	}
	// An inspection is not classified.
	_, err := s.PotentialLoads(blocked, Request{Tokens: policyPrompt})
	require.NoError(t, err)
	b, err := s.Book(context.Background(), Request{Tokens: policyPrompt})
	require.NoError(t, err)
	require.NoError(t, b.Done())
	st := s.Stats()
	require.EqualValues(t, 3, st.ClassifierRefusals)
	require.EqualValues(t, 3, st.Rejected)
	require.Equal(t, 4, calls)
	requireIdle(t, s)
}

func TestClassifierMustSetAValidPriority(t *testing.T) {
	s := policyService(t, nil, func(b *SelectionServiceBuilder) {
		b.Classifier(ClassifierFunc(func(context.Context, *Request) Admission {
			return Admission{Priority: Priority{Jump: math.NaN()}}
		}))
	})
	_, err := s.SelectAndReserve(context.Background(), Request{Tokens: policyPrompt})
	require.ErrorIs(t, err, ErrPolicy)
	require.Equal(t, http.StatusInternalServerError, HTTPStatus(err))
}

// The classifier's priority orders the admission queue: of two requests
// waiting, the one it puts in the higher tier is admitted first, whatever
// the caller asked for.
func TestClassifierSetsThePriority(t *testing.T) {
	s := policyService(t, func(c *Config) { th := 1.0; c.QueueThreshold = &th }, func(b *SelectionServiceBuilder) {
		b.Classifier(ClassifierFunc(func(ctx context.Context, req *Request) Admission {
			if ctx.Value(tenantKey{}) == "interactive" {
				return Admission{Priority: Priority{Tier: 1}}
			}
			return Admission{Priority: Priority{Tier: 0}} // the caller's tier is not trusted
		}))
	})
	ctx := testContext(t)
	// One big request on each worker makes every one busy.
	for i, w := range []string{"a", "b", "c"} {
		res, err := s.SelectAndReserve(ctx, Request{ReservationID: reservation.ID(w), Tokens: toks(200, 10+i), Allowed: []string{w}})
		require.NoError(t, err)
		require.Equal(t, w, res.WorkerID)
	}
	done := make(chan outcome, 2)
	go func() {
		r, err := s.SelectAndReserve(ctx, Request{ReservationID: "batch", Tokens: toks(8, 3), Priority: Priority{Tier: 5}, Allowed: []string{"a"}})
		done <- outcome{r, err}
	}()
	queued(t, s, "", 1)
	go func() {
		r, err := s.SelectAndReserve(context.WithValue(ctx, tenantKey{}, "interactive"),
			Request{ReservationID: "interactive", Tokens: toks(8, 4), Allowed: []string{"a"}})
		done <- outcome{r, err}
	}()
	queued(t, s, "", 2)
	require.NoError(t, s.Reservations().PrefillComplete("a"))
	got := map[string]Result{}
	for range 2 {
		o := <-done
		require.NoError(t, o.err)
		got[string(o.res.ReservationID)] = o.res
	}
	require.Less(t, got["interactive"].PotentialDecodeBlocks, got["batch"].PotentialDecodeBlocks, "the classifier's tier was admitted first")
	for _, id := range []string{"a", "b", "c", "batch", "interactive"} {
		require.NoError(t, s.Reservations().Free(reservation.ID(id)))
	}
	requireIdle(t, s)
}

func TestBuildChecksTheSeams(t *testing.T) {
	pass := FilterFunc(func(context.Context, *Request, *Scored) bool { return true })
	zero := CostTermFunc(func(context.Context, *Request, *Scored) float64 { return 0 })
	_, err := NewSelectionServiceBuilder(DefaultConfig(16)).
		Filter("ok", pass).Filter("ok", pass).Filter("Bad Name", pass).Filter("nil", nil).
		CostTerm("", zero).CostTerm("ok", zero).
		Build(context.Background())
	require.ErrorIs(t, err, ErrInvalidConfig)
	for _, want := range []string{`filter name "ok" is used twice`, `filter name "Bad Name" is not a token`, `filter "nil" is nil`, `cost term name "" is not a token`} {
		require.ErrorContains(t, err, want)
	}
	require.NotContains(t, err.Error(), `cost term name "ok"`, "names are per kind")
}

// TestSparseWithScopedTermMatchesFullScan is the sparse decision's model test
// with a scoped cost term: it prices some workers (a fixed value each, of
// either sign), and the sparse decision, which evaluates those workers' ranks
// one by one, finds the full scan's costs, ties, margin and pin.
func TestSparseWithScopedTermMatchesFullScan(t *testing.T) {
	for seed := range uint64(30) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 99))
			term := &tableTerm{price: map[string]float64{}}
			for w := range 14 {
				if r.IntN(3) == 0 {
					term.price[fmt.Sprintf("w%d", w)] = []float64{-3, -0.5, 0.25, 2, 40}[r.IntN(5)]
				}
			}
			s := checkSparseModelWith(t, seed, 40, func(b *SelectionServiceBuilder) { b.CostTerm("table", term) })
			require.Zero(t, s.Stats().PolicyFullScans, "a scoped term keeps the sparse decision")
		})
	}
}

// tableTerm prices the workers of its table, and names them as its scope.
type tableTerm struct{ price map[string]float64 }

func (tt *tableTerm) Cost(_ context.Context, _ *Request, c *Scored) float64 {
	return tt.price[c.WorkerID]
}

func (tt *tableTerm) Scope(_ context.Context, _ *Request, dst []string) []string {
	for w := range tt.price {
		dst = append(dst, w)
	}
	return dst
}

var _ ScopedCostTerm = (*tableTerm)(nil)

// With a seam that needs every candidate, a decision that would have been
// sparse takes the full scan, counted; with a scoped term it stays sparse and
// exact.
func TestSeamsAndTheSparseDecision(t *testing.T) {
	term := &tableTerm{price: map[string]float64{"w3": -1000}}
	unscoped := CostTermFunc(term.Cost)
	for _, tc := range []struct {
		name  string
		seams func(*SelectionServiceBuilder)
		full  bool
	}{
		{"none", func(*SelectionServiceBuilder) {}, false},
		{"scoped-term", func(b *SelectionServiceBuilder) { b.CostTerm("t", term) }, false},
		{"unscoped-term", func(b *SelectionServiceBuilder) { b.CostTerm("t", unscoped) }, true},
		{"filter", func(b *SelectionServiceBuilder) {
			b.Filter("all", FilterFunc(func(context.Context, *Request, *Scored) bool { return true }))
		}, true},
		{"scoped-filter", func(b *SelectionServiceBuilder) {
			b.Filter("w3", &tableFilter{workers: map[string]bool{"w3": true}, mode: AdmitsOnly})
		}, false},
		{"picker", func(b *SelectionServiceBuilder) {
			b.Picker(PickerFunc(func(_ context.Context, _ *Request, cs []Scored) int {
				return slices.IndexFunc(cs, func(c Scored) bool { return c.WorkerID == "w3" })
			}))
		}, true},
		{"classifier", func(b *SelectionServiceBuilder) {
			b.Classifier(ClassifierFunc(func(_ context.Context, r *Request) Admission { return Admission{Priority: r.Priority} }))
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig(16)
			cfg.Cost = CostDynamo
			b := NewSelectionServiceBuilder(cfg).ExternalEvents().SweepInterval(-1).Rand(rand.NewPCG(1, 1))
			tc.seams(b)
			s, err := b.Build(context.Background())
			require.NoError(t, err)
			t.Cleanup(func() { _ = s.Close() })
			for w := range 20 {
				_, err := s.Workers().Upsert(catalog.Worker{ID: fmt.Sprintf("w%d", w), Endpoint: fmt.Sprintf("10.0.1.%d:80", w+1), DPSize: 8, BlockSize: 16})
				require.NoError(t, err)
			}
			res, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(64, 1)})
			require.NoError(t, err)
			if tc.name == "scoped-term" || tc.name == "unscoped-term" || tc.name == "picker" || tc.name == "scoped-filter" {
				require.Equal(t, "w3", res.WorkerID)
			}
			want := uint64(0)
			if tc.full {
				want = 1
			}
			require.Equal(t, want, s.Stats().PolicyFullScans)
		})
	}
}

// TestPolicyConcurrent books and frees from several goroutines with every
// seam set, with and without queueing, under the race detector in CI:
// afterwards every booking is freed and each filter's count is what the
// decisions excluded.
func TestPolicyConcurrent(t *testing.T) {
	for _, queueing := range []bool{false, true} {
		t.Run(fmt.Sprint("queueing=", queueing), func(t *testing.T) {
			mod := func(c *Config) {
				if queueing {
					th := 1e9
					c.QueueThreshold = &th
				}
			}
			s := policyService(t, mod, func(b *SelectionServiceBuilder) {
				b.Filter("not-c", FilterFunc(func(_ context.Context, _ *Request, c *Scored) bool { return c.WorkerID != "c" })).
					CostTerm("load", CostTermFunc(func(_ context.Context, _ *Request, c *Scored) float64 { return float64(c.ActiveRequests) })).
					Picker(PickerFunc(func(_ context.Context, _ *Request, cs []Scored) int {
						return slices.IndexFunc(cs, func(c Scored) bool {
							return c.Cost == slices.MinFunc(cs, func(x, y Scored) int { return cmpFloat(x.Cost, y.Cost) }).Cost
						})
					})).
					Classifier(ClassifierFunc(func(_ context.Context, r *Request) Admission {
						if r.ISL%7 == 0 {
							return Admission{Refuse: "sevens"}
						}
						return Admission{Priority: Priority{Tier: r.ISL % 2}}
					}))
			})
			var wg sync.WaitGroup
			var refused, booked sync.Map
			for g := range 4 {
				wg.Go(func() {
					for i := range 100 {
						req := Request{ISL: 1 + (g*100+i)%50}
						b, err := s.Book(context.Background(), req)
						if err != nil {
							assert.ErrorIs(t, err, ErrRefused)
							refused.Store(fmt.Sprint(g, i), true)
							continue
						}
						assert.NotEqual(t, "c", b.WorkerID)
						booked.Store(fmt.Sprint(g, i), true)
						assert.NoError(t, b.Done())
					}
				})
			}
			wg.Wait()
			n, m := 0, 0
			refused.Range(func(any, any) bool { n++; return true })
			booked.Range(func(any, any) bool { m++; return true })
			st := s.Stats()
			require.EqualValues(t, n, st.ClassifierRefusals)
			require.Equal(t, map[string]uint64{"not-c": uint64(m)}, st.Filtered)
			requireIdle(t, s)
		})
	}
}

// BenchmarkPolicySeams measures what the seams cost a decision: each
// sub-benchmark alternates SelectAndReserve + Free between a service with no
// seam and one with the seams named (each first half of the time), so that
// both see the same machine moment by moment; p50-ns is the median with the
// seams, none-p50-ns without, x-none their ratio. workers=64 is
// BenchmarkSelectAndReserve's fleet (the full scan, the predictive cost);
// ranks=N is BenchmarkSelectAndReserveFleet's, where a decision is sparse
// without seams: a scoped term and scoped filters keep it sparse, a filter
// (or a term) without a scope takes the full scan. scoped-filter+term is a
// RefusesOnly filter naming 2 workers (16 ranks) and a scoped term;
// admits-only+term an AdmitsOnly filter naming 16 workers (128 ranks: an
// adapter's holders) and a scoped term. ranks=N/alternating/... alternates
// the same seams between the 64-rank fleet and the N-rank one instead:
// x-ranks64 is the ratio of their p50s (the bar: within 2x).
func BenchmarkPolicySeams(b *testing.B) {
	filter := FilterFunc(func(_ context.Context, _ *Request, c *Scored) bool { return c.Labels["taint"] == "" })
	term := CostTermFunc(func(_ context.Context, _ *Request, c *Scored) float64 { return 0.01 * float64(c.ActiveRequests) })
	scoped := &tableTerm{price: map[string]float64{"w00001": -1, "w00002": 1, "w001": -1, "w002": 1}}
	tainted := &tableFilter{workers: map[string]bool{"w00003": true, "w00004": true}, mode: RefusesOnly, cond: 3}
	holders := &tableFilter{workers: map[string]bool{}, mode: AdmitsOnly}
	for w := range 16 {
		holders.workers[fmt.Sprintf("w%05d", 7*w)] = true
	}
	filterTerm := func(x *SelectionServiceBuilder) { x.Filter("taint", filter).CostTerm("load", term) }
	scopedTerm := func(x *SelectionServiceBuilder) { x.CostTerm("table", scoped) }
	scopedFilterTerm := func(x *SelectionServiceBuilder) { x.Filter("taint", tainted).CostTerm("table", scoped) }
	admitsOnlyTerm := func(x *SelectionServiceBuilder) { x.Filter("lora", holders).CostTerm("table", scoped) }
	type fleet struct {
		s       *SelectionService
		prompts [][]uint32
	}
	for _, bc := range []struct {
		name  string
		n     int
		fleet bool // benchFleet's (ranks), else benchService's (workers)
		seams func(*SelectionServiceBuilder)
	}{
		{"workers=64/filter+term", 64, false, filterTerm},
		{"ranks=4096/scoped-term", 4096, true, scopedTerm},
		{"ranks=4096/filter+term", 4096, true, filterTerm},
		{"ranks=4096/scoped-filter+term", 4096, true, scopedFilterTerm},
		{"ranks=4096/admits-only+term", 4096, true, admitsOnlyTerm},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var none, with fleet
			if bc.fleet {
				f := buildBenchFleet(b, bc.n, nil)
				none = fleet{f.s, f.prompts}
				f = buildBenchFleet(b, bc.n, bc.seams)
				with = fleet{f.s, f.prompts}
				none.s.scan, with.s.scan = scanAuto, scanAuto
				b.Cleanup(func() { _ = none.s.Close(); _ = with.s.Close() })
			} else {
				none.s, none.prompts = benchServiceWith(b, bc.n, nil, func(x *SelectionServiceBuilder) *SelectionServiceBuilder { return x.ExternalEvents() })
				with.s, with.prompts = benchServiceWith(b, bc.n, nil, func(x *SelectionServiceBuilder) *SelectionServiceBuilder {
					bc.seams(x)
					return x.ExternalEvents()
				})
			}
			ctx := context.Background()
			ids := benchIDs("p")
			once := func(f fleet) func(int) time.Duration {
				return func(i int) time.Duration { return bookFree(ctx, b, f.s, ids[i%len(ids)], f.prompts[i%len(f.prompts)]) }
			}
			times := interleaved(b, once(none), once(with))
			pn, pw := median(times[0]), median(times[1])
			b.ReportMetric(float64(pw.Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(pn.Nanoseconds()), "none-p50-ns")
			b.ReportMetric(float64(pw)/float64(pn), "x-none")
			b.ReportMetric(float64(with.s.Stats().PolicyFullScans)/float64(len(times[1])), "full-scans/op")
		})
	}
	for _, bc := range []struct {
		name  string
		seams func(*SelectionServiceBuilder)
	}{
		{"scoped-filter+term", scopedFilterTerm},
		{"admits-only+term", admitsOnlyTerm},
	} {
		b.Run("ranks=4096/alternating/"+bc.name, func(b *testing.B) {
			small, big := buildBenchFleet(b, 64, bc.seams), buildBenchFleet(b, 4096, bc.seams)
			small.s.scan, big.s.scan = scanAuto, scanAuto
			b.Cleanup(func() { _ = small.s.Close(); _ = big.s.Close() })
			ctx := context.Background()
			ids := benchIDs("a")
			once := func(f *fleetBench) func(int) time.Duration {
				return func(i int) time.Duration { return bookFree(ctx, b, f.s, ids[i%len(ids)], f.prompts[i%len(f.prompts)]) }
			}
			times := interleaved(b, once(small), once(big))
			ps, pb := median(times[0]), median(times[1])
			b.ReportMetric(float64(pb.Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(ps.Nanoseconds()), "ranks64-p50-ns")
			b.ReportMetric(float64(pb)/float64(ps), "x-ranks64")
			b.ReportMetric(float64(big.s.Stats().PolicyFullScans)/float64(len(times[1])), "full-scans/op")
		})
	}
}
