package selection_test

import (
	"context"
	"fmt"

	"github.com/kvselect/kvselect/selection"
)

// holders requires the request's LoRA adapter, and names the workers that
// hold it as its scope: the only ones it admits.
type holders map[string][]string // adapter -> workers, kept by the EPP's discovery

func (h holders) Admit(_ context.Context, req *selection.Request, c *selection.Scored) bool {
	if req.LoRAName == "" {
		return true
	}
	for _, w := range h[req.LoRAName] {
		if w == c.WorkerID {
			return true
		}
	}
	return false
}

func (h holders) Scope(_ context.Context, req *selection.Request, dst []string) ([]string, selection.FilterScope) {
	if req.LoRAName == "" {
		return dst, selection.RefusesOnly // refuses nobody
	}
	return append(dst, h[req.LoRAName]...), selection.AdmitsOnly
}

var _ selection.ScopedFilter = holders(nil)

// A scoped filter confines its verdict to the workers it names, so that the
// sparse decision evaluates those one by one and stays exact.
func ExampleScopedFilter() {
	cfg := selection.DefaultConfig(4)
	cfg.Cost = selection.CostDynamo // the cost of large fleets, where decisions are sparse
	svc := policyExampleService(selection.NewSelectionServiceBuilder(cfg).Filter("lora", holders{"sql": {"pod-a"}}))
	defer svc.Close()
	ctx := context.Background()
	res, _ := svc.Select(ctx, selection.Request{Tokens: examplePrompt, LoRAName: "sql"})
	fmt.Println(res.WorkerID, selection.AdmitsOnly)
	_, err := svc.Select(ctx, selection.Request{Tokens: examplePrompt, LoRAName: "chat"})
	fmt.Println(selection.RefusalReason(err), "full scans for the policy:", svc.Stats().PolicyFullScans)
	// Output:
	// pod-a admits-only
	// filtered:lora full scans for the policy: 0
}
