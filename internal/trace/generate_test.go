package trace

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func writeFile(path, s string) error { return os.WriteFile(path, []byte(s), 0o600) }

func TestSharedPrefixStructure(t *testing.T) {
	cfg := SharedPrefixConfig{Groups: 3, PromptsPerGroup: 4, CommonBlocks: 1, SystemBlocks: 2, QuestionBlocks: 2,
		OutputTokens: 50, BlockSize: 16, Rate: 10, Seed: 7}
	reqs, err := SharedPrefix(cfg)
	require.NoError(t, err)
	require.Len(t, reqs, 12)
	bySystem := map[[2]uint64]int{}
	questions := map[uint64]bool{}
	for i, r := range reqs {
		require.NoError(t, r.Validate(16))
		require.Equal(t, 5*16, r.InputTokens)
		require.Equal(t, 50, r.OutputTokens)
		require.Equal(t, uint64(0), r.Blocks[0], "every request shares block 0")
		bySystem[[2]uint64{r.Blocks[1], r.Blocks[2]}]++
		for _, q := range r.Blocks[3:] {
			require.False(t, questions[q], "question blocks are unique")
			questions[q] = true
		}
		if i > 0 {
			require.GreaterOrEqual(t, r.Arrival, reqs[i-1].Arrival)
		}
	}
	require.Len(t, bySystem, 3)
	for _, n := range bySystem {
		require.Equal(t, 4, n)
	}
	require.Greater(t, reqs[11].Arrival, reqs[0].Arrival)

	s := Summarize(reqs)
	require.Equal(t, 12, s.Requests)
	require.Equal(t, 60, s.Blocks)
	require.Equal(t, 1+3*2+12*2, s.DistinctBlocks)
	require.InDelta(t, float64(60-31)/60, s.ReachableHitRate, 1e-12)
}

func TestSharedPrefixDeterministic(t *testing.T) {
	cfg := SharedPrefixConfig{Groups: 8, PromptsPerGroup: 5, SystemBlocks: 3, QuestionBlocks: 1, OutputTokens: 10, Rate: 2, Seed: 42}
	a, err := SharedPrefix(cfg)
	require.NoError(t, err)
	b, err := SharedPrefix(cfg)
	require.NoError(t, err)
	require.Equal(t, a, b)
	cfg.Seed = 43
	c, err := SharedPrefix(cfg)
	require.NoError(t, err)
	require.NotEqual(t, a, c)

	cfg.Rate = 0
	d, err := SharedPrefix(cfg)
	require.NoError(t, err)
	for _, r := range d {
		require.Zero(t, r.Arrival)
		require.Equal(t, 4*DefaultBlockSize, r.InputTokens)
	}
}

func TestSharedPrefixValidation(t *testing.T) {
	_, err := SharedPrefix(SharedPrefixConfig{Groups: 0, PromptsPerGroup: -1, OutputTokens: -1, BlockSize: -1, Rate: -1})
	require.ErrorIs(t, err, ErrInvalidOptions)
	for _, want := range []string{"Groups 0", "PromptsPerGroup -1", "at least one block", "OutputTokens -1", "BlockSize -1", "Rate -1"} {
		require.Contains(t, err.Error(), want)
	}
	_, err = SharedPrefix(SharedPrefixConfig{Groups: 1, PromptsPerGroup: 1, SystemBlocks: -1, QuestionBlocks: 1})
	require.ErrorContains(t, err, "none may be negative")
	_, err = SharedPrefix(SharedPrefixConfig{Groups: 1 << 20, PromptsPerGroup: 1 << 20, QuestionBlocks: 1})
	require.ErrorContains(t, err, "exceeds")
}

func TestPrependCommon(t *testing.T) {
	in := []Request{
		{InputTokens: 700, Blocks: []uint64{5, 9}},
		{InputTokens: 0, Blocks: []uint64{}},
	}
	out, err := PrependCommon(in, 2, 512)
	require.NoError(t, err)
	require.Equal(t, []Request{
		{InputTokens: 700 + 1024, Blocks: []uint64{10, 11, 5, 9}},
		{InputTokens: 1024, Blocks: []uint64{10, 11}},
	}, out)
	require.Equal(t, []uint64{5, 9}, in[0].Blocks, "input untouched")
	for _, r := range out {
		require.NoError(t, r.Validate(512))
	}
	_, err = PrependCommon(in, -1, 512)
	require.ErrorIs(t, err, ErrInvalidOptions)
}

func TestPrefixTreeAndSummary(t *testing.T) {
	var pt PrefixTree
	require.Equal(t, []int32{0, 1}, pt.Append(nil, []uint64{7, 8}))
	require.Equal(t, []int32{0, 2}, pt.Append(nil, []uint64{7, 9}))
	require.Equal(t, []int32{3, 4}, pt.Append(nil, []uint64{8, 7}), "same id after another prefix is another block")
	require.Equal(t, 5, pt.Len())

	s := Summarize([]Request{
		{Arrival: 5, Blocks: []uint64{1, 2, 3}},
		{Arrival: 2, Blocks: []uint64{1, 2, 4}},
		{Arrival: 9, Blocks: []uint64{2}},
	})
	require.Equal(t, 7, s.Blocks)
	require.Equal(t, 5, s.DistinctBlocks)
	require.InDelta(t, 2.0/7, s.ReachableHitRate, 1e-12)
	require.EqualValues(t, 7, s.Span)
	require.Zero(t, Summarize(nil).ReachableHitRate)
}

// sharedTracePath finds the public Mooncake synthetic trace: the
// KVSELECT_MOONCAKE_TRACE environment variable, or the shared directory next to
// the repository. Tests that need it skip when it is absent.
func sharedTracePath(t testing.TB) string {
	if p := os.Getenv("KVSELECT_MOONCAKE_TRACE"); p != "" {
		return p
	}
	p := filepath.Join("..", "..", "..", "shared", "data", "mooncake_synthetic_trace.jsonl")
	if _, err := os.Stat(p); err != nil {
		t.Skip("Mooncake synthetic trace not found; set KVSELECT_MOONCAKE_TRACE to run")
	}
	return p
}

func TestMooncakeSyntheticTrace(t *testing.T) {
	reqs, err := ReadFile(sharedTracePath(t), ReaderOptions{})
	require.NoError(t, err)
	s := Summarize(reqs)
	t.Logf("%+v", s)
	require.Equal(t, 3993, s.Requests)
	require.InDelta(t, 0.64, s.ReachableHitRate, 0.01)
}
