package eppproc

import "syscall"

// childAttr makes the kernel kill an EPP process when the test process dies
// without stopping it (a panic, a test timeout, a SIGKILL), so no EPP outlives
// the run.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
