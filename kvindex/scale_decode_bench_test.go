package kvindex_test

import (
	"math/rand/v2"
	"testing"

	"github.com/tinylib/msgp/msgp"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/kvindex/kvevents"
)

// storedBatch encodes a vLLM batch [ts, [BlockStored]] in the array event form:
// [tag, block_hashes, parent, token_ids, block_size, lora_id, medium].
func storedBatch(hashes []uint64, parent uint64, tokens []uint32, blockSize int) []byte {
	b := msgp.AppendArrayHeader(nil, 2)
	b = msgp.AppendFloat64(b, 1760000000.5)
	b = msgp.AppendArrayHeader(b, 1)
	b = msgp.AppendArrayHeader(b, 7)
	b = msgp.AppendString(b, "BlockStored")
	b = msgp.AppendArrayHeader(b, uint32(len(hashes)))
	for _, h := range hashes {
		b = msgp.AppendUint64(b, h)
	}
	b = msgp.AppendUint64(b, parent)
	b = msgp.AppendArrayHeader(b, uint32(len(tokens)))
	for _, t := range tokens {
		b = msgp.AppendUint32(b, t)
	}
	b = msgp.AppendInt(b, blockSize)
	b = msgp.AppendNil(b)
	return msgp.AppendString(b, "GPU")
}

// removedBatch encodes [ts, [["BlockRemoved", block_hashes, medium]]].
func removedBatch(hashes []uint64) []byte {
	b := msgp.AppendArrayHeader(nil, 2)
	b = msgp.AppendFloat64(b, 1760000000.5)
	b = msgp.AppendArrayHeader(b, 1)
	b = msgp.AppendArrayHeader(b, 3)
	b = msgp.AppendString(b, "BlockRemoved")
	b = msgp.AppendArrayHeader(b, uint32(len(hashes)))
	for _, h := range hashes {
		b = msgp.AppendUint64(b, h)
	}
	return msgp.AppendString(b, "GPU")
}

// decodeApplyRounds is the store-remove pairs of one benchmark operation.
const decodeApplyRounds = 8

// BenchmarkScaleDecodeApply decodes and applies, through an IndexHandler, a
// BlockStored batch of 16 blocks x 16 tokens that extends a chain the worker
// rank holds, then a BlockRemoved of the same blocks, 8 times per operation:
// into an index holding only that chain (entries=0) and into the 8M-entry
// scale fleet (entries=8M). blocks/s counts stored blocks.
func BenchmarkScaleDecodeApply(b *testing.B) {
	const blocks, bs = 16, 16
	hashes := make([]uint64, blocks)
	for i := range hashes {
		hashes[i] = 1<<63 | 0x9e3779b97f4a7c15*uint64(i+1)>>1
	}
	tokens := make([]uint32, blocks*bs)
	for i := range tokens {
		tokens[i] = uint32(70000 + i*37%60000)
	}
	removed := removedBatch(hashes)
	empty := func(b *testing.B) (*kvindex.Index, catalog.WorkerRank, uint64) {
		ix, err := kvindex.New(kvindex.Options{BlockSize: bs})
		if err != nil {
			b.Fatal(err)
		}
		w, parent := catalog.WorkerRank{WorkerID: "engine-0"}, uint64(42)
		if err := ix.Apply(w, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: []uint64{parent}, Tokens: make([]uint32, bs)}); err != nil {
			b.Fatal(err)
		}
		return ix, w, parent
	}
	full := func(*testing.B) (*kvindex.Index, catalog.WorkerRank, uint64) { return kvindex.ScaleFleet() }
	for _, c := range []struct {
		name string
		get  func(*testing.B) (*kvindex.Index, catalog.WorkerRank, uint64)
	}{{"entries=0", empty}, {"entries=8M", full}} {
		b.Run(c.name, func(b *testing.B) {
			ix, w, parent := c.get(b)
			h, err := kvevents.NewIndexHandler(ix, kvevents.HandlerOptions{BlockSize: bs})
			if err != nil {
				b.Fatal(err)
			}
			stored := storedBatch(hashes, parent, tokens, bs)
			entries := ix.Stats().Entries
			b.ReportAllocs()
			seq := uint64(0)
			for b.Loop() {
				for range decodeApplyRounds {
					h.HandleBatch(w, seq, stored)
					h.HandleBatch(w, seq+1, removed)
					seq += 2
				}
			}
			b.StopTimer()
			st := h.Stats(w)
			if st.SkippedTotal() != 0 || st.EventsApplied != seq {
				b.Fatalf("applied %d of %d events: %+v", st.EventsApplied, seq, st)
			}
			if got := ix.Stats().Entries; got != entries {
				b.Fatalf("%d entries after the benchmark, %d before", got, entries)
			}
			b.ReportMetric(float64(blocks*seq/2)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

// BenchmarkDecodeApplyLongBlocks is the entries=0 case of
// BenchmarkScaleDecodeApply with blocks of 128 tokens (index and engine),
// their ids drawn from a 128,256-token vocabulary (Llama 3), so that decoding
// the token ids and hashing them weigh as they do with long engine blocks.
// blocks/s counts stored blocks.
func BenchmarkDecodeApplyLongBlocks(b *testing.B) {
	const blocks, bs = 16, 128
	hashes := make([]uint64, blocks)
	for i := range hashes {
		hashes[i] = 1<<63 | 0x9e3779b97f4a7c15*uint64(i+1)>>1
	}
	r := rand.New(rand.NewPCG(128, 256))
	tokens := make([]uint32, blocks*bs)
	for i := range tokens {
		tokens[i] = uint32(r.IntN(128256))
	}
	ix, err := kvindex.New(kvindex.Options{BlockSize: bs})
	if err != nil {
		b.Fatal(err)
	}
	w, parent := catalog.WorkerRank{WorkerID: "engine-0"}, uint64(42)
	if err := ix.Apply(w, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: []uint64{parent}, Tokens: make([]uint32, bs)}); err != nil {
		b.Fatal(err)
	}
	h, err := kvevents.NewIndexHandler(ix, kvevents.HandlerOptions{BlockSize: bs})
	if err != nil {
		b.Fatal(err)
	}
	stored, removed := storedBatch(hashes, parent, tokens, bs), removedBatch(hashes)
	b.ReportAllocs()
	seq := uint64(0)
	for b.Loop() {
		for range decodeApplyRounds {
			h.HandleBatch(w, seq, stored)
			h.HandleBatch(w, seq+1, removed)
			seq += 2
		}
	}
	b.StopTimer()
	if st := h.Stats(w); st.SkippedTotal() != 0 || st.EventsApplied != seq {
		b.Fatalf("applied %d of %d events: %+v", st.EventsApplied, seq, st)
	}
	b.ReportMetric(float64(blocks*seq/2)/b.Elapsed().Seconds(), "blocks/s")
}
