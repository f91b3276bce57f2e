package selection

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
)

// TestPredictedWorkedExample: T = 64 tokens, 32 cached, 100 queued begun
// 50 ms ago at 1,000 tokens a second (50 left), 2 active + 2 new blocks of
// 16 at decode weight 0.5, backlog weight 1: (50 + 2 x 32 + 0.5 x 4 x 16) /
// 1000. Calibrated, the queue is priced as the fit says, not drained.
func TestPredictedWorkedExample(t *testing.T) {
	w := DefaultConfig(16).weights()
	w.predictive, w.rate, w.backlogW, w.decodeW, w.inflightW = true, 1000, 1, 0.5, 0
	now := time.Unix(100, 0).UnixNano()
	c := candidate{device: 2, activePrefill: 100, since: now - int64(50*time.Millisecond), activeBlocks: 2, newBlocks: 2,
		activeRequests: 3, tokTime: 1.0 / 1000, queueTime: 1.0 / 1000}
	in := costInput{isl: 64, blockSize: 16, now: now, backlogW: w.backlogW}
	require.InDelta(t, (50+2*32+0.5*4*16)/1000.0, cost(&c, &in, &w), 1e-12)
	c.tokTime = 1.0 / 1500 // a faster rank: 100 - 75 = 25 left, then /1500
	require.InDelta(t, (25+2*32+0.5*4*16)/1500.0, cost(&c, &in, &w), 1e-12)
	c.tokTime, c.since = 1.0/1000, now-int64(time.Second) // long done: nothing left ahead
	require.InDelta(t, (2*32+0.5*4*16)/1000.0, cost(&c, &in, &w), 1e-12)
	c.since = 0 // no clock: the whole queue is ahead
	require.InDelta(t, (100+2*32+0.5*4*16)/1000.0, cost(&c, &in, &w), 1e-12)

	// Calibrated: 10 ms overhead, 2 ms a request, queued tokens at 0.5 ms,
	// own tokens at 1 ms: 0.010 + 0.5e-3 x 100 + 0.002 x 3 + 1e-3 x 32,
	// backlog 1 x 0.5e-3 x 32, decode 0.5 x 1e-3 x 4 x 16.
	c.queueTime, c.since = 0.5e-3, now-int64(time.Second)
	cal := in
	cal.calibrated, cal.overhead, cal.perRequest = true, 0.010, 0.002
	require.InDelta(t, 0.010+0.5e-3*100+0.002*3+1e-3*32+0.5e-3*32+0.5*1e-3*4*16, cost(&c, &cal, &w), 1e-12)
	c.queueTime = 0 // an engine where nothing waits for what is queued: no backlog either
	require.InDelta(t, 0.010+0.002*3+1e-3*32+0.5*1e-3*4*16, cost(&c, &cal, &w), 1e-12)

	// A full cache (pressure 0.5, eviction weight 2): the request's 32
	// uncached tokens cost 2 x 0.5 x 1 ms more, and the decode term half.
	c.queueTime, w.evictW, c.pressure = 0.5e-3, 2, 0.5
	require.InDelta(t, 0.010+0.5e-3*100+0.002*3+1e-3*32+0.5e-3*32+2*0.5*1e-3*32+0.5*0.5*1e-3*4*16, cost(&c, &cal, &w), 1e-12)
	c.since = 0
	require.InDelta(t, (100+(1+1+2*0.5)*32+0.5*0.5*4*16)/1000.0, cost(&c, &in, &w), 1e-12)
	c.pressure, w.evictW = 0, 0

	w.trackPrefill, c.activePrefill, c.queueTime = false, 0, 1.0/1000 // a decode leg: decode pressure only
	require.InDelta(t, (0.5*4*16)/1000.0, cost(&c, &in, &w), 1e-12)
}

// TestBacklogWeightGrowsWithSaturation: the backlog weight is the
// configured one until the candidates queue SaturationDepth mean prompts on
// average, then grows by SaturationGrowth for each one more; 0 turns that
// off.
func TestBacklogWeightGrowsWithSaturation(t *testing.T) {
	w := DefaultConfig(16).weights()
	w.backlogW, w.satGrowth = 0.5, 1
	const prompt = 0.1 // seconds to prefill the mean prompt
	queued := func(prompts ...float64) []candidate {
		var cs []candidate
		for _, p := range prompts { // p mean prompts queued, at 1 ms a token
			cs = append(cs, candidate{queueTime: 1e-3, activePrefill: int64(p * prompt / 1e-3)})
		}
		return cs
	}
	require.InDelta(t, 0.5, backlogWeight(&w, queued(0, 2, 6), prompt), 1e-9, "a mean of 8/3 prompts: not saturated")
	require.InDelta(t, 0.5, backlogWeight(&w, queued(4, 4), prompt), 1e-9, "at the depth")
	require.InDelta(t, 0.5*(1+3), backlogWeight(&w, queued(6, 8), prompt), 1e-9, "3 beyond it")
	w.satGrowth = 2
	require.InDelta(t, 0.5*(1+6), backlogWeight(&w, queued(6, 8), prompt), 1e-9)
	w.satGrowth = 0
	require.InDelta(t, 0.5, backlogWeight(&w, queued(60, 80), prompt), 1e-9, "off")
	w.satGrowth = 1
	require.InDelta(t, 0.5, backlogWeight(&w, queued(60, 80), 0), 1e-9, "no prompt time yet")
}

