// Command demo shows kvselect at work on one machine, with nothing but Go:
// fake vLLM-like engines (internal/fakeengine: real ZMQ KV events, an
// OpenAI-compatible HTTP API, a prefix cache, and vLLM's scheduler run in real
// time by internal/enginemodel, so requests on one engine queue, batch and
// slow each other), the reference
// EPP (examples/epp/eppserver) built in process, and an Envoy-like driver
// that sends a shared-prefix chat workload through the EPP's ext_proc server
// and forwards each request where the EPP says. It prints, per policy
// (kvselect with its defaults, with Dynamo's weights, with the other cost
// function, and round-robin), the engines' prefix-cache hit rate, the
// client's time to first byte and the requests per worker, then what each
// kvselect run's selection service saw of every engine's KV-event feed.
//
//	go run ./examples/demo                                   # kvselect vs round-robin
//	go run ./examples/demo --demo-engine-dialect sglang      # engines speaking another KV-event dialect
//	go run ./examples/demo --demo-workers-file workers.yaml  # engines you run instead of fake ones
//	go run ./examples/demo --topology disaggregated          # prefill engines, decode engines behind sidecars, conditional, vs aggregated
//	go run ./examples/demo --demo-slow-fraction 0.5          # half the engines twice as slow (--demo-slow-speed)
//	go run ./examples/demo --demo-engine-overhead 50ms       # a fixed cost per request on every engine
//
// Its own flags are the --demo-* ones; every other flag, and its environment
// variable, is the EPP's (the README's table; `go run ./examples/demo --help`
// lists them all), so `--cost dynamo` or DYN_EPP_COST=dynamo runs the demo
// under Dynamo's cost. The demo is a command of its own so that the shipped
// EPP binary links no fake engine, no fake Envoy and no sidecar.
//
// Concurrency: each run owns its engines, its EPP and the driver's
// goroutines, and stops and waits for them before the next run starts; an
// interrupt (SIGINT, SIGTERM) ends the run in progress.
package main
