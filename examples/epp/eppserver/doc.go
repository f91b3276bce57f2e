// Package eppserver is kvselect's reference Endpoint Picker as a library: the
// ext_proc server an Envoy-based Gateway (Gateway API Inference Extension)
// calls for every request. It discovers workers (Kubernetes InferencePool +
// Pods, or a static file), tokenizes each request with the engines' own
// tokenizer, books the best worker with kvselect, and tells Envoy where to send
// the request. The command examples/epp parses flags and calls it;
// examples/demo runs it in process over fake engines.
//
// The pieces:
//
//   - LoadConfig reads the environment contract of Dynamo's standalone EPP
//     into a Config (every variable also has a flag, and flags win; EnvTable
//     renders the contract as the README's table).
//   - Serve runs the whole EPP until its context ends: replicas, tracing,
//     discovery, and the ext_proc, health and Prometheus listeners.
//   - New builds an EPP that listens nowhere: a caller in process applies
//     discovery snapshots itself (Apply) and serves ExtProc on a gRPC server
//     of its own.
//
// The tokenizer is a pool: one tokenize.Client per URL, a tokenize.Pool
// over them (round robin, failover on an endpoint's fault, a circuit per
// endpoint, hedged calls) and the tokenize.Cache around the pool. Its URLs
// are, by default, the discovered workers' own endpoints (every vLLM and
// SGLang pod serves its model's render or tokenize endpoint): each worker
// of the EPP's model at http://<its endpoint>, less those whose
// kvselect.io/engine label names another engine than the protocol's (label
// TensorRT-LLM pods trtllm: they serve no tokenizer). Apply gives the pool
// each snapshot's set (tokenize.Pool.SetBaseURLs), so a worker that comes
// is a tokenizer and one that goes is not, and a synced snapshot that
// leaves no tokenizer is logged at WARN. DYN_EPP_TOKENIZER_SERVICE_URL, one
// or more URLs of the same protocol (a render service, say), wins over
// discovery. The mode is logged as the EPP starts. When no tokenizer
// answers (the error is the tokenizers', not the request's nor the
// client's), the request is routed on load alone rather than refused: the
// degraded mode books a load-only decision (selection.Request.ISL estimated
// from the body, no tokens) and settles it like any other, counts it and
// logs a WARN at most every 10 s; DYN_EPP_TOKENIZER_NO_DEGRADE refuses it
// with the tokenizer error's status instead. The pool's counters, one set
// per endpoint it has at the scrape, and the degraded requests are on
// /metrics (prommetrics.TokenizerCollector).
//
// After the pick the EPP follows each response through ext_proc
// (docs/OBSERVABILITY.md): it renews the request's leases while the response
// starts or flows (DYN_EPP_RENEW_INTERVAL_MS; a stream gone silent expires at
// its lease), grows its decode booking with the SSE events of its stream
// (DYN_EPP_OUTPUT_GROWTH), returns fallback endpoints after the pick in the
// GAIE destination list (DYN_EPP_FALLBACKS), marks failed the workers a
// response says failed, and moves the booking to the worker the gateway
// reports as served (or frees it when that is no worker it can book). It
// exports per-rank load, decision quality, rebookings and renewals on
// /metrics (package prommetrics; a Grafana dashboard is in docs/grafana),
// OpenTelemetry spans for pick, tokenize and book when DYN_EPP_OTLP_ENDPOINT
// names a collector (package oteltracing), and with DYN_EPP_DEBUG_HEADER the
// cost terms of the cheapest candidates in an x-kvselect-debug response
// header.
//
// With DYN_EPP_LORA_AFFINITY (prefer or require), a request whose body
// names a model other than DYN_MODEL_NAME names a LoRA adapter: it is the
// request's selection.Request.LoRAName, and package policies' cost term
// (prefer) or filter (require) steers it to the workers whose labels
// (DYN_EPP_LORA_LABEL_PREFIX) say they have it loaded; Apply gives each
// snapshot's workers to the adapters' index.
//
// Several replicas of the EPP share their active load (docs/REPLICAS.md) when
// DYN_EPP_PEER_SERVICE is set (each embeds a NATS server routed to the ready
// endpoints of that headless Service, on DYN_EPP_REPLICA_SYNC_PORT; RBAC
// services get and endpointslices list, watch), or DYN_EPP_PEERS (the same
// with static routes), or DYN_EPP_NATS_URL (an existing NATS cluster). One
// Replicator per role (both roles in disaggregated mode) rides the one
// connection; the Replicators start once discovery has registered the
// workers, and the EPP reports ready once each has made its initial sync.
//
// # Concurrency
//
// Serve owns every goroutine it starts (the three servers, discovery, the
// lease renewer, the replicas' readiness and peer discovery) and returns once
// they have all stopped. An EPP's ExtProc server and its router are safe for
// concurrent use; Apply is called by one goroutine at a time (the discovery
// loop's). The selection services, the pair booker's sweeper, the
// Replicators and the tokenizer cache run goroutines the EPP owns: Close
// stops them and waits for them (a tokenizer pool's hedged call is joined by
// the call that started it). LoadConfig, EnvTable and New start nothing of their own beyond that.
//
// # Invariants
//
// The EPP routes only once discovery has synced (and, with replicas, once
// each Replicator has made its initial sync). Every request it books is
// settled exactly once, through the library's lifecycle.Follower, whatever
// ends it. A Config is never changed once New has taken it. Flags, variables
// and metric names are a contract: the README's table is EnvTable's output.
package eppserver
