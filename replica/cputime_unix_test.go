//go:build unix

package replica_test

import (
	"syscall"
	"time"
)

// cpuTime is the CPU time the process has used, every thread counted (the
// publisher's and the collector's too).
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
