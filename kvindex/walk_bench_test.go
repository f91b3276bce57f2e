package kvindex

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
)

// A prefix fleet is what eviction leaves in caches: every worker rank holds
// prefixes of conversations of various lengths (a few blocks of a system
// prompt, the whole prompt, the prompt and part or all of a conversation), so
// along a request's path the holder sets shrink step by step, where a rank's
// prefix ends, instead of staying equal for a whole prompt as in the
// benchmark fleet. 64 system prompts of 128 blocks, 16 conversations of 384
// blocks after each, blocks of 16 tokens.
const (
	prefixConvs   = 16 // conversations per system prompt
	prefixQueries = 256
)

// prefixShape is one prefix fleet: its worker ranks, how many prefixes each
// holds, and how many of every 8 stored prefixes go to the host tier (the
// rest to the device).
type prefixShape struct {
	name    string
	workers int
	perRank int
	host    int
}

var prefixShapes = []prefixShape{
	{"ranks=16", 16, 256, 0},
	{"ranks=256", 256, 16, 0},
	{"ranks=16/tiers", 16, 256, 1},
}

type prefixFleet struct {
	ix      *Index
	naive   *naiveIndex // every tier: the baseline of Match.Total
	queries [][]uint64
}

func buildPrefixFleet(shape prefixShape) *prefixFleet {
	ix, err := New(Options{BlockSize: benchBS})
	if err != nil {
		panic(err)
	}
	h, _ := NewHasher(benchBS, HashOptions{})
	f := &prefixFleet{ix: ix, naive: newNaive()}
	r := rand.New(rand.NewPCG(33, uint64(shape.workers)))
	toks := make([]uint32, benchDepth*benchBS)
	for w := range shape.workers {
		wr := catalog.WorkerRank{WorkerID: fmt.Sprintf("worker-%03d", w)}
		for range shape.perRank {
			group, conv := r.IntN(benchGroups), r.IntN(prefixConvs)
			n := 1 + r.IntN(benchDepth)
			if r.IntN(4) == 0 { // part of the system prompt only
				n = 1 + r.IntN(benchShared)
			}
			id := group*prefixConvs + conv
			fillSeqTokens(toks, group, id)
			hashes := make([]uint64, n)
			for i := range hashes {
				// Engines hash content: a system prompt's blocks have the same
				// engine hashes in every conversation.
				hashes[i] = benchEngineHash(id, i)
				if i < benchShared {
					hashes[i] = benchEngineHash(1<<16+group, i)
				}
			}
			tier := TierDevice
			if r.IntN(8) < shape.host {
				tier = TierHost
			}
			ev := Event{Kind: EventStored, Tier: tier, BlockHashes: hashes, Tokens: toks[:n*benchBS]}
			if err := ix.Apply(wr, ev); err != nil {
				panic(err)
			}
			f.naive.add(wr, h.SeqHashes(toks[:n*benchBS]))
		}
	}
	for q := range prefixQueries {
		group, conv := r.IntN(benchGroups), r.IntN(prefixConvs)
		id := group*prefixConvs + conv
		if q%4 == 3 { // a known system prompt, a new conversation
			id = 1<<20 + q
		}
		f.queries = append(f.queries, h.SeqHashes(seqTokens(group, id)))
	}
	return f
}

// BenchmarkFindMatchesPrefixes runs 256 queries of 512 blocks (3 in 4 a
// conversation of the fleet, 1 in 4 a new conversation after a known system
// prompt) against prefix fleets: 16 worker ranks holding 256 prefixes each
// (holder sets of one word), 256 holding 16 each (four words), and 16 again
// with one stored prefix in 8 on the host tier (the walk over every tier).
// ns/op is per query; p50-ns and p99-ns its distribution; entries the fleet's
// (block, worker rank) entries.
func BenchmarkFindMatchesPrefixes(b *testing.B) {
	for _, shape := range prefixShapes {
		b.Run(shape.name, func(b *testing.B) {
			f := buildPrefixFleet(shape)
			for _, q := range f.queries {
				want := f.naive.findMatches(q)
				got := f.ix.FindMatches(q, MatchOptions{})
				if len(got) != len(want) {
					b.Fatalf("index found %d worker ranks, baseline %d", len(got), len(want))
				}
				for _, m := range got {
					if want[m.Worker] != m.Total() {
						b.Fatalf("%v: index %d, baseline %d", m.Worker, m.Total(), want[m.Worker])
					}
				}
			}
			buf := make([]Match, 0, shape.workers)
			durs := make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				q := f.queries[i%len(f.queries)]
				start := time.Now()
				buf = f.ix.AppendMatches(buf[:0], q, MatchOptions{})
				durs = append(durs, time.Since(start))
			}
			b.StopTimer()
			reportP50(b, durs)
			b.ReportMetric(float64(f.ix.Stats().Entries), "entries")
		})
	}
}
