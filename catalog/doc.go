// Package catalog knows which inference workers exist and which of them may
// receive requests.
//
// A Worker describes one engine: its id, model, serving endpoint, data-parallel
// ranks, KV-event endpoints and capacity. A Catalog holds one Record per
// worker: the worker plus its Lifecycle and the Reasons it is not routable.
// Discovery (for example the EPP's pod watcher) computes the desired set of
// workers, Reconcile plans the deletes and upserts that turn the current
// records into it, and the caller applies them.
//
// The catalog only keeps records: it starts nothing and notifies no one. The
// selection service keeps a Catalog, routes only to its Schedulable records,
// and starts and stops each worker's KV-event sources itself, from the worker's
// record before and after each Workers().Upsert and Workers().Delete.
//
// # Lifecycle
//
// Whether a worker is routable depends on what the service needs
// (Requirements): a serving endpoint, a block size, at least one data-parallel
// rank, max_num_batched_tokens when queueing is on, and a KV-event endpoint for
// every rank when KV events are on. Anything missing is named by a Reason, per
// rank for event endpoints ("kv_event_endpoint_missing:rank=1"). So is an
// endpoint the service must not route to or read from (Requirements.Endpoints,
// an EndpointPolicy): by default a hostname, a link-local (cloud metadata),
// unspecified, broadcast or multicast address, or an ipc:// event endpoint.
//
//	from         what happens                          to
//	(absent)     Upsert                                Incomplete or Schedulable
//	Incomplete   Upsert supplying everything missing   Schedulable
//	Schedulable  Upsert that drops something needed    Incomplete
//	any          SetDraining(true)                     Draining
//	Draining     Upsert                                Draining (worker updated)
//	Draining     SetDraining(false)                    Incomplete or Schedulable
//	any          Delete                                Unschedulable, returned; the id is gone
//
// A new worker starts Incomplete or Schedulable according to the catalog's
// Requirements, and every Upsert judges it again; SetDraining(true) moves it to
// Draining whatever it lacks, later Upserts update it but keep it Draining, and
// SetDraining(false) judges it afresh. Delete removes it and returns its final
// record, Unschedulable with ReasonDeleted; an Upsert of the same id later
// starts a new record. Worker.Validate rejects plainly malformed workers (bad
// endpoints, negative sizes, event endpoints for ranks the worker does not
// have) before they reach any of these states, and an Upsert that would take
// the catalog past Options.MaxRanks data-parallel ranks (DefaultMaxRanks,
// 65,536) is refused with ErrTooManyRanks before it changes anything.
//
// # Concurrency
//
// A Catalog is safe for concurrent use: reads (Get, List, Schedulable) share a
// read lock, writes (Upsert, Delete, SetDraining) are serialised. Every method
// copies: no map a caller passes in or gets back is shared with the catalog.
// Worker, Record and Plan are plain values with no locking of their own.
// Nothing in this package starts a goroutine.
//
// # Invariants
//
//   - Ids are unique: a catalog holds at most one record per Worker.ID.
//   - Every stored worker passed Worker.Validate, and its Model is never empty
//     (an empty one is stored as DefaultModel).
//   - The stored workers' data-parallel ranks together (TotalRanks) never
//     exceed the catalog's bound, Options.MaxRanks.
//   - A record is Schedulable if and only if its worker meets the catalog's
//     Requirements and it is not draining.
//   - Nothing routable survives Delete: the id leaves every list at once, and
//     the record Delete returns is Unschedulable.
//   - A write that changes nothing (an Upsert equal to the stored worker, a
//     SetDraining to the state it has) leaves the record as it was, UpdatedAt
//     included.
package catalog
