// Package trace reads and generates request traces for routing experiments: the
// Mooncake JSONL format (one request a line: arrival timestamp in milliseconds,
// prompt and output lengths in tokens, and the ids of the prompt's fixed-size
// blocks) and synthetic workloads, all as the same Request type. The
// generators (Generate, one per Workload) each model one shape of traffic:
// one-shot prompts sharing system prompts, multi-turn chat re-sending its
// history, agent loops on long shared tool prompts, RAG over documents of
// skewed popularity, on/off bursts, and a mix; each is seeded and spans
// Requests/Rate seconds in steady state.
//
// One job: turn a workload into a validated, time-ordered []Request. Replaying
// it against routing policies is package replay's job.
//
// # Block identities
//
// A request's Blocks name its prompt blocks in order; two requests that share a
// block id at the same position share that block of tokens. In the Mooncake
// traces an id also implies its whole prefix (an id always follows the same
// parent); consumers should not rely on that and should chain ids (hash the
// sequence of ids up to each block) when they need prefix identity.
//
// # Validation
//
// Reader checks every line: a JSON object with a timestamp >= 0 (milliseconds,
// integral or not), input_length >= 0, output_length >= 0, hash_ids of
// non-negative integers whose count is exactly ceil(input_length / block size),
// and timestamps that never decrease (unless AllowUnordered, in which case
// ReadAll sorts stably by arrival). A bad line is a *LineError carrying its
// 1-based line number; with SkipBad the reader counts it and moves on. Blank lines
// are ignored; unknown JSON fields are ignored.
//
// # Concurrency
//
// A Reader is not safe for concurrent use; it owns no goroutine. The generator
// functions are pure: equal configurations give equal traces.
package trace
