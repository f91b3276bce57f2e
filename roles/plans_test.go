package roles

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvselect/kvselect/reservation"
	"github.com/stretchr/testify/require"
)

// epoch is the fake clock's start.
var epoch = newFakeClock().Now()

func newPlans(t testing.TB, now func() time.Time, lease time.Duration) *planTable {
	t.Helper()
	if lease == 0 {
		lease = reservation.DefaultLease
	}
	return newPlanTable(now, lease)
}

// checkPlans compares the map, the lease tree and the Active counter.
func checkPlans(t testing.TB, p *planTable) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	require.Equal(t, len(p.plans), p.leases.Len())
	var last *plan
	p.leases.Ascend(func(pl *plan) bool {
		require.Same(t, pl, p.plans[pl.id])
		if last != nil {
			require.True(t, planLess(last, pl))
		}
		last = pl
		return true
	})
	require.Equal(t, int64(len(p.plans)), p.active.Load())
}

func TestPlanLifecycle(t *testing.T) {
	clk := newFakeClock()
	p := newPlans(t, clk.Now, time.Minute)
	legs := planLegs{Prefill: "p1/prefill", Decode: "p1/decode"}
	require.NoError(t, register(p, "p1", legs))

	info, ok := p.Get("p1")
	require.True(t, ok)
	require.Equal(t, planInfo{ID: "p1", Legs: legs, RegisteredAt: epoch, Deadline: epoch.Add(time.Minute)}, info)

	s, err := p.Handoff("p1")
	require.NoError(t, err)
	require.Equal(t, settlement{Plan: "p1", FreePrefill: "p1/prefill", DecodePrefillComplete: "p1/decode"}, s)
	info, _ = p.Get("p1")
	require.True(t, info.HandedOff)

	// A second hand-off is a no-op.
	s, err = p.Handoff("p1")
	require.NoError(t, err)
	require.True(t, s.Empty())
	require.Equal(t, reservation.ID("p1"), s.Plan)

	// Complete after hand-off frees the decode leg only.
	s, err = p.Complete("p1")
	require.NoError(t, err)
	require.Equal(t, settlement{Plan: "p1", FreeDecode: "p1/decode"}, s)
	require.Zero(t, p.Len())

	// Everything after completion is unknown and harmless.
	_, err = p.Complete("p1")
	require.ErrorIs(t, err, ErrUnknownPlan)
	_, err = p.Handoff("p1")
	require.ErrorIs(t, err, ErrUnknownPlan)
	_, ok = p.Get("p1")
	require.False(t, ok)
	require.Equal(t, PlanStats{Registered: 1, HandedOff: 1, Completed: 1}, p.Stats())
	checkPlans(t, p)
}

func TestPlanCompleteWithoutHandoffFreesBothLegs(t *testing.T) {
	p := newPlans(t, newFakeClock().Now, 0)
	require.NoError(t, register(p, "p", planLegs{Prefill: "a", Decode: "b"}))
	s, err := p.Complete("p")
	require.NoError(t, err)
	require.Equal(t, settlement{Plan: "p", FreePrefill: "a", FreeDecode: "b"}, s)
}

func TestPlanDecodeOnly(t *testing.T) {
	p := newPlans(t, newFakeClock().Now, 0)
	require.NoError(t, register(p, "p", planLegs{Decode: "p/aggregated"}))
	s, err := p.Handoff("p")
	require.NoError(t, err)
	require.Equal(t, settlement{Plan: "p", DecodePrefillComplete: "p/aggregated"}, s)
	s, err = p.Complete("p")
	require.NoError(t, err)
	require.Equal(t, settlement{Plan: "p", FreeDecode: "p/aggregated"}, s)
}

func TestPlanRegisterRejects(t *testing.T) {
	p := newPlans(t, newFakeClock().Now, 0)
	err := register(p, "", planLegs{})
	require.ErrorIs(t, err, reservation.ErrInvalid)
	require.ErrorContains(t, err, "plan id is empty")
	require.ErrorContains(t, err, "decode reservation id is empty")
	require.ErrorIs(t, register(p, "x", planLegs{Prefill: "same", Decode: "same"}), reservation.ErrInvalid)

	require.NoError(t, register(p, "x", planLegs{Decode: "d"}))
	require.ErrorIs(t, register(p, "x", planLegs{Prefill: "p2", Decode: "d2"}), reservation.ErrConflict)
	info, _ := p.Get("x")
	require.Equal(t, planLegs{Decode: "d"}, info.Legs, "a rejected Register changed the plan")
	require.Equal(t, int64(1), p.Stats().Registered)
	checkPlans(t, p)
}

func TestPlanExpire(t *testing.T) {
	clk := newFakeClock()
	p := newPlans(t, clk.Now, 10*time.Second)
	require.NoError(t, register(p, "a", planLegs{Prefill: "a/p", Decode: "a/d"}))
	clk.Advance(time.Second)
	require.NoError(t, register(p, "b", planLegs{Prefill: "b/p", Decode: "b/d"}))
	require.NoError(t, register(p, "c", planLegs{Prefill: "c/p", Decode: "c/d"}))
	_, err := p.Handoff("b")
	require.NoError(t, err)

	next, ok := p.NextExpiry()
	require.True(t, ok)
	require.Equal(t, epoch.Add(10*time.Second), next)

	require.Nil(t, p.Expire(epoch.Add(9*time.Second)))
	got := p.Expire(epoch.Add(10 * time.Second))
	require.Equal(t, []settlement{{Plan: "a", FreePrefill: "a/p", FreeDecode: "a/d"}}, got)

	// Same deadline: registration order; a handed-off plan frees decode only.
	got = p.Expire(epoch.Add(time.Hour))
	require.Equal(t, []settlement{
		{Plan: "b", FreeDecode: "b/d"},
		{Plan: "c", FreePrefill: "c/p", FreeDecode: "c/d"},
	}, got)
	_, ok = p.NextExpiry()
	require.False(t, ok)
	_, err = p.Complete("a")
	require.ErrorIs(t, err, ErrUnknownPlan)
	require.Equal(t, PlanStats{Registered: 3, HandedOff: 1, Expired: 3}, p.Stats())
	checkPlans(t, p)
}

