package prommetrics

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvselect/kvselect/tokenize"
)

// TokenizerOptions configure a TokenizerCollector.
type TokenizerOptions struct {
	// Pool is the tokenizer pool whose counters are exported (required):
	// its failovers, hedges and exhaustion, and each endpoint's calls,
	// failures and circuit, labelled by the endpoint's name.
	Pool *tokenize.Pool
	// Degraded counts the requests routed on load alone because no
	// tokenizer answered (the degraded mode); nil exports no
	// kvselect_epp_degraded_requests_total.
	Degraded func() uint64
}

// TokenizerCollector reads a tokenize.Pool's counters (Pool.Stats), and the
// EPP's count of degraded requests, on every scrape. Create it with
// NewTokenizerCollector and register it in the EPP's registry. (The
// tokenizer cache's series are the ServiceCollector's.)
type TokenizerCollector struct {
	pool     *tokenize.Pool
	degraded func() uint64 // may be nil
}

var _ prometheus.Collector = (*TokenizerCollector)(nil)

// NewTokenizerCollector returns the collector of o's pool.
func NewTokenizerCollector(o TokenizerOptions) (*TokenizerCollector, error) {
	if o.Pool == nil {
		return nil, errors.New("prommetrics: a TokenizerCollector needs a tokenize.Pool")
	}
	return &TokenizerCollector{pool: o.Pool, degraded: o.Degraded}, nil
}

var (
	epLabels          = []string{"endpoint"}
	dTokEpCalls       = prometheus.NewDesc("kvselect_tokenizer_endpoint_calls_total", "Tokenizer calls the endpoint answered or failed (a hedged call counts on each endpoint it went to).", epLabels, nil)
	dTokEpFailures    = prometheus.NewDesc("kvselect_tokenizer_endpoint_failures_total", "Tokenizer calls that failed on the endpoint's side (unreachable, its own timeout, an upstream error): each one fails over to the next endpoint.", epLabels, nil)
	dTokEpOpen        = prometheus.NewDesc("kvselect_tokenizer_endpoint_circuit_open", "1 while the endpoint's circuit is open (it failed several times in a row and is tried again by one probe at a time), 0 while it takes calls.", epLabels, nil)
	dTokEpOpened      = prometheus.NewDesc("kvselect_tokenizer_endpoint_circuit_opened_total", "Times the endpoint's circuit opened.", epLabels, nil)
	dTokFailovers     = prometheus.NewDesc("kvselect_tokenizer_failovers_total", "Tokenizer calls sent to another endpoint after one failed.", nil, nil)
	dTokHedges        = prometheus.NewDesc("kvselect_tokenizer_hedges_total", "Second tokenizer calls sent to another endpoint because the first was slower than most recent calls.", nil, nil)
	dTokHedgeWins     = prometheus.NewDesc("kvselect_tokenizer_hedge_wins_total", "Hedged calls that answered before the first.", nil, nil)
	dTokHedgeDelay    = prometheus.NewDesc("kvselect_tokenizer_hedge_delay_seconds", "How long a tokenizer call waits now before it is hedged: the recent calls' p95, at least 50 ms.", nil, nil)
	dTokExhausted     = prometheus.NewDesc("kvselect_tokenizer_exhausted_total", "Tokenizations that every endpoint tried failed.", nil, nil)
	dDegradedRequests = prometheus.NewDesc("kvselect_epp_degraded_requests_total", "Requests routed on load alone, without prefix reuse, because no tokenizer answered (the degraded mode; DYN_EPP_TOKENIZER_NO_DEGRADE refuses them instead).", nil, nil)
)

// Describe sends the descriptors of every series Collect may send.
func (c *TokenizerCollector) Describe(ch chan<- *prometheus.Desc) {
	prometheus.DescribeByCollect(c, ch)
}

// Collect reads the pool and sends its series.
func (c *TokenizerCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	st := c.pool.Stats()
	for _, e := range st.Endpoints {
		counter(dTokEpCalls, e.Calls, e.Name)
		counter(dTokEpFailures, e.Failures, e.Name)
		counter(dTokEpOpened, e.Opened, e.Name)
		ch <- prometheus.MustNewConstMetric(dTokEpOpen, prometheus.GaugeValue, b2f(e.Open), e.Name)
	}
	counter(dTokFailovers, st.Failovers)
	counter(dTokHedges, st.Hedges)
	counter(dTokHedgeWins, st.HedgeWins)
	counter(dTokExhausted, st.Exhausted)
	ch <- prometheus.MustNewConstMetric(dTokHedgeDelay, prometheus.GaugeValue, st.HedgeAfter.Seconds())
	if c.degraded != nil {
		counter(dDegradedRequests, c.degraded())
	}
}
