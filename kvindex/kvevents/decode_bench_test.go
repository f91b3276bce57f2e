package kvevents

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
)

// benchBatch returns one BlockStored of 16 blocks x 16 tokens with realistic
// (32-bit encoded) token ids and uint64 hashes, in the array or map event form.
func benchBatch(mapForm bool) []byte {
	const blocks, bs = 16, 16
	hashes := make([]uint64, blocks)
	for i := range hashes {
		hashes[i] = 0x9e3779b97f4a7c15 * uint64(i+1)
	}
	tokens := make([]uint32, blocks*bs)
	for i := range tokens {
		tokens[i] = uint32(70000 + i*37%60000)
	}
	medium := mp(nil).str("GPU")
	var ev []byte
	if mapForm {
		ev = storedMap(hashes, u64p(42), tokens, bs,
			mp(nil).str("lora_id").null(), mp(nil).str("medium").raw(medium), mp(nil).str("lora_name").null(),
			mp(nil).str("extra_keys").arr(blocks).raw(nullN(blocks)), mp(nil).str("group_idx").i(0),
			mp(nil).str("kv_cache_spec_kind").str("full_attention"))
	} else {
		ev = storedArr(hashes, u64p(42), tokens, bs, mp(nil).null(), medium, mp(nil).null())
	}
	return arrayBatch(0, ev)
}

func nullN(n int) []byte {
	var e mp
	for range n {
		e = e.null()
	}
	return e
}

func BenchmarkDecodeBatch(b *testing.B) {
	for _, form := range []struct {
		name string
		map_ bool
	}{{"array", false}, {"map", true}} {
		b.Run(form.name, func(b *testing.B) {
			payload := benchBatch(form.map_)
			d, err := NewDecoder(DecoderOptions{})
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.SetBytes(int64(len(payload)))
			blocks := 0
			for b.Loop() {
				batch, err := d.Decode(payload)
				if err != nil {
					b.Fatal(err)
				}
				blocks += len(batch.Events[0].BlockHashes)
			}
			b.ReportMetric(float64(blocks)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

// nopApplier accepts every event.
type nopApplier struct{ blocks int }

func (a *nopApplier) Apply(_ catalog.WorkerRank, ev kvindex.Event) error {
	a.blocks += len(ev.BlockHashes)
	return nil
}
func (a *nopApplier) ClearRank(catalog.WorkerRank) {}

func BenchmarkDecodeApply(b *testing.B) {
	payload := benchBatch(true)
	src := catalog.WorkerRank{WorkerID: "engine-0"}

	b.Run("nop", func(b *testing.B) {
		a := &nopApplier{}
		h, err := NewIndexHandler(a, HandlerOptions{BlockSize: 16})
		if err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		var seq uint64
		for b.Loop() {
			h.HandleBatch(src, seq, payload)
			seq++
		}
		if h.Stats(src).EventsApplied != seq {
			b.Fatalf("applied %d of %d", h.Stats(src).EventsApplied, seq)
		}
		b.ReportMetric(float64(a.blocks)/b.Elapsed().Seconds(), "blocks/s")
	})

	// Into the real index: store the 16 blocks, then remove them, so every
	// iteration does real tree work.
	b.Run("index", func(b *testing.B) {
		ix, err := kvindex.New(kvindex.Options{BlockSize: 16})
		if err != nil {
			b.Fatal(err)
		}
		h, err := NewIndexHandler(ix, HandlerOptions{BlockSize: 16})
		if err != nil {
			b.Fatal(err)
		}
		stored := benchBatch(false)
		d, _ := NewDecoder(DecoderOptions{})
		batch, _ := d.Decode(stored)
		parent := batch.Events[0].ParentHash
		// Make the parent known, and build the matching remove.
		root := arrayBatch(0, storedArr([]uint64{parent}, nil, seqTokens(0, 16), 16))
		removed := arrayBatch(0, mp(nil).arr(3).str("BlockRemoved").hashes(batch.Events[0].BlockHashes...).str("GPU"))
		h.HandleBatch(src, 0, root)
		b.ReportAllocs()
		seq := uint64(1)
		for b.Loop() {
			h.HandleBatch(src, seq, stored)
			h.HandleBatch(src, seq+1, removed)
			seq += 2
		}
		st := h.Stats(src)
		if st.SkippedTotal() != 0 {
			b.Fatalf("skipped: %+v", st)
		}
		b.ReportMetric(float64(16*(seq-1)/2)/b.Elapsed().Seconds(), "blocks/s")
	})
}

// BenchmarkDecodeTokens decodes BlockStored events of 16 blocks of 128
// tokens (array form), their token ids drawn from vocabularies of 32,000 ids
// (most encoded in 3 bytes), 128,256 (Llama 3: about half in 3 bytes, half in
// 5) and 151,936 (Qwen). It cycles through 64 different batches (131,072
// ids), as a router's feed brings new ones: decoding one batch again and
// again, the branch predictor learns its ids' forms and the figure is
// several times too good. ns/token is the decode time per token id.
func BenchmarkDecodeTokens(b *testing.B) {
	const blocks, bs, batches = 16, 128, 64
	for _, vocab := range []int{32000, 128256, 151936} {
		b.Run(fmt.Sprintf("vocab=%d", vocab), func(b *testing.B) {
			hashes := make([]uint64, blocks)
			for i := range hashes {
				hashes[i] = 0x9e3779b97f4a7c15 * uint64(i+1)
			}
			r := rand.New(rand.NewPCG(1, uint64(vocab)))
			tokens := make([]uint32, blocks*bs)
			payloads := make([][]byte, batches)
			size := 0
			for k := range payloads {
				for i := range tokens {
					tokens[i] = uint32(r.IntN(vocab))
				}
				payloads[k] = arrayBatch(0, storedArr(hashes, u64p(42), tokens, bs, mp(nil).null(), mp(nil).str("GPU"), mp(nil).null()))
				size += len(payloads[k])
			}
			d, err := NewDecoder(DecoderOptions{})
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.SetBytes(int64(size / batches))
			k := 0
			for b.Loop() {
				batch, err := d.Decode(payloads[k%batches])
				if err != nil || len(batch.Events) != 1 || len(batch.Events[0].Tokens) != len(tokens) {
					b.Fatalf("decoded %+v, %v", batch, err)
				}
				k++
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(tokens)), "ns/token")
		})
	}
}
