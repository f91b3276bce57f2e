// Command epp is kvselect's reference Endpoint Picker: the ext_proc server an
// Envoy-based Gateway (Gateway API Inference Extension) calls for every
// request. It reads its settings (package eppserver: Dynamo's standalone EPP
// environment contract, every variable also a flag, flags win) and serves
// until SIGINT or SIGTERM; what it does is package eppserver's, which a
// custom EPP can import.
//
//	go run ./examples/epp --print-env-table # the environment contract as Markdown
//	go run ./examples/demo                  # the demo: fake engines, a workload, kvselect vs round-robin
//
// The binary links no test code: no fake engine, no fake Envoy, no sidecar
// (TestShippedBinaryLinksNoTestCode). The demo, which needs them, is its own
// command, examples/demo; `epp --demo` says so and exits.
//
// Exit status: 0 after a clean shutdown (or --help, --print-env-table), 1
// when the EPP stopped on an error, 2 for a bad flag or setting.
package main
