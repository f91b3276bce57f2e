package selection_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/selection"
)

// policyExampleService builds b's service with three workers: pod-a (an
// H100 with the "sql" LoRA adapter loaded), pod-b (an A10 whose engine holds
// the first two blocks of examplePrompt) and pod-c (an H100); its ties break
// the same way every run.
func policyExampleService(b *selection.SelectionServiceBuilder) *selection.SelectionService {
	svc, err := b.ExternalEvents().Rand(rand.NewPCG(7, 7)).Build(context.Background())
	if err != nil {
		panic(err)
	}
	labels := []map[string]string{
		{"gpu": "h100", "lora/sql": "loaded"},
		{"gpu": "a10"},
		{"gpu": "h100"},
	}
	for i, id := range []string{"pod-a", "pod-b", "pod-c"} {
		w := catalog.Worker{ID: id, Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1), DPSize: 1, Labels: labels[i]}
		if _, err := svc.Workers().Upsert(w); err != nil {
			panic(err)
		}
	}
	_ = svc.Events().Apply(catalog.WorkerRank{WorkerID: "pod-b"}, kvindex.Event{
		Kind: kvindex.EventStored, BlockHashes: []uint64{901, 902}, Tokens: examplePrompt[:8],
	})
	return svc
}

// A filter keeps the workers that may serve a request: here, those with the
// request's LoRA adapter loaded (a label set by the EPP's discovery). When
// it keeps none, the request is refused with the filter's name.
func ExampleSelectionServiceBuilder_Filter() {
	lora := selection.FilterFunc(func(_ context.Context, req *selection.Request, c *selection.Scored) bool {
		return req.LoRAName == "" || c.Labels["lora/"+req.LoRAName] == "loaded"
	})
	svc := policyExampleService(selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).Filter("lora", lora))
	defer svc.Close()
	ctx := context.Background()

	res, _ := svc.Select(ctx, selection.Request{Tokens: examplePrompt, LoRAName: "sql"})
	fmt.Println("sql:", res.WorkerID)
	_, err := svc.Select(ctx, selection.Request{Tokens: examplePrompt, LoRAName: "chat"})
	fmt.Println("chat:", selection.RefusalReason(err), selection.HTTPStatus(err))
	fmt.Println("excluded:", svc.Stats().Filtered["lora"])
	// Output:
	// sql: pod-a
	// chat: filtered:lora 503
	// excluded: 5
}

// A cost term prices what the service cannot see, in the cost's own unit:
// here an A10 is slower than an H100, which outweighs pod-b's cached prefix.
func ExampleSelectionServiceBuilder_CostTerm() {
	slowGPU := selection.CostTermFunc(func(_ context.Context, _ *selection.Request, c *selection.Scored) float64 {
		if c.Labels["gpu"] != "a10" {
			return 0
		}
		if c.Predicted {
			return 0.5 // seconds: the predictive cost
		}
		return 64 // blocks: Dynamo's cost
	})
	ctx := context.Background()
	for _, b := range []*selection.SelectionServiceBuilder{
		selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)),
		selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).CostTerm("gpu", slowGPU),
	} {
		svc := policyExampleService(b)
		res, _ := svc.Select(ctx, selection.Request{Tokens: examplePrompt})
		fmt.Println(res.WorkerID, res.Overlap.Device)
		svc.Close()
	}
	// Output:
	// pod-b 2
	// pod-a 0
}

// loraAffinity prefers the workers that have the request's adapter loaded
// (a preference, where a filter would be a requirement). It names them as
// its scope, so that a large fleet keeps the sparse decision.
type loraAffinity struct {
	mu     sync.RWMutex
	loaded map[string][]string // adapter -> workers, kept by the EPP's discovery
}

func (l *loraAffinity) Cost(_ context.Context, req *selection.Request, c *selection.Scored) float64 {
	if req.LoRAName == "" || c.Labels["lora/"+req.LoRAName] != "loaded" {
		return 0
	}
	if c.Predicted {
		return -0.2 // seconds
	}
	return -16 // blocks
}

func (l *loraAffinity) Scope(_ context.Context, req *selection.Request, dst []string) []string {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return append(dst, l.loaded[req.LoRAName]...)
}

var _ selection.ScopedCostTerm = (*loraAffinity)(nil)

// A scoped cost term is zero outside the workers it names: the sparse
// decision evaluates those one by one and stays exact.
func ExampleScopedCostTerm() {
	affinity := &loraAffinity{loaded: map[string][]string{"sql": {"pod-a"}}}
	cfg := selection.DefaultConfig(4)
	cfg.Cost = selection.CostDynamo // the cost of large fleets, where decisions are sparse
	svc := policyExampleService(selection.NewSelectionServiceBuilder(cfg).CostTerm("lora-affinity", affinity))
	defer svc.Close()
	res, _ := svc.Select(context.Background(), selection.Request{Tokens: examplePrompt, LoRAName: "sql"})
	fmt.Println(res.WorkerID, "full scans for the policy:", svc.Stats().PolicyFullScans)
	// Output:
	// pod-a full scans for the policy: 0
}

// powerOfTwo is the power of two choices: two candidates drawn at random,
// the cheaper one taken.
type powerOfTwo struct {
	mu  sync.Mutex
	rng *rand.Rand
}

func (p *powerOfTwo) Pick(_ context.Context, _ *selection.Request, cands []selection.Scored) int {
	p.mu.Lock()
	i, j := p.rng.IntN(len(cands)), p.rng.IntN(len(cands))
	p.mu.Unlock()
	if cands[j].Cost < cands[i].Cost {
		return j
	}
	return i
}

// A picker chooses among the scored candidates in place of the pick by cost.
func ExampleSelectionServiceBuilder_Picker() {
	picker := &powerOfTwo{rng: rand.New(rand.NewPCG(1, 2))}
	svc := policyExampleService(selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).Picker(picker))
	defer svc.Close()
	var picks []string
	for range 4 {
		res, _ := svc.Select(context.Background(), selection.Request{Tokens: examplePrompt})
		picks = append(picks, res.WorkerID)
	}
	fmt.Println(picks) // pod-b when it is drawn: it caches the prompt
	// Output:
	// [pod-b pod-c pod-a pod-b]
}

type tenantKey struct{}

// A classifier admits or refuses each request before anything is done for
// it, and sets its priority in the admission queue: here from the tenant a
// custom EPP put in the context (from a header it trusts).
func ExampleSelectionServiceBuilder_Classifier() {
	classify := selection.ClassifierFunc(func(ctx context.Context, req *selection.Request) selection.Admission {
		switch ctx.Value(tenantKey{}) {
		case "interactive":
			return selection.Admission{Priority: selection.Priority{Tier: 1}}
		case "batch":
			return selection.Admission{Priority: req.Priority}
		}
		return selection.Admission{Refuse: "unknown_tenant"}
	})
	svc := policyExampleService(selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).Classifier(classify))
	defer svc.Close()

	ctx := context.WithValue(context.Background(), tenantKey{}, "interactive")
	b, err := svc.Book(ctx, selection.Request{Tokens: examplePrompt})
	fmt.Println(b.WorkerID, err)
	_ = b.Done()
	_, err = svc.Book(context.Background(), selection.Request{Tokens: examplePrompt})
	fmt.Println(errors.Is(err, selection.ErrRefused), selection.RefusalReason(err), selection.HTTPStatus(err))
	// Output:
	// pod-b <nil>
	// true classifier:unknown_tenant 429
}
