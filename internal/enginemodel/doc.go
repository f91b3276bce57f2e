// Package enginemodel is a deterministic model of one inference engine's
// scheduler, the time model that internal/fakeengine runs in real time and
// the replay simulator (internal/replay) runs in simulated time, so that what
// is tuned in a replay holds on the demo's engines.
//
// One job: given the requests added to an engine and when, say when each one
// gets its first token, each later token, and when it leaves. It has no
// goroutine and no clock: the caller passes times as offsets from an origin of
// its choosing (time.Duration), asks Next when something happens next, and
// calls Advance to get there.
//
// # The model
//
// It follows vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py), which has
// no separate prefill and decode phases: each step hands out a token budget.
//
//   - A request is schedulable RequestOverhead after it is added (HTTP,
//     tokenization, the trip to the engine core).
//   - Each step has a budget of MaxBatchedTokens tokens (vLLM's
//     max_num_batched_tokens). The running requests are served first, in the
//     order they were admitted: one that decodes takes 1 token of the budget,
//     one whose prompt is partly computed takes the rest of its prompt, or
//     what is left of the budget (chunked prefill). Then waiting requests are
//     admitted first come, first served, while budget remains and fewer than
//     MaxRunning requests (vLLM's max_num_seqs) hold a seat; each takes as much
//     of its prompt as the budget allows, so several prompts can prefill in
//     one step and a long one spans several. A waiting request that is not
//     schedulable yet does not hold back those behind it (vLLM skips a request
//     whose KV is still arriving).
//   - A step lasts (StepBase + PrefillToken x its prompt tokens + DecodeSeq x
//     its decoding requests) / Speed. Speed 1 is the nominal engine; 0.5 is
//     one twice as slow.
//   - A request's first token comes at the end of the step that computes the
//     last token of its prompt; a prompt the cache holds entirely still
//     computes one token (vLLM caps a cache hit at the prompt length minus one,
//     vllm/v1/core/kv_cache_manager.py get_computed_blocks). Each later step
//     that holds it gives it one more token; at its last output token it
//     leaves and its seat is free for the next step.
//   - Params.Cached, when set, is asked once per request, when the request is
//     first scheduled, how many prompt tokens its engine has cached (vLLM reads
//     the prefix cache at that moment, not at arrival); without it the tokens
//     given to Add are all computed.
//
// Not modelled: KV-cache capacity and preemption, speculative decoding,
// priorities, max_num_partial_prefills and long_prefill_token_threshold
// (vLLM's defaults leave them off), and SGLang's separate prefill and decode
// batches (SGLang mixes them only with --enable-mixed-chunk).
//
// # Sources
//
// Read for this package (repository, path):
//
//	vllm-project/vllm  vllm/v1/core/sched/scheduler.py   schedule(): running first, then waiting (FCFS), token budget, max_num_seqs
//	vllm-project/vllm  vllm/v1/core/kv_cache_manager.py  get_computed_blocks: a full hit still computes the last token
//	vllm-project/vllm  vllm/engine/arg_utils.py          online-serving defaults: max_num_batched_tokens 8192 and max_num_seqs 1024
//	                                                     on GPUs of 70 GiB or more other than the A100 (2048 and 256 on others)
//	vllm-project/vllm  vllm/config/scheduler.py          max_num_batched_tokens, max_num_seqs: per-iteration limits
//	sgl-project/sglang python/sglang/srt/server_args.py  chunked_prefill_size, max_running_requests, schedule_policy fcfs
//	ai-dynamo/dynamo   lib/mocker/src/common/perf_model.rs  a mock engine's step times: prefill by new tokens, decode by batch
//
// The time defaults (DefaultStepBase, DefaultPrefillToken, DefaultDecodeSeq)
// are the fake engines': a small model on a fast GPU, with a prompt of a few
// hundred tokens computed in about ten milliseconds, so that a demo on a
// two-core machine times it. The replay maps its own options onto Params.
//
// # Concurrency
//
// An Engine is not safe for concurrent use: its owner serialises every call
// (fakeengine holds a mutex; the replay runs on one goroutine). Params.Cached
// is called from within Advance, on the caller's goroutine.
//
// # Invariants
//
//   - Times never go back: Advance's events are in non-decreasing time order,
//     and across calls; Add with a time before the engine's is taken at the
//     engine's time.
//   - Every added request that is not canceled gets exactly one EventFirstToken,
//     then its other tokens as EventToken (numbered 2, 3, ... up to its output
//     count), then one EventFinished, in that order; a canceled one gets
//     nothing after Cancel.
//   - A step never schedules more than MaxBatchedTokens tokens, and at most
//     MaxRunning requests hold a seat.
//   - The model is a function of its calls: the same calls give the same
//     events.
package enginemodel
