package catalog_test

import (
	"fmt"

	"github.com/kvselect/kvselect/catalog"
)

// Reconcile a desired set of workers (as discovery produces them) into a
// catalog: plan, apply the deletes and then the upserts, and print each
// record's lifecycle.
func Example() {
	cat := catalog.New(catalog.Options{
		Requirements: catalog.Requirements{KVEvents: true, Queueing: true},
	})
	desired := []catalog.Worker{
		{
			ID: "ns/vllm-0", Model: "llama", Endpoint: "10.0.0.5:8000",
			DPSize: 1, KVEventEndpoints: map[int]string{0: "tcp://10.0.0.5:5557"},
			BlockSize: 16, MaxNumBatchedTokens: 8192,
		},
		{
			// Two data-parallel ranks; rank 1 has no event endpoint yet.
			ID: "ns/vllm-1", Model: "llama", Endpoint: "10.0.0.6:8000",
			DPSize: 2, KVEventEndpoints: map[int]string{0: "tcp://10.0.0.6:5557"},
			BlockSize: 16, MaxNumBatchedTokens: 8192,
		},
		{ID: "ns/vllm-2", Model: "llama", Endpoint: "http://10.0.0.7:8000"}, // malformed
	}
	plan, err := catalog.Reconcile(cat.List(), desired)
	if err != nil {
		panic(err)
	}
	for _, id := range plan.Deletes {
		if _, err := cat.Delete(id); err != nil {
			panic(err)
		}
	}
	for _, w := range plan.Upserts {
		if _, err := cat.Upsert(w); err != nil {
			panic(err)
		}
	}
	for _, inv := range plan.Invalid {
		fmt.Println("skipped", inv.ID)
	}
	for _, r := range cat.List() {
		fmt.Println(r.Worker.ID, r.Lifecycle, r.Reasons)
	}
	fmt.Println("schedulable:", len(cat.Schedulable("llama")))
	// Output:
	// skipped ns/vllm-2
	// ns/vllm-0 schedulable []
	// ns/vllm-1 incomplete [kv_event_endpoint_missing:rank=1]
	// schedulable: 1
}

// Draining takes a worker out of rotation; Delete leaves nothing routable.
func ExampleCatalog_SetDraining() {
	var cat catalog.Catalog // the zero value: no KV events, no queueing
	w := catalog.Worker{ID: "w", Endpoint: "10.0.0.5:8000", DPSize: 1, BlockSize: 16}
	r, _ := cat.Upsert(w)
	fmt.Println(r.Lifecycle, r.Reasons)
	r, _ = cat.SetDraining("w", true)
	fmt.Println(r.Lifecycle, r.Reasons)
	r, _ = cat.Delete("w")
	fmt.Println(r.Lifecycle, r.Reasons, len(cat.List()))
	// Output:
	// schedulable []
	// draining [draining]
	// unschedulable [deleted] 0
}

// Check a desired set as a whole against a rank limit before applying any of
// it: a DPSize past MaxDPSize counts as MaxDPSize, as Ranks clamps it.
func ExampleTotalRanks() {
	desired := []catalog.Worker{
		{ID: "a", DPSize: 1},
		{ID: "b", DPSize: 8},
		{ID: "c", DPSize: catalog.MaxDPSize + 100},
	}
	n := catalog.TotalRanks(desired)
	fmt.Println(n, n <= catalog.DefaultMaxRanks)
	// Output:
	// 4105 true
}
