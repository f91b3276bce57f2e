package trace_test

import (
	"fmt"
	"strings"

	"github.com/kvselect/kvselect/internal/trace"
)

func ExampleReadAll() {
	in := `{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]}
{"timestamp": 250, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]}
{"timestamp": 100, "input_length": 512, "output_length": 3, "hash_ids": [5]}`
	reqs, err := trace.ReadAll(strings.NewReader(in), trace.ReaderOptions{})
	fmt.Println(len(reqs), err)

	reqs, _ = trace.ReadAll(strings.NewReader(in), trace.ReaderOptions{SkipBad: true})
	s := trace.Summarize(reqs)
	fmt.Printf("%d requests, %d of %d blocks reusable\n", s.Requests, s.Blocks-s.DistinctBlocks, s.Blocks)
	// Output:
	// 0 trace: line 3: trace: timestamp decreases: 100 ms after 250 ms
	// 2 requests, 2 of 5 blocks reusable
}

func ExampleSharedPrefix() {
	reqs, _ := trace.SharedPrefix(trace.SharedPrefixConfig{
		Groups: 2, PromptsPerGroup: 2, CommonBlocks: 1, SystemBlocks: 2, QuestionBlocks: 1, OutputTokens: 100, Seed: 1,
	})
	for _, r := range reqs {
		fmt.Println(r.Blocks, r.InputTokens)
	}
	// Output:
	// [0 1 2 6] 2048
	// [0 3 4 7] 2048
	// [0 1 2 5] 2048
	// [0 3 4 8] 2048
}
