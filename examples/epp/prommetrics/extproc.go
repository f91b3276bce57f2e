package prommetrics

import (
	"errors"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvselect/kvselect/examples/epp/extproc"
)

// ExtProcRecorder backs the ext_proc server's Recorder with Prometheus
// (kvselect_epp_requests_total, kvselect_epp_pick_duration_seconds,
// kvselect_epp_served_endpoint_mismatch_total,
// kvselect_epp_inflight_requests). Create it with NewExtProcRecorder.
type ExtProcRecorder struct {
	requests *prometheus.CounterVec
	pick     prometheus.Histogram
	mismatch prometheus.Counter
	inflight prometheus.Gauge
}

var _ extproc.Recorder = (*ExtProcRecorder)(nil)

// NewExtProcRecorder creates the server's metrics and registers them in reg.
func NewExtProcRecorder(reg prometheus.Registerer) (*ExtProcRecorder, error) {
	m := &ExtProcRecorder{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvselect_epp_requests_total", Help: "Requests by outcome status (200 routed, else the immediate response; 0 stream ended first).",
		}, []string{"status"}),
		pick: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvselect_epp_pick_duration_seconds", Help: "Time to tokenize and select, per request.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 16),
		}),
		mismatch: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvselect_epp_served_endpoint_mismatch_total", Help: "Responses served by another endpoint than the one picked.",
		}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvselect_epp_inflight_requests", Help: "Requests between headers and routing decision.",
		}),
	}
	if err := register(reg, m.requests, m.pick, m.mismatch, m.inflight); err != nil {
		return nil, err
	}
	return m, nil
}

// Outcome counts a request by the status it ended with.
func (m *ExtProcRecorder) Outcome(status int) { m.requests.WithLabelValues(strconv.Itoa(status)).Inc() }

// PickLatency observes the time one pick took.
func (m *ExtProcRecorder) PickLatency(d time.Duration) { m.pick.Observe(d.Seconds()) }

// ServedMismatch counts a response served by another endpoint than the pick.
func (m *ExtProcRecorder) ServedMismatch() { m.mismatch.Inc() }

// Inflight sets the number of requests waiting for their decision.
func (m *ExtProcRecorder) Inflight(n int) { m.inflight.Set(float64(n)) }

// register registers every collector in reg, or none: on an error, those
// already registered are unregistered again.
func register(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	if reg == nil {
		return errors.New("prommetrics: a nil Registerer")
	}
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, done := range cs[:i] {
				reg.Unregister(done)
			}
			return err
		}
	}
	return nil
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
