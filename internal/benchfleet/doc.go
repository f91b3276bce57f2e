// Package benchfleet warms a selection service for the benchmarks of
// packages selection and replica: workers whose indexed prompts share a few
// system prompts, as a fleet serving a handful of applications holds them, so
// that lookups walk real shared prefixes.
//
// One job: Warm registers the workers of a Fleet on a Service (the two
// methods of selection.SelectionService it calls) and stores their prompts
// through Events().Apply, then returns prompts to route: each worker's first
// cached prompt and Fleet.Fresh new ones on the known system prompts.
//
// Concurrency: Warm calls the Service from the calling goroutine only; it
// starts none.
//
// Invariants: equal Fleets give equal workers, hashes and prompts (every
// random choice is seeded); every stored block has an engine hash of its
// own, so prompts share blocks only through their tokens, which the index
// hashes itself.
package benchfleet
