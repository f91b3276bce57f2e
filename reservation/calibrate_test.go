package reservation

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
)

// engineTimes is a made-up engine's time to first token: its coefficients
// in seconds, and a per-rank factor on its token times.
type engineTimes struct {
	overhead, queued, active, own float64
	slower                        map[string]float64
}

func (e engineTimes) ttft(rank string, q, r, u int) time.Duration {
	s := 1.0
	if f, ok := e.slower[rank]; ok {
		s = f
	}
	secs := e.overhead + e.queued*s*float64(q) + e.active*float64(r) + e.own*s*float64(u)
	return time.Duration(secs * 1e9)
}

// drive books n requests one at a time on the given ranks, each behind a
// random number of other bookings with random prefill (what the rank had
// been sent and not finished), waits the engine's time to first token on the
// fake clock, completes its prefill and frees everything.
func drive(t *testing.T, l *Ledger, clk *fakeClock, e engineTimes, ranks []string, n int, rng *rand.Rand) {
	t.Helper()
	for i := range n {
		rank := ranks[i%len(ranks)]
		w := wr(rank, 0)
		q, reqs := 0, rng.IntN(5)
		for j := range reqs {
			p := rng.IntN(4000)
			q += p
			require.NoError(t, l.Book(Booking{ID: ID(fmt.Sprintf("f%d-%d", i, j)), Worker: w, PrefillTokens: p}))
		}
		u := rng.IntN(4000)
		id := fmt.Sprint("r", i)
		require.NoError(t, l.Book(Booking{ID: ID(id), Worker: w, PrefillTokens: u}))
		clk.Advance(e.ttft(rank, q, reqs, u))
		require.NoError(t, l.PrefillComplete(ID(id)))
		require.NoError(t, l.Free(ID(id)))
		for j := range reqs {
			require.NoError(t, l.Free(ID(fmt.Sprintf("f%d-%d", i, j))))
		}
	}
}

// TestCalibrationFitsTheEngine: the fit finds a queueing engine's overhead
// and its prices of queued tokens, active requests and own tokens from the
// bookings' times to first token alone, and is Ready after
// CalibrationSamples completions; before that the prior (1/PrefillRate a
// token) decides and PrefillClock reports no rate.
func TestCalibrationFitsTheEngine(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now, PrefillRate: 5000})
	cal := l.Calibration()
	require.False(t, cal.Ready)
	require.Equal(t, Calibration{QueuedToken: 1.0 / 5000, OwnToken: 1.0 / 5000}, cal, "the prior")
	e := engineTimes{overhead: 0.005, queued: 50e-6, active: 0.001, own: 100e-6}
	rng := rand.New(rand.NewPCG(1, 2))
	drive(t, l, clk, e, []string{"a"}, CalibrationSamples-1, rng)
	require.False(t, l.Calibration().Ready)
	ref := l.AppendRanks(nil, []catalog.WorkerRank{wr("a", 0)})[0]
	require.Zero(t, l.PrefillClock(ref, clk.Now()).Rate, "no rate before the fit is ready")

	drive(t, l, clk, e, []string{"a"}, 600, rng)
	cal = l.Calibration()
	require.True(t, cal.Ready)
	require.EqualValues(t, CalibrationSamples-1+600, cal.Samples)
	require.InDelta(t, e.overhead, cal.Overhead, 0.0005)
	require.InEpsilon(t, e.queued, cal.QueuedToken, 0.02)
	require.InDelta(t, e.active, cal.ActiveRequest, 0.0002)
	require.InEpsilon(t, e.own, cal.OwnToken, 0.02)
	require.Less(t, cal.Residual, 0.001)
	clock := l.PrefillClock(ref, clk.Now())
	require.InEpsilon(t, 1/(cal.OwnToken*clock.Slowness), clock.Rate, 1e-9)
	require.InDelta(t, 1, clock.Slowness, 0.03, "one rank: its speed is the fleet's")
}

