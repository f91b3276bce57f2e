package catalog

import (
	"encoding/json"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestEvaluate(t *testing.T) {
	none := Requirements{}
	events := Requirements{KVEvents: true}
	queue := Requirements{Queueing: true}
	both := Requirements{KVEvents: true, Queueing: true}
	tests := []struct {
		name   string
		mutate func(*Worker)
		req    Requirements
		want   []Reason // nil means Schedulable
	}{
		{"complete, nothing required", func(*Worker) {}, none, nil},
		{"complete, everything required", func(*Worker) {}, both, nil},
		{"no endpoint", func(w *Worker) { w.Endpoint = "" }, none, []Reason{ReasonNoEndpoint}},
		{"no block size", func(w *Worker) { w.BlockSize = 0 }, none, []Reason{ReasonNoBlockSize}},
		{"dp size zero", func(w *Worker) { w.DPSize = 0 }, none, []Reason{ReasonNoDPSize}},
		{"dp size zero with events: no rank to miss", func(w *Worker) { w.DPSize = 0; w.KVEventEndpoints = nil }, events, []Reason{ReasonNoDPSize}},
		{"no max batched, queueing off", func(w *Worker) { w.MaxNumBatchedTokens = 0 }, events, nil},
		{"no max batched, queueing on", func(w *Worker) { w.MaxNumBatchedTokens = 0 }, queue, []Reason{ReasonNoMaxBatched}},
		{"no event endpoint, events off", func(w *Worker) { w.KVEventEndpoints = nil }, queue, nil},
		{"no event endpoint, events on", func(w *Worker) { w.KVEventEndpoints = nil }, events, []Reason{"kv_event_endpoint_missing:rank=0"}},
		{"empty event endpoint counts as missing", func(w *Worker) { w.KVEventEndpoints = map[int]string{0: ""} }, events, []Reason{ReasonNoEventEndpoint.forRank(0)}},
		{"multi-rank, one rank missing", func(w *Worker) {
			w.DPStart, w.DPSize = 8, 4
			w.KVEventEndpoints = map[int]string{8: "tcp://10.9.9.9:1", 9: "tcp://10.9.9.9:2", 11: "tcp://10.9.9.9:4"}
		}, events, []Reason{ReasonNoEventEndpoint.forRank(10)}},
		{"multi-rank, all present", func(w *Worker) {
			w.DPStart, w.DPSize = 8, 2
			w.KVEventEndpoints = map[int]string{8: "tcp://10.9.9.9:1", 9: "tcp://10.9.9.9:2"}
		}, both, nil},
		{"everything missing, in order", func(w *Worker) { *w = Worker{ID: "a"} }, both,
			[]Reason{ReasonNoEndpoint, ReasonNoBlockSize, ReasonNoDPSize, ReasonNoMaxBatched}},
		{"everything but dp missing, ranks ascending", func(w *Worker) { *w = Worker{ID: "a", DPStart: 2, DPSize: 3} }, both,
			[]Reason{ReasonNoEndpoint, ReasonNoBlockSize, ReasonNoMaxBatched,
				ReasonNoEventEndpoint.forRank(2), ReasonNoEventEndpoint.forRank(3), ReasonNoEventEndpoint.forRank(4)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := complete("a")
			tt.mutate(&w)
			require.NoError(t, w.Validate(), "the table holds valid workers only")
			life, reasons := evaluate(w, tt.req)
			if tt.want == nil {
				require.Equal(t, Schedulable, life)
				require.Nil(t, reasons)
				return
			}
			require.Equal(t, Incomplete, life)
			require.Equal(t, tt.want, reasons)
		})
	}
}

func TestReason(t *testing.T) {
	require.Equal(t, Reason("kv_event_endpoint_missing:rank=3"), ReasonNoEventEndpoint.forRank(3))
	require.Equal(t, Reason("kv_event_endpoint_scheme:rank=0"), ReasonEventEndpointScheme.forRank(0))
}

func TestLifecycleString(t *testing.T) {
	require.Equal(t, "unknown", Lifecycle(0).String())
	require.Equal(t, "incomplete", Incomplete.String())
	require.Equal(t, "schedulable", Schedulable.String())
	require.Equal(t, "draining", Draining.String())
	require.Equal(t, "unschedulable", Unschedulable.String())
	require.Equal(t, "Lifecycle(9)", Lifecycle(9).String())
	b, err := json.Marshal(map[string]Lifecycle{"l": Draining})
	require.NoError(t, err)
	require.JSONEq(t, `{"l":"draining"}`, string(b))
}

func TestEvaluateEndpointPolicy(t *testing.T) {
	ok := func(ep string) Worker {
		return Worker{ID: "w", Endpoint: ep, DPSize: 1, BlockSize: 16, KVEventEndpoints: map[int]string{0: "tcp://10.0.0.5:5557"}}
	}
	ev := Requirements{KVEvents: true}
	for ep, want := range map[string][]Reason{
		"10.0.0.5:8000":             nil,
		"127.0.0.1:8000":            nil,
		"[2001:db8::5]:8000":        nil,
		"vllm-0.vllm.ns.svc:8000":   {ReasonEndpointHostname},
		"localhost:8000":            {ReasonEndpointHostname},
		"169.254.169.254:80":        {ReasonEndpointNotRoutable},
		"0.0.0.0:8000":              {ReasonEndpointNotRoutable},
		"[::]:8000":                 {ReasonEndpointNotRoutable},
		"255.255.255.255:8000":      {ReasonEndpointNotRoutable},
		"224.0.0.1:8000":            {ReasonEndpointNotRoutable},
		"[fe80::1%eth0]:8000":       {ReasonEndpointNotRoutable},
		"[fe80::1]:8000":            {ReasonEndpointNotRoutable},
		"[::ffff:169.254.1.1]:8000": {ReasonEndpointNotRoutable},
	} {
		life, reasons := evaluate(ok(ep), ev)
		require.Equal(t, want, reasons, ep)
		require.Equal(t, len(want) == 0, life == Schedulable, ep)
	}
	// Event and replay endpoints are judged too, ipc only when allowed.
	w := ok("10.0.0.5:8000")
	w.KVEventEndpoints = map[int]string{0: "ipc:///etc/passwd"}
	w.ReplayEndpoint = "tcp://169.254.169.254:5558"
	_, reasons := evaluate(w, ev)
	require.Equal(t, []Reason{ReasonEventEndpointScheme.forRank(0), ReasonEndpointNotRoutable + ":replay"}, reasons)
	// An allowlist and the switches lift the refusals.
	lax := Requirements{KVEvents: true, Endpoints: EndpointPolicy{AllowHostnames: true, AllowIPC: true,
		Allow: []netip.Prefix{netip.MustParsePrefix("169.254.0.0/16")}}}
	life, reasons := evaluate(w, lax)
	require.Equal(t, Schedulable, life, reasons)
	life, _ = evaluate(ok("vllm-0:8000"), lax)
	require.Equal(t, Schedulable, life)
}
