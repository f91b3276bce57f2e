package kvselect

import (
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const module = "github.com/kvselect/kvselect"

// corePackages are the library's core: they may import only the standard
// library, the modules in allowedModules and each other (the design's dependency rule).
var corePackages = []string{"selection", "kvindex", "catalog", "roles", "reservation", "tokenize", "replica", "lifecycle", "gaie"}

// coreInternal are the internal packages the core may import: mechanics two
// core packages share, held to the same rule (internal/binfmt, the binary
// format toolkit of kvindex's snapshot and replica's wire).
var coreInternal = []string{"internal/binfmt"}

var allowedModules = []string{
	"github.com/cespare/xxhash/v2",
	"github.com/dgraph-io/ristretto/v2",
	"github.com/go-zeromq/zmq4",
	"github.com/google/btree",
	"golang.org/x/sync",
	"github.com/tinylib/msgp",
}

// Tests of core packages may also use these.
var allowedInTests = []string{"github.com/stretchr/testify", "go.uber.org/goleak"}

type listedPackage struct {
	ImportPath   string
	Imports      []string
	TestImports  []string
	XTestImports []string
}

func underAny(path string, prefixes []string) bool {
	for _, p := range prefixes {
		if path == p || strings.HasPrefix(path, p+"/") {
			return true
		}
	}
	return false
}

func isCore(path string) bool {
	for _, c := range slices.Concat(corePackages, coreInternal) {
		if underAny(path, []string{module + "/" + c}) {
			return true
		}
	}
	return false
}

func isStd(path string) bool {
	first, _, _ := strings.Cut(path, "/")
	return !strings.Contains(first, ".")
}

// checkImport returns "" when a core package may import path, else the reason.
func checkImport(path string, test bool) string {
	switch {
	case isStd(path), isCore(path), underAny(path, allowedModules):
		return ""
	case test && (underAny(path, allowedInTests) || strings.HasPrefix(path, module+"/internal/")):
		return ""
	case strings.HasPrefix(path, module+"/"):
		return "core packages may not depend on " + path
	default:
		return "module not on the allowed list"
	}
}

func TestCheckImportRule(t *testing.T) {
	require.Empty(t, checkImport("net/http", false))
	require.Empty(t, checkImport("github.com/tinylib/msgp/msgp", false))
	require.Empty(t, checkImport(module+"/kvindex", false))
	require.Empty(t, checkImport(module+"/internal/binfmt", false))
	require.NotEmpty(t, checkImport("google.golang.org/grpc", false))
	require.NotEmpty(t, checkImport("github.com/prometheus/client_golang/prometheus", false))
	require.NotEmpty(t, checkImport(module+"/examples/epp", false))
	require.NotEmpty(t, checkImport(module+"/internal/fakeengine", false))
	require.Empty(t, checkImport(module+"/internal/fakeengine", true))
	require.NotEmpty(t, checkImport("github.com/stretchr/testify/require", false))
	require.Empty(t, checkImport("github.com/stretchr/testify/require", true))
}

// TestCoreImports lists every core package with the go tool and fails on any
// import outside the allowed set.
func TestCoreImports(t *testing.T) {
	var patterns []string
	for _, c := range slices.Concat(corePackages, coreInternal) {
		if _, err := os.Stat(c); err == nil {
			patterns = append(patterns, "./"+c+"/...")
		}
	}
	require.NotEmpty(t, patterns, "no core package found")
	cmd := exec.Command("go", append([]string{"list", "-json=ImportPath,Imports,TestImports,XTestImports"}, patterns...)...)
	out, err := cmd.Output()
	require.NoError(t, err, "go list: %s", exitStderr(err))
	dec := json.NewDecoder(strings.NewReader(string(out)))
	n := 0
	for {
		var p listedPackage
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else {
			require.NoError(t, err)
		}
		n++
		for _, imp := range p.Imports {
			if why := checkImport(imp, false); why != "" {
				t.Errorf("%s imports %s: %s", p.ImportPath, imp, why)
			}
		}
		for _, imp := range append(p.TestImports, p.XTestImports...) {
			if why := checkImport(imp, true); why != "" {
				t.Errorf("%s (tests) import %s: %s", p.ImportPath, imp, why)
			}
		}
	}
	require.Positive(t, n)
}

// bannedInCore are modules a user who imports only the core packages must never
// find in their module graph: custom EPPs built on GAIE or llm-d pin their own
// versions, and minimal version selection would raise them. NATS belongs to
// replica/natsbus, a module of its own.
var bannedInCore = []string{"k8s.io/", "sigs.k8s.io/", "github.com/envoyproxy/", "google.golang.org/grpc", "github.com/prometheus/", "github.com/nats-io/"}

// TestRootModuleRequires fails when the root go.mod requires a module outside
// the core's list (the examples, with client-go, Envoy, gRPC and Prometheus, are
// their own module: examples/go.mod).
func TestRootModuleRequires(t *testing.T) {
	out, err := exec.Command("go", "mod", "edit", "-json").Output()
	require.NoError(t, err, "go mod edit: %s", exitStderr(err))
	var mod struct {
		Require []struct {
			Path     string
			Indirect bool
		}
	}
	require.NoError(t, json.Unmarshal(out, &mod))
	require.NotEmpty(t, mod.Require)
	for _, r := range mod.Require {
		if r.Indirect {
			continue // a dependency of an allowed module
		}
		if !underAny(r.Path, allowedModules) && !underAny(r.Path, allowedInTests) {
			t.Errorf("go.mod requires %s, which is not on the core's list", r.Path)
		}
	}
}

// TestCoreModuleGraph builds testdata/coreuser, a module outside this one that
// imports every core package, and checks that its module graph holds none of
// the examples' heavy dependencies.
func TestCoreModuleGraph(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a separate module")
	}
	env := append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
	build := exec.Command("go", "build", "-o", os.DevNull, ".")
	build.Dir, build.Env = "testdata/coreuser", env
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build in testdata/coreuser: %s", out)
	list := exec.Command("go", "list", "-m", "all")
	list.Dir, list.Env = "testdata/coreuser", env
	graph, err := list.Output()
	require.NoError(t, err, "go list -m all: %s", exitStderr(err))
	lines := strings.Split(strings.TrimSpace(string(graph)), "\n")
	require.Contains(t, lines, "github.com/kvselect/kvselect v0.0.0 => ../..", "the consumer must use this checkout")
	for _, l := range lines {
		for _, b := range bannedInCore {
			if strings.HasPrefix(l, b) {
				t.Errorf("an importer of the core packages gets %s in its module graph", l)
			}
		}
	}
}

func exitStderr(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}
