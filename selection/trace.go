package selection

import "context"

// Tracer traces the service's decisions: one span for every Select,
// SelectAndReserve and Book call, started with the caller's context (so it
// is a child of the caller's span) and ended with what was decided. The
// library imports no tracing package: examples/epp adapts OpenTelemetry to
// this interface. Implementations must be safe for concurrent use and must
// not block. With no Tracer set (the default) nothing is traced and nothing is
// spent on it.
type Tracer interface {
	// StartDecision starts a decision's span; reserve is true for
	// SelectAndReserve and Book.
	StartDecision(ctx context.Context, model string, reserve bool) DecisionSpan
}

// DecisionSpan is one decision's span.
type DecisionSpan interface {
	// End ends the span with the decision, or with the error that ended the
	// call (d is then nil). d is valid only during the call.
	End(d *Decision, err error)
}

// Tracer sets the decision tracer (default: none).
func (b *SelectionServiceBuilder) Tracer(t Tracer) *SelectionServiceBuilder {
	b.tracer = t
	return b
}
