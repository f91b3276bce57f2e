// Package kvselect decides which LLM inference worker should serve a request,
// using what each worker already holds in its KV cache (prefix reuse) and what it
// is already doing (active load), and books that decision so concurrent requests
// see it.
//
// It is a library: an Endpoint Picker (EPP) behind a Kubernetes Gateway, or any
// other gateway, imports it and calls it in process. No serving runtime, no
// operator, no sidecar.
//
// # Packages
//
//   - kvindex: block hashing, and the radix-tree index of which worker rank holds
//     which prefix; an approximate index for engines without KV events.
//   - kvindex/kvevents: decoding of engine KV-event batches (vLLM, SGLang,
//     TensorRT-LLM through a vLLM-compatible publisher) and the ZeroMQ feed that
//     keeps an index true across gaps, replays and restarts.
//   - selection: the SelectionService facade (cost function, picking, admission
//     queue) built by SelectionServiceBuilder. (planned)
//   - catalog, reservation, roles, tokenize: workers and their lifecycle, the
//     active-load ledger, prefill/decode pair booking, and engine-native
//     tokenization. (planned)
//   - examples/epp: a thin reference EPP over Envoy ext_proc. (planned)
//
// # Quick start
//
// Index what workers cache, then ask which worker holds the longest prefix of a
// request:
//
//	ix, _ := kvindex.New(kvindex.Options{BlockSize: 16})
//	_ = ix.Apply(kvindex.WorkerRank{Worker: "pod-a"}, kvindex.Event{
//		Kind: kvindex.EventStored, BlockHashes: engineHashes, Tokens: cachedTokens,
//	})
//	h, _ := kvindex.NewHasher(16, kvindex.HashOptions{})
//	for _, m := range ix.FindMatches(h.SeqHashes(promptTokens), kvindex.MatchOptions{}) {
//		fmt.Println(m.Worker, m.Device) // blocks of the prompt pod-a already holds
//	}
//
// In production the kvevents feed applies the engines' events, and the
// selection package combines overlap with load.
package kvselect
