package selection

import (
	"math"

	"github.com/kvselect/kvselect/reservation"
)

// candidate is one eligible (worker, rank) with everything its cost needs.
type candidate struct {
	idx int // position in the partition's candidate list

	// overlap, in blocks
	device, host, disk int
	// inflight is the request's blocks active on the rank (booked there and
	// shared), set only when InFlightHitWeight is on; pending, what of them
	// extends past device, host and disk.
	inflight, pending int
	// load
	activePrefill  int64
	activeBlocks   int
	newBlocks      int // this request's blocks not already active on the worker
	activeRequests int
	maxBatched     int
	stamp          reservation.Stamp // what the ledger read was, for BookAt
	// the rank's prefill clock (CostPredictive only): since, unix
	// nanoseconds (0: nothing queued); tokTime and queueTime, its seconds
	// per own and per queued prefill token; arrivals, its recent bookings
	since              int64
	tokTime, queueTime float64
	arrivals           float64
	// pressure is the rank's cache pressure, in [0, 1] (CostPredictive)
	pressure float64

	cost float64
	// extra is what the policy's cost terms added to cost (policy.go);
	// 0 without them
	extra float64
}

// costInput is the request side of the cost.
type costInput struct {
	isl        int // prompt tokens
	blockSize  int
	minPrefill int64 // the least active prefill of the candidates (credit decay)
	now        int64 // unix nanoseconds of the decision (CostPredictive)
	// the candidates' mean recent bookings, and their mean time to prefill
	// the model's mean prompt, seconds (CostPredictive)
	meanArrivals, promptTime float64
	// backlogW is the backlog weight of this decision: the configured one,
	// raised on a saturated fleet (PredictiveCost.SaturationGrowth)
	backlogW float64
	// calibrated: the ledger's Calibration is Ready and the cost uses it
	// (its Overhead and ActiveRequest prices, seconds); else every rank
	// prefills at the configured rate, draining its queue since its clock
	// began
	calibrated           bool
	overhead, perRequest float64
}

// cost is the cost of sending the request to c under w's cost function,
// with what the policy's cost terms added to it.
func cost(c *candidate, in *costInput, w *weights) float64 {
	if w.predictive {
		return predicted(c, in, w) + c.extra
	}
	return logit(c, *in, w) + c.extra
}

// predicted is CostPredictive's cost of sending the request to c, in
// seconds; lower is better. Calibrated (reservation.Calibration Ready),
// with s the rank's slowness:
//
//	ttft = Overhead + QueuedToken x s x A + ActiveRequest x R + OwnToken x s x own
//	cost = ttft + backlogW x QueuedToken x s x own + evictW x p x OwnToken x s x own
//	       + decodeW x (1 - p) x OwnToken x s x (active blocks + new blocks
//	                                   + decodeActiveRequestWeight x active requests) x bs
//	       + balanceW x P x max(0, arrivals / mean arrivals - 1 - slack)
//
// and before that, every rank at the configured rate:
//
//	remaining = max(0, A - rate x (now - since))   the queued prefill still ahead
//	cost      = (remaining + (1 + backlogW + evictW x p) x own
//	             + decodeW x (1 - p) x (active blocks + ...) x bs) / rate + balance
//
// A is the rank's active prefill tokens (the uncached tokens of requests
// booked there and not yet prefilled), R its active requests, own the
// request's uncached prompt (T - min(cached, T); 0 when prefill is not
// tracked), since when the rank began the prefill it is serving. ttft is
// the rank's predicted time to first token; backlogW prices the time the
// request's own prefill adds to every request that queues behind it there
// (nothing on an engine that makes no request wait for another: its
// QueuedToken is 0), evictW what the request's uncached blocks evict on a
// rank whose cache is full (p, its cache pressure in [0, 1]: 0 where caches
// never fill), decodeW the rank's decode pressure (which spreads a cached
// prefix, and fades as p rises: a full cache that spreads a prefix evicts
// for it), balanceW its share
// of the recent bookings above the candidates' mean, once that mean
// reaches one, in units of P: the candidates' mean time to prefill the
// model's mean prompt (over its last few hundred decisions), the time
// scale of its requests, so that the price means the same whether prompts
// take milliseconds or seconds. cached counts the in-flight credit's
// pending blocks, which the request waits for in A anyway.
func predicted(c *candidate, in *costInput, w *weights) float64 {
	var own float64 // the request's own prefill: none where prefill is not tracked (a decode leg)
	if w.trackPrefill {
		own = float64(in.isl - min(cachedTokens(c, w, in.blockSize), in.isl))
	}
	decode := (1 - c.pressure) * (float64(c.activeBlocks+c.newBlocks) + w.activeReqWeight*float64(c.activeRequests))
	evict := w.evictW * c.pressure
	if in.calibrated {
		ttft := in.overhead + c.queueTime*float64(c.activePrefill) + in.perRequest*float64(c.activeRequests) + c.tokTime*own
		return ttft + in.backlogW*c.queueTime*own + evict*c.tokTime*own + w.decodeW*c.tokTime*decode*float64(in.blockSize) + balance(c, in, w)
	}
	remaining := float64(c.activePrefill)
	if c.since != 0 && in.now > c.since && remaining > 0 {
		remaining = max(0, remaining-float64(in.now-c.since)/1e9/c.tokTime)
	}
	return (remaining+(1+in.backlogW+evict)*own+w.decodeW*decode*float64(in.blockSize))*c.tokTime + balance(c, in, w)
}

