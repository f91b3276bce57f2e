package main

import (
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/epp/eppserver"
)

// notRead are the variables the docs name that no binary reads, each
// documented as such where it is named.
var notRead = map[string]string{
	"DYN_ADAPTER_MODE": "an older revision of Dynamo's sidecar backend selector (docs/SIDECAR.md)",
}

// TestDocsNameOnlyVariablesTheBinariesRead: every DYN_* variable README.md
// and docs/ name is in the EPP's or the sidecar's environment contract (the
// gateway's is a subset of the EPP's), or documented as not read. A renamed
// or removed variable cannot linger in the docs.
func TestDocsNameOnlyVariablesTheBinariesRead(t *testing.T) {
	name := regexp.MustCompile(`DYN_[A-Z0-9_]+`)
	read := map[string]bool{}
	for _, v := range name.FindAllString(eppserver.EnvTable()+envTable(), -1) {
		read[v] = true
	}
	files, err := filepath.Glob("../../docs/*.md")
	require.NoError(t, err)
	files = append(files, "../../README.md")
	var unknown []string
	for _, f := range files {
		raw, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, v := range name.FindAllString(string(raw), -1) {
			if strings.HasSuffix(v, "_") { // a family of names, "DYN_PD_*"
				continue
			}
			if !read[v] && notRead[v] == "" {
				unknown = append(unknown, filepath.Base(f)+": "+v)
			}
		}
	}
	sort.Strings(unknown)
	require.Empty(t, unknown, "variables the docs name that no binary reads")
	require.NotEmpty(t, read["DYN_EPP_TOKENIZER_SERVICE_URL"])
	require.NotEmpty(t, read["DYN_SIDECAR_PORT"])
}
