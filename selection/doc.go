// Package selection is kvselect's public face: the in-process SelectionService
// that an Endpoint Picker or a gateway builds once and calls for every request to
// pick the worker that should serve it and book that decision.
//
// # Request path
//
// SelectAndReserve hashes the prompt (kvindex.Hasher), asks the model's index how
// many leading blocks each worker rank holds, reads every eligible rank's active
// load from the reservation ledger (through handles resolved when the model's
// ranks last changed, so no lookup by name), computes each rank's cost, picks
// one and books it. Without queueing none of this holds a service or model
// lock, and bookings on different ranks do not exclude each other in the
// ledger either: the booking is reservation.Ledger.BookAt, which refuses it if
// another booking reached the chosen rank after its load was read, and the
// request then decides again (Stats.Retries). Loads rise only through bookings,
// so an accepted decision is one some serial order of the concurrent requests
// would have made: two requests never both decide on the load from before the
// other's booking of the same rank. With queueing the whole decision runs under
// the model's lock, since admission needs a consistent view of the queue. The
// response tells the caller where to send the request; the caller reports the
// first output (PrefillComplete) and the end of the request (FreeReservation).
// Bookings carry a lease: one never freed (a gateway that died mid-request)
// expires and releases its load.
//
// # Cost
//
// For a prompt of T tokens and block size bs, per eligible (worker, rank), lower
// is better:
//
//	cached        = round((device + hostW*host + diskW*disk) * bs)
//	prefill       = A + max(0, T - min(cached, T)) + cached       (0 when prefill is not tracked)
//	credit        = credit*device + hostW*host + diskW*disk
//	logit         = scale * max(0, prefill/bs - credit) + active blocks + new blocks
//	              + decodeActiveRequestWeight * active requests
//
// where A is the rank's active prefill tokens and new blocks are the request's
// blocks not already active on it. Temperature 0 picks the minimum with ties
// broken uniformly at random; a positive temperature samples a softmax over costs
// normalised by their range.
//
// # Admission
//
// With Config.QueueThreshold set, a rank is busy when its active prefill tokens
// exceed threshold x max_num_batched_tokens. When every eligible rank is busy,
// SelectAndReserve waits in the model's queue (strict priority tiers, then FCFS,
// LCFS or WSPT) until a booking frees capacity, a worker is added, its context
// ends, or the service closes; a full queue is ErrOverloaded. The queue is strict:
// only its head is admitted, so an allowed-subset request at the head can hold
// others back until its own workers free up.
//
// # Without KV events
//
// With Config.UseKVEvents false, each model keeps a kvindex.Approx fed with the
// service's own bookings, so prefix affinity still works for a TTL.
//
// # Concurrency
//
// SelectionService is safe for concurrent use. Decisions of one model run in
// parallel without queueing (see Request path) and under the model's lock with
// it; a change to the model's workers takes that lock exclusively, so no booking
// lands on a rank the change removed. Index lookups and event application use
// the index's own lock; the ledger has its own read-write lock, shared by the
// load reads of concurrent decisions. Build starts the KV-event feed and the expiry sweeper;
// Close stops them and waits. The ledger's load-dropped hook never takes a lock a
// ledger caller may hold.
//
// # Invariants
//
//   - A request is only ever routed to a schedulable worker of its own model.
//   - After DeleteWorker nothing routes to the worker, its event sources are
//     stopped, and neither index blocks nor active load of it remain.
//   - Every booking is settled exactly once: freed, expired, or dropped with its
//     worker; loads never go negative.
package selection
