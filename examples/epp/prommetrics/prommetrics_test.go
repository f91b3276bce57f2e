package prommetrics_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/prommetrics"
	"github.com/kvselect/kvselect/lifecycle"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// gather returns every series of reg by metric name, as label sets with
// their values: a counter's, a gauge's, or a histogram's sample count.
func gather(t *testing.T, reg *prometheus.Registry) map[string][]series {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	out := map[string][]series{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			s := series{labels: map[string]string{}}
			for _, l := range m.GetLabel() {
				s.labels[l.GetName()] = l.GetValue()
			}
			switch {
			case m.GetCounter() != nil:
				s.value = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				s.value = m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				s.value = float64(m.GetHistogram().GetSampleCount())
			}
			out[f.GetName()] = append(out[f.GetName()], s)
		}
	}
	return out
}

type series struct {
	labels map[string]string
	value  float64
}

// find returns the value of name's series whose labels include want.
func find(t *testing.T, all map[string][]series, name string, want map[string]string) float64 {
	t.Helper()
next:
	for _, s := range all[name] {
		for k, v := range want {
			if s.labels[k] != v {
				continue next
			}
		}
		return s.value
	}
	t.Fatalf("no series %s%v", name, want)
	return 0
}

func TestRecorders(t *testing.T) {
	reg := prometheus.NewRegistry()
	ep, err := prommetrics.NewExtProcRecorder(reg)
	require.NoError(t, err)
	ep.Outcome(200)
	ep.Outcome(200)
	ep.Outcome(429)
	ep.PickLatency(time.Millisecond)
	ep.ServedMismatch()
	ep.Inflight(3)

	dec, err := prommetrics.NewDecisions(reg)
	require.NoError(t, err)
	rec := dec.ForRole("prefill")
	rec.Selected("m", selection.Decision{BestOverlapBlocks: 4, ChosenOverlapBlocks: 2, Margin: 3, Retries: 1})
	rec.Selected("m", selection.Decision{Margin: 0.01, Predicted: true})
	rec.Rejected("m", selection.ErrNoEndpoints)

	resp, err := prommetrics.NewResponses(reg)
	require.NoError(t, err)
	resp.Rebooked(prommetrics.RebookMoved)
	resp.MarkedFailed(lifecycle.CauseFallback)
	resp.Renewals(2, 1)
	resp.Chunk()
	var none *prommetrics.Responses // records nothing, and does not panic
	none.Rebooked(prommetrics.RebookFreed)
	none.MarkedFailed(lifecycle.CauseStatus)
	none.Renewals(1, 1)
	none.Chunk()

	all := gather(t, reg)
	require.Equal(t, 2.0, find(t, all, "kvselect_epp_requests_total", map[string]string{"status": "200"}))
	require.Equal(t, 1.0, find(t, all, "kvselect_epp_requests_total", map[string]string{"status": "429"}))
	require.Equal(t, 1.0, find(t, all, "kvselect_epp_pick_duration_seconds", nil))
	require.Equal(t, 1.0, find(t, all, "kvselect_epp_served_endpoint_mismatch_total", nil))
	require.Equal(t, 3.0, find(t, all, "kvselect_epp_inflight_requests", nil))
	role := map[string]string{"role": "prefill"}
	require.Equal(t, 1.0, find(t, all, "kvselect_decision_overlap_ratio", role), "only a decision with a best overlap")
	require.Equal(t, 1.0, find(t, all, "kvselect_decision_cost_margin_blocks", role))
	require.Equal(t, 1.0, find(t, all, "kvselect_decision_cost_margin_seconds", role), "the predictive cost's margin in seconds")
	require.Equal(t, 2.0, find(t, all, "kvselect_decision_retries", role))
	require.Equal(t, 1.0, find(t, all, "kvselect_epp_rebookings_total", map[string]string{"result": "moved"}))
	require.Equal(t, 0.0, find(t, all, "kvselect_epp_rebookings_total", map[string]string{"result": "freed"}), "exported at 0")
	require.Equal(t, 1.0, find(t, all, "kvselect_epp_workers_marked_failed_total", map[string]string{"cause": "fallback"}))
	require.Equal(t, 0.0, find(t, all, "kvselect_epp_workers_marked_failed_total", map[string]string{"cause": "status"}), "exported at 0")
	require.Equal(t, 2.0, find(t, all, "kvselect_epp_lease_renewals_total", nil))
	require.Equal(t, 1.0, find(t, all, "kvselect_epp_lease_renewal_stalls_total", nil))
	require.Equal(t, 1.0, find(t, all, "kvselect_epp_response_chunks_total", nil))
}

