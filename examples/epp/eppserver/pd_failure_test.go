package eppserver

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/roles"
)

// A prefill engine that crashes: the decode sidecars answer its legs 502
// and say the prefill leg failed, so the EPP ejects the prefill worker, not
// the decode workers that carried the requests; one request at a time, the
// first failure ejects it and every later request is served by the other
// prefill engine.
func TestDisaggregatedPrefillFailureEjectsThePrefillWorker(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cfg, err := load(t, nil)
	require.NoError(t, err)
	fo := demofleet.PDFleetOptions{Prefill: 2, Decode: 2, PrefillBlocks: pdPrefillBlocks, DecodeBlocks: 4096,
		Model: demofleet.Model, Fallback: sidecar.FallbackFail}
	rig, err := newPDRig(ctx, cfg, fo, nil)
	require.NoError(t, err)
	defer rig.close()
	require.NoError(t, rig.fleet.StopPrefill(1))

	res, err := rig.drive(ctx, 1, pdTestWorkload(t, 40))
	require.NoError(t, err)
	require.Equal(t, 40, res.Requests)
	require.Equal(t, 1, res.Failed, "the first leg sent to the dead engine fails and ejects it (%s)", res.FirstFailure)
	require.Contains(t, res.FirstFailure, "prefill_upstream_unavailable")
	require.EqualValues(t, 1, rig.e.rs.Service(roles.Prefill).Stats().Failures, "the dead prefill worker marked")
	require.Zero(t, rig.e.rs.Service(roles.Decode).Stats().Failures, "no decode worker is to blame")
	require.NoError(t, rig.waitSettled(ctx))
}
