//go:build !unix

package replica_test

import "time"

// cpuTime is not measured here.
func cpuTime() time.Duration { return 0 }
