package enginemodel

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const (
	us = time.Microsecond
	ms = time.Millisecond
)

// params are round costs that make hand computation easy: a step costs 1 ms,
// a prompt token 10 us, a decoding request 100 us.
func params() Params {
	return Params{StepBase: ms, PrefillToken: 10 * us, DecodeSeq: 100 * us, MaxBatchedTokens: 4096, MaxRunning: 16}
}

func newEngine(t testing.TB, p Params) *Engine {
	t.Helper()
	e, err := New(p)
	require.NoError(t, err)
	return e
}

// drain advances e one change at a time until it is idle and returns every
// event.
func drain(e *Engine) []Event {
	var evs []Event
	for {
		t, ok := e.Next()
		if !ok {
			return evs
		}
		evs = e.Advance(t, evs)
	}
}

func ev(at time.Duration, id uint64, k EventKind, n int) Event {
	return Event{At: at, ID: id, Kind: k, Tokens: n}
}

// A request alone: its overhead, one prefill step, then one decode step per
// further token.
func TestLoneRequest(t *testing.T) {
	p := params()
	p.RequestOverhead = 5 * ms
	e := newEngine(t, p)
	require.NoError(t, e.Add(1, 100, 3, 0))
	next, ok := e.Next()
	require.True(t, ok)
	require.Equal(t, 5*ms, next, "schedulable after its overhead")
	require.Equal(t, []Event{
		ev(7*ms, 1, EventFirstToken, 1),  // 5 ms + (1 ms + 100 x 10 us)
		ev(8100*us, 1, EventToken, 2),    // + (1 ms + 100 us)
		ev(9200*us, 1, EventToken, 3),    // + 1.1 ms
		ev(9200*us, 1, EventFinished, 3), // with its last token
	}, drain(e))
	require.Equal(t, Stats{Steps: 3}, e.Stats())
	_, ok = e.Next()
	require.False(t, ok)
}

// Two prompts that arrive together prefill in one step and get their first
// token together: the step's prefill cost is the sum.
func TestTwoRequestsShareAStep(t *testing.T) {
	e := newEngine(t, params())
	require.NoError(t, e.Add(1, 100, 1, 0))
	require.NoError(t, e.Add(2, 200, 1, 0))
	require.Equal(t, []Event{
		ev(4*ms, 1, EventFirstToken, 1), ev(4*ms, 1, EventFinished, 1),
		ev(4*ms, 2, EventFirstToken, 1), ev(4*ms, 2, EventFinished, 1),
	}, drain(e))
}

// A prompt longer than the step budget is computed in chunks, one a step.
func TestChunkedPrefill(t *testing.T) {
	p := params()
	p.MaxBatchedTokens = 64
	e := newEngine(t, p)
	require.NoError(t, e.Add(1, 150, 1, 0))
	require.NoError(t, e.Add(2, 10, 1, 0))
	// Step 1: 64 of request 1's prompt, nothing left for 2 (1.64 ms). Step 2:
	// 64 more (1.64 ms). Step 3: the last 22 of 1, then 10 of 2 (1.32 ms).
	want := 1640*us + 1640*us + 1320*us
	require.Equal(t, []Event{
		ev(want, 1, EventFirstToken, 1), ev(want, 1, EventFinished, 1),
		ev(want, 2, EventFirstToken, 1), ev(want, 2, EventFinished, 1),
	}, drain(e))
	require.EqualValues(t, 3, e.Stats().Steps)
}

// A request that decodes shares the step a newcomer prefills in: the
// newcomer waits for the step in progress and pays for the decode.
func TestDecodeSlowsPrefill(t *testing.T) {
	e := newEngine(t, params())
	require.NoError(t, e.Add(1, 10, 5, 0))
	evs := e.Advance(ms, nil) // the first step (1.1 ms) is in progress
	require.Empty(t, evs)
	require.NoError(t, e.Add(2, 100, 1, ms))
	evs = drain(e)
	// Step 2 begins at 1.1 ms: 1 decodes, 2 prefills: 1 + 0.1 + 1 ms.
	require.Contains(t, evs, ev(3200*us, 2, EventFirstToken, 1))
	require.Equal(t, ev(1100*us, 1, EventFirstToken, 1), evs[0])

	// Alone, the same request gets its first token 2 ms after it arrives.
	alone := newEngine(t, params())
	require.NoError(t, alone.Add(2, 100, 1, ms))
	require.Equal(t, ev(3*ms, 2, EventFirstToken, 1), drain(alone)[0])
}

