package trace

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"
)

// SharedPrefixConfig describes a synthetic shared-prefix workload in the shape of
// inference-perf's shared_prefix data: Groups groups of PromptsPerGroup prompts;
// every prompt of a group starts with the group's system prompt and ends with its
// own question. CommonBlocks, when set, puts a prefix shared by every request in
// front of the system prompts (a universal system prompt: every request shares
// block 0). Lengths are in blocks of BlockSize tokens.
type SharedPrefixConfig struct {
	// Groups and PromptsPerGroup: > 0.
	Groups, PromptsPerGroup int
	// CommonBlocks are shared by every request. >= 0.
	CommonBlocks int
	// SystemBlocks are shared by the prompts of one group. >= 0.
	SystemBlocks int
	// QuestionBlocks are unique to each prompt. >= 0. CommonBlocks +
	// SystemBlocks + QuestionBlocks must be > 0.
	QuestionBlocks int
	// OutputTokens is every request's output length. >= 0.
	OutputTokens int
	// BlockSize is tokens per block. 0 means DefaultBlockSize; negative is invalid.
	BlockSize int
	// Rate is the mean arrival rate in requests per second of a Poisson process.
	// 0 means every request arrives at time 0. Finite, >= 0.
	Rate float64
	// Seed fixes the order of the prompts and the arrival times.
	Seed uint64
}

func (c SharedPrefixConfig) validate() (SharedPrefixConfig, error) {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOptions}, args...)...))
	}
	if c.Groups <= 0 {
		bad("Groups %d, want > 0", c.Groups)
	}
	if c.PromptsPerGroup <= 0 {
		bad("PromptsPerGroup %d, want > 0", c.PromptsPerGroup)
	}
	if c.CommonBlocks < 0 || c.SystemBlocks < 0 || c.QuestionBlocks < 0 {
		bad("CommonBlocks %d, SystemBlocks %d, QuestionBlocks %d: none may be negative", c.CommonBlocks, c.SystemBlocks, c.QuestionBlocks)
	} else if c.CommonBlocks+c.SystemBlocks+c.QuestionBlocks == 0 {
		bad("a prompt needs at least one block (CommonBlocks + SystemBlocks + QuestionBlocks is 0)")
	}
	if c.OutputTokens < 0 {
		bad("OutputTokens %d is negative", c.OutputTokens)
	}
	if c.BlockSize < 0 {
		bad("BlockSize %d is negative", c.BlockSize)
	}
	if math.IsNaN(c.Rate) || math.IsInf(c.Rate, 0) || c.Rate < 0 {
		bad("Rate %v, want a finite value >= 0", c.Rate)
	}
	const maxRequests = 1 << 24
	if c.Groups > 0 && c.PromptsPerGroup > 0 && c.Groups > maxRequests/c.PromptsPerGroup {
		bad("Groups x PromptsPerGroup exceeds %d requests", maxRequests)
	}
	if len(errs) > 0 {
		return c, errors.Join(errs...)
	}
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	return c, nil
}

// SharedPrefix generates the workload cfg describes: Groups x PromptsPerGroup
// requests in a seeded random order, with Poisson arrivals at cfg.Rate. Block
// ids are assigned densely: the common blocks first, then each group's system
// prompt, then each prompt's question. Equal configurations give equal traces.
// Errors: ErrInvalidOptions.
func SharedPrefix(cfg SharedPrefixConfig) ([]Request, error) {
	c, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	next := uint64(0)
	ids := func(n int) []uint64 {
		out := make([]uint64, n)
		for i := range out {
			out[i] = next
			next++
		}
		return out
	}
	common := ids(c.CommonBlocks)
	system := make([][]uint64, c.Groups)
	for g := range system {
		system[g] = ids(c.SystemBlocks)
	}
	n := c.Groups * c.PromptsPerGroup
	perPrompt := c.CommonBlocks + c.SystemBlocks + c.QuestionBlocks
	reqs := make([]Request, 0, n)
	for g := range c.Groups {
		for range c.PromptsPerGroup {
			blocks := make([]uint64, 0, perPrompt)
			blocks = append(blocks, common...)
			blocks = append(blocks, system[g]...)
			blocks = append(blocks, ids(c.QuestionBlocks)...)
			reqs = append(reqs, Request{
				InputTokens: perPrompt * c.BlockSize, OutputTokens: c.OutputTokens, Blocks: blocks,
			})
		}
	}
	rng := rand.New(rand.NewPCG(c.Seed, c.Seed^0x9e3779b97f4a7c15))
	rng.Shuffle(len(reqs), func(i, j int) { reqs[i], reqs[j] = reqs[j], reqs[i] })
	if c.Rate > 0 {
		t := 0.0 // seconds
		for i := range reqs {
			if i > 0 {
				t += rng.ExpFloat64() / c.Rate
			}
			reqs[i].Arrival = time.Duration(t * float64(time.Second))
		}
	}
	return reqs, nil
}

// PrependCommon returns copies of reqs that all start with the same n extra
// blocks (a universal system prompt, as in the Mooncake conversation trace where
// every request begins with block 0). The new blocks get ids above every id in
// reqs, and InputTokens grows by n x blockSize. reqs is not modified. Errors:
// ErrInvalidOptions (n < 0, blockSize <= 0).
func PrependCommon(reqs []Request, n, blockSize int) ([]Request, error) {
	if n < 0 || blockSize <= 0 {
		return nil, fmt.Errorf("%w: PrependCommon(n=%d, blockSize=%d), want n >= 0 and blockSize > 0", ErrInvalidOptions, n, blockSize)
	}
	var maxID uint64
	for _, r := range reqs {
		for _, b := range r.Blocks {
			maxID = max(maxID, b)
		}
	}
	out := make([]Request, len(reqs))
	for i, r := range reqs {
		blocks := make([]uint64, 0, n+len(r.Blocks))
		for j := range n {
			blocks = append(blocks, maxID+1+uint64(j))
		}
		blocks = append(blocks, r.Blocks...)
		r.Blocks = blocks
		r.InputTokens += n * blockSize
		out[i] = r
	}
	return out, nil
}
