package pdhint

import (
	"fmt"
	"os"
	"strings"
)

// LoadKey reads a key setting the way the EPP (DYN_EPP_PD_HINT_KEY) and the
// sidecar (DYN_PD_HINT_KEY) both take it: "file:<path>", or an absolute path,
// names a file whose contents are the key, trailing line breaks trimmed;
// anything else is the key itself. A file is the better choice (a Kubernetes
// Secret volume): other processes of the pod can read the environment. LoadKey
// does not check the key's length; Sign and NewVerifier refuse one shorter
// than MinKeyLen. A file that cannot be read is an error naming the path,
// never the key.
func LoadKey(v string) ([]byte, error) {
	path, isFile := strings.CutPrefix(v, "file:")
	if !isFile && !strings.HasPrefix(v, "/") {
		return []byte(v), nil
	}
	if !isFile {
		path = v
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("pdhint: read the key file: %w", err)
	}
	return []byte(strings.TrimRight(string(b), "\r\n")), nil
}
