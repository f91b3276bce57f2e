package trace

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Every workload is valid, time-ordered, about the size and rate asked, and
// the same for the same seed.
func TestGenerateEveryWorkload(t *testing.T) {
	for _, w := range Workloads() {
		t.Run(string(w), func(t *testing.T) {
			cfg := WorkloadConfig{Requests: 600, Rate: 6, Seed: 3}
			reqs, err := Generate(w, cfg)
			require.NoError(t, err)
			require.InEpsilon(t, 600, len(reqs), 0.25)
			for i, r := range reqs {
				require.NoError(t, r.Validate(DefaultBlockSize), "request %d", i)
				if i > 0 {
					require.GreaterOrEqual(t, r.Arrival, reqs[i-1].Arrival)
				}
			}
			rate := float64(len(reqs)) / reqs[len(reqs)-1].Arrival.Seconds()
			require.InEpsilon(t, 6, rate, 0.25, "mean rate")
			sum := Summarize(reqs)
			require.Greater(t, sum.ReachableHitRate, 0.3, "every workload has prefixes to reuse")
			again, err := Generate(w, cfg)
			require.NoError(t, err)
			require.Equal(t, reqs, again)
			cfg.Seed++
			other, err := Generate(w, cfg)
			require.NoError(t, err)
			require.NotEqual(t, reqs, other)
		})
	}
	_, err := Generate("nope", WorkloadConfig{})
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = Generate(WorkloadRAG, WorkloadConfig{Rate: -1, BurstFactor: 0.5})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "Rate")
	require.ErrorContains(t, err, "BurstFactor")
}

// A conversation's turns each re-send the one before, answer included.
func TestMultiTurnResendsHistory(t *testing.T) {
	reqs, err := Generate(WorkloadMultiTurn, WorkloadConfig{Requests: 400, Seed: 1})
	require.NoError(t, err)
	extended := 0
	for i, r := range reqs {
		for _, prev := range reqs[:i] {
			if len(prev.Blocks) < len(r.Blocks) && slices.Equal(prev.Blocks, r.Blocks[:len(prev.Blocks)]) &&
				len(r.Blocks) > len(prev.Blocks)+BlocksFor(prev.OutputTokens, DefaultBlockSize) {
				extended++
				break
			}
		}
	}
	require.Greater(t, extended, len(reqs)/2, "most turns extend an earlier turn and its answer")
}

// Bursty arrivals come in bursts of BurstOn with silences between.
func TestBurstyArrivals(t *testing.T) {
	reqs, err := Generate(WorkloadBursty, WorkloadConfig{Requests: 800, Rate: 4, BurstOn: 2 * time.Second, BurstFactor: 10, Seed: 1})
	require.NoError(t, err)
	long := 0
	for i := 1; i < len(reqs); i++ {
		if reqs[i].Arrival-reqs[i-1].Arrival > 10*time.Second {
			long++
		}
	}
	// 800 requests at 40/s is 20 s of bursts of 2 s: about 10 silences of 18 s.
	require.InDelta(t, 10, long, 3)
}

// Batch gives every workload same-instant batches of Batch requests at
// the mean rate of the unbatched one; a negative Batch is refused.
func TestBatchArrivals(t *testing.T) {
	for _, w := range []Workload{WorkloadSharedPrefix, WorkloadMultiTurn} {
		plain, err := Generate(w, WorkloadConfig{Requests: 400, Rate: 4, Seed: 3})
		require.NoError(t, err)
		batched, err := Generate(w, WorkloadConfig{Requests: 400, Rate: 4, Seed: 3, Batch: 10})
		require.NoError(t, err)
		require.Equal(t, len(plain), len(batched), w)
		instants := map[time.Duration]int{}
		for i, r := range batched {
			instants[r.Arrival]++
			require.Equal(t, plain[i-i%10].Arrival, r.Arrival, "%s request %d takes its batch's first arrival", w, i)
			require.Equal(t, plain[i].Blocks, r.Blocks, "only arrivals change")
		}
		for at, n := range instants {
			require.LessOrEqual(t, n, 10, "%s at %v", w, at)
		}
		require.GreaterOrEqual(t, len(instants), len(batched)/10, w)
	}
	_, err := Generate(WorkloadMix, WorkloadConfig{Batch: -1})
	require.ErrorIs(t, err, ErrInvalidOptions)
}

// About BurstHot of a burst's requests share the burst's own system prompt,
// which no other burst has; none with BurstHot < 0.
func TestBurstyHotPrefix(t *testing.T) {
	for _, c := range []struct {
		hot  float64
		want float64
	}{{0, 0.5}, {0.8, 0.8}, {-1, 0}} {
		reqs, err := Generate(WorkloadBursty, WorkloadConfig{Requests: 1600, Rate: 4, BurstOn: 2 * time.Second, BurstFactor: 10, BurstHot: c.hot, Seed: 1})
		require.NoError(t, err)
		burst := func(r Request) int { return int(r.Arrival / (20 * time.Second)) } // a burst and its silence
		perBurst := map[int]map[uint64]int{}                                        // first block -> requests
		size := map[int]int{}
		for _, r := range reqs {
			b := burst(r)
			if perBurst[b] == nil {
				perBurst[b] = map[uint64]int{}
			}
			perBurst[b][r.Blocks[0]]++
			size[b]++
		}
		owner := map[uint64]int{}
		hot := 0
		for b, firsts := range perBurst {
			top, topN := uint64(0), 0
			for f, n := range firsts {
				if n > topN {
					top, topN = f, n
				}
			}
			if c.want > 0 {
				_, seen := owner[top]
				require.False(t, seen, "burst %d's hot prompt is another burst's", b)
				owner[top] = b
			}
			hot += topN
		}
		got := float64(hot) / float64(len(reqs))
		if c.want == 0 {
			require.Less(t, got, 0.1, "no hot prompt: a burst's commonest prompt is one of the 100 groups'")
			continue
		}
		require.InDelta(t, c.want, got, 0.05)
	}
	_, err := Generate(WorkloadBursty, WorkloadConfig{BurstHot: 1.5})
	require.ErrorIs(t, err, ErrInvalidOptions)
}

// RAG requests share a hot document more than a cold one.
func TestRAGHotDocuments(t *testing.T) {
	reqs, err := Generate(WorkloadRAG, WorkloadConfig{Requests: 1000, Seed: 1})
	require.NoError(t, err)
	byDoc := map[uint64]int{}
	for _, r := range reqs {
		byDoc[r.Blocks[2]]++ // the document's first block, after the 2-block system prompt
	}
	counts := make([]int, 0, len(byDoc))
	for _, n := range byDoc {
		counts = append(counts, n)
	}
	slices.Sort(counts)
	require.Greater(t, counts[len(counts)-1], 10*counts[0], "popularity is skewed")
}
