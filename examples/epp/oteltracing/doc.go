// Package oteltracing traces kvselect's routing decisions with OpenTelemetry,
// for the reference EPP and any custom EPP that wants the same spans: a pick
// is one server span (SpanPick) joined to the client's W3C trace context, with
// the tokenizer call (SpanTokenize) and one decision span per role (SpanBook
// for a booking, SpanSelect for an advisory selection) as its children. The
// decision spans come from DecisionTracer, which adapts a trace.Tracer to
// selection.Tracer (set it on each service's builder); their attributes are
// the decision's terms (the Attr* keys). NewProvider builds the OTLP/gRPC
// export pipeline of DYN_EPP_OTLP_ENDPOINT; ParseEndpoint checks that
// variable's value.
//
// Concurrency: a DecisionTracer is a value that only reads its fields and is
// safe for concurrent use, as the selection service calls it from every
// request's goroutine. StartPick and EndTokenize run on the caller's
// goroutine. NewProvider's batch span processor runs one goroutine that the
// caller owns: it stops on the provider's Shutdown, which flushes the last
// spans; nothing else here starts a goroutine.
//
// Invariants: a span is ended exactly once, by its DecisionSpan's End or by
// EndTokenize; an error is recorded on the span and sets its status; span
// names and attribute keys are stable, since dashboards and queries name
// them.
package oteltracing
