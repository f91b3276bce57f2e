//go:build !unix

package pdhint

import "testing"

// mkfifo: no named pipes in the file system here.
func mkfifo(*testing.T, string) bool { return false }
