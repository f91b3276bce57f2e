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
//	AddOutputBlocks  its generated output fills more blocks (one per block size of tokens)
//	Move             all of it moved to another worker rank (the request was served elsewhere)
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
// and Touch take the current time from the injected Options.Now; Expire takes the
// time as an argument. The owner
// (the selection service) calls Expire from a sweeper that ticks at a fixed
// interval (every second by default, SelectionServiceBuilder.SweepInterval).
//
// # Prefill clock
//
// Each worker rank also keeps what a cost that predicts time needs
// (PrefillClock): when it began the prefill it is serving (the Book that
// found its prefill queue empty, or the last PrefillComplete that left some
// queued), its calibrated rate and slowness (below), and its recent arrivals
// (Arrivals): each Book adds one, decaying with time constant
// Options.ArrivalWindow, so that a cost can see which ranks take more than
// their share of the requests.
//
// # Calibration
//
// Every booking's time to first token (Book to PrefillComplete, on the
// injected clock) is fitted, fleet-wide, against what its rank held when it
// was booked: the prefill tokens queued there (Q), the requests active there
// (R) and its own prefill tokens (U), as Overhead + QueuedToken x Q +
// ActiveRequest x R + OwnToken x U (Calibration). The fit is a
// least-squares regression whose samples decay (a memory of about 512
// completions), weighted by Huber's rule against the recent mean absolute
// residual (one stalled request barely moves it), with coefficients kept >=
// 0 and a prior of 1/Options.PrefillRate seconds per token, queued or own,
// that decides until CalibrationSamples completions are fitted and then
// fades. The fit is Ready, to be used, once those are fitted and its
// own-token price is more than CalibrationEvidence standard errors: where
// the times' noise hides the tokens (a starved host's scheduling jitter of
// tens of milliseconds against a prefill of a few), the fit finds tokens
// free, and a cost that believed it would price a cached prefix at nothing
// and route by request counts alone. Each rank then learns its slowness, how its token times compare
// with the fleet's, by least squares through the fleet's overhead and
// request terms from its own last dozen or so completions; it is reported
// once SlownessSamples of them had token times at least the overhead, the
// evidence that separates a rank's speed from the fixed cost every request
// pays. A fixed cost per request (HTTP, scheduling, the first decode step)
// is thus the intercept, not a lower rate for the rank whose requests are
// mostly cached; an engine that never makes a request wait for another
// fits QueuedToken near 0; an engine that batches several prefills fits the
// price a queued token really has. A booking that moved teaches nothing,
// nor does one freed, expired or removed before its prefill completed.
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
// AppendRankLoads, the hot-path read, therefore looks each of the request's
// hashes up once, whatever the number of candidates, and credits every holder;
// answering for 64 candidates costs one pass over the request plus a few atomic
// reads per candidate, through handles resolved once by AppendRanks
// (AppendLoads adds a lookup by name per candidate). Book costs one index lookup per hash, Free one reference-count
// decrement per hash (it reuses the entries Book found), and neither anything
// per private block; a hash active on many worker ranks (a shared system prompt)
// finds its holder by binary search. A block whose last booking goes stays in
// the index as an idle entry, since the same prefix is often booked again soon;
// each stripe lists the entries that go idle and, once it has more than 2048
// idle ones, removes those still idle together (a cost per idle entry, whatever
// the live ones). Leases are ordered per worker rank in a B-tree by deadline, so
// Expire costs one look per worker rank plus what it settles, and
// never scan live bookings.
//
// Memory follows the live bookings: a booking disappears when it is settled and
// the index holds the live blocks plus at most 2048 idle ones per stripe. A
// worker rank's load entry (a few hundred bytes) is made by its first Book or by
// AppendRanks and kept, empty, until RemoveWorker of its worker, so the number
// of entries is the number of worker ranks in use, not of bookings. Buffers kept
// for reuse (index slots, pooled hash lists) are bounded by the peak of live
// bookings.
//
// # Concurrency
//
// A Ledger is safe for concurrent use, and calls on different worker ranks run
// in parallel. There is no ledger-wide lock on the request path. Each worker
// rank's entry has a mutex that its Book, settlements (Free, Expire,
// RemoveWorker), PrefillComplete and Touch hold, so bookings on one worker rank
// are serialised and bookings on different ones are not. The block index is
// split into 8 stripes by hash, each with its own mutex; Book and Free take the
// stripes of their hashes one at a time (a booking's hashes are kept grouped by
// stripe), and the reads likewise. Reservation ids map to bookings through 32
// independently locked stripes. A registry of worker ranks is read-locked for
// lookups and write-locked only to add or remove an entry or a slot. Locks are taken in
// one order (worker rank, then id stripe, then block stripe; the registry is
// never held while waiting for a worker rank), so calls cannot deadlock. Every
// critical section is short and bounded (a stripe's share of one booking's
// hashes at most), copies of the caller's slices are made outside them, and
// Stats reads atomic counters. Options.OnChange runs after the locks are
// released, on the goroutine of the call that lowered the load; it must not
// block, and it may call back into the Ledger. Nothing in this package starts a
// goroutine.
//
// Read, decide, book without a lock around the three: AppendRankLoads (and
// AppendLoads) reads each candidate's load without its lock and stamps what it
// read (the worker rank's entry and a sequence number that every Book
// advances, odd while the Book is changing it), and BookAt books only if the
// chosen worker rank's entry and sequence number are still the ones stamped
// (ErrStale otherwise). Loads rise only through Book, so the rank chosen as the
// cheapest is still no dearer than it looked, and every other candidate is at
// least as dear as it looked or became cheaper only through settlements the
// decision may be ordered before: a decision BookAt accepts is one that some
// serial order of the concurrent calls would have made. This is the one place
// the argument is made; the selection service relies on it and retries on
// ErrStale. A candidate read while a Book or a settlement was changing it may
// be seen part-way; its load then lies between its loads before and after that
// call, and BookAt refuses a booking on a candidate whose Book was under way.
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
//     the sequence hashes of the live bookings, never a private block, each in
//     the stripe its bits select; a stripe's idle entries number at most 2048;
//   - no field is ever negative, and w appears in Loads only while it has a live
//     booking;
//   - PrefillClock(w).Since is non-zero exactly while Load(w).ActivePrefillTokens
//     is above zero.
//
// Every booking is settled exactly once, by Free, Expire or RemoveWorker;
// Stats().Booked always equals Active + Freed + Expired + Removed once the calls in
// flight have returned.
package reservation