// TestPredictiveCostWaitsOrMoves: a request whose prefix only a busy worker
// caches waits there while the queue ahead drains faster than computing the
// prefix elsewhere, and moves once it does not; Dynamo's cost (at its
// default weights), which sees queued tokens but not how far their prefill
// has got, moves at once.
func TestPredictiveCostWaitsOrMoves(t *testing.T) {
	prompt := toks(64, 1) // 16 blocks of 4
	for _, tc := range []struct {
		name    string
		cost    CostModel
		elapsed time.Duration
		want    string
	}{
		{"predictive, queue half done", CostPredictive, 50 * time.Millisecond, "a"},
		{"predictive, queue just begun", CostPredictive, 0, "b"},
		{"dynamo, queue half done", CostDynamo, 50 * time.Millisecond, "b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig(4)
			cfg.Cost, cfg.InFlightHitWeight = tc.cost, 0
			if tc.cost == CostDynamo {
				cfg.OverlapScoreCredit, cfg.PrefillLoadScale = 1, 1
			}
			cfg.Predictive.PrefillTokensPerSecond, cfg.Predictive.FixedRate = 1000, true
			cfg.Predictive.BalanceWeight = 0 // a's booking would make it costlier still
			s, clk, h := newEventService(t, cfg, "a", "b")
			require.NoError(t, s.Events().Apply(catalog.WorkerRank{WorkerID: "a"},
				kvindex.Event{Kind: kvindex.EventStored, BlockHashes: h.AppendSeqHashes(nil, prompt[:60]), Tokens: prompt[:60]}))
			// 100 ms of prefill queued on a (100 tokens at 1,000 a second).
			_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(100, 7), Allowed: []string{"a"}})
			require.NoError(t, err)
			clk.Advance(tc.elapsed)
			// On a: the rest of the queue, then 4 tokens; on b: 64 tokens.
			got, err := s.Select(context.Background(), Request{Tokens: prompt})
			require.NoError(t, err)
			require.Equal(t, tc.want, got.WorkerID, "cost %v", got.Cost)
		})
	}
}

// TestPredictiveLearnsRates: a worker whose prefills complete twice as fast
// as another's, behind the same 5 ms overhead, is calibrated as such once
// the ledger's fit is Ready, and its queue then costs half; with FixedRate
// the cost keeps the configured rate for both.
func TestPredictiveLearnsRates(t *testing.T) {
	for _, fixed := range []bool{false, true} {
		cfg := DefaultConfig(4)
		cfg.Cost, cfg.InFlightHitWeight = CostPredictive, 0
		cfg.Predictive.PrefillTokensPerSecond, cfg.Predictive.FixedRate = 1000, fixed
		clk := newFakeClock()
		s, err := NewSelectionServiceBuilder(cfg).ExternalEvents().Clock(clk.Now).SweepInterval(-1).Build(context.Background())
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		addWorkers(t, s, "fast", "slow")
		for i := range 40 {
			n := 100 + 37*i%300 // prompt tokens, none cached
			for _, w := range []struct {
				id   string
				rate float64
			}{{"fast", 2000}, {"slow", 1000}} {
				r, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(n, 10*i+len(w.id)), Allowed: []string{w.id}})
				require.NoError(t, err)
				clk.Advance(5*time.Millisecond + time.Duration(float64(n)/w.rate*float64(time.Second)))
				require.NoError(t, s.Reservations().PrefillComplete(r.ReservationID))
				require.NoError(t, s.Reservations().Free(r.ReservationID))
			}
		}
		rates := map[string]float64{}
		for _, l := range s.Loads("") {
			rates[l.WorkerID] = l.PrefillRate
		}
		require.InEpsilon(t, 2000, rates["fast"], 0.05, "calibrated whatever the cost's FixedRate")
		require.InEpsilon(t, 1000, rates["slow"], 0.05)
		cal := s.Stats().Calibration
		require.True(t, cal.Ready)
		// One fit pools both ranks' completions, whose token times differ by
		// 2x: its overhead is near, not at, the 5 ms they share.
		require.InDelta(t, 0.005, cal.Overhead, 0.005)
		for _, id := range []string{"fast", "slow"} {
			_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(400, 99), Allowed: []string{id}})
			require.NoError(t, err)
		}
		costs := map[string]float64{}
		scored, err := s.PotentialLoads(context.Background(), Request{Tokens: toks(40, 5)})
		require.NoError(t, err)
		for _, sc := range scored {
			costs[sc.WorkerRank.WorkerID] = sc.Cost
		}
		if fixed {
			require.InDelta(t, costs["slow"], costs["fast"], 1e-9, "one rate for all")
			continue
		}
		// Each: the overhead and one active request's price, plus
		// (QueuedToken x 400 + OwnToken x 40 + backlog and decode) x its
		// slowness: the rank-dependent part doubles.
		base := cal.Overhead + cal.ActiveRequest
		require.InEpsilon(t, 2, (costs["slow"]-base)/(costs["fast"]-base), 0.08)
	}
}

