package selection

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/reservation"
)

// drain admits the queue's heads until it is empty and returns them.
func drain(q *waitQueue) []*waiter {
	var out []*waiter
	for q.Len() > 0 {
		w := q.head()
		q.remove(w, true)
		out = append(out, w)
	}
	return out
}

func TestWaitQueueDRRSharesFollowWeights(t *testing.T) {
	// Two classes always waiting, of costs 1000 and 8000 tokens, weights 3
	// and 1: the tokens admitted follow 3:1 whatever the request sizes.
	var q waitQueue
	seq := uint64(0)
	push := func(class int32, cost, quantum float64) {
		seq++
		q.push(&waiter{class: class, cost: cost, deadline: noDeadline, seq: seq}, quantum)
	}
	for range 4000 {
		push(0, 1000, 3*ClassQuantum)
	}
	for range 500 {
		push(1, 8000, 1*ClassQuantum)
	}
	tokens := [2]float64{}
	// While both wait (the first 3,000,000 tokens of class 0's 4,000,000).
	for tokens[0]+tokens[1] < 3_000_000 {
		w := q.head()
		q.remove(w, true)
		tokens[w.class] += w.cost
	}
	share := tokens[0] / (tokens[0] + tokens[1])
	require.InDelta(t, 0.75, share, 0.01, "tokens %v", tokens)
	rest := drain(&q)
	require.Zero(t, q.Len())
	require.NotEmpty(t, rest)
}

func TestWaitQueueEDFWithinClassAndTiers(t *testing.T) {
	var q waitQueue
	at := func(s int) int64 { return time.Unix(int64(s), 0).UnixNano() }
	// Class 0: no deadline (score order), then deadlines 30, 10, 20.
	q.push(&waiter{class: 0, cost: 1, deadline: noDeadline, score: 5, seq: 1}, ClassQuantum)
	q.push(&waiter{class: 0, cost: 1, deadline: at(30), seq: 2}, ClassQuantum)
	q.push(&waiter{class: 0, cost: 1, deadline: at(10), seq: 3}, ClassQuantum)
	q.push(&waiter{class: 0, cost: 1, deadline: at(20), seq: 4}, ClassQuantum)
	q.push(&waiter{class: 0, cost: 1, deadline: noDeadline, score: 9, seq: 5}, ClassQuantum)
	// A higher tier goes first, whatever its deadline.
	q.push(&waiter{tier: 1, class: 1, cost: 1, deadline: noDeadline, seq: 6}, ClassQuantum)
	var order []uint64
	for _, w := range drain(&q) {
		order = append(order, w.seq)
	}
	require.Equal(t, []uint64{6, 3, 4, 2, 5, 1}, order)
}

func TestWaitQueueExpireTakesPassedDeadlines(t *testing.T) {
	var q waitQueue
	ws := []*waiter{
		{class: 0, cost: 1, deadline: 10, seq: 1},
		{class: 0, cost: 1, deadline: 20, seq: 2},
		{class: 1, cost: 1, deadline: 5, seq: 3},
		{class: 1, cost: 1, deadline: noDeadline, seq: 4},
		{tier: 2, class: 2, cost: 1, deadline: 1, seq: 5},
	}
	for _, w := range ws {
		q.push(w, ClassQuantum)
	}
	require.False(t, q.expire(0))
	require.True(t, q.expire(10))
	require.Equal(t, 2, q.Len())
	require.True(t, ws[0].expired && ws[2].expired && ws[4].expired)
	require.False(t, ws[1].expired || ws[3].expired)
	require.Equal(t, 1, q.classWaiting(0))
	require.Equal(t, 0, q.classWaiting(2))
	require.Len(t, q.tiers, 1)
	require.Equal(t, 2, len(drain(&q)))
}

func TestWaitQueueLargeRequestCostsRoundsNotLoops(t *testing.T) {
	// A request a million times its quantum is admitted after the other
	// class's turns, without looping a million times.
	var q waitQueue
	q.push(&waiter{class: 0, cost: 1e6 * ClassQuantum, deadline: noDeadline, seq: 1}, ClassQuantum)
	for i := range 3 {
		q.push(&waiter{class: 1, cost: ClassQuantum, deadline: noDeadline, seq: uint64(2 + i)}, ClassQuantum)
	}
	var order []uint64
	for _, w := range drain(&q) {
		order = append(order, w.seq)
	}
	require.Equal(t, []uint64{2, 3, 4, 1}, order)
}