// balance is the predictive cost's balance term for c: balanceW x the
// share of the recent bookings c has above the mean and the slack, in units
// of the candidates' time to prefill the model's mean prompt.
func balance(c *candidate, in *costInput, w *weights) float64 {
	if w.balanceW <= 0 || in.meanArrivals < 1 {
		return 0
	}
	return w.balanceW * in.promptTime * max(0, c.arrivals/in.meanArrivals-1-w.balSlack)
}

// effectiveOverlap returns device + hostW*host + diskW*disk blocks.
func effectiveOverlap(c *candidate, w *weights) float64 {
	e := float64(c.device)
	if w.hostW > 0 {
		e += w.hostW * float64(c.host)
	}
	if w.diskW > 0 {
		e += w.diskW * float64(c.disk)
	}
	if c.pending > 0 {
		e += w.inflightW * float64(c.pending)
	}
	return e
}

// cachedTokens returns round(effective overlap x block size).
func cachedTokens(c *candidate, w *weights, bs int) int {
	if c.host == 0 && c.disk == 0 && c.pending == 0 { // device blocks only: an exact integer, same result
		return c.device * bs
	}
	return int(math.Round(effectiveOverlap(c, w) * float64(bs)))
}

// logit is the cost of sending the request to c; lower is better:
//
//	raw_prefill_tokens = A + max(0, T - min(cached, T)) + cached   (0 when prefill is not tracked)
//	credit_blocks      = credit*device + hostW*host + diskW*disk
//	logit = scale * max(0, raw_prefill_tokens/bs - credit_blocks)
//	      + (active blocks + new blocks)
//	      + decodeActiveRequestWeight * active requests
func logit(c *candidate, in costInput, w *weights) float64 {
	bs := float64(in.blockSize)
	var rawPrefillBlocks float64
	if w.trackPrefill {
		t := in.isl
		cached := cachedTokens(c, w, in.blockSize)
		raw := c.activePrefill + int64(max(0, t-min(cached, t))) + int64(cached)
		rawPrefillBlocks = float64(raw) / bs
	}
	devCredit := w.credit
	if w.decay > 0 && w.trackPrefill {
		// Dynamo's overlap_score_credit_decay: a rank whose queued prefill
		// exceeds the least loaded one's by a request's worth gets half the
		// credit at decay 1, so a cached prefix cannot draw a whole burst.
		reqBlocks := math.Ceil(float64(in.isl) / bs)
		devCredit /= 1 + w.decay*(float64(c.activePrefill-in.minPrefill)/bs)/max(reqBlocks, 1)
	}
	credit := devCredit * float64(c.device)
	if w.hostW > 0 {
		credit += w.hostW * float64(c.host)
	}
	if w.diskW > 0 {
		credit += w.diskW * float64(c.disk)
	}
	if c.pending > 0 {
		credit += devCredit * w.inflightW * float64(c.pending)
	}
	decode := float64(c.activeBlocks + c.newBlocks)
	prefill := rawPrefillBlocks - credit
	if prefill < 0 { // max(0, prefill), without math.Max's call (-0 and NaN end the same)
		prefill = 0
	}
	return w.scale*prefill + decode + w.activeReqWeight*float64(c.activeRequests)
}

// randSource is what pick draws from (*rand.Rand, or a partition's lockedRand).
type randSource interface {
	IntN(n int) int
	Float64() float64
}

// pick returns the index in cands of the chosen candidate: the cheapest with ties
// broken uniformly at random when temperature is 0, else a softmax draw over
// costs normalised by their range. cands must not be empty.
func pick(cands []candidate, temperature float64, rng randSource) int {
	if temperature <= 0 {
		best, ties := 0, 1
		for i := 1; i < len(cands); i++ {
			switch c := cands[i].cost; {
			case c < cands[best].cost:
				best, ties = i, 1
			case c == cands[best].cost:
				ties++
			}
		}
		if ties == 1 {
			return best
		}
		// One draw picks uniformly among the tied candidates, from best on.
		k := rng.IntN(ties)
		low := cands[best].cost
		for i := best; ; i++ {
			if cands[i].cost == low {
				if k == 0 {
					return i
				}
				k--
			}
		}
	}
	lo, hi := cands[0].cost, cands[0].cost
	for _, c := range cands[1:] {
		lo, hi = math.Min(lo, c.cost), math.Max(hi, c.cost)
	}
	span := hi - lo
	if span == 0 || math.IsInf(span, 0) || math.IsNaN(span) {
		return rng.IntN(len(cands))
	}
	var sum float64
	for i := range cands {
		p := math.Exp(-(cands[i].cost - lo) / (span * temperature))
		cands[i].cost = p // reuse the field for the weight
		sum += p
	}
	u := rng.Float64() * sum
	acc := 0.0
	for i := range cands {
		acc += cands[i].cost
		if u <= acc {
			return i
		}
	}
	return len(cands) - 1
}

// backlogWeight is the predictive cost's backlog weight for a decision
// over cands whose mean time to prefill the model's mean prompt is
// promptTime: w's, raised by w.satGrowth for each mean prompt the
// candidates queue on average beyond SaturationDepth
// (PredictiveCost.SaturationGrowth).
func backlogWeight(w *weights, cands []candidate, promptTime float64) float64 {
	if w.satGrowth <= 0 || promptTime <= 0 || len(cands) == 0 {
		return w.backlogW
	}
	var wait float64 // the candidates' predicted queues, seconds
	for i := range cands {
		wait += cands[i].queueTime * float64(cands[i].activePrefill)
	}
	depth := wait / float64(len(cands)) / promptTime
	return w.backlogW * (1 + w.satGrowth*min(max(0, depth-SaturationDepth), MaxWeight))
}
