package replay_test

import (
	"context"
	"fmt"

	"github.com/kvselect/kvselect/internal/replay"
	"github.com/kvselect/kvselect/internal/trace"
)

func ExampleRun() {
	reqs, _ := trace.SharedPrefix(trace.SharedPrefixConfig{
		Groups: 16, PromptsPerGroup: 8, SystemBlocks: 8, QuestionBlocks: 1, OutputTokens: 50, Rate: 10, Seed: 1,
	})
	for _, p := range []replay.Policy{replay.KVSelect, replay.RoundRobin} {
		res, err := replay.Run(context.Background(), reqs, p, replay.Options{Workers: 4, CapacityBlocks: 100, Seed: 1})
		if err != nil {
			panic(err)
		}
		fmt.Printf("%s: hit rate %.2f of reachable %.2f\n", p, res.HitRate, res.ReachableHitRate)
	}
	// Output:
	// kvselect: hit rate 0.77 of reachable 0.78
	// round-robin: hit rate 0.36 of reachable 0.78
}
