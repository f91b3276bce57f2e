package oteltracing_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/oteltracing"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder returns a tracer provider whose ended spans the recorder holds.
func recorder(t *testing.T) (*sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	t.Helper()
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp, sr
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	out := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		out[kv.Key] = kv.Value
	}
	return out
}

// A pick joins the client's trace; the tokenizer call and the decision are
// its children, each with its attributes; an error is recorded and sets the
// span's status.
func TestSpansOfAPick(t *testing.T) {
	tp, sr := recorder(t)
	tr := tp.Tracer(oteltracing.TracerName)
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	ctx, pick := oteltracing.StartPick(context.Background(), tr, map[string]string{"traceparent": "00-" + traceID + "-00f067aa0ba902b7-01"})
	_, tok := tr.Start(ctx, oteltracing.SpanTokenize)
	oteltracing.EndTokenize(tok, tokenize.Result{Tokens: make([]uint32, 48)}, nil)
	dt, err := oteltracing.NewDecisionTracer(tr, "decode")
	require.NoError(t, err)
	dt.StartDecision(ctx, "m", true).End(&selection.Decision{WorkerRank: catalog.WorkerRank{WorkerID: "w1", Rank: 2}, Candidates: 3,
		RequestBlocks: 3, QueueWait: 250 * time.Millisecond, Cost: 1.5, Retries: 1}, nil)
	dt.StartDecision(ctx, "m", false).End(nil, errors.New("no endpoints"))
	pick.End()

	spans := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range sr.Ended() {
		spans[s.Name()] = s
	}
	require.Len(t, spans, 4)
	p := spans[oteltracing.SpanPick]
	require.Equal(t, traceID, p.SpanContext().TraceID().String(), "joined the client's trace")
	for _, name := range []string{oteltracing.SpanTokenize, oteltracing.SpanBook, oteltracing.SpanSelect} {
		require.Equal(t, p.SpanContext().SpanID(), spans[name].Parent().SpanID(), name)
	}
	require.EqualValues(t, 48, attrs(spans[oteltracing.SpanTokenize])[oteltracing.AttrTokens].AsInt64())
	book := attrs(spans[oteltracing.SpanBook])
	require.Equal(t, "decode", book[oteltracing.AttrRole].AsString())
	require.Equal(t, "m", book[oteltracing.AttrModel].AsString())
	require.Equal(t, "w1", book[oteltracing.AttrWorker].AsString())
	require.EqualValues(t, 2, book[oteltracing.AttrRank].AsInt64())
	require.EqualValues(t, 3, book[oteltracing.AttrCandidates].AsInt64())
	require.Equal(t, 0.25, book[oteltracing.AttrQueueWait].AsFloat64())
	require.Equal(t, 1.5, book[oteltracing.AttrCost].AsFloat64())
	require.EqualValues(t, 1, book[oteltracing.AttrRetries].AsInt64())
	sel := spans[oteltracing.SpanSelect]
	require.Equal(t, codes.Error, sel.Status().Code)
	require.Equal(t, "no endpoints", sel.Status().Description)
	require.NotContains(t, attrs(sel), oteltracing.AttrWorker, "no decision, no decision attributes")
}

func TestNewDecisionTracerNeedsATracer(t *testing.T) {
	_, err := oteltracing.NewDecisionTracer(nil, "aggregated")
	require.Error(t, err)
}

func TestParseEndpoint(t *testing.T) {
	for in, want := range map[string]string{
		"collector:4317":            "collector:4317",
		" 10.0.0.1:4317 ":           "10.0.0.1:4317",
		"http://collector:4317":     "http://collector:4317",
		"https://collector.example": "https://collector.example",
	} {
		got, err := oteltracing.ParseEndpoint(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "collector", ":4317", "grpc://collector:4317", "http://"} {
		_, err := oteltracing.ParseEndpoint(in)
		require.Error(t, err, in)
	}
}

// NewProvider dials nothing: a provider for a collector nobody runs is
// built, and shut down, without a connection.
func TestNewProviderConnectsLazily(t *testing.T) {
	tp, err := oteltracing.NewProvider(context.Background(), "127.0.0.1:1")
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, tp.Shutdown(ctx))
}

// A DecisionTracer on each role's selection service makes every decision a
// span, a child of the pick's.
func ExampleNewDecisionTracer() {
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	tr := tp.Tracer(oteltracing.TracerName)

	dt, err := oteltracing.NewDecisionTracer(tr, "aggregated")
	if err != nil {
		fmt.Println(err)
		return
	}
	// In an EPP: builder.Tracer(dt) on the role's SelectionServiceBuilder.
	ctx, pick := oteltracing.StartPick(context.Background(), tr, nil)
	dt.StartDecision(ctx, "qwen", true).End(&selection.Decision{WorkerRank: catalog.WorkerRank{WorkerID: "pod-a"}, Candidates: 4}, nil)
	pick.End()
	for _, s := range sr.Ended() {
		a := attrs(s)
		fmt.Println(s.Name(), a[oteltracing.AttrRole].AsString(), a[oteltracing.AttrWorker].AsString())
	}
	// Output:
	// kvselect.book aggregated pod-a
	// kvselect.pick
}
