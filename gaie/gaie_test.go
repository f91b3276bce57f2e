package gaie_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/gaie"
)

func TestControlHeaders(t *testing.T) {
	hs := gaie.ControlHeaders()
	require.Contains(t, hs, gaie.HeaderDestination)
	require.Contains(t, hs, gaie.HeaderPrefiller)
	require.Contains(t, hs, gaie.HeaderPrefillerSignature)
	require.Contains(t, hs, gaie.HeaderTestSelection)
	hs[0] = "changed"
	require.Equal(t, gaie.HeaderDestination, gaie.ControlHeaders()[0], "a copy")
	for _, h := range gaie.ControlHeaders() {
		require.True(t, gaie.IsControlHeader(h), h)
	}
	for _, h := range []string{"X-Gateway-Destination-Endpoint", "x-kvselect-debug", "X-Gateway-Inference-Objective",
		"x-gateway-model-name-rewrite", "X-Dynamo-DP-Rank", "x-gateway-destination-endpoint-whatever"} {
		require.True(t, gaie.IsControlHeader(h), h)
	}
	for _, h := range []string{"content-type", "authorization", gaie.HeaderSessionID, gaie.HeaderDynamoPriority, "x-request-id"} {
		require.False(t, gaie.IsControlHeader(h), h)
	}
}

func TestParseOverloadStatus(t *testing.T) {
	for in, want := range map[string]int{"429": 429, "529": gaie.StatusSiteOverloaded} {
		got, err := gaie.ParseOverloadStatus(in)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	for _, in := range []string{"", "503", " 429", "too-many"} {
		_, err := gaie.ParseOverloadStatus(in)
		require.Error(t, err, in)
	}
}
