// Package catalog knows which inference workers exist and which of them may
// receive requests.
//
// A Worker describes one engine: its id, model, serving endpoint, data-parallel
// ranks, KV-event endpoints and capacity. A Catalog holds one Record per
// worker: the worker plus its Lifecycle and the Reasons it is not routable.
// Discovery (for example the EPP's pod watcher) computes the desired set of
// workers and hands it to Reconcile or Catalog.Sync, which plan and apply the
// upserts and deletes that turn the current set into it. The selection package
// keeps a Catalog, routes only to its Schedulable records, and starts and stops
// each worker's KV-event sources itself as UpsertWorker and DeleteWorker change
// the worker's record.
//
// # Lifecycle
//
// Whether a worker is routable depends on what the service needs
// (Requirements) and is decided by Evaluate: it must have a serving endpoint,
// a block size, at least one data-parallel rank, max_num_batched_tokens when
// queueing is on, and a KV-event endpoint for every rank when KV events are on.
// Anything missing is named by a Reason, per rank for event endpoints
// ("kv_event_endpoint_missing:rank=1"). So is an endpoint the service must not
// route to or read from (Requirements.Endpoints, an EndpointPolicy): by
// default a hostname, a link-local (cloud metadata), unspecified, broadcast or
// multicast address, or an ipc:// event endpoint.
//
//	from         what happens                          to
//	(absent)     Upsert                                Incomplete or Schedulable (Evaluate)
//	Incomplete   Upsert supplying everything missing   Schedulable
//	Schedulable  Upsert that drops something needed    Incomplete
//	any          SetDraining(true)                     Draining
//	Draining     Upsert                                Draining (worker updated)
//	Draining     SetDraining(false)                    Incomplete or Schedulable (Evaluate)
//	any          Delete                                Unschedulable, returned; the id is gone
//
// A new worker starts Incomplete or Schedulable according to Evaluate. An
// Upsert re-evaluates it; SetDraining(true) moves it to Draining whatever it
// lacks, and later Upserts update it but keep it Draining; SetDraining(false)
// evaluates it afresh. Delete removes it and returns its final record,
// Unschedulable with ReasonDeleted. Validate rejects plainly malformed workers
// (bad endpoints, negative sizes, event endpoints for ranks the worker does not
// have) before they reach any of these states.
//
// Every change bumps the catalog's Version counter and stamps the record with
// it; an Upsert equal to the stored worker changes nothing. Change reports
// which parts of a record moved (serving endpoint, event feed, model, capacity,
// metadata, draining), so the consumer restarts event sources only when the
// event endpoints, ranks or block size changed.
//
// For the request path, AppendTargets copies the Schedulable workers of a
// model as flat Target values (no maps) from a list the catalog keeps sorted,
// without allocating.
//
// # Concurrency
//
// Catalog is safe for concurrent use: reads (Get, List, ListModel,
// Schedulable, AppendTargets, Models, Len, Version) share a read lock; writes (Upsert, Delete,
// SetDraining, Apply, Sync) are serialised, and Apply and Sync apply a whole
// plan under one hold of the lock. Every method copies: no map a caller passes
// in or gets back is shared with the catalog. The OnChange hook runs after the
// lock is released, in Version order, one call at a time; it may read the
// catalog but not write to it. Worker, Record, Plan and the other value types
// have no locking of their own. Nothing in this package starts a goroutine.
//
// # Invariants
//
//   - Ids are unique: a catalog holds at most one record per Worker.ID, in
//     exactly one model partition.
//   - A record is Schedulable if and only if Evaluate says so for its worker
//     and the catalog's Requirements, and it is neither draining nor deleted.
//   - Nothing routable survives Delete: the id leaves every list at once, and
//     the record Delete returns is Unschedulable.
//   - A record's Version grows with each of its changes and is never reused,
//     not even by a later record with the same id.
package catalog
