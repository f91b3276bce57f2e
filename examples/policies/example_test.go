package policies_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/policies"
	"github.com/kvselect/kvselect/selection"
)

// fleet builds b's service over three workers, as discovery would see them:
// pod-a and pod-c label adapter sql-lora loaded, pod-b labels it unloaded
// (an operator unloaded it). adapters is updated from the same snapshot.
func fleet(b *selection.SelectionServiceBuilder, adapters *policies.Adapters) *selection.SelectionService {
	svc, err := b.ExternalEvents().Rand(rand.NewPCG(3, 3)).Build(context.Background())
	if err != nil {
		panic(err)
	}
	ws := []catalog.Worker{
		{ID: "pod-a", Endpoint: "10.0.0.1:8000", DPSize: 1, Labels: map[string]string{"lora.kvselect.io/sql-lora": "true"}},
		{ID: "pod-b", Endpoint: "10.0.0.2:8000", DPSize: 1, Labels: map[string]string{"lora.kvselect.io/sql-lora": "false"}},
		{ID: "pod-c", Endpoint: "10.0.0.3:8000", DPSize: 1, Labels: map[string]string{"lora.kvselect.io/sql-lora": "true"}},
	}
	for _, w := range ws {
		if _, err := svc.Workers().Upsert(w); err != nil {
			panic(err)
		}
	}
	adapters.Update(ws)
	return svc
}

// Adapters reads the adapters each worker has loaded from its labels.
func ExampleAdapters() {
	adapters, _ := policies.NewAdapters("") // lora.kvselect.io/<adapter>=true
	adapters.Update([]catalog.Worker{
		{ID: "pod-b", Labels: map[string]string{"lora.kvselect.io/sql-lora": "true", "lora.kvselect.io/chat-lora": "true"}},
		{ID: "pod-a", Labels: map[string]string{"lora.kvselect.io/sql-lora": "true", "app": "vllm"}},
	})
	fmt.Println(adapters.AppendHolders(nil, "sql-lora"), adapters.Loaded("chat-lora", "pod-a"))
	_, err := policies.NewAdapters("not a prefix/")
	fmt.Println(errors.Is(err, policies.ErrLabelPrefix))
	// Output:
	// [pod-a pod-b] false
	// true
}

// LoRAFilter requires the request's adapter: pod-b never serves sql-lora,
// and an adapter no worker has is refused with the filter's name.
func ExampleLoRAFilter() {
	adapters, _ := policies.NewAdapters(policies.DefaultLabelPrefix)
	b := selection.NewSelectionServiceBuilder(selection.DefaultConfig(16)).Filter("lora", policies.LoRAFilter{Adapters: adapters})
	svc := fleet(b, adapters)
	defer svc.Close()
	ctx := context.Background()
	served := map[string]int{}
	for range 20 {
		res, err := svc.Select(ctx, selection.Request{ISL: 512, LoRAName: "sql-lora"})
		if err != nil {
			panic(err)
		}
		served[res.WorkerID]++
	}
	fmt.Println("sql-lora served by pod-b:", served["pod-b"])
	_, err := svc.Select(ctx, selection.Request{ISL: 512, LoRAName: "chat-lora"})
	fmt.Println("chat-lora:", selection.RefusalReason(err), selection.HTTPStatus(err))
	res, _ := svc.Select(ctx, selection.Request{ISL: 512}) // the base model: anywhere
	fmt.Println("base model served:", res.WorkerID != "")
	// Output:
	// sql-lora served by pod-b: 0
	// chat-lora: filtered:lora 503
	// base model served: true
}

// LoRAAffinity prefers the adapter's holders, in the cost's own unit: here
// pod-b, which has no adapter, is idle while the holders each run 2
// requests, and the preference (32 blocks) outweighs that load.
func ExampleLoRAAffinity() {
	adapters, _ := policies.NewAdapters("")
	affinity := policies.LoRAAffinity{Adapters: adapters, Blocks: policies.DefaultAffinityBlocks, Seconds: policies.DefaultAffinitySeconds}
	cfg := selection.DefaultConfig(16)
	cfg.Cost = selection.CostDynamo
	svc := fleet(selection.NewSelectionServiceBuilder(cfg).CostTerm("lora-affinity", affinity), adapters)
	defer svc.Close()
	ctx := context.Background()
	for i := range 4 { // load the holders
		worker := []string{"pod-a", "pod-c"}[i%2]
		if _, err := svc.SelectAndReserve(ctx, selection.Request{ISL: 64, Allowed: []string{worker}}); err != nil {
			panic(err)
		}
	}
	res, _ := svc.Select(ctx, selection.Request{ISL: 64, LoRAName: "sql-lora"})
	fmt.Println("sql-lora:", res.WorkerID == "pod-a" || res.WorkerID == "pod-c")
	res, _ = svc.Select(ctx, selection.Request{ISL: 64})
	fmt.Println("base model:", res.WorkerID)
	// Output:
	// sql-lora: true
	// base model: pod-b
}
