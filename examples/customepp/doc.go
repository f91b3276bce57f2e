// Package customepp is a custom Endpoint Picker built on kvselect, in tests:
// what a team writes when the reference EPP's policy is not theirs. It builds
// a selection service with a policy of its own (package selection's seams),
// set once on the builder:
//
//   - a filter: workers labelled example.com/cordoned=true never serve;
//   - a cost term: a worker labelled example.com/gpu=a10 costs more (64
//     blocks under Dynamo's cost, 0.5 s under the predictive one), so the
//     H100s serve first;
//   - a classifier: the x-tenant header admits the tenants it knows (the
//     interactive one in a higher queue tier) and refuses the others, 429
//     with the reason classifier:unknown_tenant.
//
// Its workers come from a workers file (discovery.ParseWorkers), its ext_proc
// server is the reference EPP's (package extproc) around a Picker of its own,
// and the tests drive it like Envoy (extproctest) against fake engines on
// loopback, checking that each seam took effect.
//
// # Concurrency
//
// The EPP's Picker and its seams run on the ext_proc server's request
// goroutines, concurrently: the seams only read. The tests own the gRPC
// server's goroutine and the engines, and stop them before they end.
package customepp
