package eppserver

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/oteltracing"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
)

// answer is a forward that answers every request with one SSE event.
func answer(_ string, req *http.Request) (*http.Response, error) {
	return &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"text/event-stream"}},
		Body: io.NopCloser(strings.NewReader(sseEvent)), ContentLength: -1, Request: req}, nil
}

// With a tracer provider, a pick is a server span joined to the client's
// trace (traceparent), with the tokenizer call and the booking as its
// children; the booking's span carries the decision.
func TestTracingSpans(t *testing.T) {
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	rig := newFlightRig(t, nil, extras{tracing: tp})
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	_, err := rig.client.Roundtrip(context.Background(), extproctest.HTTPRequest{Path: "/v1/chat/completions",
		Body:    []byte(strings.Repeat("t", 64)),
		Headers: http.Header{"Traceparent": {"00-" + traceID + "-00f067aa0ba902b7-01"}}}, answer)
	require.NoError(t, err)

	spans := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range sr.Ended() {
		spans[s.Name()] = s
	}
	require.Len(t, spans, 3, "%v", spans)
	pick, tok, book := spans[oteltracing.SpanPick], spans[oteltracing.SpanTokenize], spans[oteltracing.SpanBook]
	require.NotNil(t, pick)
	require.NotNil(t, tok)
	require.NotNil(t, book)
	require.Equal(t, traceID, pick.SpanContext().TraceID().String(), "joined the client's trace")
	require.Equal(t, pick.SpanContext().SpanID(), tok.Parent().SpanID())
	require.Equal(t, pick.SpanContext().SpanID(), book.Parent().SpanID())

	attrs := map[attribute.Key]attribute.Value{}
	for _, kv := range book.Attributes() {
		attrs[kv.Key] = kv.Value
	}
	require.Equal(t, "aggregated", attrs[oteltracing.AttrRole].AsString())
	require.Contains(t, []string{"w1", "w2", "w3"}, attrs[oteltracing.AttrWorker].AsString())
	require.EqualValues(t, 3, attrs[oteltracing.AttrCandidates].AsInt64())
	require.EqualValues(t, 4, attrs[oteltracing.AttrRequestBlocks].AsInt64(), "64 tokens of block size 16")
	require.EqualValues(t, 0, attrs[oteltracing.AttrRetries].AsInt64())
	for _, k := range []attribute.Key{oteltracing.AttrCost, oteltracing.AttrMargin, oteltracing.AttrChosenOverlap, oteltracing.AttrBestOverlap, oteltracing.AttrPrefill, oteltracing.AttrDecodeBlocks, oteltracing.AttrQueueWait} {
		require.Contains(t, attrs, k)
	}
	require.Equal(t, attribute.IntValue(64), tokAttr(tok, oteltracing.AttrTokens))
}

func tokAttr(s sdktrace.ReadOnlySpan, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// dashboardPath is the Grafana dashboard shipped in docs/.
const dashboardPath = "../../../docs/grafana/kvselect-epp.json"

// Every query of the Grafana dashboard names metrics that a running EPP
// exports on /metrics (scraped after it has routed, moved and renewed
// requests, with KV events on).
func TestDashboardQueriesNameExportedMetrics(t *testing.T) {
	rig := newFlightRig(t, map[string]string{"DYN_EPP_KV_EVENT_PORT": "1", "DYN_EPP_FALLBACKS": "1"}, extras{})
	ws := make([]catalog.Worker, len(rigWorkers))
	for i, w := range rigWorkers {
		w.KVEventEndpoints = map[int]string{0: "tcp://127.0.0.1:1"} // nobody serves it
		ws[i] = w
	}
	rig.e.Apply(discovery.Snapshot{Workers: ws, Synced: true})
	fr := rig.send(t, strings.Repeat("m", 64), "text/event-stream", func(l []string) string { return l[1] })
	rig.write(t, fr, sseEvent, 1)
	rig.e.router.renew.tick()
	fr.end(t)

	srv := httptest.NewServer(rig.e.metricsHandler())
	t.Cleanup(srv.Close)
	resp, err := http.Get(srv.URL + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	exported := map[string]bool{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, _, _ := strings.Cut(line, "{")
		name, _, _ = strings.Cut(name, " ")
		exported[name] = true
	}
	require.NoError(t, sc.Err())

	raw, err := os.ReadFile(dashboardPath)
	require.NoError(t, err)
	var dash any
	require.NoError(t, json.Unmarshal(raw, &dash))
	exprs := collectExprs(dash, nil)
	require.NotEmpty(t, exprs)
	metric := regexp.MustCompile(`kvselect_[a-z0-9_]+`)
	var missing []string
	named := map[string]bool{}
	for _, e := range exprs {
		ms := metric.FindAllString(e, -1)
		require.NotEmpty(t, ms, "a query without a kvselect metric: %s", e)
		for _, m := range ms {
			named[m] = true
			if !exported[m] {
				missing = append(missing, m)
			}
		}
	}
	sort.Strings(missing)
	require.Empty(t, missing, "dashboard metrics the EPP does not export")
	for _, m := range []string{"kvselect_worker_active_blocks", "kvselect_queue_depth", "kvselect_decision_overlap_ratio_bucket",
		"kvselect_decision_cost_margin_blocks_bucket", "kvselect_epp_rebookings_total", "kvselect_epp_lease_renewals_total"} {
		require.True(t, named[m], "the dashboard shows %s", m)
	}
}

// collectExprs returns every "expr" string of a Grafana dashboard.
func collectExprs(v any, out []string) []string {
	switch x := v.(type) {
	case map[string]any:
		for k, c := range x {
			if s, ok := c.(string); ok && k == "expr" {
				out = append(out, s)
				continue
			}
			out = collectExprs(c, out)
		}
	case []any:
		for _, c := range x {
			out = collectExprs(c, out)
		}
	}
	return out
}
