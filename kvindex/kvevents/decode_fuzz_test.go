package kvevents

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/tinylib/msgp/msgp"

	"github.com/kvselect/kvselect/kvindex"
)

// fuzzSeeds returns the fixtures of the decoder tests, as fuzzing seeds.
func fuzzSeeds(t testing.TB) [][]byte {
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
			require.True(t, ev.Tier.Valid())
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