func TestClassConfigValidation(t *testing.T) {
	cfg := DefaultConfig(4)
	cfg.Classes = []Class{
		{Name: "Interactive", Weight: 1},
		{Name: "batch", Weight: 0},
		{Name: "batch", Weight: math.NaN(), QueueLimit: -1, InFlightLimit: -2, Deadline: -time.Second},
	}
	cfg.DefaultClass = "nope"
	before := fmt.Sprint(cfg.Classes) // NaN != NaN
	err := cfg.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	for _, want := range []string{
		`Classes[0].Name "Interactive" is not a token`,
		`Classes[1] (batch): Weight is 0`,
		`Classes[2].Name "batch" is used twice`,
		`Classes[2] (batch): Weight is NaN`,
		`QueueLimit is -1`, `InFlightLimit is -2`, `Deadline is -1s`,
		`DefaultClass "nope" names none of the Classes`,
	} {
		require.ErrorContains(t, err, want)
	}
	require.Equal(t, before, fmt.Sprint(cfg.Classes), "Validate must not change the classes")

	cfg = DefaultConfig(4)
	cfg.DefaultClass = "batch"
	require.ErrorContains(t, cfg.Validate(), `DefaultClass is "batch" but Classes is empty`)
}

func TestParseClasses(t *testing.T) {
	cs, err := ParseClasses(" interactive:weight=3,tier=1,deadline=2s ; batch:queue=256,inflight=512")
	require.NoError(t, err)
	require.Equal(t, []Class{
		{Name: "interactive", Weight: 3, Tier: 1, Deadline: 2 * time.Second},
		{Name: "batch", Weight: 1, QueueLimit: 256, InFlightLimit: 512},
	}, cs)
	cs, err = ParseClasses("")
	require.NoError(t, err)
	require.Nil(t, cs)
	for _, bad := range []string{"a:weight", "a:speed=2", "a:weight=x", "a:deadline=soon"} {
		_, err := ParseClasses(bad)
		require.ErrorIs(t, err, ErrInvalidConfig, bad)
	}
}

// classService is a service with two classes, interactive and batch, and
// the given changes, on one worker "a".
func classService(t *testing.T, mod func(*Config)) (*SelectionService, *fakeClock) {
	t.Helper()
	s, clk := newTestService(t, func(c *Config) {
		c.Classes = []Class{
			{Name: "interactive", Weight: 3, Tier: 0, Deadline: time.Second},
			{Name: "batch", Weight: 1, QueueLimit: 1, InFlightLimit: 2},
		}
		if mod != nil {
			mod(c)
		}
	})
	addWorkers(t, s, "a")
	return s, clk
}

func TestClassInFlightLimitRefusesWithItsReason(t *testing.T) {
	for _, queueing := range []bool{false, true} {
		t.Run(fmt.Sprintf("queueing=%v", queueing), func(t *testing.T) {
			s, _ := classService(t, func(c *Config) {
				if queueing {
					th := 1e9
					c.QueueThreshold = &th
				}
			})
			ctx := context.Background()
			var held []*Booking
			for range 2 {
				b, err := s.Book(ctx, Request{ISL: 8, Class: "batch"})
				require.NoError(t, err)
				held = append(held, b)
			}
			_, err := s.Book(ctx, Request{ISL: 8, Class: "batch"})
			require.ErrorIs(t, err, ErrAdmission)
			require.Equal(t, "class_inflight_full:batch", RefusalReason(err))
			require.Equal(t, http.StatusTooManyRequests, HTTPStatus(err))
			// Another class, and an unknown one (the default class,
			// interactive), are not held back.
			_, err = s.Book(ctx, Request{ISL: 8, Class: "interactive"})
			require.NoError(t, err)
			_, err = s.Book(ctx, Request{ISL: 8, Class: "no-such-class"})
			require.NoError(t, err)
			st := s.Stats().Classes
			require.Equal(t, ClassStats{InFlight: 2, Admitted: 2, Refused: map[string]uint64{RefusedClassInFlightFull: 1}}, st["batch"])
			require.Equal(t, 2, st["interactive"].InFlight)

			// Done frees the slot; so does an expired lease.
			require.NoError(t, held[0].Done())
			_, err = s.Book(ctx, Request{ISL: 8, Class: "batch", ReservationID: "x"})
			require.NoError(t, err)
			_, err = s.Book(ctx, Request{ISL: 8, Class: "batch"})
			require.Equal(t, "class_inflight_full:batch", RefusalReason(err))
			_, err = s.Workers().Delete("a")
			require.NoError(t, err)
			require.Equal(t, 0, s.Stats().Classes["batch"].InFlight)
			addWorkers(t, s, "a")
			_, err = s.Book(ctx, Request{ISL: 8, Class: "batch"})
			require.NoError(t, err)
		})
	}
}

