// Package lifecycle is the life of one booked request after its pick: one
// handle that settles it, whatever booked it, and one follower that drives
// the handle from the response as it passes.
//
// # The handle
//
// Handle is the one vocabulary of a booked request. *selection.Booking (one
// worker of one service) and roles.Plan (a prefill/decode pair, or one
// worker booked through the pair booker) implement it:
//
//	PrefillComplete  the first output byte: the prompt is computed (a plan hands off)
//	Renew            the request makes progress: extend the leases
//	Generated        the output so far, in tokens: grow the decode booking
//	Move             the request was served by another worker rank: book it there
//	MarkFailed       the worker carrying the booking failed the request
//	Done             the request ended, whatever the way: free the booking
//
// Every implementation keeps one repeat-call contract. PrefillComplete,
// MarkFailed and Done act on their first call only; a later call changes
// nothing and returns nil. After Done, PrefillComplete returns nil and
// changes nothing; Renew, Generated and Move return the implementation's
// unknown-booking error (selection.ErrUnknownReservation,
// roles.ErrUnknownPlan). A first Done on a booking whose lease already
// passed returns that error too, which needs no action.
//
// # The follower
//
// A Follower drives one Handle from one response, as the reference EPP (from
// ext_proc messages) and selection/httproute (from an http.Response) see it:
//
//   - Response: the status and content type. A status that describes the
//     worker's health (Options.FailureStatus; FailureStatus by default: 5xx
//     but 501 and 505) marks the worker failed; a 2xx event stream is
//     counted, with output growth on.
//   - Body: each chunk. The first of an answer whose status is 2xx (or
//     unknown) reports the first output; every chunk is progress; the data
//     lines of a counted stream are the output so far (one per token, as an
//     OpenAI-compatible engine streams).
//   - Served: the gateway served the request elsewhere. A fallback of the
//     pick is served only when the pick could not answer, so the pick is
//     marked failed first; the booking moves either way.
//   - Fail: the worker could not be reached, or cut its answer short.
//   - PrefillFailed: before Response, the decode sidecar said the prefill
//     leg failed (gaie.HeaderFailedLeg): the prefill worker is marked
//     (PrefillMarker, which roles.Plan implements), not the destination.
//   - Renew: the owner's tick. It renews while nothing has come yet (the
//     worker prefills, or computes an answer it does not stream) and when
//     chunks came since the tick before; a stream that went silent is not
//     renewed, so it expires at its lease.
//   - Done: the end, on every path, exactly once.
//
// The worker is marked failed at most once per follower, and
// Options.Marked hears of it with the cause.
//
// # Concurrency
//
// A Handle is safe for concurrent use. A Follower's Response, Body, Served
// and Fail are called by one goroutine at a time (the request's), in the
// order the response arrives; Renew by one goroutine at a time (the owner's
// ticker or timer), concurrently with those; Done from any goroutine, any
// number of times. The follower starts no goroutine and reads no clock: its
// owner ticks it.
package lifecycle
