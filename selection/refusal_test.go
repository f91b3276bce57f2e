package selection_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
)

// Each way a request finds no worker has its own named reason, and a worker
// registered without what it needs is logged at WARN once per reason.
func TestRefusalReasons(t *testing.T) {
	var logs bytes.Buffer
	svc, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).ExternalEvents().
		Logger(slog.New(slog.NewTextHandler(&logs, nil))).Build(context.Background())
	require.NoError(t, err)
	defer func() { _ = svc.Close() }()
	req := func(model string, allowed ...string) error {
		_, err := svc.Select(context.Background(), selection.Request{Model: model, Tokens: make([]uint32, 8), Allowed: allowed})
		return err
	}

	require.Equal(t, selection.RefusedUnknownModel, selection.RefusalReason(req("nobody-serves-this")))

	// A worker without its data-parallel size is not routable.
	for _, id := range []string{"a", "b"} {
		rec, err := svc.Workers().Upsert(catalog.Worker{ID: id, Model: "m", Endpoint: "10.0.0.1:8000"})
		require.NoError(t, err)
		require.Equal(t, catalog.Incomplete, rec.Lifecycle)
	}
	err = req("m")
	require.ErrorIs(t, err, selection.ErrNotReady)
	require.Equal(t, "no_schedulable_worker:"+string(catalog.ReasonNoDPSize), selection.RefusalReason(err))
	require.Equal(t, 1, strings.Count(logs.String(), "reason="+string(catalog.ReasonNoDPSize)), "one WARN per reason, not per worker:\n%s", logs.String())
	require.Contains(t, logs.String(), "level=WARN")

	rec, err := svc.Workers().Upsert(catalog.Worker{ID: "c", Model: "m", Endpoint: "10.0.0.3:8000", DPSize: 1})
	require.NoError(t, err)
	require.Equal(t, catalog.Schedulable, rec.Lifecycle)
	require.NoError(t, req("m"))
	require.Equal(t, selection.RefusedNoneEligible, selection.RefusalReason(req("m", "a")))

	require.Empty(t, selection.RefusalReason(nil))
	require.Empty(t, selection.RefusalReason(selection.ErrBadRequest))
	require.NoError(t, svc.Close())
	require.Equal(t, selection.RefusedClosed, selection.RefusalReason(req("m")))
}

// A request with a length and no tokens is a load-only decision: no prefix
// credit, the least loaded worker, and its prompt booked as prefill load.
func TestLoadOnlyRequest(t *testing.T) {
	svc, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).ExternalEvents().Build(context.Background())
	require.NoError(t, err)
	defer func() { _ = svc.Close() }()
	for i, id := range []string{"a", "b"} {
		_, err := svc.Workers().Upsert(catalog.Worker{ID: id, Endpoint: "10.0.0." + string(rune('1'+i)) + ":8000", DPSize: 1})
		require.NoError(t, err)
	}
	busy, err := svc.Book(context.Background(), selection.Request{Tokens: make([]uint32, 64), Allowed: []string{"a"}})
	require.NoError(t, err)
	b, err := svc.Book(context.Background(), selection.Request{ISL: 40})
	require.NoError(t, err)
	require.Equal(t, "b", b.WorkerID, "the less loaded worker")
	require.Zero(t, b.Overlap.Device)
	require.Equal(t, 40, b.EffectivePrefillTokens)
	for _, l := range svc.Loads("") {
		if l.WorkerID == "b" {
			require.EqualValues(t, 40, l.ActivePrefillTokens)
		}
	}
	require.NoError(t, b.Done())
	require.NoError(t, busy.Done())
	_, err = svc.Select(context.Background(), selection.Request{})
	require.ErrorIs(t, err, selection.ErrBadRequest)
}