// With one seat, the second request waits until the first has finished.
func TestMaxRunningQueues(t *testing.T) {
	p := params()
	p.MaxRunning = 1
	e := newEngine(t, p)
	require.NoError(t, e.Add(1, 10, 2, 0))
	require.NoError(t, e.Add(2, 10, 1, 0))
	require.Equal(t, Stats{Waiting: 2, QueuedPrefillTokens: 20}, e.Stats())
	require.Equal(t, []Event{
		ev(1100*us, 1, EventFirstToken, 1),
		ev(2200*us, 1, EventToken, 2), ev(2200*us, 1, EventFinished, 2),
		ev(3300*us, 2, EventFirstToken, 1), ev(3300*us, 2, EventFinished, 1),
	}, drain(e))
}

// Speed divides every step.
func TestSpeed(t *testing.T) {
	for _, tc := range []struct {
		speed float64
		want  time.Duration
	}{{1, 2 * ms}, {0.5, 4 * ms}, {2, ms}} {
		p := params()
		p.Speed = tc.speed
		e := newEngine(t, p)
		require.NoError(t, e.Add(7, 100, 1, 0))
		require.Equal(t, ev(tc.want, 7, EventFirstToken, 1), drain(e)[0], "speed %v", tc.speed)
	}
}

// Cached is asked when the request is first scheduled, and a full hit still
// computes one token.
func TestCached(t *testing.T) {
	var asked []uint64
	p := params()
	p.MaxRunning = 1
	p.Cached = func(id uint64) int {
		asked = append(asked, id)
		return map[uint64]int{1: 90, 2: 500}[id]
	}
	e := newEngine(t, p)
	require.NoError(t, e.Add(1, 100, 1, 0))
	require.NoError(t, e.Add(2, 100, 1, 0))
	require.Equal(t, 200, e.Stats().QueuedPrefillTokens, "the whole prompts until the cache is read")
	evs := e.Advance(0, nil)
	require.Empty(t, evs)
	require.Equal(t, []uint64{1}, asked, "only the request admitted")
	require.Equal(t, 110, e.Stats().QueuedPrefillTokens, "request 1 computes 10 of its 100")
	evs = drain(e)
	require.Equal(t, []uint64{1, 2}, asked)
	require.Equal(t, ev(1100*us, 1, EventFirstToken, 1), evs[0])
	require.Equal(t, ev(1100*us+1010*us, 2, EventFirstToken, 1), evs[2])
}

// Advance stops after a step that ends at its bound: the next step, which
// asks Cached, begins on the next call, after the caller saw the events.
func TestAdvanceStopsAtAStepEnd(t *testing.T) {
	stored := false
	p := params()
	p.MaxRunning = 1
	p.Cached = func(id uint64) int {
		if id == 2 && stored {
			return 99
		}
		return 0
	}
	e := newEngine(t, p)
	require.NoError(t, e.Add(1, 100, 1, 0))
	require.NoError(t, e.Add(2, 100, 1, 0))
	evs := e.Advance(0, nil)
	require.Empty(t, evs)
	evs = e.Advance(2*ms, nil)
	require.Equal(t, []Event{ev(2*ms, 1, EventFirstToken, 1), ev(2*ms, 1, EventFinished, 1)}, evs)
	next, _ := e.Next()
	require.Equal(t, 2*ms, next, "request 2's step begins now, on the next call")
	stored = true
	evs = e.Advance(2*ms, nil)
	require.Empty(t, evs)
	require.Equal(t, []Event{ev(3010*us, 2, EventFirstToken, 1), ev(3010*us, 2, EventFinished, 1)}, drain(e))
}

