// Package eppproc runs the reference EPP (examples/epp) as a process in tests,
// for the e2ekube and attacktest suites: build the binary once, start it with
// exactly the environment a test chooses, capture its log (one Record a line,
// each JSON record parsed), wait for log records, scrape its /metrics and stop
// it; Report, from a test's cleanup, fails the test on a data race the EPP
// reported and logs its output when the test failed. What a suite does with
// the process (a Kubernetes cluster, attacks, its assertions) stays in the
// suite.
//
// # Concurrency
//
// A Process is safe for concurrent use: its log Sink is written by exec's
// copying goroutines while a test reads it, and Stop may race with the
// process's own exit. One goroutine per Process, started by Start, reaps the
// process; Stop waits for it.
package eppproc