// A constructor that fails leaves nothing of its own registered.
func TestFailedConstructorRegistersNothing(t *testing.T) {
	reg := prometheus.NewRegistry()
	taken := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvselect_epp_inflight_requests", Help: "someone else's"})
	require.NoError(t, reg.Register(taken))
	_, err := prommetrics.NewExtProcRecorder(reg)
	require.Error(t, err)
	all := gather(t, reg)
	require.Len(t, all, 1, "%v", all)
	require.Contains(t, all, "kvselect_epp_inflight_requests")

	_, err = prommetrics.NewDecisions(nil)
	require.Error(t, err)
	_, err = prommetrics.NewResponses(nil)
	require.Error(t, err)
}

// The service collector reads a selection service on every scrape: workers
// by lifecycle, per-rank loads, bookings.
func TestServiceCollector(t *testing.T) {
	_, err := prommetrics.NewServiceCollector(prommetrics.ServiceOptions{})
	require.Error(t, err)
	_, err = prommetrics.NewServiceCollector(prommetrics.ServiceOptions{Services: map[string]*selection.SelectionService{"aggregated": nil}})
	require.Error(t, err)

	cfg := selection.DefaultConfig(16)
	cfg.UseKVEvents = false
	svc, err := selection.NewSelectionServiceBuilder(cfg).Build(context.Background())
	require.NoError(t, err)
	defer func() { _ = svc.Close() }()
	_, err = svc.Workers().Upsert(catalog.Worker{ID: "a", Model: "m", Endpoint: "10.0.0.1:8000", DPSize: 1, BlockSize: 16})
	require.NoError(t, err)
	res, err := svc.SelectAndReserve(context.Background(), selection.Request{Model: "m", ReservationID: "r1", Tokens: make([]uint32, 64)})
	require.NoError(t, err)
	require.Equal(t, "a", res.WorkerID)

	sc, err := prommetrics.NewServiceCollector(prommetrics.ServiceOptions{Services: map[string]*selection.SelectionService{"aggregated": svc}, Model: "m"})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(sc))
	all := gather(t, reg)
	agg := map[string]string{"role": "aggregated"}
	require.Equal(t, 1.0, find(t, all, "kvselect_workers", map[string]string{"role": "aggregated", "lifecycle": "schedulable"}))
	require.Equal(t, 1.0, find(t, all, "kvselect_bookings_total", agg))
	require.Equal(t, 1.0, find(t, all, "kvselect_reservations_active", agg))
	require.Equal(t, 1.0, find(t, all, "kvselect_worker_active_requests", map[string]string{"role": "aggregated", "worker": "a", "rank": "0"}))
	require.Equal(t, 4.0, find(t, all, "kvselect_request_blocks_total", agg))
	require.Equal(t, 0.0, find(t, all, "kvselect_calibration_ready", agg), "no prefill completed: the configured rate prices tokens")
	require.Equal(t, 1e-4, find(t, all, "kvselect_calibration_seconds", map[string]string{"role": "aggregated", "term": "own_token"}), "the prior: 10,000 tokens a second")
	require.Equal(t, 0.0, find(t, all, "kvselect_calibration_seconds", map[string]string{"role": "aggregated", "term": "own_token_error"}))
	require.NotContains(t, all, "kvselect_tokenizer_cache_hits_total", "no cache, no tokenizer series")
}

func TestReplicaCollectorOptions(t *testing.T) {
	_, err := prommetrics.NewReplicaCollector(prommetrics.ReplicaOptions{})
	require.Error(t, err)
	_, err = prommetrics.NewReplicaCollector(prommetrics.ReplicaOptions{Replicators: map[roles.Role]*replica.Replicator{roles.Aggregated: nil}})
	require.Error(t, err)
}

// An EPP registers the recorders in its own registry and hands each role's
// service its Recorder; nothing goes to a global registry.
func ExampleNewDecisions() {
	reg := prometheus.NewRegistry()
	dec, err := prommetrics.NewDecisions(reg)
	if err != nil {
		fmt.Println(err)
		return
	}
	// In an EPP: builder.Recorder(dec.ForRole("aggregated")) on the role's
	// SelectionServiceBuilder; the service calls it once per decision.
	dec.ForRole("aggregated").Selected("qwen", selection.Decision{BestOverlapBlocks: 8, ChosenOverlapBlocks: 8, Margin: 2.5})
	families, err := reg.Gather()
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, f := range families {
		h := f.GetMetric()[0].GetHistogram()
		fmt.Printf("%s: count %d, sum %v\n", f.GetName(), h.GetSampleCount(), h.GetSampleSum())
	}
	// Output:
	// kvselect_decision_cost_margin_blocks: count 1, sum 2.5
	// kvselect_decision_cost_margin_seconds: count 0, sum 0
	// kvselect_decision_overlap_ratio: count 1, sum 1
	// kvselect_decision_retries: count 1, sum 0
}