func TestCancel(t *testing.T) {
	p := params()
	p.MaxRunning = 1
	e := newEngine(t, p)
	require.NoError(t, e.Add(1, 100, 3, 0))
	require.NoError(t, e.Add(2, 100, 1, 0))
	require.NoError(t, e.Add(3, 100, 1, 0))
	require.True(t, e.Cancel(2), "a waiting request")
	require.False(t, e.Cancel(2))
	require.False(t, e.Cancel(9))
	evs := e.Advance(ms, nil) // request 1's prefill is in progress
	require.Empty(t, evs)
	require.True(t, e.Cancel(1), "a request in the step in progress")
	require.ErrorIs(t, e.Add(3, 1, 1, ms), ErrDuplicateID)
	require.NoError(t, e.Add(1, 100, 1, ms), "its id is free again")
	evs = drain(e)
	// Step 1 still ends at 2 ms; request 3 then prefills alone (2 ms), then
	// the new request 1.
	require.Equal(t, []Event{
		ev(4*ms, 3, EventFirstToken, 1), ev(4*ms, 3, EventFinished, 1),
		ev(6*ms, 1, EventFirstToken, 1), ev(6*ms, 1, EventFinished, 1),
	}, evs)
	require.Equal(t, Stats{Steps: 3}, e.Stats())
}

func TestAddClampsAndValidates(t *testing.T) {
	e := newEngine(t, params())
	e.Advance(10*ms, nil)
	require.Equal(t, 10*ms, e.Now())
	require.NoError(t, e.Add(1, 0, 0, 0), "a past time is now; no prompt or output is one token")
	require.Equal(t, []Event{ev(10*ms+1010*us, 1, EventFirstToken, 1), ev(10*ms+1010*us, 1, EventFinished, 1)}, drain(e))
	require.ErrorIs(t, e.Add(2, -1, 1, 0), ErrInvalidRequest)
	require.ErrorIs(t, e.Add(2, 1, -1, 0), ErrInvalidRequest)
	require.NoError(t, e.Add(2, 1, 1, 20*ms), "a future time delays the request")
	next, _ := e.Next()
	require.Equal(t, 20*ms, next)
}

func TestParams(t *testing.T) {
	e := newEngine(t, Params{})
	p := e.Params()
	require.Equal(t, DefaultMaxBatchedTokens, p.MaxBatchedTokens)
	require.Equal(t, DefaultMaxRunning, p.MaxRunning)
	require.Equal(t, DefaultStepBase, p.StepBase)
	require.Equal(t, DefaultPrefillToken, p.PrefillToken)
	require.Equal(t, DefaultDecodeSeq, p.DecodeSeq)
	require.Equal(t, 1.0, p.Speed)
	require.Zero(t, p.RequestOverhead)

	none := newEngine(t, Params{StepBase: -1, PrefillToken: -1, DecodeSeq: -1, MaxRunning: 4})
	p = none.Params()
	require.Zero(t, p.StepBase+p.PrefillToken+p.DecodeSeq, "negative costs are none")
	require.Equal(t, DefaultMaxBatchedTokens, p.MaxBatchedTokens)

	_, err := New(Params{RequestOverhead: -1, MaxRunning: 8, MaxBatchedTokens: 4, Speed: -2})
	require.ErrorIs(t, err, ErrInvalidParams)
	for _, want := range []string{"RequestOverhead -1ns", "MaxBatchedTokens 4 < MaxRunning 8", "Speed -2"} {
		require.ErrorContains(t, err, want)
	}
	_, err = New(Params{MaxRunning: -1})
	require.ErrorContains(t, err, "MaxRunning -1")
}

