package prommetrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvselect/kvselect/lifecycle"
)

// Responses counts what an EPP does while it follows the responses of its
// picks: bookings moved to the worker that served (or freed), workers marked
// failed, lease renewals, response body chunks. Create it with
// NewResponses; a nil *Responses records nothing.
type Responses struct {
	rebookings *prometheus.CounterVec
	failed     *prometheus.CounterVec
	renewed    prometheus.Counter
	stalled    prometheus.Counter
	chunks     prometheus.Counter
}

// Results of a rebooking (kvselect_epp_rebookings_total's result label).
const (
	RebookMoved = "moved" // the booking moved to the served worker
	RebookFreed = "freed" // the served endpoint is no schedulable worker of the role: booking freed
)

// NewResponses creates the counters and registers them in reg.
func NewResponses(reg prometheus.Registerer) (*Responses, error) {
	m := &Responses{
		rebookings: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvselect_epp_rebookings_total",
			Help: "Responses served by another endpoint than the one picked, by what became of their booking (moved to the served worker, or freed when that is no schedulable worker of the destination role).",
		}, []string{"result"}),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvselect_epp_workers_marked_failed_total",
			Help: "Workers reported failed to the selection service (left out of the picks for DYN_EPP_FAILURE_EJECTION_SECS): a 5xx response (status), a response served by one of the pick's fallbacks (fallback), or a prefill worker whose leg failed, as the decode sidecar reported (prefill).",
		}, []string{"cause"}),
		renewed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvselect_epp_lease_renewals_total", Help: "Plan leases renewed because their response was starting or flowing.",
		}),
		stalled: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvselect_epp_lease_renewal_stalls_total", Help: "Renewal ticks skipped because the plan's response sent nothing since the last tick (a stalled stream expires at its lease).",
		}),
		chunks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvselect_epp_response_chunks_total", Help: "Response body chunks the EPP followed (ext_proc response body messages with bytes): the progress lease renewal reads, and output growth's input.",
		}),
	}
	for _, r := range []string{RebookMoved, RebookFreed} {
		m.rebookings.WithLabelValues(r) // exported at 0 from the start
	}
	for _, c := range []lifecycle.Cause{lifecycle.CauseStatus, lifecycle.CauseFallback, lifecycle.CausePrefill} { // the EPP sees no upstream error: Envoy answers 503
		m.failed.WithLabelValues(c.String())
	}
	if err := register(reg, m.rebookings, m.failed, m.renewed, m.stalled, m.chunks); err != nil {
		return nil, err
	}
	return m, nil
}

// MarkedFailed counts a worker marked failed, by cause.
func (m *Responses) MarkedFailed(cause lifecycle.Cause) {
	if m != nil {
		m.failed.WithLabelValues(cause.String()).Inc()
	}
}

// Chunk counts one response body chunk followed.
func (m *Responses) Chunk() {
	if m != nil {
		m.chunks.Inc()
	}
}

// Rebooked counts a response served elsewhere by what became of its booking:
// RebookMoved or RebookFreed.
func (m *Responses) Rebooked(result string) {
	if m != nil {
		m.rebookings.WithLabelValues(result).Inc()
	}
}

// Renewals counts one renewal tick: the leases renewed and the stalled
// responses skipped.
func (m *Responses) Renewals(renewed, stalled int) {
	if m != nil {
		m.renewed.Add(float64(renewed))
		m.stalled.Add(float64(stalled))
	}
}
