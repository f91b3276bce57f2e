//go:build e2e

package e2ekube

import "syscall"

// childAttr makes the kernel kill an EPP subprocess when the test process
// dies without running its cleanups (a panic, a test timeout, a SIGKILL), so
// no EPP outlives the run.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