// TestCalibrationOverheadIsNotSpeed: an engine that never makes requests
// wait for each other but costs a fixed 50 ms a request prices queued
// tokens at (nearly) nothing, and its rate is the true one whatever share
// of cached prompts a rank gets: the rank that is sent only short uncached
// prompts (it holds the hot prefixes) learns the same rate as the others,
// where a ratio of tokens to busy time made it look 8x slower.
func TestCalibrationOverheadIsNotSpeed(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	e := engineTimes{overhead: 0.050, own: 20e-6}
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 800 {
		rank, u := "cold", 2000+rng.IntN(6000)
		if i%2 == 0 {
			rank, u = "hot", rng.IntN(300) // mostly cached
		}
		w := wr(rank, 0)
		for j := range i % 3 {
			require.NoError(t, l.Book(Booking{ID: ID(fmt.Sprintf("f%d-%d", i, j)), Worker: w, PrefillTokens: 1000}))
		}
		id := fmt.Sprint("r", i)
		require.NoError(t, l.Book(Booking{ID: ID(id), Worker: w, PrefillTokens: u}))
		clk.Advance(e.ttft(rank, 0, 0, u))
		require.NoError(t, l.PrefillComplete(ID(id)))
		require.NoError(t, l.Free(ID(id)))
		for j := range i % 3 {
			require.NoError(t, l.Free(ID(fmt.Sprintf("f%d-%d", i, j))))
		}
	}
	cal := l.Calibration()
	require.InDelta(t, 0.050, cal.Overhead, 0.002)
	require.Less(t, cal.QueuedToken, 1e-6, "nothing waits for what is queued")
	require.InEpsilon(t, 20e-6, cal.OwnToken, 0.05)
	refs := l.AppendRanks(nil, []catalog.WorkerRank{wr("hot", 0), wr("cold", 0)})
	hot, cold := l.PrefillClock(refs[0], clk.Now()), l.PrefillClock(refs[1], clk.Now())
	if hot.Slowness != 0 { // few of its completions separate its speed from the overhead
		require.InDelta(t, 1, hot.Slowness, 0.1)
	}
	require.InDelta(t, 1, cold.Slowness, 0.05)
	require.InEpsilon(t, 50_000, hot.Rate, 0.06, "the hot rank's rate is the fleet's, not 8x lower")
}

// TestCalibrationNoiseIsNotEvidence: on a starved host, where each time to
// first token carries tens of milliseconds of scheduling jitter against a
// prefill of a few milliseconds, the fit cannot tell the price of a token
// from zero, so it is not Ready (a cost that used it would value a cached
// prefix at nothing); when the jitter stops it finds the price again and is
// Ready.
func TestCalibrationNoiseIsNotEvidence(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	e := engineTimes{overhead: 0.004, own: 20e-6}
	rng := rand.New(rand.NewPCG(9, 10))
	complete := func(n int, jitter time.Duration) {
		for i := range n {
			id := ID(fmt.Sprint("r", i))
			u := rng.IntN(417) // the demo's prompts: up to 26 blocks of 16
			require.NoError(t, l.Book(Booking{ID: id, Worker: wr("a", 0), PrefillTokens: u}))
			d := e.ttft("a", 0, 0, u)
			if jitter > 0 {
				d += time.Duration(rng.Int64N(int64(jitter)))
			}
			clk.Advance(d)
			require.NoError(t, l.PrefillComplete(id))
			require.NoError(t, l.Free(id))
		}
	}
	complete(120, 60*time.Millisecond)
	cal := l.Calibration()
	require.EqualValues(t, 120, cal.Samples)
	require.False(t, cal.Ready, "own token %v +/- %v", cal.OwnToken, cal.OwnTokenError)
	require.LessOrEqual(t, cal.OwnToken, CalibrationEvidence*cal.OwnTokenError)

	complete(600, 0)
	cal = l.Calibration()
	require.True(t, cal.Ready, "own token %v +/- %v", cal.OwnToken, cal.OwnTokenError)
	// The noisy completions still weigh in the fit (its memory is about
	// 512): the price is on its way back to the engine's.
	require.InEpsilon(t, e.own, cal.OwnToken, 0.3)
	require.Less(t, cal.OwnTokenError, cal.OwnToken/10)
}

// TestCalibrationSlowness: a rank whose token times are twice the others'
// learns a slowness twice theirs, and its rate is half.
func TestCalibrationSlowness(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	e := engineTimes{overhead: 0.002, queued: 40e-6, own: 40e-6, slower: map[string]float64{"slow": 2}}
	drive(t, l, clk, e, []string{"a", "b", "slow"}, 900, rand.New(rand.NewPCG(5, 6)))
	refs := l.AppendRanks(nil, []catalog.WorkerRank{wr("a", 0), wr("b", 0), wr("slow", 0)})
	a, b, slow := l.PrefillClock(refs[0], clk.Now()), l.PrefillClock(refs[1], clk.Now()), l.PrefillClock(refs[2], clk.Now())
	require.InEpsilon(t, a.Slowness, b.Slowness, 0.05)
	require.InEpsilon(t, 2, slow.Slowness/a.Slowness, 0.08)
	require.InEpsilon(t, 0.5, slow.Rate/a.Rate, 0.08)
	cal := l.Calibration()
	require.InEpsilon(t, 40e-6, cal.OwnToken*a.Slowness, 0.08, "the fast ranks' token time")
}