// TestPlansModel drives Plans with random operations and checks it against a
// map: every registered leg is settled exactly once, by exactly one of Handoff
// (prefill), Complete or Expire.
func TestPlansModel(t *testing.T) {
	clk := newFakeClock()
	p := newPlans(t, clk.Now, 30*time.Second)
	r := rand.New(rand.NewPCG(3, 4))
	type state struct{ handedOff bool }
	model := map[string]*state{}
	freed := map[string]int{} // reservation id -> times freed
	prefillDone := map[string]int{}
	apply := func(s settlement) {
		if s.FreePrefill != "" {
			freed[string(s.FreePrefill)]++
		}
		if s.FreeDecode != "" {
			freed[string(s.FreeDecode)]++
		}
		if s.DecodePrefillComplete != "" {
			prefillDone[string(s.DecodePrefillComplete)]++
		}
	}
	n := 0
	for range 5000 {
		switch op := r.IntN(10); {
		case op < 4:
			id := fmt.Sprintf("plan-%d", n)
			n++
			legs := planLegs{Prefill: reservation.ID(id + "/prefill"), Decode: reservation.ID(id + "/decode")}
			if r.IntN(5) == 0 {
				legs.Prefill = ""
			}
			require.NoError(t, register(p, id, legs))
			model[id] = &state{}
		case op < 6 && n > 0:
			id := fmt.Sprintf("plan-%d", r.IntN(n))
			s, err := p.Handoff(reservation.ID(id))
			if st := model[id]; st == nil {
				require.ErrorIs(t, err, ErrUnknownPlan)
			} else {
				require.NoError(t, err)
				if st.handedOff {
					require.True(t, s.Empty())
				}
				st.handedOff = true
				apply(s)
			}
		case op < 8 && n > 0:
			id := fmt.Sprintf("plan-%d", r.IntN(n))
			s, err := p.Complete(reservation.ID(id))
			if model[id] == nil {
				require.ErrorIs(t, err, ErrUnknownPlan)
			} else {
				require.NoError(t, err)
				delete(model, id)
				apply(s)
			}
		case op == 8:
			clk.Advance(time.Duration(r.IntN(5)) * time.Second)
			for _, s := range p.Expire(clk.Now()) {
				require.NotNil(t, model[string(s.Plan)])
				delete(model, string(s.Plan))
				apply(s)
			}
		default:
			require.Equal(t, len(model), p.Len())
		}
	}
	for _, s := range p.Expire(clk.Now().Add(time.Hour)) {
		delete(model, string(s.Plan))
		apply(s)
	}
	require.Empty(t, model)
	require.Zero(t, p.Len())
	for id, k := range freed {
		require.Equal(t, 1, k, "reservation %q freed %d times", id, k)
	}
	for id, k := range prefillDone {
		require.Equal(t, 1, k, "reservation %q marked prefill-complete %d times", id, k)
	}
	for i := range n {
		require.Equal(t, 1, freed[fmt.Sprintf("plan-%d/decode", i)], "decode leg of plan-%d", i)
	}
	checkPlans(t, p)
}

func TestPlansConcurrent(t *testing.T) {
	p := newPlans(t, newFakeClock().Now, 0)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 500 {
				id := fmt.Sprintf("g%d-%d", g, i)
				if err := register(p, id, planLegs{Prefill: reservation.ID(id + "/p"), Decode: reservation.ID(id + "/d")}); err != nil {
					t.Error(err)
					return
				}
				if i%2 == 0 {
					_, _ = p.Handoff(reservation.ID(id))
					_, _ = p.Handoff(reservation.ID(id))
				}
				if _, err := p.Complete(reservation.ID(id)); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Zero(t, p.Len())
	st := p.Stats()
	require.Equal(t, PlanStats{Registered: 4000, HandedOff: 2000, Completed: 4000}, st)
	checkPlans(t, p)
}

func BenchmarkPlansRegisterComplete(b *testing.B) {
	p := newPlans(b, time.Now, 0)
	ids := make([]string, 1024)
	for i := range ids {
		ids[i] = fmt.Sprintf("plan-%d", i)
	}
	legs := planLegs{Prefill: "p", Decode: "d"}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		id := ids[i%len(ids)]
		if err := register(p, id, legs); err != nil {
			b.Fatal(err)
		}
		if _, err := p.Handoff(reservation.ID(id)); err != nil {
			b.Fatal(err)
		}
		if _, err := p.Complete(reservation.ID(id)); err != nil {
			b.Fatal(err)
		}
	}
}

// register is Register for the tests that need no entry: its decode leg on
// worker "w".
func register(p *planTable, id string, legs planLegs) error {
	_, err := p.Register(reservation.ID(id), legs, "w")
	return err
}
