package main

import (
	"flag"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/selection"
)

// The gateway reads the EPP's policy classes and overload status, and
// reports bad ones at startup; the classes reach the selection services.
func TestLoadConfigPolicyClasses(t *testing.T) {
	base := map[string]string{"DYN_EPP_WORKERS_FILE": "w.json",
		"DYN_EPP_POLICY_CLASSES": "interactive:weight=3;batch:inflight=64", "DYN_EPP_OVERLOAD_STATUS": "529"}
	c, err := loadConfig(flag.NewFlagSet("t", flag.ContinueOnError), nil, env(base))
	require.NoError(t, err)
	require.Equal(t, []selection.Class{{Name: "interactive", Weight: 3}, {Name: "batch", Weight: 1, InFlightLimit: 64}}, c.Classes)
	require.Equal(t, gaie.StatusSiteOverloaded, c.OverloadStatus)
	require.Equal(t, c.Classes, c.selectionConfig().Classes)

	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	_, err = loadConfig(fs, []string{"--policy-classes", "a:inflight=-1;a", "--overload-status", "503"}, env(map[string]string{"DYN_EPP_WORKERS_FILE": "w.json"}))
	require.ErrorIs(t, err, errConfig)
	require.ErrorContains(t, err, "InFlightLimit is -1")
	require.ErrorContains(t, err, `Classes[1].Name "a" is used twice`)
	require.ErrorContains(t, err, "--overload-status")
}
