package eppserver

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/roles"
)

func TestExclusionsAreLoggedOncePerChange(t *testing.T) {
	var buf bytes.Buffer
	e := &EPP{logger: slog.New(slog.NewTextHandler(&buf, nil))}
	lines := func() []string {
		out := strings.Split(strings.TrimSpace(buf.String()), "\n")
		buf.Reset()
		if len(out) == 1 && out[0] == "" {
			return nil
		}
		return out
	}
	missing := roles.Excluded{ID: "a", Reason: roles.ReasonRoleLabelMissing}
	invalid := roles.Excluded{ID: "b", Reason: roles.ReasonRoleLabelInvalid, Value: "both"}

	e.logExclusions([]roles.Excluded{missing, invalid})
	require.Len(t, lines(), 2)
	e.logExclusions([]roles.Excluded{missing, invalid})
	require.Empty(t, lines(), "an unchanged snapshot logs nothing")

	invalid.Value = "gpu"
	e.logExclusions([]roles.Excluded{missing, invalid})
	got := lines()
	require.Len(t, got, 1)
	require.Contains(t, got[0], "value=gpu")

	e.logExclusions([]roles.Excluded{invalid})
	got = lines()
	require.Len(t, got, 1)
	require.Contains(t, got[0], `msg="worker no longer excluded" id=a`)
}
