package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/internal/fakeengine"
)

func TestMain(m *testing.M) {
	if os.Getenv(eppChildEnv) == "1" { // a process test started this binary as the EPP
		os.Exit(runEPPChild())
	}
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
}

func TestRunPrintsEnvTableAndRejectsBadConfig(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"--print-env-table"}, func(string) string { return "" }, &out, &errb)
	require.Equal(t, 0, code)
	require.Contains(t, out.String(), "DYN_EPP_TOKENIZER_SERVICE_URL")
	out.Reset()
	code = run(context.Background(), nil, func(k string) string {
		if k == "DYN_EPP_MODE" {
			return "dynamo"
		}
		return ""
	}, &out, &errb)
	require.Equal(t, 2, code)
	require.Contains(t, errb.String(), "DYN_EPP_MODE")
	errb.Reset()
	// A real run without its required settings stops before listening.
	code = run(context.Background(), nil, func(string) string { return "" }, &out, &errb)
	require.Equal(t, 2, code)
	require.Contains(t, errb.String(), "DYN_EPP_INFERENCE_POOL_NAME")
}

// The demo left the EPP: any of its flags names the command that runs it
// now, and nothing runs; --help says where the demo went.
func TestDemoFlagsPointAtTheDemoCommand(t *testing.T) {
	for _, args := range [][]string{
		{"--demo"},
		{"-demo"},
		{"--demo=true"},
		{"--topology", "disaggregated", "--demo", "--demo-requests", "60"},
		{"--demo-engine-dialect", "sglang"},
	} {
		var out, errb bytes.Buffer
		code := run(context.Background(), args, func(string) string { return "" }, &out, &errb)
		require.Equal(t, 2, code, "%v", args)
		require.Contains(t, errb.String(), "go run ./examples/demo", "%v", args)
		require.Empty(t, out.String(), "%v: nothing ran", args)
	}
	var out, errb bytes.Buffer
	require.Equal(t, 0, run(context.Background(), []string{"--help"}, func(string) string { return "" }, &out, &errb))
	require.Contains(t, errb.String(), "go run ./examples/demo")
	require.Contains(t, errb.String(), "-tokenizer-url")
	require.NotContains(t, errb.String(), "-demo-engines")
}

// testOnly are the packages that exist for tests and the demo: a fake engine,
// a fake Envoy, the decode sidecar and the demo's fleets. The shipped EPP
// binary must link none of them.
var testOnly = []string{
	"github.com/kvselect/kvselect/internal/fakeengine",
	"github.com/kvselect/kvselect/examples/internal/extproctest",
	"github.com/kvselect/kvselect/examples/internal/demofleet",
	"github.com/kvselect/kvselect/examples/pdsidecar",
}

// TestShippedBinaryLinksNoTestCode lists what the EPP binary links with the
// go tool (`go list -deps ./examples/epp`): none of testOnly, or any package
// under them.
func TestShippedBinaryLinksNoTestCode(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	var stderr string
	if ee, ok := err.(*exec.ExitError); ok {
		stderr = string(ee.Stderr)
	}
	require.NoError(t, err, "go list -deps: %s", stderr)
	deps := strings.Fields(string(out))
	require.Contains(t, deps, "github.com/kvselect/kvselect/examples/epp/eppserver", "the listing is the EPP's")
	for _, dep := range deps {
		for _, banned := range testOnly {
			require.False(t, dep == banned || strings.HasPrefix(dep, banned+"/"), "the EPP binary links %s", dep)
		}
	}
}

// maxMainLines bounds package main: flags, wiring and signals, nothing a
// custom EPP would want to reuse (that belongs in eppserver and its siblings).
const maxMainLines = 2000

func TestMainStaysThin(t *testing.T) {
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	lines := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		lines += bytes.Count(b, []byte("\n"))
	}
	require.Positive(t, lines)
	require.Less(t, lines, maxMainLines, "package main of the EPP has %d lines", lines)
}
