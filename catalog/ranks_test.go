package catalog

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// wide is a worker of n data-parallel ranks without event endpoints.
func wide(id string, n int) Worker {
	return Worker{ID: id, Endpoint: "10.0.0.5:8000", DPSize: n, BlockSize: 16}
}

func TestMaxRanks(t *testing.T) {
	c := New(Options{MaxRanks: 10})
	_, err := c.Upsert(wide("a", 4))
	require.NoError(t, err)
	_, err = c.Upsert(wide("b", 6))
	require.NoError(t, err)
	require.Equal(t, 10, c.Ranks())

	// One rank more is refused by name, and changes nothing.
	_, err = c.Upsert(wide("c", 1))
	require.ErrorIs(t, err, ErrTooManyRanks)
	require.ErrorContains(t, err, `worker "c" has 1 ranks, and the catalog's workers would have 11, above its bound of 10`)
	_, ok := c.Get("c")
	require.False(t, ok)
	require.Equal(t, 10, c.Ranks())

	// A replacement counts its new ranks instead of its old ones.
	_, err = c.Upsert(wide("b", 7))
	require.ErrorIs(t, err, ErrTooManyRanks)
	rec, _ := c.Get("b")
	require.Equal(t, 6, rec.Worker.DPSize, "a refused update leaves the old worker")
	_, err = c.Upsert(wide("b", 2))
	require.NoError(t, err)
	require.Equal(t, 6, c.Ranks())

	// Delete gives its ranks back; a worker without ranks (DPSize 0) costs
	// none, Incomplete as it is.
	_, err = c.Delete("a")
	require.NoError(t, err)
	_, err = c.Upsert(wide("c", 8))
	require.NoError(t, err)
	rec, err = c.Upsert(wide("d", 0))
	require.NoError(t, err)
	require.Equal(t, Incomplete, rec.Lifecycle)
	require.Equal(t, 10, c.Ranks())

	// Draining or not, a worker's ranks count.
	_, err = c.SetDraining("c", true)
	require.NoError(t, err)
	_, err = c.Upsert(wide("e", 1))
	require.ErrorIs(t, err, ErrTooManyRanks)
	require.Equal(t, 10, TotalRanks(workersOf(c.List())))
}

func workersOf(recs []Record) []Worker {
	ws := make([]Worker, len(recs))
	for i, r := range recs {
		ws[i] = r.Worker
	}
	return ws
}

func TestMaxRanksDefault(t *testing.T) {
	// The zero catalog holds DefaultMaxRanks ranks and not one more: 16
	// workers of 4,096 (MaxDPSize), then a one-rank worker is refused.
	var c Catalog
	for i := range DefaultMaxRanks / MaxDPSize {
		_, err := c.Upsert(wide(fmt.Sprintf("w%02d", i), MaxDPSize))
		require.NoError(t, err)
	}
	require.Equal(t, DefaultMaxRanks, c.Ranks())
	_, err := c.Upsert(wide("one-more", 1))
	require.ErrorIs(t, err, ErrTooManyRanks)

	// A negative bound is no bound.
	u := New(Options{MaxRanks: -1})
	for i := range DefaultMaxRanks/MaxDPSize + 1 {
		_, err := u.Upsert(wide(fmt.Sprintf("w%02d", i), MaxDPSize))
		require.NoError(t, err)
	}
	require.Equal(t, DefaultMaxRanks+MaxDPSize, u.Ranks())
}

func TestTotalRanks(t *testing.T) {
	require.Zero(t, TotalRanks(nil))
	ws := []Worker{wide("a", 3), wide("b", 0), wide("c", -2), wide("d", MaxDPSize+5)}
	require.Equal(t, 3+MaxDPSize, TotalRanks(ws), "negative sizes count 0, oversized ones MaxDPSize (as Ranks)")
	// The 500-worker file of issue 27: every worker within MaxDPSize, the
	// whole 31 times the default bound.
	big := make([]Worker, 500)
	for i := range big {
		big[i] = wide(fmt.Sprint(i), MaxDPSize)
	}
	require.Equal(t, 500*MaxDPSize, TotalRanks(big))
	require.Greater(t, TotalRanks(big), DefaultMaxRanks)
	c := New(Options{})
	var refused error
	for _, w := range big {
		if _, err := c.Upsert(w); err != nil {
			refused = err
			break
		}
	}
	require.True(t, errors.Is(refused, ErrTooManyRanks))
	require.Equal(t, DefaultMaxRanks, c.Ranks())
}
