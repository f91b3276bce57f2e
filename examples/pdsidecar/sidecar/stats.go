package sidecar

import (
	"maps"
	"slices"
	"sync"
	"time"
)

// Leg names one upstream call of a request.
type Leg string

const (
	LegPrefill     Leg = "prefill"     // to the hinted prefill engine
	LegDecode      Leg = "decode"      // to the local decode engine, on the P/D path (or its local fallback)
	LegPassthrough Leg = "passthrough" // to the local decode engine, no hint
)

// AllLegs lists the legs, in the order of their constants.
var AllLegs = []Leg{LegPrefill, LegDecode, LegPassthrough}

// Outcome is how a leg ended.
type Outcome string

const (
	OutcomeOK          Outcome = "ok"           // a 2xx answer, read (prefill) or relayed (decode) to its end
	OutcomeHTTPError   Outcome = "http_error"   // the engine answered a non-2xx status
	OutcomeError       Outcome = "error"        // connecting, sending or reading failed
	OutcomeTimeout     Outcome = "timeout"      // the leg's deadline passed
	OutcomeCanceled    Outcome = "canceled"     // the client went away
	OutcomeAbandoned   Outcome = "abandoned"    // dropped because the other leg failed (SGLang)
	OutcomeTooLarge    Outcome = "too_large"    // the prefill answer passed MaxPrefillResponseBytes
	OutcomeBadResponse Outcome = "bad_response" // the prefill answer had no usable hand-over
)

// AllOutcomes lists the outcomes, in the order of their constants.
var AllOutcomes = []Outcome{
	OutcomeOK, OutcomeHTTPError, OutcomeError, OutcomeTimeout, OutcomeCanceled,
	OutcomeAbandoned, OutcomeTooLarge, OutcomeBadResponse,
}

// Refusals of a request before any leg (Stats.Refused, the log line's reason).
const (
	RefusedBodyTooLarge   = "body_too_large"         // 413
	RefusedBodyTimeout    = "body_timeout"           // 408
	RefusedBodyUnreadable = "body_unreadable"        // 400
	RefusedNotJSONObject  = "not_json_object"        // 400
	RefusedBadStream      = "bad_stream"             // 400: stream is not a boolean
	RefusedNotOneChoice   = "n_not_one"              // 400: P/D hands over one sequence
	RefusedBatchPrompt    = "batch_prompt"           // 400: a completions prompt list
	RefusedTransferParams = "client_transfer_params" // 400: the client set the protocol's own fields
	RefusedInternal       = "internal"               // 500: the sidecar could not build the request
)

var refusedReasons = []string{
	RefusedBodyTooLarge, RefusedBodyTimeout, RefusedBodyUnreadable, RefusedNotJSONObject,
	RefusedBadStream, RefusedNotOneChoice, RefusedBatchPrompt, RefusedTransferParams, RefusedInternal,
}

// LegKey is a leg and how it ended.
type LegKey struct {
	Leg     Leg
	Outcome Outcome
}

// HandoffBuckets are the upper bounds, in seconds, of the hand-off latency
// histogram.
var HandoffBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}

// Histogram is a snapshot of a latency histogram in Prometheus's shape.
type Histogram struct {
	// Bounds are the buckets' upper bounds in seconds (HandoffBuckets);
	// Cumulative[i] counts observations <= Bounds[i].
	Bounds     []float64
	Cumulative []uint64
	Count      uint64
	Sum        time.Duration
}

// Stats is a consistent snapshot of a Sidecar's counters. Its maps are the
// caller's; BadHints and Refused hold every reason, counted or not.
type Stats struct {
	Protocol Protocol
	// Passthrough counts requests proxied as they came (no hint, or not a
	// completion); Disaggregated counts requests whose hint was accepted.
	Passthrough   uint64
	Disaggregated uint64
	// Legs counts upstream calls by leg and outcome.
	Legs map[LegKey]uint64
	// BadHints counts refused hints by reason (Hint* constants).
	BadHints map[string]uint64
	// Refused counts requests refused before any leg, by reason (Refused*):
	// body_too_large on either path, the others on the P/D path.
	Refused map[string]uint64
	// Fallbacks counts P/D requests sent to the decode engine unchanged after
	// their prefill leg failed (FallbackLocal).
	Fallbacks uint64
	// Handoff is the latency of successful prefill legs: the wait before the
	// decode engine gets its KV (vLLM, TensorRT-LLM), or the prefill's whole
	// transfer (SGLang).
	Handoff Histogram
}

// counters are a Sidecar's statistics, guarded by one mutex.
type counters struct {
	mu            sync.Mutex
	passthrough   uint64
	disaggregated uint64
	fallbacks     uint64
	legs          map[LegKey]uint64
	badHints      map[string]uint64
	refused       map[string]uint64
	handoff       []uint64 // per bucket (not cumulative), one more for +Inf
	handoffCount  uint64
	handoffSum    time.Duration
}

func (c *counters) add(f func(*counters)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.legs == nil {
		c.legs, c.badHints, c.refused = map[LegKey]uint64{}, map[string]uint64{}, map[string]uint64{}
		c.handoff = make([]uint64, len(HandoffBuckets)+1)
	}
	f(c)
}

func (c *counters) leg(l Leg, o Outcome) { c.add(func(c *counters) { c.legs[LegKey{l, o}]++ }) }

func (c *counters) observeHandoff(d time.Duration) {
	c.add(func(c *counters) {
		i, _ := slices.BinarySearch(HandoffBuckets, d.Seconds())
		c.handoff[i]++
		c.handoffCount++
		c.handoffSum += d
	})
}

func (c *counters) snapshot(p Protocol) Stats {
	var s Stats
	c.add(func(c *counters) {
		s = Stats{
			Protocol:      p,
			Passthrough:   c.passthrough,
			Disaggregated: c.disaggregated,
			Legs:          maps.Clone(c.legs),
			BadHints:      maps.Clone(c.badHints),
			Refused:       maps.Clone(c.refused),
			Fallbacks:     c.fallbacks,
			Handoff: Histogram{
				Bounds:     slices.Clone(HandoffBuckets),
				Cumulative: make([]uint64, len(HandoffBuckets)),
				Count:      c.handoffCount,
				Sum:        c.handoffSum,
			},
		}
		var run uint64
		for i := range HandoffBuckets {
			run += c.handoff[i]
			s.Handoff.Cumulative[i] = run
		}
	})
	for _, r := range hintReasons {
		s.BadHints[r] += 0
	}
	for _, r := range refusedReasons {
		s.Refused[r] += 0
	}
	return s
}
