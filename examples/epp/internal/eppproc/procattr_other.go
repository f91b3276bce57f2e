//go:build !linux

package eppproc

import "syscall"

// childAttr is nil where the kernel cannot tie a child's life to its parent;
// the tests' cleanups still stop every EPP they start.
func childAttr() *syscall.SysProcAttr { return nil }
