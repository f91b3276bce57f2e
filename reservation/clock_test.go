package reservation

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
)

// TestPrefillClockSince: a rank reports when its current prefill began; a
// queue that empties has no start.
func TestPrefillClockSince(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	a := wr("a", 0)
	ref := l.AppendRanks(nil, []catalog.WorkerRank{a})[0]
	require.Equal(t, PrefillClock{}, l.PrefillClock(ref, clk.Now()), "never booked")

	start := clk.Now()
	for i := range 3 {
		require.NoError(t, l.Book(Booking{ID: ID(fmt.Sprint(i)), Worker: a, PrefillTokens: 1000 * (i + 1)}))
		clk.Advance(time.Millisecond)
	}
	require.Equal(t, start, l.PrefillClock(ref, clk.Now()).Since, "the first booking found the queue empty")
	for i := range 3 {
		clk.Advance(100 * time.Millisecond)
		require.NoError(t, l.PrefillComplete(ID(fmt.Sprint(i))))
		c := l.PrefillClock(ref, clk.Now())
		if i < 2 {
			require.Equal(t, clk.Now(), c.Since, "the next prefill starts when one ends")
		} else {
			require.True(t, c.Since.IsZero(), "nothing queued")
		}
	}
}

// TestPrefillClockDropped: prefill that leaves without completing teaches no
// rate, and the queue's start is kept while some is still queued.
func TestPrefillClockDropped(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	a := wr("a", 0)
	ref := l.AppendRanks(nil, []catalog.WorkerRank{a})[0]
	start := clk.Now()
	require.NoError(t, l.Book(Booking{ID: "x", Worker: a, PrefillTokens: 500}))
	clk.Advance(time.Second)
	require.NoError(t, l.Book(Booking{ID: "y", Worker: a, PrefillTokens: 500}))
	require.NoError(t, l.Book(Booking{ID: "cached", Worker: a}))
	require.NoError(t, l.PrefillComplete("cached"), "nothing to prefill: no sample, no change")
	require.Equal(t, start, l.PrefillClock(ref, clk.Now()).Since)
	require.NoError(t, l.Free("x"))
	require.Equal(t, start, l.PrefillClock(ref, clk.Now()).Since, "y is still queued")
	moved, err := l.Move("y", wr("b", 0))
	require.NoError(t, err)
	require.Equal(t, 500, moved.PrefillTokens)
	require.True(t, l.PrefillClock(ref, clk.Now()).Since.IsZero(), "the queue emptied")
	b := l.AppendRanks(nil, []catalog.WorkerRank{wr("b", 0)})[0]
	require.Equal(t, clk.Now(), l.PrefillClock(b, clk.Now()).Since, "the move found b idle")
}

// TestPrefillClockArrivals: every Book adds one to the rank's arrivals, which
// decay with the window's time constant; Free leaves them, a Move carries
// what the booking still weighs to the rank it moves to.
func TestPrefillClockArrivals(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now, ArrivalWindow: time.Minute})
	a, b := wr("a", 0), wr("b", 0)
	refs := l.AppendRanks(nil, []catalog.WorkerRank{a, b})
	arrivals := func(i int) float64 { return l.PrefillClock(refs[i], clk.Now()).Arrivals }
	require.Zero(t, arrivals(0), "never booked")

	require.NoError(t, l.Book(Booking{ID: "x", Worker: a}))
	require.NoError(t, l.Book(Booking{ID: "y", Worker: a}))
	require.InDelta(t, 2, arrivals(0), 1e-9)
	clk.Advance(time.Minute)
	require.InDelta(t, 2/math.E, arrivals(0), 1e-9, "one time constant later")
	require.InDelta(t, 2, l.PrefillClock(refs[0], clk.Now().Add(-2*time.Minute)).Arrivals, 1e-9,
		"a time before the last update reads the value at it")

	require.NoError(t, l.Free("x"))
	require.InDelta(t, 2/math.E, arrivals(0), 1e-9, "a Free is not an arrival")
	require.NoError(t, l.Book(Booking{ID: "z", Worker: a}))
	require.InDelta(t, 1+2/math.E, arrivals(0), 1e-9)

	_, err := l.Move("y", b)
	require.NoError(t, err)
	require.InDelta(t, 1+1/math.E, arrivals(0), 1e-9, "y's decayed weight left a")
	require.InDelta(t, 1, arrivals(1), 1e-9, "y arrived on b now")
	clk.Advance(time.Hour)
	require.Less(t, arrivals(0), 1e-20)
}

// TestArrivalWindowRefused: New refuses a negative window.
func TestArrivalWindowRefused(t *testing.T) {
	_, err := New(Options{ArrivalWindow: -time.Second})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "ArrivalWindow")
}

// TestArrivalDecay: the short-interval series agrees with exp on both sides
// of where it takes over.
func TestArrivalDecay(t *testing.T) {
	l := newLedger(t, Options{ArrivalWindow: time.Minute})
	for _, d := range []time.Duration{0, time.Nanosecond, time.Millisecond, 900 * time.Millisecond, 937 * time.Millisecond,
		938 * time.Millisecond, time.Second, time.Minute, time.Hour} {
		want := 3 * math.Exp(-float64(d)/float64(time.Minute))
		require.InEpsilon(t, want, l.decay(3, 1, 1+int64(d)), 3e-9, "%v", d)
	}
	require.Equal(t, 3.0, l.decay(3, 10, 5), "a time before at")
}
