package eppserver

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/internal/demofleet"
)

// TestConditionalDisaggregation: with DYN_EPP_LOCAL_PREFILL_BELOW set, a short
// prompt goes to a decode worker with no prefiller hint (it prefills itself),
// while a long uncached one gets a prefill leg.
func TestConditionalDisaggregation(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := load(t, map[string]string{"DYN_EPP_LOCAL_PREFILL_BELOW": "64"})
	require.NoError(t, err)
	require.Equal(t, 64, cfg.LocalPrefillBelow)
	rig, err := newPDRig(ctx, cfg, demofleet.PDFleetOptions{Prefill: 2, Decode: 1, Model: demofleet.Model, PrefillBlocks: 256, DecodeBlocks: 256}, nil)
	require.NoError(t, err)
	defer rig.close()
	conn, client := rig.dial(t)
	defer conn.Close()

	body := func(text string) []byte {
		return []byte(`{"model":"` + demofleet.Model + `","stream":true,"messages":[{"role":"user","content":"` + text + `"}]}`)
	}
	short := hold(t, client, body("hi"))
	require.Empty(t, short.prefiller, "a short prompt is prefilled by its decode worker")
	require.NotEmpty(t, rig.workerAt(short.destination))
	long := hold(t, client, body(strings.Repeat("a long and uncached question ", 40)))
	require.NotEmpty(t, rig.workerAt(long.prefiller), "a long uncached prompt gets a prefill leg")
	for _, h := range []*heldRequest{short, long} {
		h.write(t, "data: [DONE]\n\n")
		require.NoError(t, h.w.Close())
		require.NoError(t, h.wait(t))
	}
	require.Eventually(t, func() bool { return rig.unsettled() == nil }, 5*time.Second, time.Millisecond, "%v", rig.unsettled())
	st := rig.e.pairs.Stats()
	require.Equal(t, int64(1), st.Conditional)
	require.Equal(t, int64(2), st.Plans.Completed)
}
