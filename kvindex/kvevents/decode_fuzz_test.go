package kvevents

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/tinylib/msgp/msgp"

	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/kvindex"
)

// fuzzSeeds returns the fixtures of the decoder tests and the wire variants of
// the engines (wireVariantSeeds), as fuzzing seeds.
func fuzzSeeds(t testing.TB) [][]byte {
	return append(fixtureSeeds(t), wireVariantSeeds()...)
}

// fixtureSeeds returns the fixtures of the decoder tests.
func fixtureSeeds(t testing.TB) [][]byte {
	toks := seqTokens(1, 8)
	return [][]byte{
		payloadA(t),
		payloadB(t),
		golden(t, `93 cb 41 da 39 de 00 20 00 00 91 93 ac 'BlockRemoved' 91 cf da b8 9b aa 7b 58 57 c0 a3 'GPU' 00`),
		golden(t, `93 cb 41 da 39 de 00 20 00 00 91 91 b0 'AllBlocksCleared' 00`),
		golden(t, `93 cb 41 da 39 de 00 20 00 00 91 81 a4 'type' b0 'AllBlocksCleared' 00`),
		golden(t, `92 cb 41 da 39 de 00 20 00 00 91 93 ac 'BlockRemoved' 91 d3 da b8 9b aa 7b 58 57 c0 a3 'GPU'`),
		arrayBatch(1, storedArr([]uint64{1, 2}, u64p(3), toks, 4,
			v(func(e mp) mp { return e.i(2).str("CPU").str("lora") }),
			v(func(e mp) mp { return e.arr(2).arr(2).str("salt").str("lora").arr(1).arr(2).str("img").i(0) }),
			v(func(e mp) mp { return e.i(0).str("full_attention").null() }),
		)),
		arrayBatch(noRank, v(func(e mp) mp {
			e = e.arr(7).str("BlockStored").arr(1).i(-5).null().arr(4)
			for i := range 4 {
				e = e.arr(2).i(int64(i)).i(int64(i + 1))
			}
			return e.i(4).null().str("GPU")
		})),
		mp(nil).m(3).str("ts").f(1).str("events").arr(2).
			raw(storedMap([]uint64{1}, nil, toks[:4], 4, v(func(e mp) mp { return e.str("locality").str("REMOTE") }))).
			raw(v(func(e mp) mp { return e.arr(1).str("Unknown") })).
			str("attn_dp_rank").i(2),
		arrayBatch(0, storedArr([]uint64{1}, nil, toks[:4], 4,
			v(func(e mp) mp { return e.null().str("GPU").m(1).str("cache_salt").str("s") }))),
	}
}

// dialectFormat is the encoder Format that a fake-engine dialect publishes with.
func dialectFormat(d fakeengine.Dialect) fakeengine.Format {
	o := d.Apply(fakeengine.Options{})
	return fakeengine.Format{
		Events: o.Encoding, BatchAsMap: o.BatchAsMap, Hashes: o.HashFormat, ExtraFields: o.ExtraFields,
		RootParent: o.RootParent, TokenPairs: o.TokenPairs, ArrayFullLength: o.ArrayFullLength,
	}
}

