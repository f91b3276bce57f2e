// Package reservation keeps the active load of every worker rank: what the router
// has already sent each one and not yet seen finish.
//
// A Ledger records a Booking for every request the router dispatches: which worker
// rank got it, the request's block sequence hashes, how many blocks it holds
// privately, how many prompt tokens the worker still has to prefill (the prompt
// length minus what it had cached) and a lease. The selection package reads the resulting Load of each candidate (active
// prefill tokens, active blocks, active requests) and the number of the request's
// blocks a candidate does not already have active, and feeds them to its cost
// function. The request's life then settles the booking:
//
//	Book             one active request, its prefill tokens and its blocks added
//	PrefillComplete  its prefill tokens removed (the first response byte arrived)
//	Free             everything it added removed (the response ended, failed or was cancelled)
//	Expire           Free for every booking whose lease ran out (an owner that died mid-request)
//	RemoveWorker     Free for every booking on a deleted worker
//
// Blocks named by sequence hashes are reference-counted per worker rank, so
// requests that share a prompt prefix share its blocks. Blocks no other request
// can share (a partial last block, or every block when the engine does not reuse
// blocks across requests) are booked as a count, Booking.PrivateBlocks, and never
// named. A worker rank's active block count is the number of distinct sequence
// hashes over its live bookings plus the sum of their private blocks.
//
// # Time
//
// The ledger never starts a timer and never reads the wall clock directly. Book
// and Touch take the current time from the injected Clock; Expire takes the time
// as an argument, and NextExpiry tells an owner when to call it next. The owner
// (the selection service) runs the sweeper.
//
// # Errors
//
// Book reports ErrInvalid for a malformed booking and ErrConflict for an id that
// is already booked; BookAt also ErrStale. PrefillComplete, Free and Touch report ErrUnknownReservation
// for an id that is not booked, which includes one that was already freed,
// expired or removed with its worker; such calls change nothing, so a double free
// is harmless. New reports ErrInvalidOptions. Every error wraps its sentinel with
// the id and worker concerned.
//
// # Structure and cost
//
// Active blocks are kept in one inverted index, sequence hash -> the worker ranks
// holding it with a reference count each, rather than one set per worker rank.
// AppendLoads, the hot-path read, therefore looks each of the request's hashes up
// once, whatever the number of candidates, and credits every holder; answering
// for 64 candidates costs one pass over the request plus 64 worker lookups. Book
// costs one index lookup per hash, Free one reference-count decrement per hash
// (it reuses the entries Book found), and neither anything per private block; a
// hash active on many worker ranks (a shared system prompt) finds its holder by
// binary search. A block whose last booking goes stays in the index as an idle
// entry, since the same prefix is usually booked again soon; idle entries are
// swept out together once there are more than 1024 of them and more than live
// ones. Leases are ordered in a B-tree by deadline, so Expire and NextExpiry
// never scan live bookings.
//
// Memory follows the live bookings: a worker rank's entry and a booking
// disappear when their last booking is settled, and the index holds at most
// twice the live blocks plus 1024 idle ones. Buffers kept for reuse (index
// slots, pooled bookings, spare worker entries) are bounded by the peak of live
// bookings, and the index's hash table, above 4096 slots, halves whenever it
// falls under 1/16 full.
//
// # Concurrency
//
// A Ledger is safe for concurrent use. One read-write mutex guards all of its
// state: calls that change it hold it exclusively, the reads (AppendLoads,
// NewBlocks, Load, Loads, Get, NextExpiry) share it, so the candidate
// evaluations of concurrent requests run in parallel. Every method holds it for
// a short, bounded critical section (Book and Free cost the booking's sequence
// hashes, AppendLoads the request's sequence hashes plus the candidates, Expire
// and RemoveWorker the bookings they settle), and copies of the caller's slices
// are made outside it. Stats reads atomic counters without the lock.
// Options.OnChange runs after the lock is released, on the goroutine of the call
// that lowered the load; it must not block, and it may call back into the
// Ledger. Nothing in this package starts a goroutine.
//
// Read, decide, book without a lock around the three: AppendLoads stamps what
// it read, and BookAt books only if the chosen worker rank was not booked after
// that stamp (ErrStale otherwise). Because only Book raises a load, a decision
// BookAt accepts is one that some serial order of the concurrent calls would
// have made; the selection service retries on ErrStale.
//
// # Invariants
//
// After every method returns, for every worker rank w:
//
//   - Load(w).ActiveRequests is the number of live bookings on w;
//   - Load(w).ActivePrefillTokens is the sum of PrefillTokens over the live
//     bookings on w whose prefill is not complete;
//   - Load(w).ActiveBlocks is the number of distinct sequence hashes over the live
//     bookings on w plus the sum of PrivateBlocks over the live bookings on w
//     (each booking's private blocks are added by Book and removed exactly once,
//     when Free, Expire or RemoveWorker settles it);
//   - the shared block index's live entries (those with a holder) are exactly
//     the sequence hashes of the live bookings, never a private block; its
//     idle entries number at most 1024 or the live ones;
//   - no field is ever negative, and w has an entry (in Loads) only while it has a
//     live booking, so memory follows the live bookings under any churn.
//
// Every booking is settled exactly once, by Free, Expire or RemoveWorker;
// Stats().Booked always equals Active + Freed + Expired + Removed once the calls in
// flight have returned.
package reservation
