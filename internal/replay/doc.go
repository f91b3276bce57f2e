// Package replay measures routing policies by replaying a request trace against
// simulated workers: how much prefix cache each policy reuses, how evenly it
// spreads requests, and what that does to time to first token.
//
// One job: given a []trace.Request, a Policy and Options, Run returns a Result
// (block-weighted hit rate, the reachable hit rate of one infinite shared
// cache, request imbalance max/mean, TTFT p50/p90/p99, makespan, wall time),
// for one router or for several replicas of it (see Replicas).
//
// # Workers
//
// Each of Options.Workers simulated engines holds an LRU prefix cache of
// CapacityBlocks trace blocks. A request's blocks are touched from the last to
// the first, so a block is always more recent than its cached descendants and
// eviction takes sequence tails before their prefixes (vLLM's order); what a
// worker holds of any sequence is therefore a leading run. When a prefill ends
// the worker stores the request's blocks and, for the kvselect policy, emits
// exactly what an engine would: a BlockRemoved event for the blocks it evicted
// to make room, then a BlockStored event for the new run with its parent's
// block hash and its tokens. The router's kvindex.Index is built from nothing
// else.
//
// # Granularity
//
// The simulation runs at the trace's granularity: one trace block (512 tokens
// in the Mooncake traces) is one router token, and the router's block size is 1.
// Each block's token is its dense prefix id (trace.PrefixTree), so equal prefixes
// give equal tokens and the index's chained hashes identify prefixes exactly,
// with no per-token work: the full Mooncake synthetic trace replays in well under
// a second per policy. Every term of kvselect's cost is then in trace blocks,
// which is the same cost a 512-token-block deployment computes (its prefill
// term divides tokens by the block size), except that a partial last block
// counts as a whole one. Time uses real token counts: a prefill computes
// InputTokens minus 512 per cached block.
//
// # Time model
//
// A discrete-event simulation in simulated time. Arrivals come from the trace
// (divided by Speedup). The router decides at arrival (for kvselect,
// SelectAndReserve with the service's clock set to simulated time). Each
// worker runs the engine model of internal/enginemodel, the one the fake
// engines run in real time (vLLM V1's scheduler): a request is schedulable
// RequestOverhead after it arrives; steps have a budget of MaxBatchedTokens
// tokens and at most MaxRunning requests hold a seat; each step serves the
// running requests first (one token per decoding request, the next chunk of a
// prompt being computed), then admits waiting ones in arrival order, so that
// several prompts prefill in one step and a long one spans several. The
// cached prefix is read from the worker's cache when a request is first
// scheduled. A step lasts StepBase + 1/PrefillTokensPerSecond per prompt
// token + (DecodeTokenTime - StepBase) per decoding request, divided by the
// worker's speed (Speeds); by default StepBase is all of DecodeTokenTime, so
// a batch of decodes costs one request's token time and a step that prefills
// costs that much on top of its tokens. A request's first token (TTFT,
// queueing included) comes at the end of the step that completes its
// prompt, which is also when its blocks are stored and the router hears
// PrefillComplete; it then gets one token per step until OutputTokens, when
// its seat frees and the router hears Reservations.Free. Decode and prefill
// share steps, so each slows the other. Events at equal times run in the
// order they were scheduled, and an engine that ends a step acts on its
// events before it begins the next, so replays are deterministic for a seed.
//
// With Options.DecodeHoldsKV, a running request's output takes cache space
// as it is generated, one block per BlockSize tokens, until it finishes (the
// prefix cache is what running requests leave free, as in vLLM): the
// evictions it forces reach the router as BlockRemoved events. With
// Options.OutputGrowth the kvselect policies hear each such block as
// Reservations.AddOutputBlocks, so the booking grows. The figures that follow
// were measured with the previous time model, in which decode did not slow
// prefill and growth could only move requests; on the command's synthetic
// workload with 4,096 output tokens (8 workers, 500
// blocks each, decode holding KV, 2 req/s; medians of seeds 1-5) it lowered
// the hit rate from 0.825 to 0.748 and raised TTFT p90 from 0.13 s to 0.92 s
// under Dynamo's cost, whose decode term then outweighs a cached prefix, and
// under the predictive cost without its balance term kept the hit rate
// (0.826, 0.827) and lowered p90 from 0.13 s to 0.11 s (with the balance
// term: 0.831 to 0.822, p90 0.10 s to 0.15 s, within this workload's seed
// noise; docs/ROUTING.md); the reference EPP grows bookings with the
// predictive cost only.
//
// # Policies
//
// kvselect and kvselect-approx drive the real selection.SelectionService;
// round-robin, random, least-loaded and max-overlap-only are implemented here
// (max-overlap-only reads the simulated caches directly: the best a policy
// without a load term can do).
//
// # Replicas
//
// With Options.Replicas R > 1 the kvselect policies are R router replicas, as
// behind one gateway: R SelectionServices with the same configuration and
// workers, each with its own ledger and random stream, and every engine's KV
// events applied to all of them (each replica subscribes to every engine).
// Arrival i goes to replica i mod R, round-robin as Envoy's default load
// balancer spreads requests over the Endpoint Pickers behind it; round-robin
// rather than random also makes consecutive requests always land on different
// replicas, the hardest case for replicas that do not share their load. The
// replica that booked a request hears its PrefillComplete and Reservations.Free.
// Each service's selection.BookingObserver puts every booking and settling call
// in the simulator's event queue, and SyncDelay of simulated time later the
// other replicas apply it (ReplicaPlane.Book, ReplicaPlane.Settle), as package replica would
// deliver it; one delay for all, so a booking always reaches a peer before its
// settling calls. NoSync delivers nothing: each replica carries only its own
// bookings. With R = 1 nothing changes: no observer, no extra event.
//
// On the command's synthetic workload at 12 req/s (8 workers, seed 1, the
// default cost; figures of the time model before internal/enginemodel),
// R = 3 with sync reaches the hit rate of one router (0.830 against 0.829)
// and its TTFT p99 (1.44 s against 1.43 s). Without sync,
// kvselect still knows every prefix (the events reach every replica) but
// each replica sees a third of the load, so requests pile up: TTFT p90 0.99 s
// against 0.59 s, p99 2.6 s against 1.4 s. kvselect-approx, whose index is
// its own bookings, also loses the prefixes the others routed: hit rate 0.72
// against 0.83, TTFT p90 2.0 s (TestReplicasWithSyncMatchOneRouter).
//
// # Concurrency
//
// Run is safe to call concurrently with independent arguments; one replay runs
// on the calling goroutine and closes the SelectionServices it builds before
// returning.
package replay