// check plays a random scenario and verifies the invariants: every request
// not canceled gets one first token, its tokens in order, one finish; times
// never go back; the engine ends empty.
func check(t *testing.T, seed uint64, n int) {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	p := Params{
		RequestOverhead:  time.Duration(rng.IntN(3)) * ms,
		MaxRunning:       1 + rng.IntN(8),
		StepBase:         time.Duration(rng.IntN(3)-1) * ms,
		PrefillToken:     time.Duration(rng.IntN(20)-1) * us,
		DecodeSeq:        time.Duration(rng.IntN(200)-1) * us,
		Speed:            []float64{0.5, 1, 3}[rng.IntN(3)],
		MaxBatchedTokens: 0,
	}
	p.MaxBatchedTokens = p.MaxRunning + rng.IntN(300)
	cached := map[uint64]int{}
	if rng.IntN(2) == 0 {
		p.Cached = func(id uint64) int { return cached[id] }
	}
	e := newEngine(t, p)
	type seen struct {
		out, tokens int
		first, done bool
		canceled    bool
	}
	reqs := map[uint64]*seen{}
	var last time.Duration
	var buf []Event
	var now time.Duration
	consume := func(evs []Event) {
		for _, x := range evs {
			require.GreaterOrEqual(t, x.At, last, "time goes back: %+v", x)
			last = x.At
			s := reqs[x.ID]
			require.NotNil(t, s, "event of an unknown request %+v", x)
			require.False(t, s.canceled, "event after Cancel %+v", x)
			require.False(t, s.done, "event after the finish %+v", x)
			switch x.Kind {
			case EventFirstToken:
				require.False(t, s.first, "second first token %+v", x)
				require.Equal(t, 1, x.Tokens)
				s.first, s.tokens = true, 1
			case EventToken:
				require.True(t, s.first)
				require.Equal(t, s.tokens+1, x.Tokens)
				s.tokens++
			case EventFinished:
				require.True(t, s.first)
				require.Equal(t, s.out, s.tokens)
				require.Equal(t, s.tokens, x.Tokens)
				s.done = true
			}
		}
	}
	for id := uint64(0); id < uint64(n); id++ {
		now += time.Duration(rng.IntN(3000)) * us
		if rng.IntN(4) == 0 {
			buf = e.Advance(now, buf[:0])
		} else {
			for {
				t, ok := e.Next()
				if !ok || t > now {
					break
				}
				buf = e.Advance(t, buf[:0])
				consume(buf)
				buf = buf[:0]
			}
		}
		consume(buf)
		buf = buf[:0]
		prompt, out := rng.IntN(700), rng.IntN(12)
		cached[id] = rng.IntN(prompt + 50)
		require.NoError(t, e.Add(id, prompt, out, now+time.Duration(rng.IntN(2))*ms))
		reqs[id] = &seen{out: max(1, out)}
		if rng.IntN(10) == 0 {
			victim := uint64(rng.IntN(int(id) + 1))
			if s := reqs[victim]; !s.done && e.Cancel(victim) {
				s.canceled = true
			}
		}
	}
	consume(drain(e))
	for id, s := range reqs {
		if !s.canceled {
			require.True(t, s.done, "request %d never finished (%+v)", id, *s)
		}
	}
	st := e.Stats()
	require.Zero(t, st.Waiting)
	require.Zero(t, st.Running)
	require.Zero(t, st.QueuedPrefillTokens)
	require.Empty(t, e.index)
}

func TestRandomScenarios(t *testing.T) {
	for seed := range uint64(200) {
		check(t, seed, 60)
	}
}

func FuzzEngine(f *testing.F) {
	for _, s := range []uint64{1, 2, 3, 42} {
		f.Add(s, uint8(40))
	}
	f.Fuzz(func(t *testing.T, seed uint64, n uint8) { check(t, seed, int(n)) })
}

// BenchmarkEngine measures a busy engine: 32 seats, 2,000-token prompts, 100
// output tokens, one request added per step on average.
func BenchmarkEngine(b *testing.B) {
	e := newEngine(b, Params{MaxRunning: 32})
	var buf []Event
	id := uint64(0)
	b.ReportAllocs()
	for b.Loop() {
		t, ok := e.Next()
		if !ok || e.Stats().Waiting < 4 {
			_ = e.Add(id, 2000, 100, e.Now())
			id++
			continue
		}
		buf = e.Advance(t, buf[:0])
	}
}
