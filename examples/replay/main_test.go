package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRunSynthetic(t *testing.T) {
	csvPath := filepath.Join(t.TempDir(), "out.csv")
	var out, errOut bytes.Buffer
	err := run(context.Background(), []string{"--workers", "4", "--capacity", "200", "--groups", "8", "--prompts-per-group", "6",
		"--system-blocks", "6", "--rate", "5", "--common-blocks", "1", "--sweep", "--sweep-credit", "1,2", "--sweep-scale", "1",
		"--sweep-temperature", "0", "--explain", "--cost", "dynamo", "--csv", csvPath, "--parallel", "1"}, &out, &errOut)
	require.NoError(t, err, errOut.String())
	s := out.String()
	for _, want := range []string{"synthetic shared prefix: 8 groups x 6 prompts", "1 common leading block(s)", "hit/reach",
		"kvselect-approx", "max-overlap-only", "kvselect c=2 s=1 t=0", "active blocks", "8 replays in"} {
		require.Contains(t, s, want)
	}
	f, err := os.Open(csvPath)
	require.NoError(t, err)
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	require.NoError(t, err)
	require.Len(t, rows, 1+8)
	require.Equal(t, "label", rows[0][0])
	require.Equal(t, "48", rows[1][5])
}

func TestRunReplicas(t *testing.T) {
	csvPath := filepath.Join(t.TempDir(), "out.csv")
	var out, errOut bytes.Buffer
	err := run(context.Background(), []string{"--workers", "4", "--capacity", "200", "--groups", "8", "--prompts-per-group", "6",
		"--system-blocks", "6", "--rate", "5", "--policies", "kvselect,round-robin", "--replicas", "1,3", "--no-sync",
		"--sync-delay", "2ms", "--csv", csvPath, "--parallel", "2"}, &out, &errOut)
	require.NoError(t, err, errOut.String())
	s := out.String()
	for _, want := range []string{"replicas: kvselect with R router replicas", "after 2ms of simulated time", "kvselect R=1 ", "kvselect R=3 sync 2ms",
		"kvselect R=3 no sync", "round-robin", "4 replays in"} {
		require.Contains(t, s, want)
	}
	f, err := os.Open(csvPath)
	require.NoError(t, err)
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	require.NoError(t, err)
	require.Len(t, rows, 1+4)
	col := map[string]int{}
	for i, h := range rows[0] {
		col[h] = i
	}
	for i, want := range [][3]string{{"1", "", "0"}, {"3", "0.002", "96"}, {"3", "", "0"}, {"1", "", "0"}} {
		r := rows[1+i]
		require.Equal(t, want, [3]string{r[col["replicas"]], r[col["sync_delay_s"]], r[col["remote_bookings"]]}, r[0])
	}
}

func TestRunTraceFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "t.jsonl")
	require.NoError(t, os.WriteFile(path, []byte(`{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 10, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]}
not json
`), 0o600))
	var out, errOut bytes.Buffer
	err := run(context.Background(), []string{"--trace", path, "--workers", "2", "--policies", "kvselect,round-robin"}, &out, &errOut)
	require.ErrorContains(t, err, "line 3")
	out.Reset()
	err = run(context.Background(), []string{"--trace", path, "--workers", "2", "--policies", "kvselect, round-robin", "--skip-bad"}, &out, &errOut)
	require.NoError(t, err)
	require.Contains(t, out.String(), "1 bad lines skipped")
	require.Contains(t, out.String(), "2 requests")
}

func TestFlagValidation(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--workers", "0"}, "--workers 0"},
		{[]string{"--capacity", "-5"}, "--capacity -5"},
		{[]string{"--speedup", "0"}, "--speedup 0"},
		{[]string{"--prefill-rate", "-1"}, "--prefill-rate -1"},
		{[]string{"--tpot", "-1s"}, "--tpot -1s"},
		{[]string{"--max-running", "0"}, "--max-running 0"},
		{[]string{"--policies", "kvselect,fastest"}, `unknown policy "fastest"`},
		{[]string{"--trace", "x.jsonl", "--groups", "3"}, "--groups applies to synthetic mode only"},
		{[]string{"--sweep-scale", "1,x"}, `"x" is not a finite number`},
		{[]string{"--temperature", "-1"}, "Temperature"},
		{[]string{"--explain"}, "add --cost dynamo"},
		{[]string{"--sweep", "--cost", "predictive"}, "add --cost dynamo"},
		{[]string{"--cost", "cheapest"}, "want dynamo, predictive or auto"},
		{[]string{"--balance-weight", "-1"}, "Predictive.BalanceWeight"},
		{[]string{"--balance-window", "10ms"}, "Predictive.BalanceWindow"},
		{[]string{"--seed", "-1"}, "--seed -1"},
		{[]string{"--groups", "0"}, "Groups 0"},
		{[]string{"--replicas", "0"}, `"0" is not a replica count`},
		{[]string{"--replicas", "1,3,3"}, "3 is listed twice"},
		{[]string{"--no-sync"}, "--no-sync needs a --replicas value above 1"},
		{[]string{"--replicas", "2", "--sync-delay", "-1ms"}, "--sync-delay -1ms"},
		{[]string{"extra"}, "unexpected arguments: extra"},
		{[]string{"--trace", filepath.Join(t.TempDir(), "missing.jsonl")}, "missing.jsonl"},
	} {
		var out, errOut bytes.Buffer
		err := run(context.Background(), tc.args, &out, &errOut)
		require.ErrorContains(t, err, tc.want, "%v", tc.args)
	}
}

// The engine-model flags reach the replay and its header; bad values are
// refused.
func TestEngineFlags(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run(context.Background(), []string{"--workers", "4", "--capacity", "200", "--groups", "4", "--prompts-per-group", "4",
		"--policies", "round-robin", "--max-batched-tokens", "1024", "--step-base", "5ms", "--request-overhead", "10ms",
		"--slow-fraction", "0.5", "--slow-speed", "0.25"}, &out, &errOut)
	require.NoError(t, err, errOut.String())
	require.Contains(t, out.String(), "engines: steps of at most 1024 tokens costing 5ms each, request overhead 10ms, 2 of 4 workers at speed 0.25")

	c := config{workers: 4, slowFrac: 0.5, slowSpeed: 0.25}
	require.Equal(t, []float64{1, 1, 0.25, 0.25}, c.speeds())
	c.slowFrac = 0
	require.Nil(t, c.speeds())

	err = run(context.Background(), []string{"--max-batched-tokens", "8", "--step-base", "1s", "--request-overhead", "-1s",
		"--slow-fraction", "2", "--slow-speed", "0"}, &out, &errOut)
	for _, want := range []string{"--max-batched-tokens 8", "--step-base 1s", "--request-overhead -1s", "--slow-fraction 2", "--slow-speed 0"} {
		require.ErrorContains(t, err, want)
	}
}