// wireVariantSeeds returns batches in the wire variants engines really send (see
// docs/ENGINES.md): every fake-engine dialect (full-length SGLang arrays with int64
// hashes, EAGLE token pairs, TensorRT-LLM's signed radix-key hashes, hybrid group
// events), every root-parent spelling (nil, absent, integer 0, zero bytes), the
// llm-d storage tier's bin-wrapped events, tokenless stores with block_size 0, and
// the mediums of offloading connectors.
func wireVariantSeeds() [][]byte {
	const bs = 4
	toks := seqTokens(70000, 2*bs) // above 16 bits
	hashes := []uint64{0xdab89baa7b5857c0, 0x1f00_0000_0000_0001}
	root := fakeengine.Event{Kind: fakeengine.BlockStored, BlockHashes: hashes, TokenIDs: toks,
		BlockSize: bs, Medium: fakeengine.MediumGPU}
	child := fakeengine.Event{Kind: fakeengine.BlockStored, BlockHashes: []uint64{0x8000_0000_0000_0000},
		ParentHash: hashes[1], HasParent: true, TokenIDs: toks[:bs], BlockSize: bs, Medium: fakeengine.MediumGPU}
	removed := fakeengine.Event{Kind: fakeengine.BlockRemoved, BlockHashes: hashes, Medium: fakeengine.MediumGPU}
	mirror := func(ev fakeengine.Event) fakeengine.Event {
		ev.HasGroup, ev.GroupIdx = true, fakeengine.MirrorGroup
		if ev.Kind == fakeengine.BlockStored {
			ev.SpecKind, ev.SlidingWindow = fakeengine.MirrorSpecKind, fakeengine.MirrorSlidingWindow
		}
		return ev
	}
	batch := func(f fakeengine.Format, rank bool, evs ...fakeengine.Event) []byte {
		return fakeengine.AppendBatch(nil, fakeengine.Batch{Timestamp: 1760000000.25, Events: evs, HasDPRank: rank}, f)
	}

	var out [][]byte
	for _, d := range fakeengine.Dialects() {
		f := dialectFormat(d)
		evs := []fakeengine.Event{root, child, removed}
		if d == fakeengine.DialectHybrid {
			evs = append(evs, mirror(root), mirror(child), mirror(removed))
		}
		out = append(out, batch(f, true, evs...), batch(f, false, fakeengine.Event{Kind: fakeengine.AllBlocksCleared}))
	}
	for _, f := range []fakeengine.Format{{}, {Events: fakeengine.EncodingArray}, {BatchAsMap: true}} {
		for _, rp := range []fakeengine.RootParentForm{fakeengine.RootParentAbsent, fakeengine.RootParentZero} {
			f.RootParent = rp
			out = append(out, batch(f, true, root))
		}
	}
	// Hashes as bytes, and a root parent of 32 and of 8 zero bytes.
	out = append(out, batch(fakeengine.Format{Hashes: fakeengine.HashBytes32}, true, child, removed))
	for _, n := range []int{32, 8} {
		out = append(out, arrayBatch(0, v(func(e mp) mp {
			return e.arr(7).str("BlockStored").hashes(hashes...).bin(make([]byte, n)).tokens(toks).i(bs).null().str("GPU")
		})))
	}
	// Stores without tokens and with block_size 0, in every tier medium met.
	for i, m := range []string{"Disk", "SHARED_STORAGE", "OBJECT_STORE", "CPU", "file_system"} {
		f := fakeengine.Format{Events: fakeengine.Encoding(i % 2), RootParent: fakeengine.RootParentZero}
		out = append(out, batch(f, i%2 == 0,
			fakeengine.Event{Kind: fakeengine.BlockStored, BlockHashes: hashes, Medium: m},
			fakeengine.Event{Kind: fakeengine.BlockStored, BlockHashes: hashes[:1], TokenIDs: toks[:bs], Medium: m},
			fakeengine.Event{Kind: fakeengine.BlockRemoved, BlockHashes: hashes, Medium: m}))
	}
	// The llm-d storage tier: [ts, events] where each event is a bin holding a
	// separately encoded positional event with root parent 0 and no tokens.
	inner := fakeengine.Format{Events: fakeengine.EncodingArray, RootParent: fakeengine.RootParentZero}
	wrapped := mp(nil).arr(2).f(1760000000.5).arr(3)
	for _, ev := range []fakeengine.Event{
		{Kind: fakeengine.BlockStored, BlockHashes: hashes, Medium: "SHARED_STORAGE"},
		{Kind: fakeengine.BlockRemoved, BlockHashes: hashes[:1], Medium: "OBJECT_STORE"},
		root,
	} {
		wrapped = wrapped.bin(fakeengine.AppendEvent(nil, &ev, inner))
	}
	return append(out, wrapped)
}

// TestWireVariantSeedsDecode checks that the wire-variant seeds are batches the
// decoder accepts, so fuzzing starts from the real shapes rather than errors.
func TestWireVariantSeedsDecode(t *testing.T) {
	d, err := NewDecoder(DecoderOptions{})
	require.NoError(t, err)
	for i, s := range wireVariantSeeds() {
		b, err := d.Decode(s)
		require.NoError(t, err, "seed %d", i)
		require.Zero(t, b.Skipped[SkipMalformed], "seed %d", i)
		require.Positive(t, len(b.Events)+b.SkippedTotal(), "seed %d", i)
	}
}

