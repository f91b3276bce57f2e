package reservation

import (
	"math"
	"sync/atomic"
	"time"
)

// PrefillClock is what the ledger has observed of a worker rank's prefill
// queue and of the requests it is sent, for a cost that predicts time (see
// the package documentation, "Prefill clock" and "Calibration").
type PrefillClock struct {
	// Since is when the rank began the prefill it is serving: the Book that
	// found its queue empty, or the last PrefillComplete that left some
	// queued. Zero while no prefill is queued.
	Since time.Time
	// Rate is the rank's prefill rate in tokens per second as calibrated:
	// 1 / (Calibration.OwnToken x Slowness). 0 until the ledger's
	// Calibration is Ready.
	Rate float64
	// Slowness is how the rank's token times compare with the fleet's (2:
	// it takes twice as long), from its own completions; 0 until
	// SlownessSamples of them separated its speed from the overhead.
	Slowness float64
	// Arrivals is the rank's recent bookings at the time asked for: each
	// Book (or Move onto the rank) adds 1, which decays exponentially with
	// time constant Options.ArrivalWindow; a Move off the rank takes back
	// what its booking still weighs. Free and Expire leave it alone: it
	// counts requests sent, not requests active.
	Arrivals float64
}

// DefaultArrivalWindow is Options.ArrivalWindow's default.
const DefaultArrivalWindow = 5 * time.Minute

// prefillClock is a rankState's clock. since, slow, arrivals and arrivedAt
// are read without the rank's lock, together (they lead, to share a cache
// line); every field is written under it.
type prefillClock struct {
	since atomic.Int64  // unix nanoseconds; 0: nothing queued
	slow  atomic.Uint64 // float64 bits of the slowness; 0 until learned
	// arrivals is the decayed booking count at arrivedAt (unix
	// nanoseconds; 0: never booked), float64 bits. A reader racing a Book
	// may pair the new count with the old time (or the reverse): off by at
	// most that one booking's decay.
	arrivals  atomic.Uint64
	arrivedAt atomic.Int64
	// stp and stt are the decayed sums of the slowness fit (token time x
	// the rest of the TTFT, token time squared); separating counts the
	// completions whose token time was at least the overhead.
	stp, stt   float64
	separating int
}

// PrefillClock returns what the ledger has observed of k's prefill queue,
// with its Arrivals as of now; the zero PrefillClock when k has no entry. It
// takes no lock.
func (l *Ledger) PrefillClock(k Rank, now time.Time) PrefillClock {
	r := k.r
	if r == nil || r.dead.Load() {
		r = l.lookup(k.key)
	}
	if r == nil {
		return PrefillClock{}
	}
	var c PrefillClock
	if n := r.clock.since.Load(); n != 0 {
		c.Since = time.Unix(0, n).UTC()
	}
	if s := math.Float64frombits(r.clock.slow.Load()); s > 0 {
		c.Slowness = s
	}
	if cal := l.cal.load(); cal.Ready && cal.OwnToken > 0 {
		c.Rate = 1 / (cal.OwnToken * r.clock.slowness())
	}
	if at := r.clock.arrivedAt.Load(); at != 0 {
		c.Arrivals = l.decay(math.Float64frombits(r.clock.arrivals.Load()), at, now.UnixNano())
	}
	return c
}

// RankClock is PrefillClock for a cost evaluated over many ranks at once:
// the same Since (unix nanoseconds, 0 while nothing is queued), Slowness and
// Arrivals of k as of now (unix nanoseconds), without the Rate, which the
// caller computes once per decision from the Calibration. Zeros when k has
// no entry. It takes no lock and does not allocate.
func (l *Ledger) RankClock(k Rank, now int64) (since int64, slowness, arrivals float64) {
	r := k.r
	if r == nil || r.dead.Load() {
		r = l.lookup(k.key)
	}
	if r == nil {
		return 0, 0, 0
	}
	since = r.clock.since.Load()
	if s := math.Float64frombits(r.clock.slow.Load()); s > 0 {
		slowness = s
	}
	if at := r.clock.arrivedAt.Load(); at != 0 {
		arrivals = l.decay(math.Float64frombits(r.clock.arrivals.Load()), at, now)
	}
	return since, slowness, arrivals
}

// decay returns what v at unix nanoseconds at weighs at now.
func (l *Ledger) decay(v float64, at, now int64) float64 {
	if now <= at {
		return v
	}
	x := float64(now-at) / l.arrivalWindow
	if x < 1.0/64 {
		// A rank booked a moment ago, the usual case on a decision's path:
		// the series to x^3 is within 3e-9 of exp(-x) here, at a fraction
		// of math.Exp's cost.
		return v * (1 - x*(1-x*(0.5-x/6)))
	}
	return v * math.Exp(-x)
}

// arrive adds n (1 for a booking, minus what it still weighs for one moved
// away) to r's arrivals at now. r.mu is held.
func (l *Ledger) arrive(r *rankState, n float64, now time.Time) {
	t := stamp(now)
	v := n
	if at := r.clock.arrivedAt.Load(); at != 0 {
		v += l.decay(math.Float64frombits(r.clock.arrivals.Load()), at, t)
	}
	r.clock.arrivals.Store(math.Float64bits(max(v, 0)))
	r.clock.arrivedAt.Store(t)
}

// queued runs after tokens joined r's prefill queue at now. r.mu is held.
func (r *rankState) queued(tokens int, now time.Time) {
	if tokens > 0 && r.prefill.Load() == int64(tokens) { // the queue was empty
		r.clock.since.Store(stamp(now))
	}
}

// served runs after a booking's prefill of tokens completed at now (unix
// nanoseconds) and left r's queue. r.mu is held.
func (r *rankState) served(now int64) {
	if r.prefill.Load() > 0 {
		r.clock.since.Store(now) // the next queued prefill starts now
	} else {
		r.clock.since.Store(0)
	}
}

// stamp is now in unix nanoseconds, never 0 (which means nothing queued).
func stamp(now time.Time) int64 {
	if n := now.UnixNano(); n != 0 {
		return n
	}
	return 1
}

// dropped runs after prefill tokens left r's queue without completing (a
// booking freed, expired or moved before its prefill ended). r.mu is held.
func (r *rankState) dropped() {
	if r.prefill.Load() == 0 {
		r.clock.since.Store(0)
	}
}
