//go:build soak

package kvindex

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
)

var soakFor = flag.Duration("soak", time.Minute, "how long TestChurnSoak runs")

// TestChurnSoak churns a fleet for -soak (default a minute; `make soak`):
// 256 worker ranks store and evict conversations that share 32 system
// prompts, and every round a few workers leave (RemoveWorker) and new ones
// join under new names. The index's live heap, measured after a GC at every
// tenth of the run, must stay flat: the last quarter's mean within 10% of the
// second quarter's (the first is the warm-up, the fleet filling).
func TestChurnSoak(t *testing.T) {
	const (
		ranks, systems, sysBlocks, convBlocks, bs = 256, 32, 64, 32, 16
		perRank                                   = 24 // conversations each rank holds before evicting its oldest
	)
	ix, err := New(Options{BlockSize: bs})
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	tokens := func(n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = rng.Uint32N(32000)
		}
		return out
	}
	type held struct{ hashes []uint64 }
	next := uint64(1)
	hashes := func(n int) []uint64 {
		out := make([]uint64, n)
		for i := range out {
			out[i] = next
			next++
		}
		return out
	}
	// A system prompt's blocks have the same engine hashes on every worker, as
	// an engine hashes content.
	system, sysHashes := make([][]uint32, systems), make([][]uint64, systems)
	for i := range system {
		system[i], sysHashes[i] = tokens(sysBlocks*bs), hashes(sysBlocks)
	}
	names := make([]string, ranks)
	conv := make([][]held, ranks)
	gen := 0
	for i := range names {
		names[i] = fmt.Sprintf("w%d-%d", i, gen)
	}
	store := func(i int) {
		g := rng.IntN(systems)
		toks := append(append([]uint32(nil), system[g]...), tokens(convBlocks*bs)...)
		hs := append(append([]uint64(nil), sysHashes[g]...), hashes(convBlocks)...)
		w := catalog.WorkerRank{WorkerID: names[i]}
		if err := ix.Apply(w, Event{Kind: EventStored, BlockHashes: hs, Tokens: toks}); err != nil {
			t.Fatal(err)
		}
		conv[i] = append(conv[i], held{hashes: hs[sysBlocks:]}) // evicted later; the system prompt stays cached
		if len(conv[i]) > perRank {
			old := conv[i][0]
			conv[i] = conv[i][1:]
			if err := ix.Apply(w, Event{Kind: EventRemoved, BlockHashes: old.hashes}); err != nil {
				t.Fatal(err)
			}
		}
	}
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	start := time.Now()
	var samples []uint64
	rounds, removed := 0, 0
	for time.Since(start) < *soakFor {
		for i := range ranks {
			store(i)
		}
		for range 4 { // four workers leave, four join
			i := rng.IntN(ranks)
			ix.RemoveWorker(names[i])
			removed++
			gen++
			names[i], conv[i] = fmt.Sprintf("w%d-%d", i, gen), nil
		}
		rounds++
		if el := time.Since(start); len(samples) < 10 && el >= time.Duration(len(samples)+1)**soakFor/10 {
			samples = append(samples, heap())
			t.Logf("%4.0f s: round %d, %d workers removed, heap %d MiB, %+v", el.Seconds(), rounds, removed, samples[len(samples)-1]>>20, ix.Stats())
		}
	}
	if len(samples) < 8 {
		t.Fatalf("only %d samples: the soak was too short", len(samples))
	}
	mean := func(s []uint64) float64 {
		var sum float64
		for _, v := range s {
			sum += float64(v)
		}
		return sum / float64(len(s))
	}
	q := len(samples) / 4
	second, last := mean(samples[q:2*q]), mean(samples[len(samples)-q:])
	t.Logf("heap: second quarter %.1f MiB, last quarter %.1f MiB (%+.1f%%)", second/(1<<20), last/(1<<20), 100*(last/second-1))
	if last > second*1.10 {
		t.Fatalf("the heap grew over the run: %.1f MiB -> %.1f MiB", second/(1<<20), last/(1<<20))
	}
}
