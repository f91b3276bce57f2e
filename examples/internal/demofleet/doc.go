// Package demofleet is what the demo (examples/demo) and the EPP's tests share
// to put an EPP under realistic load on loopback: a shared-prefix chat
// workload (Workload), a driver that sends it through an ext_proc server the
// way Envoy would and times what a client sees (Drive), and a disaggregated
// pool of fake engines, prefill engines that publish KV events and decode
// engines each behind a real decode sidecar (StartPDFleet). It links the fake
// engine, the fake Envoy and the sidecar, which is why it is internal to the
// examples and never imported by a shipped binary (examples/epp's tests check
// that).
//
// Concurrency: Workload, HitRate and Percentile are pure. Drive runs
// DriveOptions.Concurrency goroutines and a gRPC server, all of which it
// stops and waits for before it returns. A PDFleet owns its engines, sidecars
// and their HTTP servers (one serving goroutine each): Close stops them and
// waits for them; its other methods are safe for concurrent use.
//
// Invariants: a workload is a function of its options and run number only
// (the same seed gives the same requests; another run number gives system
// prompts no earlier run had, so that engines that keep their caches between
// runs start cold); Drive counts every request it sends exactly once, as
// served or failed.
package demofleet
