package prommetrics

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvselect/kvselect/examples/epp/discovery"
)

// NewWorkersFileCollector returns the collector of kvselect_workers_file_rejected_total,
// the reloads of src's workers file it refused, with the reference EPP's
// name and help text: a program that reads its workers from a file (the
// plain-HTTP gateway) exports what the EPP exports.
func NewWorkersFileCollector(src *discovery.Static) (prometheus.Collector, error) {
	if src == nil {
		return nil, errors.New("prommetrics: a workers-file collector needs a discovery.Static")
	}
	return prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "kvselect_workers_file_rejected_total",
		Help: "Reloads of the workers file refused (unreadable, invalid, past the bounds on workers or ranks); the last good set is kept.",
	}, func() float64 { return float64(src.Rejections()) }), nil
}
