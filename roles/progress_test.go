package roles

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
)

// at is wk on its own endpoint (fallbacks are on distinct endpoints).
func at(id, role, endpoint string) catalog.Worker {
	w := wk(id, role)
	w.Endpoint = endpoint
	return w
}

// Generated grows the decode leg, the one holding the output, by one block
// per block size of generated tokens, in both topologies; the prefill leg
// never grows.
func TestPlanGeneratedGrowsTheDecodeLeg(t *testing.T) {
	for _, mode := range []TopologyMode{ModeAggregated, ModeDisaggregated} {
		t.Run(mode.String(), func(t *testing.T) {
			clk := newFakeClock()
			rs := newRoles(t, testOptions(mode, clk))
			_, err := rs.Reconcile([]catalog.Worker{wk("p", "prefill"), wk("d", "decode")})
			require.NoError(t, err)
			b := newBooker(t, rs, BookerOptions{Now: clk.Now})
			dest := mode.Destination()
			p, err := b.Book(testCtx(t), selection.Request{Tokens: toks(8, 1)})
			require.NoError(t, err)
			worker := p.Decode.WorkerID
			start := load(t, rs, dest, worker).ActiveBlocks

			require.NoError(t, p.Generated(3), "under one block (of 4)")
			require.Equal(t, start, load(t, rs, dest, worker).ActiveBlocks)
			require.NoError(t, p.Generated(41))
			require.NoError(t, p.Generated(17), "a smaller count changes nothing")
			require.Equal(t, start+10, load(t, rs, dest, worker).ActiveBlocks)
			if mode == ModeDisaggregated {
				require.Equal(t, 2, load(t, rs, Prefill, "p").ActiveBlocks, "the prompt only")
			}
			require.NoError(t, p.Done())
			require.ErrorIs(t, p.Generated(100), ErrUnknownPlan)
			requireIdle(t, rs)
		})
	}
}

// Move carries the decode leg (load, output blocks, session pin) to the
// served worker; the prefill leg stays; a rank outside the destination role
// is selection.ErrNotFound and leaves the plan as it was.
func TestPlanMoveToServedWorker(t *testing.T) {
	clk := newFakeClock()
	opts := testOptions(ModeDisaggregated, clk)
	opts.Base.Sessions.Mode = selection.SessionHard
	rs := newRoles(t, opts)
	_, err := rs.Reconcile([]catalog.Worker{
		at("p", "prefill", "10.0.0.1:8000"), at("d1", "decode", "10.0.0.2:8000"), at("d2", "decode", "10.0.0.3:8000"),
	})
	require.NoError(t, err)
	b := newBooker(t, rs, BookerOptions{Now: clk.Now})
	ctx := testCtx(t)
	p, err := b.Book(ctx, selection.Request{Tokens: toks(16, 1), SessionID: "conv", Allowed: []string{"p", "d1"}, Fallbacks: 2})
	require.NoError(t, err)
	require.Equal(t, "d1", p.Decode.WorkerID)
	require.Empty(t, p.Prefill.Fallbacks, "fallbacks are destinations: none for the prefill leg")
	require.NoError(t, p.Generated(8))
	picked := load(t, rs, Decode, "d1")

	require.ErrorIs(t, p.Move(catalog.WorkerRank{WorkerID: "p"}), selection.ErrNotFound, "a prefill worker is no destination")
	require.ErrorIs(t, p.Move(catalog.WorkerRank{WorkerID: "nope"}), selection.ErrNotFound)
	require.Equal(t, picked, load(t, rs, Decode, "d1"), "a refused move changes nothing")

	require.NoError(t, p.Move(catalog.WorkerRank{WorkerID: "d2"}))
	served := load(t, rs, Decode, "d2")
	require.Equal(t, picked.ActiveRequests, served.ActiveRequests)
	require.Equal(t, picked.ActiveBlocks, served.ActiveBlocks, "output blocks included")
	require.Zero(t, load(t, rs, Decode, "d1").ActiveRequests)
	require.Equal(t, 1, load(t, rs, Prefill, "p").ActiveRequests, "the prefill leg stays")

	// The session's next request follows the served worker, and the
	// plan's settlement frees the legs where they are now.
	next, err := b.Book(ctx, selection.Request{Tokens: toks(8, 2), SessionID: "conv"})
	require.NoError(t, err)
	require.Equal(t, "d2", next.Decode.WorkerID)
	require.NoError(t, p.PrefillComplete())
	require.NoError(t, p.Done())
	require.NoError(t, next.Done())
	require.ErrorIs(t, p.Move(catalog.WorkerRank{WorkerID: "d1"}), ErrUnknownPlan)
	requireIdle(t, rs)
}

// Fallbacks of a plan are the destination role's next-cheapest workers on
// other endpoints, and Scores reads the destination role's candidates as Book
// scores them, without booking.
func TestPlanFallbacksAndScores(t *testing.T) {
	clk := newFakeClock()
	rs := newRoles(t, testOptions(ModeAggregated, clk))
	_, err := rs.Reconcile([]catalog.Worker{
		at("a", "", "10.0.0.1:8000"), at("b", "", "10.0.0.2:8000"), at("c", "", "10.0.0.3:8000"),
	})
	require.NoError(t, err)
	b := newBooker(t, rs, BookerOptions{Now: clk.Now})
	req := selection.Request{Tokens: toks(16, 1), Fallbacks: 2}
	sc, err := b.Scores(testCtx(t), req)
	require.NoError(t, err)
	require.Len(t, sc, 3)
	require.Zero(t, rs.Service(Aggregated).Stats().Ledger.Active, "Scores books nothing")
	p, err := b.Book(testCtx(t), req)
	require.NoError(t, err)
	require.Len(t, p.Decode.Fallbacks, 2)
	seen := map[string]bool{p.Decode.Endpoint: true}
	for _, f := range p.Decode.Fallbacks {
		require.False(t, seen[f.Endpoint], "distinct endpoints")
		seen[f.Endpoint] = true
	}
	require.NoError(t, p.Done())
	requireIdle(t, rs)
}
