package selection

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The research doc's worked example: T=64, bs=16, cached 96 tokens (6 device
// blocks), A=16, 2 active + 3 new blocks, scale 2, credit 1 -> logit 7, and 5
// without prefill tracking.
func TestLogitWorkedExample(t *testing.T) {
	w := DynamoConfig(16).weights()
	w.scale, w.credit = 2, 1
	c := candidate{device: 6, activePrefill: 16, activeBlocks: 2, newBlocks: 3}
	require.Equal(t, 7.0, logit(&c, costInput{isl: 64, blockSize: 16}, &w))
	w.trackPrefill = false
	require.Equal(t, 5.0, logit(&c, costInput{isl: 64, blockSize: 16}, &w))
}

func TestLogitTable(t *testing.T) {
	base := DynamoConfig(16).weights()
	cases := []struct {
		name string
		c    candidate
		isl  int
		mod  func(*weights)
		want float64
	}{
		{"cold worker pays the whole prompt", candidate{}, 160, nil, 10},
		{"cached prefix is credited", candidate{device: 4}, 160, nil, 6},
		{"full hit costs nothing to prefill", candidate{device: 10}, 160, nil, 0},
		{"prefill load adds up", candidate{activePrefill: 320}, 160, nil, 30},
		{"decode blocks count", candidate{activeBlocks: 7, newBlocks: 3}, 160, nil, 20},
		{"active request weight", candidate{activeRequests: 4}, 160, func(w *weights) { w.activeReqWeight = 0.5 }, 12},
		{"host tier at 0.75", candidate{host: 4}, 160, nil, 10 - 3},
		{"disk tier at 0.25", candidate{disk: 4}, 160, nil, 10 - 1},
		{"zero credit ignores cache", candidate{device: 10}, 160, func(w *weights) { w.credit = 0 }, 10},
		{"scale multiplies prefill only", candidate{activeBlocks: 1}, 32, func(w *weights) { w.scale = 3 }, 7},
		{"partial block counts as tokens", candidate{}, 24, nil, 1.5},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w := base
			if c.mod != nil {
				c.mod(&w)
			}
			require.InDelta(t, c.want, logit(&c.c, costInput{isl: c.isl, blockSize: 16}, &w), 1e-9)
		})
	}
}

func TestPickArgminBreaksTiesUniformly(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	counts := make([]int, 4)
	for range 4000 {
		cands := []candidate{{cost: 3}, {cost: 1}, {cost: 1}, {cost: 1}}
		counts[pick(cands, 0, rng)]++
	}
	require.Zero(t, counts[0])
	for _, n := range counts[1:] {
		require.InDelta(t, 4000.0/3, float64(n), 150, "counts %v", counts)
	}
}

func TestPickSoftmax(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	counts := make([]int, 3)
	const n = 20000
	for range n {
		cands := []candidate{{cost: 0}, {cost: 5}, {cost: 10}}
		counts[pick(cands, 1, rng)]++
	}
	// p_i ~ exp(-(c_i-0)/(10*1)): 1, e^-0.5, e^-1.
	z := 1 + math.Exp(-0.5) + math.Exp(-1)
	require.InDelta(t, n/z, float64(counts[0]), n*0.02)
	require.InDelta(t, n*math.Exp(-0.5)/z, float64(counts[1]), n*0.02)
	require.InDelta(t, n*math.Exp(-1)/z, float64(counts[2]), n*0.02)
	// Equal costs: uniform.
	counts = make([]int, 3)
	for range 3000 {
		counts[pick([]candidate{{cost: 2}, {cost: 2}, {cost: 2}}, 0.5, rng)]++
	}
	for _, c := range counts {
		require.InDelta(t, 1000, c, 120)
	}
	// A low temperature is nearly argmin.
	low := 0
	for range 1000 {
		if pick([]candidate{{cost: 0}, {cost: 1}}, 0.01, rng) == 0 {
			low++
		}
	}
	require.Equal(t, 1000, low)
}

