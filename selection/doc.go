// Package selection is kvselect's public face: the in-process SelectionService
// that an Endpoint Picker or a gateway builds once and calls for every request to
// pick the worker that should serve it and book that decision.
//
// # The caller's duties
//
// Build the service once (SelectionServiceBuilder), register the workers
// (UpsertWorker, DeleteWorker, SetDraining), book every request (Book) and
// settle its Booking as the response passes: a lifecycle.Follower does that
// from the response, as selection/httproute and the reference EPP do
// (package lifecycle names the calls and their repeat-call contract).
// MarkFailed a worker that failed a request; Close at the end. The rest of
// the surface is reached through three views, so that the per-request core
// stays small:
//
//	Reservations()  the same settles by reservation id, for a caller that carries ids
//	                (roles' pair booker) and tests with a fake clock (Expire)
//	Events()        the KV-event plane: events applied by hand, the feed's sources,
//	                bind listener, refusals and health, the index snapshot
//	Replicas()      what package replica needs: peers' bookings booked and settled here
//
// # Request path
//
// SelectAndReserve hashes the prompt (kvindex.Hasher), asks the model's index how
// many leading blocks each worker rank holds, reads every eligible rank's active
// load from the reservation ledger (through handles resolved by the first
// decision after the model's workers last changed, once for every change made
// since, so no lookup by name), computes each rank's cost, picks
// one and books it. Without queueing none of this holds a service or model
// lock, and bookings on different ranks do not exclude each other in the
// ledger either: the booking is reservation.Ledger.BookAt, which refuses it if
// another booking reached the chosen rank after its load was read, and the
// request then decides again (Stats.Retries); reservation's package doc shows
// that an accepted decision is a serial one. With queueing the whole decision runs under
// the model's lock, since admission needs a consistent view of the queue. The
// response tells the caller where to send the request; the caller reports the
// first output (Booking.PrefillComplete) and the end of the request
// (Booking.Done).
// Bookings carry a lease: one never freed (a gateway that died mid-request)
// expires and releases its load.
//
// # Cost
//
// For a prompt of T tokens and block size bs, per eligible (worker, rank), lower
// is better:
//
//	cached        = round((device + hostW*host + diskW*disk + inflightW*pending) * bs)
//	prefill       = A + max(0, T - min(cached, T)) + cached       (0 when prefill is not tracked)
//	credit        = credit*d*(device + inflightW*pending) + hostW*host + diskW*disk
//	logit         = scale * max(0, prefill/bs - credit) + active blocks + new blocks
//	              + decodeActiveRequestWeight * active requests
//
// where A is the rank's active prefill tokens, new blocks are the request's
// blocks not already active on it, and pending (with KV events and
// InFlightHitWeight, inflightW, above 0; DefaultConfig sets 1, DynamoConfig 0)
// is the request's leading blocks that are active on the rank beyond its
// cached prefix: requests booked there are computing them, and the index will
// hear of them once their prefill ends; d is 1 unless OverlapCreditDecay k is
// set (Dynamo's credit decay): d = 1 / (1 + k x ((A - least A)/bs) / request
// blocks). Without pending the cost is Dynamo's. Temperature 0 picks the minimum with ties
// broken uniformly at random; a positive temperature samples a softmax over costs
// normalised by their range.
//
// Config.Cost = CostPredictive replaces the logit by a predicted time, in
// seconds (cost.go's predicted gives the formula): the prefill still queued
// ahead of the request on the rank, drained at the rank's prefill rate since
// its current prefill began (reservation.PrefillClock), plus the request's
// uncached prompt weighted 1 + BacklogWeight, plus DecodeWeight times the
// decode term in blocks of prefill time, all over that rate; plus the
// balance term, BalanceWeight seconds per unit of the rank's share of the
// recent bookings (PrefillClock's Arrivals) above the candidates' mean and
// BalanceSlack. Each rank's rate is learned from its completed prefills
// (PrefillComplete after the booking); until then, or with FixedRate, it is
// PrefillTokensPerSecond. A soft session pin is judged without its rank's
// balance term: the session's own requests raise that share. CostAuto, the
// default, is the predictive cost on a model of at most
// AutoPredictiveMaxRanks ranks and the logit on a larger one, where the
// sparse decision below needs it; Decision.Predicted says which a decision
// used. On the replay simulator's generators the predictive cost reaches
// 96-100% of the reachable hit rate, the best TTFT p90 of the policies
// replayed and a request imbalance of at most 1.15 on every one
// (docs/ROUTING.md).
//
// # Sparse decisions
//
// A decision need not look at every rank. Without queueing, at temperature 0,
// on a model of at least 128 ranks, a request evaluates one by one only the
// ranks it touches: those the index reports holding some of its blocks (any
// tier), those where some of its blocks are active in the ledger (the
// in-flight credit's pending blocks among them), and its session's pin.
// Every other rank costs it the same function of the rank's active prefill,
// active blocks and active requests, so the model keeps its ranks grouped by
// those three figures and the groups ordered by that cost's
// request-independent part, current through the ledger's hooks (every Book,
// PrefillComplete, AddOutputBlocks, Move, Free, Expire and worker removal);
// the cheapest groups give the best of the rest, exactly, with its ties
// (sparse.go says why the order is exact). Ejected workers are left out of
// the groups; a tie is drawn uniformly over the touched ranks and the tied
// groups' members with one draw, as the full scan draws (over the same ties;
// the member a draw names may differ). A request with an Allowed subset
// evaluates exactly the subset's ranks. A decision's cost is then the
// prompt, the ranks it touches and the few groups at the front of the order,
// whatever the number of ranks; Decision.Margin stays exact. The full scan
// remains for: a positive temperature, queueing, OverlapCreditDecay (it
// makes every credit depend on the least active prefill of all candidates),
// CostPredictive (its queued work drains with time, so no order of it stays
// current; CostAuto predicts only on models too small for the sparse
// decision), Request.Fallbacks (the next-cheapest ranks on distinct endpoints), an
// Override of PrefillLoadScale or TrackPrefillTokens (the order is built on
// the configured weights), every rank ejected, smaller models, and requests
// the index matches on more than a quarter of the ranks. The
// chosen rank is booked with BookAt like any other: a rank the order placed
// before a change it has not yet heard of is re-read before booking, placed
// again and the decision made again (Stats.Retries).
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
// # Sessions
//
// A request with a SessionID pins its session to the worker rank it is booked
// on (Config.Sessions). The session's later requests go to that rank, hard
// (whenever it is schedulable) or soft (the default: unless it is busy or
// costs more than the best rank by SoftSlack cold costs of the request); a
// request booked elsewhere moves the pin. Each model holds at most
// MaxSessions pins, least recently used dropped first, each living IdleTTL
// after its last booking. A peer's booking (ReplicaPlane.Book) pins its session too,
// so replicas share pins. A request without a SessionID never touches the
// table; one with it takes the model's table lock twice (read, then pin).
//
// # Without KV events
//
// With Config.UseKVEvents false, each model keeps a kvindex.Approx fed with the
// service's own bookings, so prefix affinity still works for a TTL.
//
// # Feed health
//
// With the built-in event feed, the service judges each worker rank's feed
// every FeedTrust.CheckInterval, on its Clock (FeedHealth reports it; the
// reference EPP exports it as metrics):
//
//   - silent: FeedTrust.SilentBookings bookings that left the engine new blocks
//     to store (fewer cached blocks than the request has) were made on the rank
//     since its feed's last batch, the oldest FeedTrust.SilentAfter ago;
//   - mis-speaking: over FeedTrust.Window, at least FeedTrust.MinStores stored
//     events arrived and more than FeedTrust.MaxLossRatio of them were lost
//     (refused by the index or undecodable; skips by design do not count);
//   - healthy otherwise.
//
// A rank that is not healthy is not trusted: its index matches are replaced by
// those of a per-model kvindex.Approx holding the bookings made on untrusted
// ranks (with Config.RouterTTL), so it is routed as in approximate mode while
// the other ranks stay on their events; it returns to its events as soon as a
// check finds its feed healthy (a silent feed by publishing again, a
// mis-speaking one by getting at least FeedTrust.MinStores stores within the
// window, most of them applied: silence alone does not heal it). Changes of state are logged (WARN when trust is
// lost, then once a minute while it lasts; INFO when it returns).
//
// Token parity: one booking in FeedTrust.ParityEvery per rank is sampled. The
// event index reports the router keys of every run it stores (kvindex
// Options.OnStored), which marks the sample's blocks the engine stored;
// FeedTrust.ParityDelay after the booking's PrefillComplete, the share of the
// request's blocks that the rank held at booking, stored since, or holds now
// is one parity sample (so evictions after the store do not count against
// it; a booking freed before its first output is not judged). The mean of the
// last 16 is FeedHealth.Parity; a mean below FeedTrust.ParityThreshold (after
// ParityMinSamples samples) is logged once a minute: router and engine
// tokenise, template, block or salt differently, and prefix matches on that
// rank are wrong. Parity is reported, not acted on. FeedTrust.Off turns all of
// this off.
//
// # Observability
//
// A Recorder (SelectionServiceBuilder.Recorder) hears of every decision and
// rejection, a Tracer of every decision call as a span with the caller's
// context; neither is called under a lock. Without them nothing is spent on
// either: Decision.Margin, the gap to the next-cheapest candidate, is
// computed only when one is set.
//
// # Index snapshots
//
// WriteSnapshot writes every model's index with each event source's
// last applied batch, read at one cut: the feed hands every batch and reset
// to the handler through a gate, under its read lock, and the cut takes it
// for writing while it copies the indexes, so no batch is half applied and
// the numbers match the entries exactly. EventPlane.LoadSnapshot, on a joining
// replica, replaces each recorded source's entries by the snapshot's on the
// source's own feed goroutine and resumes its feed from the recorded batch
// (kvevents.Feed.ResumeSource): the engine's replay brings the rest, applied
// again in order onto the snapshot, so the index ends equal to the peer's.
// Package replica uses the pair for its warm start.
//
// # Concurrency
//
// SelectionService is safe for concurrent use. Decisions of one model run in
// parallel without queueing (see Request path) and under the model's lock with
// it; a change to the model's workers takes that lock exclusively, so no booking
// lands on a rank the change removed. Index lookups and event application use
// the index's own lock; the ledger has its own read-write lock, shared by the
// load reads of concurrent decisions. Build starts the KV-event feed, the feed
// checker and the expiry sweeper; Close stops them and waits. The booking path
// touches a rank's feed state through atomics only (and never the cut gate,
// which only event batches and EventPlane.WriteSnapshot take) (and a mutex for one
// booking in FeedTrust.ParityEvery). The ledger's hooks (a load dropped, a load raised) never take a
// lock a ledger caller may hold: only the model's cost-order mutex, a leaf
// lock held for one rank's move between groups (sparse.go).
//
// # Invariants
//
//   - A request is only ever routed to a schedulable worker of its own model.
//   - After DeleteWorker nothing routes to the worker, its event sources are
//     stopped, and neither index blocks nor active load of it remain.
//   - Every booking is settled exactly once: freed, expired, or dropped with its
//     worker; loads never go negative.
package selection