func TestClassQueueLimitAndDeadline(t *testing.T) {
	s, clk := classService(t, func(c *Config) { th := 0.5; c.QueueThreshold = &th })
	ctx := testContext(t)
	blocker, err := s.Book(ctx, Request{ISL: 200, Class: "interactive"})
	require.NoError(t, err)

	results := make(chan outcome, 4)
	book := func(req Request) {
		go func() {
			r, err := s.SelectAndReserve(ctx, req)
			results <- outcome{r, err}
		}()
	}
	book(Request{ISL: 8, Class: "batch", ReservationID: "b1"})
	queued(t, s, "", 1)
	// The class's queue holds one: the next is refused at once.
	_, err = s.SelectAndReserve(ctx, Request{ISL: 8, Class: "batch"})
	require.ErrorIs(t, err, ErrAdmission)
	require.Equal(t, "class_queue_full:batch", RefusalReason(err))

	// An interactive request (deadline 1 s) waits, and is refused when
	// its deadline passes, with its own reason.
	book(Request{ISL: 8, Class: "interactive", ReservationID: "i1"})
	queued(t, s, "", 2)
	clk.Advance(1500 * time.Millisecond)
	s.partition("").signal() // what any capacity change does
	o := <-results
	require.ErrorIs(t, o.err, ErrAdmission)
	require.Equal(t, "deadline:interactive", RefusalReason(o.err))
	require.Equal(t, http.StatusTooManyRequests, HTTPStatus(o.err))

	// The batch request has no deadline: it is admitted when capacity frees.
	require.NoError(t, blocker.Done())
	o = <-results
	require.NoError(t, o.err)
	require.Equal(t, reservation.ID("b1"), o.res.ReservationID)

	st := s.Stats()
	require.Equal(t, map[string]uint64{RefusedClassQueueFull: 1}, st.Classes["batch"].Refused)
	require.Equal(t, map[string]uint64{RefusedDeadline: 1}, st.Classes["interactive"].Refused)
	require.EqualValues(t, 1, st.DeadlineRefused)
	require.Zero(t, st.Waiting)
	require.Zero(t, st.Classes["interactive"].Waiting+st.Classes["batch"].Waiting)
}

func TestClassifierSetsClassAndDeadline(t *testing.T) {
	clk := newFakeClock()
	cfg := DefaultConfig(4)
	cfg.UseKVEvents = false
	th := 0.5
	cfg.QueueThreshold = &th
	cfg.Classes = []Class{{Name: "batch", Weight: 1}, {Name: "interactive", Weight: 1}}
	s, err := NewSelectionServiceBuilder(cfg).Clock(clk.Now).SweepInterval(-1).
		Classifier(ClassifierFunc(func(_ context.Context, req *Request) Admission {
			if req.ISL < 100 {
				return Admission{Class: "interactive", Deadline: clk.Now().Add(time.Second)}
			}
			return Admission{}
		})).Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	addWorkers(t, s, "a")
	ctx := testContext(t)
	_, err = s.Book(ctx, Request{ISL: 500})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := s.SelectAndReserve(ctx, Request{ISL: 8})
		done <- err
	}()
	queued(t, s, "", 1)
	clk.Advance(2 * time.Second)
	s.partition("").signal()
	require.Equal(t, "deadline:interactive", RefusalReason(<-done))
	require.EqualValues(t, 1, s.Stats().Classes["batch"].Admitted)
}

// overloadRun is the result of one simulated run of classOverload.
type overloadRun struct {
	ttft     map[string][]time.Duration // admitted requests' times to first token, by class
	wait     map[string]time.Duration   // their queue waits, summed
	tokens   map[string]float64         // the prompt tokens admitted while requests arrive, summed
	refused  map[string]int             // refusals by reason
	arrivals map[string]int
}