func TestConfigValidation(t *testing.T) {
	require.NoError(t, DynamoConfig(16).Validate())
	nan, neg, big := math.NaN(), -1.0, 2.0
	bad := DynamoConfig(0)
	bad.OverlapScoreCredit = nan
	bad.PrefillLoadScale = math.Inf(1)
	bad.HostCacheHitWeight = big
	bad.DiskCacheHitWeight = neg
	bad.Temperature = neg
	bad.QueueThreshold = &neg
	bad.QueueLimit = -1
	bad.RouterTTL = -1
	bad.ActiveRequestExpiry = -1
	bad.QueuePolicy = 9
	err := bad.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	for _, field := range []string{"BlockSize", "OverlapScoreCredit", "PrefillLoadScale", "HostCacheHitWeight",
		"DiskCacheHitWeight", "Temperature", "QueueThreshold", "QueueLimit", "RouterTTL",
		"ActiveRequestExpiry", "QueuePolicy"} {
		require.ErrorContains(t, err, field)
	}
	// Credits above 1 are allowed (extra credit).
	ok := DynamoConfig(16)
	ok.OverlapScoreCredit = 1.5
	require.NoError(t, ok.Validate())
	// Weights so large that costs overflow, and durations that round to the
	// default, are refused by name.
	huge := DynamoConfig(16)
	huge.OverlapScoreCredit, huge.PrefillLoadScale, huge.DecodeActiveRequestWeight = 1e308, 1e7, 2e6
	huge.RouterTTL, huge.ActiveRequestExpiry = time.Nanosecond, time.Microsecond
	err = huge.Validate()
	for _, field := range []string{"OverlapScoreCredit", "PrefillLoadScale", "DecodeActiveRequestWeight", "RouterTTL", "ActiveRequestExpiry"} {
		require.ErrorContains(t, err, field)
	}
}

func TestOverrideRejectsBadWeights(t *testing.T) {
	_, err := (&Override{Temperature: &neg1}).apply(DynamoConfig(16).weights())
	require.ErrorIs(t, err, ErrBadRequest)
}

// A Config written as a literal routes almost at random (no KV events, no
// weights): Validate refuses it and says where to start.
func TestLiteralConfigRefused(t *testing.T) {
	err := Config{BlockSize: 16}.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "DefaultConfig(blockSize)")
	_, err = NewSelectionServiceBuilder(Config{BlockSize: 16}).Build(context.Background())
	require.ErrorIs(t, err, ErrInvalidConfig)
	var zero Config
	require.ErrorContains(t, zero.Validate(), "DefaultConfig(blockSize)")
	require.NoError(t, DefaultConfig(16).Validate())
	require.NoError(t, DynamoConfig(16).Validate())
}

var neg1 = -1.0

func TestParseQueuePolicy(t *testing.T) {
	for s, want := range map[string]QueuePolicy{"fcfs": QueueFCFS, " LCFS": QueueLCFS, "wspt": QueueWSPT} {
		got, err := ParseQueuePolicy(s)
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.Equal(t, want.String(), got.String())
	}
	_, err := ParseQueuePolicy("sjf")
	require.ErrorIs(t, err, ErrInvalidConfig)
}

func TestDefaultConfigDiffersFromDynamoOnlyInThreeWeightsAndTheCost(t *testing.T) {
	d, k := DynamoConfig(16), DefaultConfig(16)
	require.Equal(t, 1.0, d.OverlapScoreCredit)
	require.Equal(t, 1.0, d.PrefillLoadScale)
	require.Zero(t, d.InFlightHitWeight)
	require.Equal(t, CostDynamo, d.Cost)
	require.Equal(t, 4.0, k.OverlapScoreCredit)
	require.Equal(t, 2.5, k.PrefillLoadScale)
	require.Equal(t, 1.0, k.InFlightHitWeight)
	require.Equal(t, CostAuto, k.Cost)
	k.OverlapScoreCredit, k.PrefillLoadScale, k.InFlightHitWeight, k.Cost = d.OverlapScoreCredit, d.PrefillLoadScale, d.InFlightHitWeight, d.Cost
	require.Equal(t, d, k)
	require.NoError(t, DefaultConfig(16).Validate())
	require.NoError(t, DynamoConfig(16).Validate())
}
