// Package policies holds policy seams (package selection's Filter and
// CostTerm) that a custom Endpoint Picker can use as they are or copy, and
// that the reference EPP turns on by configuration: LoRA-adapter affinity.
//
// # LoRA adapters
//
// vLLM and SGLang serve a LoRA adapter on top of the base model when a
// request names the adapter in its "model" field; an engine loads adapters
// at start (vLLM's --lora-modules, SGLang's --lora-paths) or at run time
// (POST /v1/load_lora_adapter), and runs a request for an adapter it has not
// loaded only after loading it, if it can. Routing a request to a worker
// that has its adapter loaded avoids that. Adapters knows which workers have
// which adapters, from their labels: a worker has adapter A loaded when its
// label DefaultLabelPrefix+A (or another prefix) is "true". Whoever loads
// adapters (an operator, a controller calling the engines' load endpoint)
// labels the pods; the reference EPP's discovery copies pod labels into
// catalog.Worker.Labels, and the EPP gives each discovery snapshot to
// Adapters.Update. (GAIE's and llm-d's LoRA affinity read the engines'
// vllm:lora_requests_info gauge instead; kvselect scrapes no engine metrics.)
//
// On Adapters, two seams that read the request's selection.Request.LoRAName:
//
//   - LoRAFilter requires the adapter: only the workers that have it may
//     serve the request (none: the request is refused, "filtered:" and the
//     filter's name);
//   - LoRAAffinity prefers them: a worker that has it costs less, by Blocks
//     under Dynamo's cost or Seconds under the predictive one, so that the
//     preference trades against prefix reuse and load.
//
// Both are scoped (selection.ScopedFilter, selection.ScopedCostTerm): their
// scope is the adapter's holders, so that a large fleet keeps the sparse
// decision. A request without an adapter passes both untouched.
//
// # Concurrency
//
// Adapters is safe for concurrent use: Update replaces an immutable index
// that readers load atomically, so the seams never block on it. LoRAFilter
// and LoRAAffinity only read; they are safe for concurrent use once built.
// Nothing here starts a goroutine.
//
// # Invariants
//
//   - With LoRAFilter, a request for an adapter is only routed to a worker
//     whose label said it had the adapter loaded, in the index of the last
//     Update before the decision (or of the one before it, for a decision
//     an Update overtakes).
//   - A request without an adapter is admitted everywhere and priced 0.
package policies
