package policies_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/policies"
	"github.com/kvselect/kvselect/selection"
)

// On a fleet large enough for the sparse decision (32 workers of 8 ranks),
// both seams keep it (no full scan), the filter routes an adapter's
// requests to its holders only, and the index may be updated while
// requests are decided (the race detector watches): every pick is a worker
// that held the adapter in one of the two label sets in turn.
func TestLoRASeamsAtFleetScale(t *testing.T) {
	for _, required := range []bool{true, false} {
		t.Run(fmt.Sprint("require=", required), func(t *testing.T) {
			adapters, err := policies.NewAdapters("")
			require.NoError(t, err)
			cfg := selection.DefaultConfig(16)
			cfg.Cost = selection.CostDynamo
			b := selection.NewSelectionServiceBuilder(cfg).ExternalEvents().Rand(rand.NewPCG(5, 5))
			if required {
				b.Filter("lora", policies.LoRAFilter{Adapters: adapters})
			} else {
				b.CostTerm("lora-affinity", policies.LoRAAffinity{Adapters: adapters, Blocks: 1e6, Seconds: 1e3})
			}
			svc, err := b.Build(context.Background())
			require.NoError(t, err)
			t.Cleanup(func() { _ = svc.Close() })
			fleet := func(holders ...int) []catalog.Worker {
				ws := make([]catalog.Worker, 32)
				for i := range ws {
					ws[i] = catalog.Worker{ID: fmt.Sprintf("w%02d", i), Endpoint: fmt.Sprintf("10.0.1.%d:8000", i+1), DPSize: 8}
				}
				for _, h := range holders {
					ws[h].Labels = map[string]string{"lora.kvselect.io/sql-lora": policies.LabelLoaded}
				}
				return ws
			}
			for _, w := range fleet() {
				_, err := svc.Workers().Upsert(w)
				require.NoError(t, err)
			}
			sets := [][]catalog.Worker{fleet(3, 17), fleet(17, 30)}
			adapters.Update(sets[0])

			var wg sync.WaitGroup
			stop := make(chan struct{})
			wg.Go(func() {
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
						adapters.Update(sets[i%2])
					}
				}
			})
			ctx := context.Background()
			for i := range 300 {
				res, err := svc.SelectAndReserve(ctx, selection.Request{ISL: 256 + i%512, LoRAName: "sql-lora"})
				require.NoError(t, err)
				require.Contains(t, []string{"w03", "w17", "w30"}, res.WorkerID)
				require.NoError(t, svc.Reservations().Free(res.ReservationID))
			}
			close(stop)
			wg.Wait()
			res, err := svc.Select(ctx, selection.Request{ISL: 64}) // no adapter: anywhere
			require.NoError(t, err)
			require.NotEmpty(t, res.WorkerID)
			require.Zero(t, svc.Stats().PolicyFullScans)
		})
	}
}
