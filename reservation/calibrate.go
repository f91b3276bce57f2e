package reservation

import (
	"math"
	"sync"
	"sync/atomic"
)

// Calibration is the ledger's fit of the time to first token its bookings
// observe (Book to PrefillComplete) against what their worker rank had been
// sent and not finished when they were booked (see the package
// documentation, "Calibration"):
//
//	TTFT = Overhead + QueuedToken x s x Q + ActiveRequest x R + OwnToken x s x U
//
// Q is the prefill tokens queued on the rank at the booking, R its active
// requests, U the booking's own prefill tokens: one fit for the whole
// fleet, whose ranks' token times differ by their Slowness s (PrefillClock;
// the fleet's mean rank has about 1). Every coefficient is >= 0.
type Calibration struct {
	// Samples counts the completions fitted since New.
	Samples int64
	// Ready reports that the figures rest on evidence rather than on the
	// prior: CalibrationSamples completions have been fitted, and they tell
	// the price of a prompt token from the noise (OwnToken is more than
	// CalibrationEvidence times OwnTokenError). A fit whose tokens are lost
	// in the noise (a starved host whose scheduling jitter dwarfs the
	// prefill) finds them free, and a cost that used it would price a
	// cached prefix at nothing; it stays unready until the evidence returns.
	Ready bool
	// Overhead is a request's fixed cost in seconds: what a booking waits
	// whatever it and its rank hold (the network, the engine's own
	// handling, the step that yields the first token).
	Overhead float64
	// QueuedToken is the seconds one prefill token queued on the rank when
	// a request was booked adds to its time to first token: 0 on engines
	// that do not make requests wait for each other.
	QueuedToken float64
	// ActiveRequest is the seconds each request active on the rank adds
	// (a queued request's own overhead, a decoding one's share of each step).
	ActiveRequest float64
	// OwnToken is the seconds each of the request's own prefill tokens
	// takes: the inverse of a nominal rank's prefill rate.
	OwnToken float64
	// OwnTokenError is OwnToken's standard error, in seconds: what the
	// residuals' scale leaves uncertain of it given how the completions'
	// own tokens varied (0 before CalibrationSamples and when OwnToken is
	// held at 0; +Inf when nothing varied enough to tell it apart).
	OwnTokenError float64
	// Residual is the fit's recent mean absolute error, in seconds.
	Residual float64
}

// CalibrationSamples is how many completions the ledger fits before its
// Calibration is Ready.
const CalibrationSamples = 32

// CalibrationEvidence is how many standard errors (OwnTokenError) OwnToken
// must exceed for the Calibration to be Ready: about a 2% chance that noise
// alone fits a price that large.
const CalibrationEvidence = 2.0

// SlownessSamples is how many completions that separate a rank's speed from
// the fleet's overhead (its predicted token time at least the Overhead) the
// rank needs before PrefillClock reports its Slowness.
const SlownessSamples = 4

const (
	// calKeep is what a sample weighs at the next one in the fleet's fit:
	// its memory is about 512 completions.
	calKeep = 1 - 1.0/512
	// madKeep is the same for the mean absolute residual, the scale
	// Huber's weights are judged on: about 32 completions.
	madKeep = 31.0 / 32
	// slowKeep is the same for a rank's slowness: about 16 completions.
	slowKeep = 15.0 / 16
	// calPrior is the weight, in samples of the data's own scale, of the
	// prior in the fit (a ridge towards it) until the fit is Ready: it
	// decides the first few dozen completions.
	calPrior = 8.0
	// calPriorMin is the prior's weight, in samples, once outweighed.
	calPriorMin = 1e-3
	// huberK is how many mean absolute residuals a sample may miss the fit
	// by before its weight shrinks (Huber's loss): one stalled request does
	// not move the fit much.
	huberK = 3.0
	// minSlowness and maxSlowness bound a rank's slowness.
	minSlowness, maxSlowness = 1.0 / 8, 8.0
)

// The fit's regressors, in the order of its vectors.
const (
	zOne = iota
	zQueued
	zActive
	zOwn
	nz
)

// calibrator is a Ledger's fleet-wide fit: a decayed, Huber-weighted,
// ridge-regularised least-squares regression with coefficients kept >= 0.
// Its state is guarded by mu; what readers need is published through a
// sequence lock, so a decision reads it without a lock.
type calibrator struct {
	mu   sync.Mutex
	m    [nz][nz]float64 // decayed sum of w z z^T
	v    [nz]float64     // decayed sum of w z y
	w    float64         // decayed sum of w
	mad  float64         // decayed mean absolute residual
	n    int64
	beta [nz]float64 // the current fit
	// ownErr is beta[zOwn]'s standard error (0 when it is held at 0)
	ownErr float64
	prior  [nz]float64
	// floor is each regressor's smallest scale for the prior's weight: a
	// regressor that is always 0 (nothing ever queued) keeps its prior.
	floor [nz]float64

	seq atomic.Uint64    // odd while pub is written
	pub [8]atomic.Uint64 // samples, ready, beta..., residual, own token's error (float64 bits)
}

