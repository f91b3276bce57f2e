package main

import (
	"context"
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
	spanPick     = "kvselect.pick"
	spanTokenize = "kvselect.tokenize"
	spanBook     = "kvselect.book"
	spanSelect   = "kvselect.select"
)

// tracerName is the instrumentation scope of the EPP's spans.
const tracerName = "github.com/kvselect/kvselect/examples/epp"

// Span attribute keys of a decision (selection.Decision) and of the
// tokenizer call.
const (
	attrRole          = attribute.Key("kvselect.role")
	attrModel         = attribute.Key("kvselect.model")
	attrWorker        = attribute.Key("kvselect.worker")
	attrRank          = attribute.Key("kvselect.rank")
	attrCandidates    = attribute.Key("kvselect.candidates")
	attrChosenOverlap = attribute.Key("kvselect.overlap.chosen_blocks")
	attrBestOverlap   = attribute.Key("kvselect.overlap.best_blocks")
	attrRequestBlocks = attribute.Key("kvselect.request_blocks")
	attrPrefill       = attribute.Key("kvselect.effective_prefill_tokens")
	attrQueueWait     = attribute.Key("kvselect.queue_wait_seconds")
	attrCost          = attribute.Key("kvselect.cost")
	attrMargin        = attribute.Key("kvselect.cost_margin")
	attrDecodeBlocks  = attribute.Key("kvselect.potential_decode_blocks")
	attrRetries       = attribute.Key("kvselect.retries")
	attrTokens        = attribute.Key("kvselect.tokens")
)

// decisionTracer adapts an OpenTelemetry tracer to selection.Tracer for one
// role's service: one span per decision, a child of the pick's span.
type decisionTracer struct {
	tr   trace.Tracer
	role string
}

var _ selection.Tracer = decisionTracer{}

func (d decisionTracer) StartDecision(ctx context.Context, model string, reserve bool) selection.DecisionSpan {
	name := spanSelect
	if reserve {
		name = spanBook
	}
	_, span := d.tr.Start(ctx, name, trace.WithAttributes(attrRole.String(d.role), attrModel.String(model)))
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
			attrWorker.String(d.Worker), attrRank.Int(d.Rank), attrCandidates.Int(d.Candidates),
			attrChosenOverlap.Int(d.ChosenOverlapBlocks), attrBestOverlap.Int(d.BestOverlapBlocks),
			attrRequestBlocks.Int(d.RequestBlocks), attrPrefill.Int(d.EffectivePrefill),
			attrQueueWait.Float64(d.QueueWait.Seconds()), attrCost.Float64(d.Cost), attrMargin.Float64(d.Margin),
			attrDecodeBlocks.Int(d.PotentialDecodeBlocks), attrRetries.Int(d.Retries),
		)
	}
	s.span.End()
}

// endTokenize ends the tokenizer's span with its result.
func endTokenize(span trace.Span, tr tokenize.Result, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	} else {
		span.SetAttributes(attrTokens.Int(len(tr.Tokens)))
	}
	span.End()
}

// traceContext reads a W3C trace context (traceparent, tracestate) from the
// request's headers, so that a pick's span joins the client's trace.
var traceContext = propagation.TraceContext{}

// newTracerProvider returns the OTLP (gRPC) trace pipeline for endpoint
// (DYN_EPP_OTLP_ENDPOINT): "host:port" (plaintext) or an http:// (plaintext)
// or https:// URL. Its batch processor runs a goroutine until Shutdown,
// which the caller owns; constructing it connects nothing (the exporter
// dials lazily).
func newTracerProvider(ctx context.Context, endpoint string) (*sdktrace.TracerProvider, error) {
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

// parseOTLPEndpoint checks DYN_EPP_OTLP_ENDPOINT's value.
func parseOTLPEndpoint(v string) (string, error) {
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
