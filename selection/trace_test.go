package selection

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

type traceKey struct{}

// spans is a Tracer that keeps every span it ends.
type spans struct {
	mu    sync.Mutex
	ended []endedSpan
}

type endedSpan struct {
	parent  any
	model   string
	reserve bool
	d       *Decision
	err     error
}

type span struct {
	t *spans
	endedSpan
}

func (t *spans) StartDecision(ctx context.Context, model string, reserve bool) DecisionSpan {
	return &span{t: t, endedSpan: endedSpan{parent: ctx.Value(traceKey{}), model: model, reserve: reserve}}
}

func (s *span) End(d *Decision, err error) {
	s.err = err
	if d != nil {
		c := *d
		s.d = &c
	}
	s.t.mu.Lock()
	s.t.ended = append(s.t.ended, s.endedSpan)
	s.t.mu.Unlock()
}

// Every decision call ends one span, under the caller's context, with the
// decision or the error.
func TestTracerSpans(t *testing.T) {
	tr := &spans{}
	cfg := DefaultConfig(4)
	cfg.UseKVEvents = false
	s, err := NewSelectionServiceBuilder(cfg).Clock(newFakeClock().Now).SweepInterval(-1).Tracer(tr).Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	addWorkers(t, s, "a", "b")
	ctx := context.WithValue(context.Background(), traceKey{}, "parent")
	_, err = s.SelectAndReserve(ctx, Request{Tokens: toks(8, 1), Allowed: []string{"a"}})
	require.NoError(t, err)
	res, err := s.Select(ctx, Request{Tokens: toks(8, 2)})
	require.NoError(t, err)
	_, err = s.Select(ctx, Request{Tokens: toks(8, 2), Model: "nope"})
	require.ErrorIs(t, err, ErrNotReady)
	_, err = s.Select(ctx, Request{})
	require.ErrorIs(t, err, ErrBadRequest)

	require.Len(t, tr.ended, 4)
	for _, sp := range tr.ended {
		require.Equal(t, "parent", sp.parent)
	}
	first, second := tr.ended[0], tr.ended[1]
	require.True(t, first.reserve)
	require.NoError(t, first.err)
	require.Equal(t, "a", first.d.WorkerID)
	require.Zero(t, first.d.Margin, "alone in its allowed set")
	require.False(t, second.reserve)
	require.Equal(t, "b", second.d.WorkerID, "a carries a booking")
	require.Equal(t, res.Cost, second.d.Cost)
	require.Greater(t, second.d.Margin, 0.0, "b was strictly cheaper")
	require.Equal(t, 2, second.d.Candidates)
	require.Equal(t, "nope", tr.ended[2].model)
	require.Nil(t, tr.ended[2].d)
	require.ErrorIs(t, tr.ended[2].err, ErrNotReady)
	require.ErrorIs(t, tr.ended[3].err, ErrBadRequest)
}