// TestPredictiveConfig: the predictive cost's settings are validated and
// named.
func TestPredictiveConfig(t *testing.T) {
	cfg := DefaultConfig(4)
	require.Equal(t, CostAuto, cfg.Cost)
	require.Equal(t, CostDynamo, DynamoConfig(4).Cost)
	cfg.Cost = CostModel(9)
	cfg.Predictive = PredictiveCost{PrefillTokensPerSecond: 0, BacklogWeight: -1, DecodeWeight: 2 * MaxWeight,
		BalanceWeight: math.NaN(), BalanceSlack: -0.1, BalanceWindow: time.Millisecond}
	err := cfg.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	for _, field := range []string{"Cost", "Predictive.PrefillTokensPerSecond", "Predictive.BacklogWeight", "Predictive.DecodeWeight",
		"Predictive.BalanceWeight", "Predictive.BalanceSlack", "Predictive.BalanceWindow"} {
		require.ErrorContains(t, err, field)
	}
	for _, m := range []CostModel{CostDynamo, CostPredictive, CostAuto} {
		got, err := ParseCostModel(m.String())
		require.NoError(t, err)
		require.Equal(t, m, got)
	}
	_, err = ParseCostModel("fastest")
	require.ErrorIs(t, err, ErrInvalidConfig)
	// A subnormal rate is above 0 and would make every cost infinite.
	for _, rate := range []float64{4.9e-324, 0.5, math.Inf(1), 2e9} {
		cfg := DefaultConfig(4)
		cfg.Predictive.PrefillTokensPerSecond = rate
		require.ErrorContains(t, cfg.Validate(), "Predictive.PrefillTokensPerSecond", "rate %v", rate)
	}
}

// TestPredictiveSoftSession: under the predictive cost a soft pin's slack is
// in the cost's own unit (the request's predicted cost on an idle rank): a
// pin slightly costlier than the best is kept, a far costlier one moves.
func TestPredictiveSoftSession(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) {
		c.Cost = CostPredictive
		c.Predictive.PrefillTokensPerSecond, c.Predictive.FixedRate = 1000, true
	})
	addWorkers(t, s, "a", "b")
	first := bookSession(t, s, "conv", toks(16, 1))
	// 16 tokens queued ahead on the pinned rank: within 2 cold costs (2 x 16).
	require.Equal(t, first, bookSession(t, s, "conv", toks(16, 2)))
	for i := range 8 { // 8 x 64 tokens more: far beyond
		_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(64, 50+i), Allowed: []string{first}})
		require.NoError(t, err)
	}
	require.NotEqual(t, first, bookSession(t, s, "conv", toks(16, 3)), "the soft pin stayed on a worker far costlier")
	st := s.Stats()
	require.Equal(t, uint64(1), st.SessionHits)
	require.Equal(t, uint64(1), st.SessionMoves)
}

