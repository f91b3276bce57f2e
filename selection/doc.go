// Package selection is kvselect's public face: the in-process SelectionService
// that an Endpoint Picker or a gateway builds once and calls for every request to
// pick the worker that should serve it and book that decision.
//
// # The caller's duties
//
// In this order:
//
//  1. Build the service once: NewSelectionServiceBuilder over a validated
//     Config (DefaultConfig), Build.
//  2. Keep its workers true through Workers(): Upsert for every worker added
//     or changed, Delete for every one gone (catalog.Reconcile computes both
//     from a desired set); SetDraining takes a worker out of the picks before
//     it stops. Ready says whether a model has a schedulable worker.
//  3. Book every request (Book) and send it to the Booking's Endpoint.
//  4. Settle the Booking, a lifecycle.Handle, as the response passes: a
//     lifecycle.Follower does that from the response, as selection/httproute
//     and the reference EPP do; package lifecycle names the calls (first
//     output, progress, output growth, served elsewhere, failed, done) and
//     their repeat-call contract. Done is due exactly once, on every path; a
//     booking never settled (its caller died) expires at its lease
//     (Config.ActiveRequestExpiry).
//  5. Close the service at the end.
//
// The rest of the surface is reached through four views, so that the
// per-request core stays small:
//
//	Workers()       the fleet: Upsert, Delete, SetDraining, MarkFailed (a request
//	                path's report of a failed worker), List
//	Reservations()  the same settles by reservation id, for a caller that carries ids
//	                (roles' pair booker) and tests with a fake clock (Expire)
//	Events()        the KV-event plane: events applied by hand, the feed's sources,
//	                bind listener, refusals and health, the index snapshot
//	Replicas()      what package replica needs: peers' bookings booked and settled here
//
// A custom Endpoint Picker adds its own policy when it builds the service,
// through four small interfaces it implements (no registry): a Filter (which
// workers may serve a request), a CostTerm (a price the built-in cost cannot
// see), a Picker (the choice among the scored candidates) and a Classifier
// (admission: refuse, or set the priority, the policy class and the
// deadline). docs/POLICY.md says where each runs in a decision and what it
// costs.
//
// Fair admission shares the admission queue between policy classes
// (Config.Classes, Request.Class): strict tiers, deficit round robin across
// the classes that wait by weight, earliest deadline first within a class,
// and per-class queue and in-flight limits (ErrAdmission); docs/POLICY.md,
// "Fair admission".
//
// docs/SELECTION.md has how a decision is made: the request path, the cost
// formulas, sparse decisions, admission, sessions, approximate mode, feed
// health and token parity, index snapshots. docs/ROUTING.md measures the
// costs on every workload shape, docs/POLICY.md the policy seams,
// docs/BOUNDS.md lists every bound and what
// happens past it, docs/REPLICAS.md shares the load between router replicas
// and docs/OBSERVABILITY.md maps the counters to metrics.
//
// # Concurrency
//
// SelectionService is safe for concurrent use. Two concurrent bookings never
// both decide on the load from before the other's booking of the same worker
// rank: without queueing a decision holds no service or model lock and is
// booked with reservation.Ledger.BookAt, which refuses it when another booking
// reached the chosen rank after its load was read, and the request decides
// again (Stats.Retries); with queueing it runs under the model's lock. A change
// to a model's workers takes that lock exclusively. A Recorder or Tracer is
// never called under a lock (the policy's filters, cost terms and picker
// are, with queueing: see Filter). Build starts the KV-event feed, the feed
// checker and the lease sweeper; Close stops them and waits.
//
// # Invariants
//
//   - A request is only ever routed to a schedulable worker of its own model.
//   - After Workers().Delete nothing routes to the worker, its event sources are
//     stopped, and neither index blocks nor active load of it remain.
//   - Every booking is settled exactly once: freed, expired, or dropped with its
//     worker; loads never go negative.
package selection