func FuzzDecodeBatch(f *testing.F) {
	for _, s := range fuzzSeeds(f) {
		f.Add(s)
	}
	opts := DecoderOptions{MaxEvents: 64, MaxBlocksPerEvent: 64, MaxTokensPerEvent: 1024}
	f.Fuzz(func(t *testing.T, payload []byte) {
		d, err := NewDecoder(opts)
		require.NoError(t, err)
		b, err := d.Decode(payload)
		if err != nil {
			require.ErrorIs(t, err, ErrMalformed)
			require.Nil(t, b)
			return
		}
		require.LessOrEqual(t, len(b.Events), opts.MaxEvents)
		for _, ev := range b.Events {
			require.Contains(t, []kvindex.Tier{kvindex.TierDevice, kvindex.TierHost, kvindex.TierDisk}, ev.Tier)
			require.LessOrEqual(t, len(ev.BlockHashes), opts.MaxBlocksPerEvent)
			require.LessOrEqual(t, len(ev.Tokens), opts.MaxTokensPerEvent)
			switch ev.Kind {
			case kvindex.EventStored:
				require.GreaterOrEqual(t, ev.BlockSize, 0)
				if ev.Extra != nil {
					require.Len(t, ev.Extra, len(ev.BlockHashes))
					require.NotEqual(t, 0, slicesMax(ev.Extra))
				}
			case kvindex.EventRemoved:
				require.Nil(t, ev.Tokens)
				require.Nil(t, ev.Extra)
			case kvindex.EventCleared:
				require.Nil(t, ev.BlockHashes)
				require.Nil(t, ev.Tokens)
			default:
				t.Fatalf("kind %v", ev.Kind)
			}
		}

		// Round trip: re-encoding the decoded batch as map events and decoding it
		// again gives the same events (extra-key digests cannot be re-encoded).
		want := cloneEvents(b.Events)
		ts, rank, hasRank := b.Timestamp, b.DPRank, b.HasDPRank
		again, err := d.Decode(encodeBatch(ts, rank, hasRank, want))
		require.NoError(t, err)
		require.Equal(t, math.Float64bits(ts), math.Float64bits(again.Timestamp))
		require.Equal(t, hasRank, again.HasDPRank)
		require.Equal(t, rank, again.DPRank)
		require.Zero(t, again.SkippedTotal())
		for i := range want {
			want[i].Extra = nil
		}
		require.Equal(t, want, cloneEvents(again.Events))
	})
}

func slicesMax(xs []uint64) uint64 {
	var m uint64
	for _, x := range xs {
		m = max(m, x)
	}
	return m
}

func cloneEvents(evs []kvindex.Event) []kvindex.Event {
	out := make([]kvindex.Event, len(evs))
	for i, ev := range evs {
		if ev.BlockHashes != nil {
			ev.BlockHashes = append([]uint64(nil), ev.BlockHashes...)
		}
		if ev.Tokens != nil {
			ev.Tokens = append([]uint32(nil), ev.Tokens...)
		}
		ev.Extra = nil
		out[i] = ev
	}
	return out
}

// encodeBatch writes events in the vLLM >= 0.26 form: an array batch of map events.
func encodeBatch(ts float64, rank int, hasRank bool, evs []kvindex.Event) []byte {
	var e mp
	if hasRank {
		e = e.arr(3)
	} else {
		e = e.arr(2)
	}
	e = e.f(ts).arr(len(evs))
	media := map[kvindex.Tier]string{kvindex.TierDevice: "GPU", kvindex.TierHost: "CPU", kvindex.TierDisk: "DISK"}
	for _, ev := range evs {
		switch ev.Kind {
		case kvindex.EventStored:
			e = e.m(9).str("type").str("BlockStored").str("block_hashes").hashes(ev.BlockHashes...)
			e = e.str("parent_block_hash")
			if ev.HasParent {
				e = e.u(ev.ParentHash)
			} else {
				e = e.null()
			}
			e = e.str("token_ids").tokens(ev.Tokens).str("block_size")
			if ev.BlockSize == 0 {
				e = e.null()
			} else {
				e = e.i(int64(ev.BlockSize))
			}
			e = e.str("lora_id").null().str("medium").str(media[ev.Tier])
			e = e.str("lora_name").str(ev.LoRAName).str("cache_salt").str(ev.CacheSalt)
		case kvindex.EventRemoved:
			e = e.m(3).str("type").str("BlockRemoved").str("block_hashes").hashes(ev.BlockHashes...).
				str("medium").str(media[ev.Tier])
		case kvindex.EventCleared:
			e = e.m(1).str("type").str("AllBlocksCleared")
		}
	}
	if hasRank {
		e = e.i(int64(rank))
	}
	return e
}

// FuzzSkipValue checks the iterative skipper against msgp.Skip.
func FuzzSkipValue(f *testing.F) {
	for _, s := range fuzzSeeds(f) {
		f.Add(s)
	}
	f.Add([]byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0x01})
	f.Add([]byte{0xc7, 0x01, 0x05, 0x00})
	f.Fuzz(func(t *testing.T, b []byte) {
		mine, err1 := skipValue(b)
		theirs, err2 := msgp.Skip(b)
		if errors.Is(err2, msgp.ErrRecursion) {
			return
		}
		require.Equal(t, err1 == nil, err2 == nil, "mine %v, msgp %v", err1, err2)
		if err1 == nil {
			require.Equal(t, len(theirs), len(mine))
		}
	})
}
