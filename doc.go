// Package kvselect decides which LLM inference worker should serve a request,
// using what each worker already holds in its KV cache (prefix reuse) and what it
// is already doing (active load), and books that decision so concurrent requests
// see it.
//
// It is a library: an Endpoint Picker (EPP) behind a Kubernetes Gateway, or any
// other gateway, imports it and calls it in process. No serving runtime, no
// operator, no sidecar.
//
// # Packages
//
//   - selection: the SelectionService, built by SelectionServiceBuilder:
//     per-model partitions, the cost functions, picking, the admission queue,
//     bookings and their handle (Booking), approximate mode, HTTPStatus.
//   - selection/httproute: the net/http adapter for a gateway written in Go.
//   - gaie: the names of the gateway protocols (GAIE's Endpoint Picker
//     protocol, the prefill/decode hint, Dynamo's headers), defined once.
//   - lifecycle: one booked request's Handle (a Booking, a roles.Plan) and the
//     Follower that settles it from the response, for every gateway.
//   - kvindex: block hashing, and the radix-tree index of which worker rank holds
//     which prefix; an approximate index for engines without KV events.
//   - kvindex/kvevents: decoding of engine KV-event batches (vLLM, SGLang,
//     TensorRT-LLM through a vLLM-compatible publisher) and the ZeroMQ feed that
//     keeps an index true across gaps, replays, restarts and floods.
//   - catalog: what a worker is, its lifecycle and reasons, reconciliation.
//   - reservation: the active-load ledger (leases, ref-counted active blocks,
//     per-rank prefill clocks).
//   - roles: role labels, the prefill/decode split, per-role profiles and the
//     pair booker (with its plan ledger) for disaggregated serving.
//   - tokenize: engine-native token ids from the backend's own tokenizer service,
//     with an exact-match cache.
//   - replica: several replicas of one router share their active load over a
//     publish/subscribe Bus; replica/natsbus (a module of its own) is the Bus
//     over NATS, and an embedded NATS server.
//   - examples/epp: the reference Endpoint Picker's command (Envoy ext_proc,
//     Kubernetes discovery, Prometheus metrics), a thin main over
//     examples/epp/eppserver (the EPP as a library), with examples/epp/extproc,
//     examples/epp/discovery, examples/epp/prommetrics and
//     examples/epp/oteltracing for custom EPPs, and examples/policies
//     (LoRA-adapter affinity, a filter and a cost term) for their policy
//     seams; examples/customepp: a custom EPP with policy of its own, in
//     tests; examples/demo: the demo (fake
//     engines, a workload, the EPP in process); examples/gateway: a
//     plain-HTTP gateway on selection/httproute; examples/pdsidecar: the
//     decode sidecar of prefill/decode serving (examples/pdsidecar/sidecar);
//     examples/replay: the trace replay simulator's command line.
//     docs/ARCHITECTURE.md maps every package, internal ones included.
//
// # Quick start
//
//	svc, _ := selection.NewSelectionServiceBuilder(selection.DefaultConfig(16)).Build(ctx)
//	defer svc.Close()
//	svc.Workers().Upsert(catalog.Worker{ID: "pod-a", Endpoint: "10.0.0.5:8000", DPSize: 1, BlockSize: 16,
//		KVEventEndpoints: map[int]string{0: "tcp://10.0.0.5:5557"}})
//	b, _ := svc.Book(ctx, selection.Request{Tokens: promptTokens})
//	// send the request to b.Endpoint; then, or let a lifecycle.Follower do it:
//	b.PrefillComplete() // first response bytes
//	b.Done()            // end of stream, cancel or error
package kvselect
