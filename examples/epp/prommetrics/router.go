package prommetrics

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvselect/kvselect/selection/httproute"
)

// RouterCollector reads an httproute.Router's counters (Router.Stats) on
// every scrape: the kvselect_httproute_* series of a Go gateway that embeds
// kvselect (examples/gateway). The Router's counters stay the source of
// truth. Create it with NewRouterCollector and register it in the gateway's
// registry.
type RouterCollector struct {
	router *httproute.Router
}

var _ prometheus.Collector = (*RouterCollector)(nil)

// NewRouterCollector returns the collector of r's counters.
func NewRouterCollector(r *httproute.Router) (*RouterCollector, error) {
	if r == nil {
		return nil, errors.New("prommetrics: a RouterCollector needs a Router")
	}
	return &RouterCollector{router: r}, nil
}

var (
	dRtRequests  = prometheus.NewDesc("kvselect_httproute_requests_total", "Requests the Router received.", nil, nil)
	dRtRejected  = prometheus.NewDesc("kvselect_httproute_rejected_total", "Requests answered before any upstream (method, body, tokenizer, Prepare, selection, a bound).", nil, nil)
	dRtRefusals  = prometheus.NewDesc("kvselect_httproute_refusals_total", "Requests refused past a bound, by reason (overloaded: 503, body_timeout: 408, body_too_large: 413, prompt_too_long: 413, each also in kvselect_httproute_rejected_total), and tokenizer_degraded: requests routed on load alone because the tokenizer failed (served, not refused; no prefix reuse).", []string{"reason"}, nil)
	dRtBooked    = prometheus.NewDesc("kvselect_httproute_booked_total", "Bookings the Router made.", nil, nil)
	dRtDone      = prometheus.NewDesc("kvselect_httproute_done_total", "Bookings settled, by how the exchange ended (ended: answer read to its end; canceled: the client left or its deadline passed; failed: the upstream was unreachable or cut its answer; aborted: the proxy path panicked or stopped otherwise).", []string{"outcome"}, nil)
	dRtFirst     = prometheus.NewDesc("kvselect_httproute_first_bytes_total", "2xx answers whose first body byte arrived (PrefillComplete).", nil, nil)
	dRtRenewals  = prometheus.NewDesc("kvselect_httproute_lease_renewals_total", "Booking leases renewed while their request made progress.", nil, nil)
	dRtStalls    = prometheus.NewDesc("kvselect_httproute_lease_renewal_stalls_total", "Renewals skipped because a started answer sent nothing since the last one.", nil, nil)
	dRtUpErrors  = prometheus.NewDesc("kvselect_httproute_upstream_errors_total", "Transport errors talking to a worker (client cancels excluded).", nil, nil)
	dRtFailStat  = prometheus.NewDesc("kvselect_httproute_failure_statuses_total", "Worker answers with a failure status (5xx but 501 and 505, by default).", nil, nil)
	dRtMarkedBad = prometheus.NewDesc("kvselect_httproute_workers_marked_failed_total", "Workers marked failed (out of the picks for the failure ejection time), at most once per request.", nil, nil)
)

// Describe sends the descriptors of every series Collect sends.
func (c *RouterCollector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

// Collect reads the Router's counters and sends their series; every
// labelled one is sent, at 0 until it moves.
func (c *RouterCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.router.Stats()
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	counter(dRtRequests, st.Requests)
	counter(dRtRejected, st.Rejected)
	counter(dRtRefusals, st.Overloaded, "overloaded")
	counter(dRtRefusals, st.BodyTimeouts, "body_timeout")
	counter(dRtRefusals, st.BodiesTooLarge, "body_too_large")
	counter(dRtRefusals, st.PromptsTooLong, "prompt_too_long")
	counter(dRtRefusals, st.Degraded, "tokenizer_degraded")
	counter(dRtBooked, st.Booked)
	counter(dRtDone, st.Ended, "ended")
	counter(dRtDone, st.Canceled, "canceled")
	counter(dRtDone, st.Failed, "failed")
	counter(dRtDone, st.Aborted, "aborted")
	counter(dRtFirst, st.FirstBytes)
	counter(dRtRenewals, st.Renewals)
	counter(dRtStalls, st.Stalls)
	counter(dRtUpErrors, st.UpstreamErrors)
	counter(dRtFailStat, st.FailureStatuses)
	counter(dRtMarkedBad, st.MarkedFailed)
}