// classOverload runs a deterministic load test on the real service with
// queueing and a fake clock: workers prefill one request at a time at rate
// tokens a second (QueueThreshold 0: a worker with prefill booked is busy),
// the request's first token comes when its prefill ends (then it is done);
// each class's requests arrive as a Poisson process (seeded) of fixed
// prompt length, for span of simulated time. The driver advances the clock
// from event to event and, after each, waits until the service has acted
// on it (an arrival has been booked, refused or queued; a freed worker has
// admitted the queue's head, if any may be admitted), so the run does not
// depend on goroutine timing.
func classOverload(t *testing.T, classes []Class, load map[string]struct {
	perSec float64
	isl    int
}, workers int, rate float64, span time.Duration) overloadRun {
	t.Helper()
	th := 0.0
	s, clk := newTestService(t, func(c *Config) {
		c.QueueThreshold, c.Classes, c.QueueLimit = &th, classes, 100_000
	})
	for i := range workers {
		_, err := s.Workers().Upsert(worker(fmt.Sprintf("w%02d", i), nil))
		require.NoError(t, err)
	}
	joined := make(chan struct{}, 1024)
	s.onQueued = func() { joined <- struct{}{} }

	type arrival struct {
		at    time.Duration
		class string
		isl   int
	}
	rng := rand.New(rand.NewPCG(7, 11))
	var arrivals []arrival
	names := make([]string, 0, len(load))
	for name := range load {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		l := load[name]
		for at := time.Duration(0); ; {
			at += time.Duration(rng.ExpFloat64() / l.perSec * float64(time.Second))
			if at >= span {
				break
			}
			arrivals = append(arrivals, arrival{at, name, l.isl})
		}
	}
	sort.SliceStable(arrivals, func(i, j int) bool { return arrivals[i].at < arrivals[j].at })

	type result struct {
		id  reservation.ID
		res Result
		err error
	}
	type pending struct {
		class    string
		isl      int
		arrived  time.Duration
		deadline time.Duration // -1: none
	}
	results := make(chan result, len(arrivals))
	// A guard against a hang, long enough for -race on two shared cores.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	start := clk.Now()
	now := func() time.Duration { return clk.Now().Sub(start) }
	byName := map[string]Class{}
	for _, c := range classes {
		byName[c.Name] = c
	}
	waiting := map[reservation.ID]pending{}
	all := map[reservation.ID]pending{}
	type completion struct {
		at time.Duration
		id reservation.ID
	}
	var completions []completion // sorted by at
	run := overloadRun{ttft: map[string][]time.Duration{}, wait: map[string]time.Duration{}, tokens: map[string]float64{}, refused: map[string]int{}, arrivals: map[string]int{}}

	// handle takes one result: an admission schedules its prefill's end.
	handle := func(r result) bool {
		p := all[r.id]
		delete(waiting, r.id)
		if r.err != nil {
			reason := RefusalReason(r.err)
			require.NotEmpty(t, reason, "%v", r.err)
			run.refused[reason]++
			return false
		}
		prefill := time.Duration(float64(p.isl) / rate * float64(time.Second))
		run.ttft[p.class] = append(run.ttft[p.class], now()-p.arrived+prefill)
		run.wait[p.class] += r.res.QueueWait
		if now() < span {
			run.tokens[p.class] += float64(p.isl)
		}
		c := completion{now() + prefill, r.id}
		i := sort.Search(len(completions), func(i int) bool { return completions[i].at > c.at })
		completions = slices.Insert(completions, i, c)
		return true
	}
	// eligible reports whether a waiting request may still be admitted.
	eligible := func() bool {
		for _, p := range waiting {
			if p.deadline < 0 || p.deadline > now() {
				return true
			}
		}
		return false
	}
	next := 0
	for n := 0; next < len(arrivals) || len(completions) > 0; n++ {
		takeArrival := next < len(arrivals) && (len(completions) == 0 || arrivals[next].at < completions[0].at)
		var at time.Duration
		if takeArrival {
			at = arrivals[next].at
		} else {
			at = completions[0].at
		}
		clk.Advance(at - now())
		if takeArrival {
			a := arrivals[next]
			next++
			id := reservation.ID(fmt.Sprintf("r%05d", next))
			p := pending{class: a.class, isl: a.isl, arrived: at, deadline: -1}
			if d := byName[a.class].Deadline; d > 0 {
				p.deadline = at + d
			}
			all[id], waiting[id] = p, p
			run.arrivals[a.class]++
			go func() {
				r, err := s.SelectAndReserve(ctx, Request{ReservationID: id, ISL: a.isl, Class: a.class})
				results <- result{id, r, err}
			}()
			// Booked, refused, or queued.
			for done := false; !done; {
				select {
				case r := <-results:
					handle(r)
					done = r.id == id
				case <-joined:
					done = true
				}
			}
			continue
		}
		c := completions[0]
		completions = completions[1:]
		require.NoError(t, s.Reservations().PrefillComplete(c.id))
		require.NoError(t, s.Reservations().Free(c.id))
		// The freed worker admits the head, if any request may be admitted.
		for eligible() {
			if handle(<-results) {
				break
			}
		}
	}
	for len(waiting) > 0 { // late refusals still on their way
		handle(<-results)
	}
	return run
}

