package kvselect

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDocsNameEveryPackage keeps the two maps of the tree from drifting:
// docs/ARCHITECTURE.md's package map names every package of the three
// modules, one line each starting with its path, and this package's doc
// comment names every package a user imports or runs (none under an
// internal/ directory, and no test-only suite: a directory whose only
// non-test file is doc.go).
func TestDocsNameEveryPackage(t *testing.T) {
	arch, err := os.ReadFile("docs/ARCHITECTURE.md")
	require.NoError(t, err)
	doc, err := os.ReadFile("doc.go")
	require.NoError(t, err)
	pkgs := packageDirs(t)
	require.Contains(t, pkgs, "selection", "the walk found the tree")

	for _, dir := range pkgs {
		require.True(t, regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(dir)+`/\s`).Match(arch),
			"docs/ARCHITECTURE.md's package map has no line for %s/", dir)
		if internal(dir) || testSuite(t, dir) {
			continue
		}
		require.True(t, regexp.MustCompile(`(^|[\s(])`+regexp.QuoteMeta(dir)+`([\s,:;.)]|$)`).Match(doc),
			"the package doc (doc.go) does not name %s", dir)
	}
}

// packageDirs lists, relative to the root, every directory holding a Go file
// that is not a test (testdata and hidden directories left out), the root
// itself excepted.
func packageDirs(t *testing.T) []string {
	t.Helper()
	seen := map[string]bool{}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != "." && (name == "testdata" || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_")) {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(name, ".go") && !strings.HasSuffix(name, "_test.go") {
			if dir := filepath.ToSlash(filepath.Dir(path)); dir != "." {
				seen[dir] = true
			}
		}
		return nil
	})
	require.NoError(t, err)
	out := make([]string, 0, len(seen))
	for dir := range seen {
		out = append(out, dir)
	}
	slices.Sort(out)
	return out
}

func internal(dir string) bool {
	return slices.Contains(strings.Split(dir, "/"), "internal")
}

// testSuite reports whether dir holds tests only, its one other file doc.go.
func testSuite(t *testing.T, dir string) bool {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range entries {
		if name := e.Name(); strings.HasSuffix(name, ".go") && !strings.HasSuffix(name, "_test.go") && name != "doc.go" {
			return false
		}
	}
	return true
}
