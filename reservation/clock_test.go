package reservation

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
)

// TestPrefillClockLearnsRate: a rank that serves its queue at 10,000 tokens
// a second reports when its current prefill began and, from the fourth
// completion on, that rate; a queue that empties has no start.
func TestPrefillClockLearnsRate(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	a := wr("a", 0)
	ref := l.AppendRanks(nil, []catalog.WorkerRank{a})[0]
	require.Equal(t, PrefillClock{}, l.PrefillClock(ref), "never booked")

	start := clk.Now()
	for i := range 6 {
		require.NoError(t, l.Book(Booking{ID: fmt.Sprint(i), Worker: a, PrefillTokens: 1000 * (i + 1)}))
		clk.Advance(time.Millisecond)
	}
	require.Equal(t, start, l.PrefillClock(ref).Since, "the first booking found the queue empty")

	at := start
	for i := range 6 {
		at = at.Add(time.Duration(i+1) * 100 * time.Millisecond) // 1,000 (i+1) tokens at 10,000 a second
		clk.Advance(at.Sub(clk.Now()))
		require.NoError(t, l.PrefillComplete(fmt.Sprint(i)))
		c := l.PrefillClock(ref)
		if i < PrefillRateSamples-1 {
			require.Zero(t, c.Rate, "after %d completions", i+1)
		} else {
			require.InDelta(t, 10_000, c.Rate, 1, "after %d completions", i+1)
		}
		if i < 5 {
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
	require.Equal(t, PrefillClock{Since: start}, l.PrefillClock(ref))
	require.NoError(t, l.Free("x"))
	require.Equal(t, PrefillClock{Since: start}, l.PrefillClock(ref), "y is still queued")
	moved, err := l.Move("y", wr("b", 0))
	require.NoError(t, err)
	require.Equal(t, 500, moved.PrefillTokens)
	require.Equal(t, PrefillClock{}, l.PrefillClock(ref), "the queue emptied")
	b := l.AppendRanks(nil, []catalog.WorkerRank{wr("b", 0)})[0]
	require.Equal(t, PrefillClock{Since: clk.Now()}, l.PrefillClock(b), "the move found b idle")
}
