// Package roles routes disaggregated serving: one pool of workers split by a
// role label into prefill workers and decode workers, each role with its own
// SelectionService, and every request booked as a (prefill, decode) pair that
// is either fully booked or not booked at all.
//
// # Pieces
//
//	Role, TopologyMode     aggregated | prefill | decode; aggregated | disaggregated
//	                       (ParseTopologyMode reads a setting)
//	Split                  one desired worker set -> disjoint per-role sets + excluded workers with reasons
//	                       (the role label key, default DefaultRoleLabel, must be a Kubernetes label key)
//	RoleSelectors          owns one SelectionService per role, each configured from one base Config
//	                       (below), and reconciles each from the split
//	PairBooker             books both legs of a request concurrently, compensates failures,
//	                       keeps the plans (the plan table, plans.go) and expires the abandoned
//	Plan                   a booked request and its handle (a lifecycle.Handle): PrefillComplete,
//	                       Renew, Generated, Move, MarkFailed, Done
//
// In aggregated mode labels are never read: every worker is Aggregated, there is
// one service, and a PairBooker books that service alone, so an EPP can use the
// same calls in both modes.
//
// In disaggregated mode a worker's label value, trimmed and compared without
// ASCII case, must be "prefill" or "decode"; a missing label excludes it as
// role_label_missing and any other value ("aggregated" and "both" included) as
// role_label_invalid. There is no fallback role.
//
// The prefill service keeps the base configuration (KV events on). The decode
// service runs without KV events (its workers lose their event and replay
// endpoints, so they are schedulable without them), with overlap credit 0, no
// assumed KV reuse and no prefill-token tracking: in its Config, and again as an
// Override merged over every decode selection and booking.
//
// # A request's life
//
//	Book      plan p: "p/prefill" on the prefill service and "p/decode" on the decode
//	          service, concurrently; both booked -> plan registered and returned
//	PrefillComplete  first response byte: free "p/prefill", mark "p/decode" prefill-complete
//	Renew            while the response flows: extend the plan's lease and its legs' leases
//	Generated        output tokens so far: grow "p/decode" by one block per block size not yet
//	                 counted
//	Move             the gateway served another destination worker: move "p/decode" there
//	                 (load, lease, output blocks, session pin); "p/prefill" stays
//	MarkFailed       the destination worker (or the one moved to) failed the request: the
//	                 destination service leaves it out of its picks for a while
//	Done             end of stream, error or cancel: free "p/decode" (and "p/prefill" if not
//	                 handed off); the plan is gone
//	Expire           Done for every plan whose lease ran out (the booker's sweeper)
//
// The EPP sends the request to Plan.Destination() and passes Plan.PrefillHint()
// as x-prefiller-host-port; with Request.Fallbacks, Plan.Decode.Fallbacks are
// the other destinations a gateway may try (the prefill leg computes none),
// and Move follows the one that served. When the prefill role cannot take a
// request (no ready worker, none allowed, queue full)
// BookerOptions.PrefillFallback decides: fail (the default) or book one decode
// worker alone as "p/aggregated", with prefill tracking on, and no prefill
// hint.
//
// # Concurrency
//
// RoleSelectors, PairBooker and the plan table (plans.go) are safe for concurrent use.
// RoleSelectors.Reconcile calls are serialised; bookings run concurrently with
// them and with each other, each service using its own locks. Book runs the
// decode leg on an errgroup goroutine and the prefill leg on its own, and
// returns only after both have returned, so no leg outlives it. The services' own goroutines (KV-event feed,
// expiry sweeper) belong to the RoleSelectors, whose Close stops and waits for
// them; the PairBooker's one goroutine is its plan sweeper
// (BookerOptions.ExpireEvery), which its Close stops and waits for.
//
// # Invariants
//
//   - The destination is always a worker of the destination role (Decode, or
//     Aggregated in aggregated mode). An empty decode role is
//     ErrRoleCatalogEmpty (HTTP 503), never a prefill worker.
//   - A prefill worker is only ever a hint: it appears in Plan.Prefill, never in
//     Plan.Decode.
//   - No half-booked plan survives: Book returns a plan whose legs are all
//     booked and registered, or an error after freeing every leg it booked,
//     including a leg that finished booking after a failure, timeout or
//     cancellation of the other.
//   - A worker is in at most one role catalog at any time; after a Reconcile it
//     is in exactly the catalog its label names, or in none.
//   - Every plan leg is freed exactly once through the plan (Done, or
//     PrefillComplete for the prefill leg, or Expire); a leg already gone from
//     its service (expired, or dropped with its worker) is treated as freed.
package roles
