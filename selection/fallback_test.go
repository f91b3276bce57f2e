package selection

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
)

// Fallbacks are the next-cheapest ranks, one per endpoint, never the chosen
// endpoint; only the chosen worker is booked.
func TestFallbacks(t *testing.T) {
	s, _ := newTestService(t, nil)
	for i, id := range []string{"a", "b", "c", "d"} {
		_, err := s.Workers().Upsert(worker(id, func(w *catalog.Worker) {
			w.Endpoint = fmt.Sprintf("10.0.0.%d:8000", i+1)
			if id == "d" {
				w.DPSize = 2 // two ranks, one endpoint
			}
		}))
		require.NoError(t, err)
	}
	// Load: a none, b one request, c two, d three on each rank.
	for w, n := range map[string]int{"b": 1, "c": 2, "d": 6} {
		for i := range n {
			_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(40, 10+i), Allowed: []string{w}})
			require.NoError(t, err)
		}
	}
	res, err := s.Select(context.Background(), Request{Tokens: toks(16, 99), Fallbacks: 3})
	require.NoError(t, err)
	require.Equal(t, "a", res.WorkerID)
	var got []string
	for _, f := range res.Fallbacks {
		got = append(got, f.WorkerID+"@"+f.Endpoint)
		require.GreaterOrEqual(t, f.Cost, res.Cost)
	}
	require.Equal(t, []string{"b@10.0.0.2:8000", "c@10.0.0.3:8000", "d@10.0.0.4:8000"}, got)

	res, err = s.Select(context.Background(), Request{Tokens: toks(16, 99), Fallbacks: 1, Allowed: []string{"c", "d"}})
	require.NoError(t, err)
	require.Equal(t, "c", res.WorkerID)
	require.Len(t, res.Fallbacks, 1)
	require.Equal(t, "d", res.Fallbacks[0].WorkerID)

	res, err = s.Select(context.Background(), Request{Tokens: toks(16, 99)})
	require.NoError(t, err)
	require.Nil(t, res.Fallbacks, "none asked, none computed")
	_, err = s.Select(context.Background(), Request{Tokens: toks(16, 99), Fallbacks: MaxFallbacks + 1})
	require.ErrorIs(t, err, ErrBadRequest)
}
