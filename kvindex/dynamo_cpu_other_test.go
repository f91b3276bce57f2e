//go:build !unix

package kvindex_test

// cpuTime is unknown here: BenchmarkDynamoApplySources leaves cpu-2/1 out.
func cpuTime() float64 { return 0 }
