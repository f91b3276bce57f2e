package prommetrics_test

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/prommetrics"
	"github.com/kvselect/kvselect/selection"
)

// Fair admission's figures: per class, waiting, in flight, admitted and
// refused by reason (every reason present).
func TestServiceCollectorClasses(t *testing.T) {
	cfg := selection.DefaultConfig(16)
	cfg.UseKVEvents = false
	cfg.Classes = []selection.Class{{Name: "interactive", Weight: 3}, {Name: "batch", Weight: 1, InFlightLimit: 1}}
	svc, err := selection.NewSelectionServiceBuilder(cfg).Build(context.Background())
	require.NoError(t, err)
	defer func() { _ = svc.Close() }()
	_, err = svc.Workers().Upsert(catalog.Worker{ID: "a", Model: "m", Endpoint: "10.0.0.1:8000", DPSize: 1, BlockSize: 16})
	require.NoError(t, err)
	ctx := context.Background()
	for _, class := range []string{"batch", "batch", "interactive"} {
		_, _ = svc.SelectAndReserve(ctx, selection.Request{Model: "m", ISL: 32, Class: class})
	}

	sc, err := prommetrics.NewServiceCollector(prommetrics.ServiceOptions{Services: map[string]*selection.SelectionService{"aggregated": svc}, Model: "m"})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(sc))
	all := gather(t, reg)
	batch := map[string]string{"role": "aggregated", "class": "batch"}
	require.Equal(t, 1.0, find(t, all, "kvselect_class_inflight", batch))
	require.Equal(t, 1.0, find(t, all, "kvselect_class_admitted_total", batch))
	require.Equal(t, 0.0, find(t, all, "kvselect_class_queue_depth", batch))
	require.Equal(t, 1.0, find(t, all, "kvselect_class_refusals_total", map[string]string{"class": "batch", "reason": selection.RefusedClassInFlightFull}))
	require.Equal(t, 0.0, find(t, all, "kvselect_class_refusals_total", map[string]string{"class": "batch", "reason": selection.RefusedDeadline}))
	require.Equal(t, 1.0, find(t, all, "kvselect_class_admitted_total", map[string]string{"class": "interactive"}))
	require.Equal(t, 0.0, find(t, all, "kvselect_queue_deadline_refusals_total", map[string]string{"role": "aggregated"}))
}
