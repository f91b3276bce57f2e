package oteltracing

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	sdkresource "go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// Span names. A pick is one server span with the tokenizer call and, per
// role, one decision span (a booking, or an advisory selection) as
// children; the decision spans come from the selection services' Tracer.
const (
	SpanPick     = "kvselect.pick"
	SpanTokenize = "kvselect.tokenize"
	SpanBook     = "kvselect.book"
	SpanSelect   = "kvselect.select"
)

// TracerName is the instrumentation scope of the reference EPP's spans.
const TracerName = "github.com/kvselect/kvselect/examples/epp"

// Span attribute keys of a decision (selection.Decision) and of the
// tokenizer call.
const (
	AttrRole          = attribute.Key("kvselect.role")
	AttrModel         = attribute.Key("kvselect.model")
	AttrWorker        = attribute.Key("kvselect.worker")
	AttrRank          = attribute.Key("kvselect.rank")
	AttrCandidates    = attribute.Key("kvselect.candidates")
	AttrChosenOverlap = attribute.Key("kvselect.overlap.chosen_blocks")
	AttrBestOverlap   = attribute.Key("kvselect.overlap.best_blocks")
	AttrRequestBlocks = attribute.Key("kvselect.request_blocks")
	AttrPrefill       = attribute.Key("kvselect.effective_prefill_tokens")
	AttrQueueWait     = attribute.Key("kvselect.queue_wait_seconds")
	AttrCost          = attribute.Key("kvselect.cost")
	AttrMargin        = attribute.Key("kvselect.cost_margin")
	AttrDecodeBlocks  = attribute.Key("kvselect.potential_decode_blocks")
	AttrRetries       = attribute.Key("kvselect.retries")
	AttrTokens        = attribute.Key("kvselect.tokens")
)

// DecisionTracer adapts an OpenTelemetry tracer to selection.Tracer for one
// role's service: one span per decision, a child of the span in the
// decision's context (the pick's). Create it with NewDecisionTracer.
type DecisionTracer struct {
	tr   trace.Tracer
	role string
}

var _ selection.Tracer = DecisionTracer{}

// NewDecisionTracer returns the selection.Tracer of role's service; tr is
// required.
func NewDecisionTracer(tr trace.Tracer, role string) (DecisionTracer, error) {
	if tr == nil {
		return DecisionTracer{}, errors.New("oteltracing: a DecisionTracer needs a tracer")
	}
	return DecisionTracer{tr: tr, role: role}, nil
}

// StartDecision starts the span of one decision: SpanBook when it reserves,
// SpanSelect when it is advisory.
func (d DecisionTracer) StartDecision(ctx context.Context, model string, reserve bool) selection.DecisionSpan {
	name := SpanSelect
	if reserve {
		name = SpanBook
	}
	_, span := d.tr.Start(ctx, name, trace.WithAttributes(AttrRole.String(d.role), AttrModel.String(model)))
	return decisionSpan{span}
}

type decisionSpan struct{ span trace.Span }

// End sets the decision's attributes, or records the error, and ends the span.
func (s decisionSpan) End(d *selection.Decision, err error) {
	if err != nil {
		s.span.RecordError(err)
		s.span.SetStatus(codes.Error, err.Error())
	}
	if d != nil {
		s.span.SetAttributes(
			AttrWorker.String(d.WorkerID), AttrRank.Int(d.Rank), AttrCandidates.Int(d.Candidates),
			AttrChosenOverlap.Int(d.ChosenOverlapBlocks), AttrBestOverlap.Int(d.BestOverlapBlocks),
			AttrRequestBlocks.Int(d.RequestBlocks), AttrPrefill.Int(d.EffectivePrefill),
			AttrQueueWait.Float64(d.QueueWait.Seconds()), AttrCost.Float64(d.Cost), AttrMargin.Float64(d.Margin),
			AttrDecodeBlocks.Int(d.PotentialDecodeBlocks), AttrRetries.Int(d.Retries),
		)
	}
	s.span.End()
}

// traceContext reads a W3C trace context (traceparent, tracestate) from the
// request's headers.
var traceContext = propagation.TraceContext{}

// StartPick starts a pick's server span, joined to the client's trace when
// the request's headers (lower-case names, as ext_proc gives them) carry a
// W3C trace context. The caller ends the span.
func StartPick(ctx context.Context, tr trace.Tracer, headers map[string]string) (context.Context, trace.Span) {
	ctx = traceContext.Extract(ctx, propagation.MapCarrier(headers))
	return tr.Start(ctx, SpanPick, trace.WithSpanKind(trace.SpanKindServer))
}

// EndTokenize ends a tokenizer call's span (SpanTokenize) with its result:
// the number of tokens, or the error.
func EndTokenize(span trace.Span, tr tokenize.Result, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	} else {
		span.SetAttributes(AttrTokens.Int(len(tr.Tokens)))
	}
	span.End()
}

// NewProvider returns the OTLP (gRPC) trace pipeline for endpoint
// (DYN_EPP_OTLP_ENDPOINT, checked by ParseEndpoint): "host:port"
// (plaintext) or an http:// (plaintext) or https:// URL; its spans carry
// service.name kvselect-epp. Its batch processor runs a goroutine until
// Shutdown, which the caller owns; constructing it connects nothing (the
// exporter dials lazily).
func NewProvider(ctx context.Context, endpoint string) (*sdktrace.TracerProvider, error) {
	var opt otlptracegrpc.Option
	if strings.Contains(endpoint, "://") {
		opt = otlptracegrpc.WithEndpointURL(endpoint)
	} else {
		opt = otlptracegrpc.WithEndpoint(endpoint)
	}
	opts := []otlptracegrpc.Option{opt}
	if !strings.HasPrefix(endpoint, "https://") {
		opts = append(opts, otlptracegrpc.WithInsecure())
	}
	exp, err := otlptracegrpc.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("epp: OTLP exporter for %q: %w", endpoint, err)
	}
	res := sdkresource.NewSchemaless(attribute.String("service.name", "kvselect-epp"))
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(5*time.Second)),
		sdktrace.WithResource(res)), nil
}

// ParseEndpoint checks an OTLP collector address: host:port, or an http(s)
// URL. It returns the value trimmed.
func ParseEndpoint(v string) (string, error) {
	v = strings.TrimSpace(v)
	if strings.Contains(v, "://") {
		u, err := url.Parse(v)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return "", fmt.Errorf("%q is not host:port or an http(s) URL", v)
		}
		return v, nil
	}
	if host, _, err := net.SplitHostPort(v); err != nil || host == "" {
		return "", fmt.Errorf("%q is not host:port or an http(s) URL", v)
	}
	return v, nil
}