// TestPredictiveBalance: a rank with more than its share of the recent
// bookings costs BalanceWeight times the time to prefill the mean prompt
// more per unit of share above the mean and the slack, so a request whose prefix only it caches goes elsewhere once
// that price exceeds what the prefix saves; with the weight 0 it stays.
// Below a mean of one booking the term is off.
func TestPredictiveBalance(t *testing.T) {
	prompt := toks(64, 1) // 16 blocks of 4
	for _, weight := range []float64{0, DefaultBalanceWeight} {
		cfg := DefaultConfig(4)
		cfg.Cost, cfg.InFlightHitWeight = CostPredictive, 0
		cfg.Predictive.PrefillTokensPerSecond, cfg.Predictive.FixedRate = 1000, true
		cfg.Predictive.BalanceWeight = weight
		clk := newFakeClock()
		s, err := NewSelectionServiceBuilder(cfg).ExternalEvents().Clock(clk.Now).SweepInterval(-1).Build(context.Background())
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		addWorkers(t, s, "a", "b", "c")
		h, err := kvindex.NewHasher(4, kvindex.HashOptions{})
		require.NoError(t, err)
		require.NoError(t, s.Events().Apply(catalog.WorkerRank{WorkerID: "a"},
			kvindex.Event{Kind: kvindex.EventStored, BlockHashes: h.AppendSeqHashes(nil, prompt[:60]), Tokens: prompt[:60]}))
		book := func(w string, n int) { // n requests to w, finished at once: arrivals, no load
			for i := range n {
				r, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(64, 100*len(w)+i+n), Allowed: []string{w}})
				require.NoError(t, err)
				require.NoError(t, s.Reservations().Free(r.ReservationID))
			}
		}
		costs := func() map[string]float64 { return costsOf(t, s, Request{Tokens: prompt}) }
		// a: 4 uncached tokens; b, c: 64. Each x 1.5 (backlog), plus 16
		// new blocks x 4 tokens x 0.125 (decode), at 1,000 tokens a second.
		cold := (1.5*64 + 0.125*16*4) / 1000
		cached := (1.5*4 + 0.125*16*4) / 1000
		book("a", 2) // mean 2/3: off
		require.InDelta(t, cached, costs()["a"], 1e-12)
		book("a", 4)
		book("b", 1)
		book("c", 1) // a has 6 of 8: share 2.25
		got := costs()
		// The unit: every prompt so far has 64 tokens, 64 ms at 1,000 a second.
		require.InDelta(t, cached+weight*0.064*(2.25-1-DefaultBalanceSlack), got["a"], 1e-9)
		require.InDelta(t, cold, got["b"], 1e-12, "b's share is below the mean")
		res, err := s.Select(context.Background(), Request{Tokens: prompt})
		require.NoError(t, err)
		if weight == 0 {
			require.Equal(t, "a", res.WorkerID)
		} else {
			require.NotEqual(t, "a", res.WorkerID)
			// Decayed over a few windows the excess fades and the prefix wins.
			clk.Advance(10 * DefaultBalanceWindow)
			res, err = s.Select(context.Background(), Request{Tokens: prompt})
			require.NoError(t, err)
			require.Equal(t, "a", res.WorkerID, "after ten windows the mean is below one booking")
		}
	}
}

// costRecorder keeps the last decision.
type costRecorder struct {
	nopRecorder
	mu   sync.Mutex
	last Decision
}

func (r *costRecorder) Selected(_ string, d Decision) {
	r.mu.Lock()
	r.last = d
	r.mu.Unlock()
}

// TestCostAuto: CostAuto predicts on a model of at most
// AutoPredictiveMaxRanks ranks and decides by Dynamo's cost above, per
// decision, as the model grows and shrinks.
func TestCostAuto(t *testing.T) {
	rec := &costRecorder{}
	s, err := NewSelectionServiceBuilder(DefaultConfig(16)).ExternalEvents().SweepInterval(-1).Recorder(rec).Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	upsert := func(w int) {
		_, err := s.Workers().Upsert(catalog.Worker{ID: fmt.Sprintf("w%d", w), Endpoint: fmt.Sprintf("10.0.0.%d:80", w+1), DPSize: 8, BlockSize: 16})
		require.NoError(t, err)
	}
	predicted := func() bool {
		_, err := s.Select(context.Background(), Request{Tokens: toks(64, 3)})
		require.NoError(t, err)
		rec.mu.Lock()
		defer rec.mu.Unlock()
		return rec.last.Predicted
	}
	for w := range 15 {
		upsert(w)
	}
	require.True(t, predicted(), "120 ranks")
	upsert(15)
	require.Equal(t, AutoPredictiveMaxRanks+1, len(s.Loads("")))
	require.False(t, predicted(), "128 ranks: Dynamo's cost")
	_, err = s.Workers().Delete("w15")
	require.NoError(t, err)
	require.True(t, predicted(), "120 ranks again")
}

// newEventService builds a service of cfg fed KV events by the test
// (Events().Apply) on a fake clock, with the given workers, and a hasher of
// its 4-token blocks.
func newEventService(t *testing.T, cfg Config, workers ...string) (*SelectionService, *fakeClock, kvindex.Hasher) {
	t.Helper()
	clk := newFakeClock()
	s, err := NewSelectionServiceBuilder(cfg).ExternalEvents().Clock(clk.Now).SweepInterval(-1).Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	addWorkers(t, s, workers...)
	h, err := kvindex.NewHasher(4, kvindex.HashOptions{})
	require.NoError(t, err)
	return s, clk, h
}
