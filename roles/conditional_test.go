package roles

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
)

// Conditional disaggregation: a short prompt, or one whose prefix the decode
// worker already holds, is prefilled by the decode worker alone; a long
// uncached one gets a prefill leg.
func TestConditionalDisaggregation(t *testing.T) {
	clk := newFakeClock()
	rs := newRoles(t, testOptions(ModeDisaggregated, clk))
	_, err := rs.Reconcile([]catalog.Worker{wk("p1", "prefill"), wk("d1", "decode"), wk("d2", "decode")})
	require.NoError(t, err)
	b := newBooker(t, rs, BookerOptions{Now: clk.Now, LocalPrefillBelow: 16})
	ctx := context.Background()

	short, err := b.Book(ctx, selection.Request{Tokens: toks(12, 1)})
	require.NoError(t, err)
	require.True(t, short.LocalPrefill, "12 uncached tokens <= 16: no prefill leg")
	_, hinted := short.PrefillHint()
	require.False(t, hinted)
	require.Equal(t, int64(12), rs.Service(Decode).Loads("")[0].ActivePrefillTokens+rs.Service(Decode).Loads("")[1].ActivePrefillTokens,
		"the decode worker carries the prefill tokens itself")
	require.NoError(t, short.Done())

	long, err := b.Book(ctx, selection.Request{Tokens: toks(64, 2)})
	require.NoError(t, err)
	require.False(t, long.LocalPrefill, "64 uncached tokens: a prefill leg")
	hint, hinted := long.PrefillHint()
	require.True(t, hinted)
	require.Equal(t, "10.0.0.1:8000", hint)
	require.NoError(t, long.PrefillComplete())
	require.NoError(t, long.Done())

	// The decode leg of the long request taught the decode index its prefix:
	// the same prompt plus a short question is now mostly cached on the decode
	// worker that served it, so it stays there without a prefill leg.
	again, err := b.Book(ctx, selection.Request{Tokens: append(toks(64, 2), 7, 7, 7, 7)})
	require.NoError(t, err)
	require.True(t, again.LocalPrefill, "the decode worker holds 64 of 68 tokens")
	require.Equal(t, long.Decode.WorkerID, again.Decode.WorkerID)
	require.NoError(t, again.Done())

	st := b.Stats()
	require.Equal(t, int64(2), st.Conditional)
	require.Equal(t, int64(3), st.Booked)
	for _, r := range []Role{Prefill, Decode} {
		for _, l := range rs.Service(r).Loads("") {
			require.Zero(t, l.ActiveRequests, "%v %v", r, l)
		}
	}
	_, err = NewPairBooker(rs, BookerOptions{LocalPrefillBelow: -1})
	require.ErrorIs(t, err, ErrInvalidOptions)
}
