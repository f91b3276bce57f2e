package main

import (
	"bytes"
	"context"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDemoDisaggregated runs `--demo --topology disaggregated` small: the
// aggregated run and the disaggregated one (prefill engines, decode engines
// behind sidecars) both serve every request, each leg lands where the EPP
// booked it, every plan is handed off and completed, and the tables are
// printed.
func TestDemoDisaggregated(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"--demo", "--topology", "disaggregated", "--demo-requests", "60"},
		func(string) string { return "" }, &out, &errb)
	require.Equal(t, 0, code, "stderr: %s\nstdout: %s", errb.String(), out.String())
	s := out.String()
	t.Log("\n" + s)
	require.Contains(t, s, "2 fake prefill engines (publishing KV events, vllm-map) and 2 fake decode engines")
	require.Regexp(t, `(?m)^aggregated\s+60\s+0\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+%\s+-$`, s)
	require.Regexp(t, `(?m)^disaggregated\s+60\s+0\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+%\s+0$`, s)
	legs := regexp.MustCompile(`(?m)^disaggregated\s+(prefill|decode)-\d\s+\w+\s+(\d+) \w+(?: legs)?\s+(\d+) \w+ legs`).FindAllStringSubmatch(s, -1)
	require.Len(t, legs, 4, "a row per prefill and decode engine")
	for _, m := range legs {
		require.Equal(t, m[2], m[3], "booked and served: %s", m[0])
	}
	require.Contains(t, s, "Plans: 60 booked, 60 handed off at the first byte, 60 completed, 0 expired.")
	require.Contains(t, s, "Round-robin prefill placement of the same workload would hit")
}

func TestDemoDisaggregatedRefusesAWorkersFile(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"--demo", "--topology", "disaggregated", "--demo-workers-file", "/nonexistent"},
		func(string) string { return "" }, &out, &errb)
	require.Equal(t, 1, code)
	require.Contains(t, errb.String(), "drop --demo-workers-file")
}
