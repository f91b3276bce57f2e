package main

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDemoDisaggregated runs `--topology disaggregated` small: the
// aggregated run, the disaggregated one (prefill engines, decode engines
// behind sidecars) and the conditional one all serve every request, each leg
// lands where the EPP booked it, every plan is handed off and completed, and
// the tables are printed. In the conditional run, short questions and requests
// whose system prompt the decode engine holds skip the prefill leg: fewer
// prefill legs than requests, each skipped one prefilled by its decode engine.
func TestDemoDisaggregated(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"--topology", "disaggregated", "--demo-requests", "60"},
		func(string) string { return "" }, &out, &errb)
	require.Equal(t, 0, code, "stderr: %s\nstdout: %s", errb.String(), out.String())
	s := out.String()
	t.Log("\n" + s)
	require.Contains(t, s, "2 fake prefill engines (publishing KV events, vllm-map) and 2 fake decode engines")
	require.Contains(t, s, "DYN_EPP_LOCAL_PREFILL_BELOW=64")
	const latencies = `\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+%`
	require.Regexp(t, `(?m)^aggregated\s+60\s+0`+latencies+`\s+-\s+-$`, s)
	require.Regexp(t, `(?m)^disaggregated\s+60\s+0`+latencies+`\s+0\s+0$`, s)
	m := regexp.MustCompile(`(?m)^disaggregated, conditional\s+60\s+0` + latencies + `\s+(\d+)\s+0$`).FindStringSubmatch(s)
	require.NotNil(t, m, "the conditional row")
	skipped := atoi(t, m[1])
	require.Positive(t, skipped, "some requests skip the prefill leg")

	// Prefill rows: booked and served agree.
	prefillLegs := map[string]int{}
	for _, m := range regexp.MustCompile(`(?m)^(disaggregated(?:, conditional)?)\s+prefill-\d\s+prefill\s+(\d+) prefill legs\s+(\d+) prefill legs`).FindAllStringSubmatch(s, -1) {
		require.Equal(t, m[2], m[3], "booked and served: %s", m[0])
		prefillLegs[m[1]] += atoi(t, m[2])
	}
	require.Equal(t, 60, prefillLegs["disaggregated"], "a prefill leg for every request")
	require.Equal(t, 60-skipped, prefillLegs["disaggregated, conditional"], "a prefill leg for every request that did not skip it")
	require.Less(t, prefillLegs["disaggregated, conditional"], 60, "fewer prefill legs than requests")

	// Decode rows: every request booked on a decode worker reached its
	// engine, as a decode leg or, in the conditional run, prefilled locally.
	decodeRows := regexp.MustCompile(`(?m)^disaggregated\s+decode-\d\s+decode\s+(\d+) requests\s+(\d+) decode legs\s`).FindAllStringSubmatch(s, -1)
	require.Len(t, decodeRows, 2, "a row per decode engine")
	for _, m := range decodeRows {
		require.Equal(t, m[1], m[2], "booked and served: %s", m[0])
	}
	local := 0
	condRows := regexp.MustCompile(`(?m)^disaggregated, conditional\s+decode-\d\s+decode\s+(\d+) requests, (\d+) local\s+(\d+) decode legs, (\d+) local\s`).FindAllStringSubmatch(s, -1)
	require.Len(t, condRows, 2, "a conditional row per decode engine")
	for _, m := range condRows {
		require.Equal(t, m[2], m[4], "prefilled locally, booked and served: %s", m[0])
		require.Equal(t, atoi(t, m[1]), atoi(t, m[3])+atoi(t, m[4]), "booked: decode legs and local prefills: %s", m[0])
		local += atoi(t, m[2])
	}
	require.Equal(t, skipped, local, "every skipped prefill leg was prefilled by its decode engine")

	// Every plan settled, in both disaggregated runs.
	require.Regexp(t, `(?m)^Disaggregated: the EPP booked 0 requests on a decode worker alone`, s)
	require.Regexp(t, fmt.Sprintf(`(?m)^Disaggregated, conditional: the EPP booked %d requests on a decode worker alone \(%d conditionally, 0 because`, skipped, skipped), s)
	require.Contains(t, s, "0 hints refused, 0 requests passed through.")
	require.Contains(t, s, fmt.Sprintf("0 hints refused, %d requests passed through.", skipped), "the sidecars passed the skipped ones to their engine")
	require.Equal(t, 2, strings.Count(s, "Plans: 60 booked, 60 handed off at the first byte,\n60 completed, 0 expired."), "every plan settled")
	require.Contains(t, s, fmt.Sprintf("Conditional: %d of 60 requests skipped the prefill leg", skipped))
	require.Contains(t, s, "Round-robin prefill placement of the same workload would hit")
}

func atoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	require.NoError(t, err)
	return n
}

func TestDemoDisaggregatedRefusesAWorkersFile(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"--topology", "disaggregated", "--demo-workers-file", "/nonexistent"},
		func(string) string { return "" }, &out, &errb)
	require.Equal(t, 1, code)
	require.Contains(t, errb.String(), "drop --demo-workers-file")
}