// TestCalibrationOutlier: one request that stalls for a minute barely moves
// a fit of hundreds.
func TestCalibrationOutlier(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	e := engineTimes{overhead: 0.005, queued: 50e-6, own: 50e-6}
	rng := rand.New(rand.NewPCG(7, 8))
	drive(t, l, clk, e, []string{"a"}, 400, rng)
	before := l.Calibration()
	require.NoError(t, l.Book(Booking{ID: "stalled", Worker: wr("a", 0), PrefillTokens: 100}))
	clk.Advance(time.Minute)
	require.NoError(t, l.PrefillComplete("stalled"))
	after := l.Calibration()
	require.InEpsilon(t, before.OwnToken, after.OwnToken, 0.05)
	require.InDelta(t, before.Overhead, after.Overhead, 0.002)
}

// TestCalibrationIgnoresMoves: a booking that moved ranks teaches nothing.
func TestCalibrationIgnoresMoves(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	require.NoError(t, l.Book(Booking{ID: "x", Worker: wr("a", 0), PrefillTokens: 100}))
	_, err := l.Move("x", wr("b", 0))
	require.NoError(t, err)
	clk.Advance(time.Second)
	require.NoError(t, l.PrefillComplete("x"))
	require.Zero(t, l.Calibration().Samples)
}

// TestPrefillRateRefused: New refuses a prior that is negative or not finite.
func TestPrefillRateRefused(t *testing.T) {
	for _, r := range []float64{-1, math.NaN(), math.Inf(1)} {
		_, err := New(Options{PrefillRate: r})
		require.ErrorIs(t, err, ErrInvalidOptions)
		require.ErrorContains(t, err, "PrefillRate")
	}
}

// BenchmarkPrefillComplete is a booking's life with the calibration's
// update on its PrefillComplete: Book, PrefillComplete, Free.
func BenchmarkPrefillComplete(b *testing.B) {
	clk := newFakeClock()
	l, err := New(Options{Now: clk.Now})
	require.NoError(b, err)
	w := wr("a", 0)
	b.ReportAllocs()
	ids := [2]string{"x", "y"}
	i := 0
	for b.Loop() {
		id := ids[i&1]
		i++
		if err := l.Book(Booking{ID: ID(id), Worker: w, PrefillTokens: 100 + i%1000}); err != nil {
			b.Fatal(err)
		}
		clk.Advance(time.Millisecond)
		if err := l.PrefillComplete(ID(id)); err != nil {
			b.Fatal(err)
		}
		if err := l.Free(ID(id)); err != nil {
			b.Fatal(err)
		}
	}
}

// FuzzCalibration: whatever completions it is fed (any queue, request and
// prompt sizes, any time to first token a clock can give), the fit's
// figures stay finite and >= 0.
func FuzzCalibration(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
	f.Add(make([]byte, 64))
	f.Add([]byte{255, 255, 255, 255, 255, 255, 255, 255, 0, 0, 0, 1})
	f.Fuzz(func(t *testing.T, data []byte) {
		c := newCalibrator(DefaultPrefillRate)
		for len(data) >= 8 {
			q := float64(uint32(data[0])<<16 | uint32(data[1])<<8 | uint32(data[2]))
			r := float64(data[3])
			u := float64(uint32(data[4])<<8 | uint32(data[5]))
			y := float64(uint32(data[6])<<8|uint32(data[7])) * 1e-3 * math.Pow(10, float64(data[0]%7)-3)
			data = data[8:]
			c.add(sample{z: [nz]float64{1, q, r, u}, y: y})
			cal := c.load()
			for _, v := range []float64{cal.Overhead, cal.QueuedToken, cal.ActiveRequest, cal.OwnToken, cal.Residual} {
				if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
					t.Fatalf("fit %+v after q=%v r=%v u=%v y=%v", cal, q, r, u, y)
				}
			}
		}
	})
}
