package prommetrics_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/epp/prommetrics"
	"github.com/kvselect/kvselect/tokenize"
)

// tok answers with one token, or fails with err.
type tok struct{ err error }

func (f tok) Tokenize(context.Context, tokenize.Request) (tokenize.Result, error) {
	if f.err != nil {
		return tokenize.Result{}, f.err
	}
	return tokenize.Result{Tokens: []uint32{1}}, nil
}

// The collector exports the pool's counters as the pool counts them: each
// endpoint's calls, failures and circuit by name, from the start, and the
// failovers, exhaustion and degraded requests.
func TestTokenizerCollector(t *testing.T) {
	_, err := prommetrics.NewTokenizerCollector(prommetrics.TokenizerOptions{})
	require.Error(t, err)

	down := fmt.Errorf("dial: %w", tokenize.ErrUnavailable)
	pool, err := tokenize.NewPool(tokenize.PoolOptions{Failures: 1, HedgeQuantile: -1, Endpoints: []tokenize.Endpoint{
		{Name: "http://down:8000", Tokenizer: tok{err: down}},
		{Name: "http://up:8000", Tokenizer: tok{}},
		{Name: "http://idle:8000", Tokenizer: tok{err: down}},
	}})
	require.NoError(t, err)
	var degraded uint64 = 7
	c, err := prommetrics.NewTokenizerCollector(prommetrics.TokenizerOptions{Pool: pool, Degraded: func() uint64 { return degraded }})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(c))

	all := gather(t, reg)
	for _, ep := range []string{"http://down:8000", "http://up:8000", "http://idle:8000"} {
		l := map[string]string{"endpoint": ep}
		require.Zero(t, find(t, all, "kvselect_tokenizer_endpoint_calls_total", l), "exported at 0: %s", ep)
		require.Zero(t, find(t, all, "kvselect_tokenizer_endpoint_circuit_open", l))
	}
	require.Equal(t, 0.05, find(t, all, "kvselect_tokenizer_hedge_delay_seconds", nil))

	// The first call goes to "down" (round robin from the first), fails over
	// to "up", which answers.
	_, err = pool.Tokenize(context.Background(), tokenize.Request{Path: "/v1/completions", Body: []byte(`{"prompt":"x"}`)})
	require.NoError(t, err)
	all = gather(t, reg)
	down1 := map[string]string{"endpoint": "http://down:8000"}
	require.Equal(t, 1.0, find(t, all, "kvselect_tokenizer_endpoint_calls_total", down1))
	require.Equal(t, 1.0, find(t, all, "kvselect_tokenizer_endpoint_failures_total", down1))
	require.Equal(t, 1.0, find(t, all, "kvselect_tokenizer_endpoint_circuit_open", down1), "one failure opens it (Failures 1)")
	require.Equal(t, 1.0, find(t, all, "kvselect_tokenizer_endpoint_circuit_opened_total", down1))
	require.Equal(t, 1.0, find(t, all, "kvselect_tokenizer_endpoint_calls_total", map[string]string{"endpoint": "http://up:8000"}))
	require.Equal(t, 1.0, find(t, all, "kvselect_tokenizer_failovers_total", nil))
	require.Zero(t, find(t, all, "kvselect_tokenizer_exhausted_total", nil))
	require.Zero(t, find(t, all, "kvselect_tokenizer_hedges_total", nil))
	require.Zero(t, find(t, all, "kvselect_tokenizer_hedge_wins_total", nil))
	require.Equal(t, 7.0, find(t, all, "kvselect_epp_degraded_requests_total", nil))

	// Without a degraded count, no such series.
	c, err = prommetrics.NewTokenizerCollector(prommetrics.TokenizerOptions{Pool: pool})
	require.NoError(t, err)
	reg = prometheus.NewRegistry()
	require.NoError(t, reg.Register(c))
	require.NotContains(t, gather(t, reg), "kvselect_epp_degraded_requests_total")
}
