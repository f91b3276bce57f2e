package benchfleet

import (
	"fmt"
	"math/rand/v2"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
)

// The shape of every Fleet's prompts.
const (
	// BlockSize is the workers' block size, in tokens.
	BlockSize = 16
	// PromptTokens is the length of every prompt: SystemTokens of one of
	// SystemPrompts shared prompts, then the prompt's own tokens.
	PromptTokens  = 2048
	SystemTokens  = 1024
	SystemPrompts = 8
)

// Service is what Warm calls: a selection.SelectionService's Workers().Upsert,
// and its Events().Apply. (Functions, not an interface over the service:
// the selection package's own tests use Warm.)
type Service struct {
	Upsert     func(catalog.Worker) (catalog.Record, error)
	ApplyEvent func(catalog.WorkerRank, kvindex.Event) error
}

// Fleet sizes a warmed fleet.
type Fleet struct {
	// Workers is how many workers (one rank each) to register, named w000,
	// w001, ... on distinct private endpoints (10.0.x.y).
	Workers int
	// PerWorker is how many prompts each worker caches; prompt k of a worker
	// uses system prompt k mod SystemPrompts.
	PerWorker int
	// Fresh is how many prompts no worker caches to return after the
	// workers' first ones: new conversations on known system prompts.
	Fresh int
}

// Warm registers f's workers on s, stores their cached prompts, and returns
// the prompts to route (see the package documentation). It stops at the
// first error of s.
func Warm(s Service, f Fleet) ([][]uint32, error) {
	r := rand.New(rand.NewPCG(5, 5))
	system := make([][]uint32, SystemPrompts)
	for i := range system {
		system[i] = make([]uint32, SystemTokens)
		for j := range system[i] {
			system[i][j] = r.Uint32N(32000)
		}
	}
	prompt := func(g, k int) []uint32 {
		p := append(make([]uint32, 0, PromptTokens), system[g]...)
		rr := rand.New(rand.NewPCG(uint64(g), uint64(k)))
		for len(p) < PromptTokens {
			p = append(p, rr.Uint32N(32000))
		}
		return p
	}
	prompts := make([][]uint32, 0, f.Workers+f.Fresh)
	for w := range f.Workers {
		id := fmt.Sprintf("w%03d", w)
		if _, err := s.Upsert(catalog.Worker{ID: id, Endpoint: fmt.Sprintf("10.0.%d.%d:8000", w/250, w%250+1), DPSize: 1, BlockSize: BlockSize, MaxNumBatchedTokens: 8192}); err != nil {
			return nil, fmt.Errorf("benchfleet: worker %s: %w", id, err)
		}
		for k := range f.PerWorker {
			seq := w*f.PerWorker + k
			p := prompt(k%SystemPrompts, seq)
			hs := make([]uint64, len(p)/BlockSize)
			for i := range hs {
				hs[i] = uint64(seq)<<16 | uint64(i) + 1
			}
			if err := s.ApplyEvent(catalog.WorkerRank{WorkerID: id}, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: hs, Tokens: p}); err != nil {
				return nil, fmt.Errorf("benchfleet: worker %s, prompt %d: %w", id, k, err)
			}
			if k == 0 {
				prompts = append(prompts, p)
			}
		}
	}
	for k := range f.Fresh {
		prompts = append(prompts, prompt(k%SystemPrompts, 1<<20+k))
	}
	return prompts, nil
}
