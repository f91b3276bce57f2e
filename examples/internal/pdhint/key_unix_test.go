//go:build unix

package pdhint

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// mkfifo makes a named pipe at path.
func mkfifo(t *testing.T, path string) bool {
	t.Helper()
	require.NoError(t, syscall.Mkfifo(path, 0o600))
	return true
}
