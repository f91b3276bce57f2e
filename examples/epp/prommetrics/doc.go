// Package prommetrics exports kvselect's counters to Prometheus, for the
// reference EPP, examples/gateway and any program that embeds kvselect and
// wants the same metrics (the names docs/OBSERVABILITY.md lists and the
// Grafana dashboard in docs/grafana queries): a program with one
// SelectionService registers a ServiceCollector over it (role
// "aggregated"), and gets the EPP's families under the EPP's names.
//
//   - ServiceCollector reads the selection services (one per role), their
//     event feeds and the tokenizer cache on every scrape: the kvselect_*
//     selection, load, KV-event and tokenizer series.
//   - TokenizerCollector reads a tokenize.Pool (failovers, hedges,
//     exhaustion, each endpoint's calls, failures and circuit) and the
//     requests routed in the degraded mode.
//   - ReplicaCollector reads each role's replica.Replicator and the NATS
//     link: the kvselect_replica_* series.
//   - Decisions is each role's selection.Recorder: histograms of every
//     decision (overlap ratio, cost margin, retries).
//   - ExtProcRecorder is the ext_proc server's extproc.Recorder: outcomes,
//     pick latency, served-endpoint mismatches, requests in flight.
//   - Responses counts what an EPP does while it follows responses: bookings
//     moved or freed, workers marked failed, lease renewals, body chunks.
//   - RouterCollector reads a selection/httproute Router: the
//     kvselect_httproute_* series (requests, refusals by reason, outcomes,
//     renewals, failures).
//   - NewWorkersFileCollector exports kvselect_workers_file_rejected_total
//     for a discovery.Static workers file.
//
// Nothing is registered in a global registry: the recorders register their
// metrics in the Registerer their constructor is given, and the collectors
// are registered by the caller. The collectors read the services' own
// counters, which stay the source of truth: nothing is counted twice.
//
// Concurrency: every type here is safe for concurrent use (Prometheus
// scrapes while requests record) and starts no goroutine. A nil *Responses
// records nothing.
//
// Invariants: metric names, help texts, label names and buckets are stable
// (dashboards and alerts name them); every labelled counter whose labels
// are known in advance is exported at 0 from the start; a constructor that
// fails leaves nothing registered.
package prommetrics
