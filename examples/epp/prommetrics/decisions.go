package prommetrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvselect/kvselect/selection"
)

// Decisions backs each role's selection.Recorder with Prometheus histograms
// of every decision: how much of the best overlap the chosen rank had, how
// much cheaper it was than the next candidate, and how often it was decided
// again. Create it with NewDecisions; ForRole gives each service its
// Recorder.
type Decisions struct {
	overlap *prometheus.HistogramVec
	margin  *prometheus.HistogramVec // Dynamo's cost, in blocks
	marginS *prometheus.HistogramVec // the predictive cost, in seconds
	retries *prometheus.HistogramVec
}

// NewDecisions creates the decision histograms and registers them in reg.
func NewDecisions(reg prometheus.Registerer) (*Decisions, error) {
	m := &Decisions{
		overlap: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvselect_decision_overlap_ratio",
			Help:    "Device overlap of the chosen rank over the best overlap any eligible rank had (1: the best prefix was taken), per decision with a best overlap above 0.",
			Buckets: []float64{0, 0.25, 0.5, 0.75, 0.9, 0.99, 1},
		}, []string{"role"}),
		margin: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvselect_decision_cost_margin_blocks",
			Help:    "How much cheaper, in cost units (KV-block equivalents), the chosen rank was than the next-cheapest candidate, under Dynamo's cost (DYN_EPP_COST=dynamo, or auto on a large model; 0: alone or tied; negative: chosen by a session pin or a temperature draw).",
			Buckets: []float64{-64, -8, -1, 0, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256},
		}, []string{"role"}),
		marginS: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvselect_decision_cost_margin_seconds",
			Help:    "How much cheaper, in predicted seconds, the chosen rank was than the next-cheapest candidate, under the predictive cost (DYN_EPP_COST=predictive, or auto on a model it predicts for; 0: alone or tied; negative: chosen by a session pin or a temperature draw).",
			Buckets: []float64{-1, -0.1, -0.01, 0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5},
		}, []string{"role"}),
		retries: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvselect_decision_retries",
			Help:    "Times a decision was made again because a concurrent booking reached the chosen rank first (_sum: all retries).",
			Buckets: []float64{0, 1, 2, 4, 8},
		}, []string{"role"}),
	}
	if err := register(reg, m.overlap, m.margin, m.marginS, m.retries); err != nil {
		return nil, err
	}
	return m, nil
}

// ForRole returns the Recorder of one role's service, which observes each
// decision's margin in the histogram of its unit (Decision.Predicted).
func (m *Decisions) ForRole(role string) selection.Recorder {
	return roleRecorder{overlap: m.overlap.WithLabelValues(role), margin: m.margin.WithLabelValues(role),
		seconds: m.marginS.WithLabelValues(role), retries: m.retries.WithLabelValues(role)}
}

type roleRecorder struct {
	overlap, margin, seconds, retries prometheus.Observer
}

// Selected observes one decision.
func (r roleRecorder) Selected(_ string, d selection.Decision) {
	if d.BestOverlapBlocks > 0 {
		r.overlap.Observe(float64(d.ChosenOverlapBlocks) / float64(d.BestOverlapBlocks))
	}
	if d.Predicted {
		r.seconds.Observe(d.Margin)
	} else {
		r.margin.Observe(d.Margin)
	}
	r.retries.Observe(float64(d.Retries))
}

// Rejected records nothing: kvselect_selection_errors_total counts them.
func (roleRecorder) Rejected(string, error) {}