// newCalibrator returns a calibrator whose prior prices every token at
// 1/rate seconds (queued or own) and nothing else.
func newCalibrator(rate float64) *calibrator {
	c := &calibrator{}
	if rate > 0 {
		c.prior[zQueued] = 1 / rate
		c.prior[zOwn] = 1 / rate
	}
	c.floor = [nz]float64{1, 256 * 256, 1, 256 * 256}
	c.beta = c.prior
	c.publish()
	return c
}

// sample is one completion's evidence: z its regressors (z[zOne] = 1), y
// its time to first token in seconds.
type sample struct {
	z [nz]float64
	y float64
}

// add fits one completion.
func (c *calibrator) add(s sample) {
	c.mu.Lock()
	defer c.mu.Unlock()
	res := s.y - dot(&c.beta, &s.z)
	w := 1.0
	if c.n >= CalibrationSamples && c.mad > 0 {
		if a := math.Abs(res); a > huberK*c.mad {
			w = huberK * c.mad / a
		}
	}
	switch a := math.Abs(res); {
	case c.n == 0:
		c.mad = a
	case c.mad > 0:
		c.mad = c.mad*madKeep + min(a, 10*c.mad)*(1-madKeep)
	default:
		c.mad = a * (1 - madKeep)
	}
	c.w = c.w*calKeep + w
	for i := range nz {
		c.v[i] = c.v[i]*calKeep + w*s.z[i]*s.y
		for j := range nz {
			c.m[i][j] = c.m[i][j]*calKeep + w*s.z[i]*s.z[j]
		}
	}
	c.n++
	c.solve()
	c.publish()
}

// solve fits beta: (M + L) beta = v + L prior, L the prior's weight on each
// coefficient, with every coefficient kept >= 0 (a negative one is fixed at
// 0 and the rest fitted again).
func (c *calibrator) solve() {
	// The prior weighs calPrior samples until the fit is Ready, then fades
	// with the cube of the completions fitted (a slope pulled towards its
	// prior shifts the intercept by the pull times the regressor's mean), to
	// calPriorMin, which only keeps a regressor that is always 0 at its
	// prior. A slope's weight is in units of its regressor's variance, the
	// evidence the data holds on it.
	prior := calPrior
	if c.n > CalibrationSamples {
		f := float64(CalibrationSamples) / float64(c.n)
		prior = max(calPrior*f*f*f, calPriorMin)
	}
	w := max(c.w, 1)
	var fixed [nz]bool
	for range nz {
		var a [nz][nz + 1]float64
		for i := range nz {
			if fixed[i] {
				a[i][i], a[i][nz] = 1, 0
				continue
			}
			scale := c.floor[i]
			if i != zOne {
				mean := c.m[zOne][i] / w
				scale = max(c.m[i][i]/w-mean*mean, scale)
			}
			l := prior * scale
			for j := range nz {
				if !fixed[j] {
					a[i][j] = c.m[i][j]
				}
			}
			a[i][i] += l
			a[i][nz] = c.v[i] + l*c.prior[i]
		}
		sys := a // gauss eliminates in place
		beta, ok := gauss(&a)
		if !ok {
			return // keep the last fit
		}
		neg := false
		for i := range nz {
			if beta[i] < 0 {
				fixed[i], neg = true, true
			}
		}
		if !neg {
			c.beta = beta
			c.ownErr = c.coefError(&sys, zOwn, fixed[zOwn])
			return
		}
	}
}

// coefError is the standard error of coefficient i of the system sys
// (solve's, before elimination): the residuals' standard deviation (the
// mean absolute residual of a normal noise times sqrt(pi/2)) times the
// square root of the i-th diagonal entry of the system's inverse. 0 when i
// is held at 0 (fixed) and before CalibrationSamples completions; +Inf when
// the system is singular.
func (c *calibrator) coefError(sys *[nz][nz + 1]float64, i int, fixed bool) float64 {
	if fixed || c.n < CalibrationSamples {
		return 0
	}
	for r := range nz {
		sys[r][nz] = 0
	}
	sys[i][nz] = 1
	col, ok := gauss(sys)
	if !ok || col[i] <= 0 {
		return math.Inf(1) // nothing tells the coefficient apart
	}
	return c.mad * math.Sqrt(math.Pi/2) * math.Sqrt(col[i])
}

