package kvselect

import (
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const module = "github.com/kvselect/kvselect"

// corePackages are the library's core: they may import only the standard
// library, the modules in allowedModules and each other (DESIGN.md section 1).
var corePackages = []string{"selection", "kvindex", "catalog", "roles", "reservation", "tokenize"}

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
	for _, c := range corePackages {
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
	for _, c := range corePackages {
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

func exitStderr(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}
