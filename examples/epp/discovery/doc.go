// Package discovery tells the EPP which inference workers exist: it turns an
// InferencePool and its pods, or a file, into the complete desired set of
// catalog.Worker values, and hands that set to a sink every time it changes.
//
// A Source's Run calls its sink with a Snapshot: all workers (not a delta), a
// Synced flag and, when not synced, a Reason. The consumer reconciles its
// catalog (or its per-role catalogs) to Snapshot.Workers and reports ready
// after the first Synced Snapshot. Splitting workers into prefill and decode
// roles is not done here: every pod label is copied into Worker.Labels and the
// consumer reads the role label from there.
//
// # Kubernetes
//
// NewKubernetes watches one InferencePool (inference.networking.k8s.io/v1,
// resource "inferencepools", through the dynamic client) and all pods of its
// namespace (through a pod informer), and filters the pods in memory, so a
// selector edit needs no new watch. The pool contributes spec.selector.matchLabels
// (every label must match, by equality) and spec.targetPorts[0].number; further
// target ports are ignored. A pod is a worker when all of these hold:
//
//   - status.phase is Running and the Ready condition is True;
//   - it has no deletionTimestamp (it is not terminating);
//   - status.podIP is a valid IP address;
//   - its labels include every matchLabels pair.
//
// Its worker has:
//
//	ID                   WorkerID(namespace, name): 16 hex digits of SHA-256("namespace/name")
//	Identity             "namespace/name"
//	Endpoint             podIP:targetPort (IPv6 in brackets)
//	DPStart, DPSize      0, 1 (one data-parallel rank per pod; no annotation is read)
//	KVEventEndpoints     {0: "tcp://podIP:KVEventPort"}, none when KVEventPort is 0
//	ReplayEndpoint       "tcp://podIP:ReplayPort", empty when ReplayPort is 0
//	Model, BlockSize, TotalKVBlocks, MaxNumBatchedTokens   from KubeOptions
//	Labels               a copy of the pod's labels
//
// Nothing is emitted until both informer caches have synced. From then on a
// missing pool gives Snapshot{Synced: false, Reason: ReasonPoolNotFound} and a
// pool without selector labels or a valid first target port gives a Reason
// starting with ReasonPoolInvalid; neither carries workers. A pod whose IP
// changes keeps its ID and gets new endpoints.
//
// # Workers file
//
// NewStatic reads a JSON or YAML file (YAML is converted to JSON; unknown and
// duplicate keys are errors) of this shape (docs/WORKERS_FILE.md has an
// example per topology):
//
//	workers:                          # required; [] is an empty set
//	  - id: engine-a                  # required, unique
//	    endpoint: 10.0.0.5:8000       # required: host:port, no scheme
//	    identity: pod/engine-a        # optional; default: id
//	    model: qwen3                  # optional; default: Defaults.Model
//	    kv_events_endpoint: tcp://10.0.0.5:5557        # rank dp_start's events, or:
//	    kv_events_endpoints: {0: "tcp://10.0.0.5:5557"} # rank -> endpoint (not both)
//	    replay_endpoint: tcp://10.0.0.5:5558           # optional
//	    block_size: 16                # optional; default: Defaults.BlockSize
//	    total_kv_blocks: 4096         # optional; default: Defaults.TotalKVBlocks
//	    max_num_batched_tokens: 8192  # optional; default: Defaults.MaxNumBatchedTokens
//	    labels: {nvidia.com/role: decode}               # optional
//	    dp_start: 0                   # optional; default 0
//	    dp_size: 1                    # optional; default 1; at least 1
//
// Every worker must also pass catalog.Worker.Validate. The file as a whole is
// bounded (StaticOptions.Limits): at most DefaultMaxWorkers entries and
// catalog.DefaultMaxRanks data-parallel ranks together (the sum of dp_size),
// the selection service's own bound; past either it is refused whole, by name
// (ErrTooManyWorkers, ErrTooManyRanks), before any worker of it is used. A
// file that cannot be read or parsed, or is refused, at start makes NewStatic
// fail; later, such a file is logged at ERROR with the reason and the last
// good set stays in force. StaticWorkers wraps a fixed set.
//
// # Peers
//
// NewPeers finds the EPP's own replicas, for the embedded NATS servers to
// route to (docs/REPLICAS.md): Run reads the Service once (services get: a
// missing Service or a refused read ends Run with ErrPeerServiceNotFound or
// ErrPeerForbidden), then watches its EndpointSlices (label
// kubernetes.io/service-name; endpointslices list and watch) and emits the
// peer set whenever it changes: "ip:port" of every endpoint that is ready
// (unset counts as ready) and not terminating, of PodIP's address family,
// PodIP itself left out, port PeerOptions.Port, sorted, at most MaxPeers. A
// line "replica peers" logs each change (count, added, removed).
//
// # Tokenizers from discovery
//
// Tokenizers keeps a tokenize.Pool's URLs equal to a snapshot's workers of
// one model, each at http://<its endpoint> (every vLLM and SGLang pod serves
// its model's render and tokenize endpoints), leaving out a worker whose
// EngineLabel (kvselect.io/engine) names another engine than the tokenizer
// protocol's; the consumer of the snapshots calls Follow with each. The EPP
// and the gateway use it when no tokenizer URL is configured.
//
// # Concurrency
//
// Sources are safe to share between goroutines and each may be Run once. Run
// blocks until its context is done and returns only after every goroutine it
// started has exited. It calls the sink from one goroutine, one call at a
// time, in order; a slow sink delays later Snapshots but loses no change,
// because each Snapshot is recomputed from the current state. Snapshot is a
// plain value owned by whoever receives it.
//
// # Invariants
//
//   - Every Snapshot is complete: a worker absent from it is to be removed.
//   - Snapshot.Workers is sorted by ID and its ids are unique; every worker in
//     it passes catalog.Worker.Validate.
//   - A Snapshot that is not Synced has no workers.
//   - Consecutive Snapshots from one Run differ.
//
// A census line is logged at the first synced Snapshot and whenever the number
// of workers, or of workers with one role-label value, goes to or leaves zero.
package discovery