// gauss solves the augmented system a by elimination with partial pivoting.
func gauss(a *[nz][nz + 1]float64) ([nz]float64, bool) {
	for col := range nz {
		p := col
		for r := col + 1; r < nz; r++ {
			if math.Abs(a[r][col]) > math.Abs(a[p][col]) {
				p = r
			}
		}
		if a[p][col] == 0 || math.IsNaN(a[p][col]) {
			return [nz]float64{}, false
		}
		a[col], a[p] = a[p], a[col]
		for r := col + 1; r < nz; r++ {
			f := a[r][col] / a[col][col]
			for k := col; k <= nz; k++ {
				a[r][k] -= f * a[col][k]
			}
		}
	}
	var x [nz]float64
	for r := nz - 1; r >= 0; r-- {
		s := a[r][nz]
		for k := r + 1; k < nz; k++ {
			s -= a[r][k] * x[k]
		}
		x[r] = s / a[r][r]
		if math.IsNaN(x[r]) || math.IsInf(x[r], 0) {
			return [nz]float64{}, false
		}
	}
	return x, true
}

func dot(a, b *[nz]float64) float64 {
	var s float64
	for i := range nz {
		s += a[i] * b[i]
	}
	return s
}

// publish makes the fit readable by load. c.mu is held (or c is new).
func (c *calibrator) publish() {
	c.seq.Add(1)
	c.pub[0].Store(uint64(c.n))
	ready := uint64(0)
	if c.n >= CalibrationSamples && c.beta[zOwn] > CalibrationEvidence*c.ownErr {
		ready = 1
	}
	c.pub[1].Store(ready)
	for i := range nz {
		c.pub[2+i].Store(math.Float64bits(c.beta[i]))
	}
	c.pub[6].Store(math.Float64bits(c.mad))
	c.pub[7].Store(math.Float64bits(c.ownErr))
	c.seq.Add(1)
}

// load returns the published fit. It takes no lock; it retries while a
// publication is under way.
func (c *calibrator) load() Calibration {
	for {
		s := c.seq.Load()
		if s&1 != 0 {
			continue
		}
		cal := Calibration{
			Samples:       int64(c.pub[0].Load()),
			Ready:         c.pub[1].Load() == 1,
			Overhead:      math.Float64frombits(c.pub[2].Load()),
			QueuedToken:   math.Float64frombits(c.pub[3].Load()),
			ActiveRequest: math.Float64frombits(c.pub[4].Load()),
			OwnToken:      math.Float64frombits(c.pub[5].Load()),
			Residual:      math.Float64frombits(c.pub[6].Load()),
			OwnTokenError: math.Float64frombits(c.pub[7].Load()),
		}
		if c.seq.Load() == s {
			return cal
		}
	}
}

// Calibration returns the ledger's current fit. It takes no lock.
func (l *Ledger) Calibration() Calibration { return l.cal.load() }

// observe turns bk's completion at now into a sample and updates its rank's
// slowness against the fleet's fit; ok is false when bk teaches nothing (it
// moved, or the clock went back). r.mu is held.
func (l *Ledger) observe(bk *booking, r *rankState, nowNanos int64) (sample, bool) {
	if bk.ahead < 0 {
		return sample{}, false
	}
	y := float64(nowNanos-stamp(bk.bookedAt)) / 1e9
	if y < 0 {
		return sample{}, false
	}
	q, a, u := float64(bk.ahead), float64(bk.aheadReqs), float64(bk.prefill)
	fit := l.cal.load()
	// The rank's slowness: how its token times compare with the fleet's,
	// learned by least squares through the fleet's overhead and request
	// terms, from the completions whose tokens, not the overhead, decide
	// their time.
	if tok := fit.QueuedToken*q + fit.OwnToken*u; tok > 0 {
		rest := y - fit.Overhead - fit.ActiveRequest*a
		c := &r.clock
		c.stp = c.stp*slowKeep + tok*rest
		c.stt = c.stt*slowKeep + tok*tok
		if fit.Ready && tok >= fit.Overhead {
			c.separating++
		}
		if c.separating >= SlownessSamples && c.stt > 0 {
			c.slow.Store(math.Float64bits(min(max(c.stp/c.stt, minSlowness), maxSlowness)))
		}
	}
	return sample{z: [nz]float64{1, q, a, u}, y: y}, true
}

// slowness is the rank's learned slowness, 1 until it has one.
func (c *prefillClock) slowness() float64 {
	if s := math.Float64frombits(c.slow.Load()); s > 0 {
		return s
	}
	return 1
}
