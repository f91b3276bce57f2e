// Package gaie names the wire of the gateway protocols kvselect speaks, once,
// with the standard library only: the Gateway API Inference Extension's
// Endpoint Picker protocol (the destination header and metadata, the subset
// hint, the served endpoint, the conformance suite's test headers), the
// prefill/decode hint llm-d's and Dynamo's sidecars read, Dynamo's EPP
// request headers (session, priority, its own routing headers) and the
// status a front end answers for a client that left.
//
// Every package that reads or writes one of these names takes it from
// here: selection/httproute (a Go gateway), the reference EPP's ext_proc
// server and its test driver, the decode sidecar. ControlHeaders is the list
// a gateway removes from a client's request, so that no client can steer
// routing downstream or fake a gateway's report.
//
// The package holds constants and three pure functions; it is safe for
// concurrent use and has no state.
package gaie