func p90(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[int(math.Ceil(0.9*float64(len(s))))-1]
}

// TestFairAdmissionUnderOverload is the acceptance test of fair
// admission: two classes under overload, interactive (a 1 s deadline) and
// batch, on the real service with queueing and a fake clock.
func TestFairAdmissionUnderOverload(t *testing.T) {
	if testing.Short() {
		t.Skip("a few thousand requests")
	}
	type classLoad = struct {
		perSec float64
		isl    int
	}
	const workers, rate = 4, 10_000.0 // 40,000 prompt tokens a second in all

	t.Run("interactive-within-deadline", func(t *testing.T) {
		// Interactive asks 20% of the capacity, batch 160%: interactive
		// keeps its deadline and batch absorbs the queueing (and its queue
		// limit refuses the excess with its reason).
		run := classOverload(t, []Class{
			{Name: "interactive", Weight: 1, Deadline: time.Second},
			{Name: "batch", Weight: 1, QueueLimit: 32},
		}, map[string]classLoad{
			"interactive": {8, 1000},
			"batch":       {8, 8000},
		}, workers, rate, 120*time.Second)
		ip90 := p90(run.ttft["interactive"])
		meanWait := func(c string) time.Duration { return run.wait[c] / time.Duration(len(run.ttft[c])) }
		t.Logf("interactive: %d arrived, %d admitted, TTFT p90 %v (deadline 1s), mean wait %v; batch: %d arrived, %d admitted, TTFT p90 %v, mean wait %v; refused %v",
			run.arrivals["interactive"], len(run.ttft["interactive"]), ip90, meanWait("interactive"),
			run.arrivals["batch"], len(run.ttft["batch"]), p90(run.ttft["batch"]), meanWait("batch"), run.refused)
		require.LessOrEqual(t, ip90, time.Second)
		require.Greater(t, meanWait("batch"), 10*meanWait("interactive"))
		require.Positive(t, run.refused["class_queue_full:batch"])
		require.Zero(t, run.refused["deadline:interactive"])
	})

	t.Run("drr-shares-follow-weights", func(t *testing.T) {
		// Both classes ask more than their share: the prompt tokens admitted
		// while both wait (until the arrivals end; then the queues drain)
		// follow the weights, 3:1.
		run := classOverload(t, []Class{
			{Name: "interactive", Weight: 3, QueueLimit: 64},
			{Name: "batch", Weight: 1, QueueLimit: 64},
		}, map[string]classLoad{
			"interactive": {40, 1000},
			"batch":       {8, 8000},
		}, workers, rate, 120*time.Second)
		total := run.tokens["interactive"] + run.tokens["batch"]
		shares := map[string]float64{"interactive": run.tokens["interactive"] / total, "batch": run.tokens["batch"] / total}
		t.Logf("token shares %v (weights 0.75 / 0.25), admitted %d / %d, refused %v",
			shares, len(run.ttft["interactive"]), len(run.ttft["batch"]), run.refused)
		require.InEpsilon(t, 0.75, shares["interactive"], 0.05)
		require.InEpsilon(t, 0.25, shares["batch"], 0.05)
		require.Positive(t, run.refused["class_queue_full:interactive"])
		require.Positive(t, run.refused["class_queue_full:batch"])
	})
}

// Without classes, a request's own deadline holds too.
func TestDeadlineWithoutClasses(t *testing.T) {
	s, clk := newTestService(t, func(c *Config) { th := 0.5; c.QueueThreshold = &th })
	addWorkers(t, s, "a")
	ctx := testContext(t)
	_, err := s.Book(ctx, Request{ISL: 200})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := s.SelectAndReserve(ctx, Request{ISL: 8, Deadline: clk.Now().Add(time.Second)})
		done <- err
	}()
	queued(t, s, "", 1)
	clk.Advance(time.Second)
	s.partition("").signal()
	err = <-done
	require.ErrorIs(t, err, ErrAdmission)
	require.Equal(t, RefusedDeadline, RefusalReason(err))
	require.EqualValues(t, 1, s.Stats().DeadlineRefused)
	require.Nil(t, s.Stats().Classes)
}
