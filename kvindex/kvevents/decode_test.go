package kvevents

import (
	"encoding/hex"
	"errors"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/tinylib/msgp/msgp"

	"github.com/kvselect/kvselect/kvindex"
)

// --- fixture helpers ---

// golden turns a spaced hex listing into bytes; a token in single quotes stands for
// its ASCII bytes (without any msgpack header).
func golden(t testing.TB, listing string) []byte {
	t.Helper()
	var out []byte
	for _, tok := range strings.Fields(listing) {
		if strings.HasPrefix(tok, "'") {
			require.True(t, strings.HasSuffix(tok, "'") && len(tok) >= 2, "bad token %q", tok)
			out = append(out, tok[1:len(tok)-1]...)
			continue
		}
		b, err := hex.DecodeString(tok)
		require.NoError(t, err, "token %q", tok)
		out = append(out, b...)
	}
	return out
}

// mp is a small msgpack writer for building payloads in tests.
type mp []byte

func (e mp) arr(n int) mp    { return msgp.AppendArrayHeader(e, uint32(n)) }
func (e mp) m(n int) mp      { return msgp.AppendMapHeader(e, uint32(n)) }
func (e mp) str(s string) mp { return msgp.AppendString(e, s) }
func (e mp) u(v uint64) mp   { return msgp.AppendUint64(e, v) }
func (e mp) i(v int64) mp    { return msgp.AppendInt64(e, v) }
func (e mp) f(v float64) mp  { return msgp.AppendFloat64(e, v) }
func (e mp) null() mp        { return msgp.AppendNil(e) }
func (e mp) bin(b []byte) mp { return msgp.AppendBytes(e, b) }
func (e mp) raw(b []byte) mp { return append(e, b...) }

func (e mp) hashes(hs ...uint64) mp {
	e = e.arr(len(hs))
	for _, h := range hs {
		e = e.u(h)
	}
	return e
}

func (e mp) tokens(ts []uint32) mp {
	e = e.arr(len(ts))
	for _, t := range ts {
		e = e.u(uint64(t))
	}
	return e
}

// arrayBatch encodes [ts, events] or [ts, events, dp] (dp < 0: two elements;
// dp == nilRank: nil rank).
func arrayBatch(dp int, events ...[]byte) []byte {
	var e mp
	if dp < 0 && dp != nilRank {
		e = e.arr(2)
	} else {
		e = e.arr(3)
	}
	e = e.f(1760000000.5).arr(len(events))
	for _, ev := range events {
		e = e.raw(ev)
	}
	switch {
	case dp == nilRank:
		e = e.null()
	case dp >= 0:
		e = e.i(int64(dp))
	}
	return e
}

const (
	noRank  = -1
	nilRank = -2
)

func seqTokens(start, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(start + i)
	}
	return out
}

// storedMap encodes a map-form BlockStored with the given extra keys appended.
func storedMap(hashes []uint64, parent *uint64, tokens []uint32, bs int, extra ...[]byte) []byte {
	var e mp
	pairs := 0
	for _, x := range extra {
		pairs += countValues(x)
	}
	e = e.m(5 + pairs/2)
	e = e.str("type").str("BlockStored")
	e = e.str("block_hashes").hashes(hashes...)
	e = e.str("parent_block_hash")
	if parent != nil {
		e = e.u(*parent)
	} else {
		e = e.null()
	}
	e = e.str("token_ids").tokens(tokens)
	e = e.str("block_size").i(int64(bs))
	for _, x := range extra {
		e = e.raw(x)
	}
	return e
}

// storedArr encodes a positional BlockStored with fields after block_size given
// as raw values (lora_id, medium, lora_name, extra_keys, group_idx, ...).
func storedArr(hashes []uint64, parent *uint64, tokens []uint32, bs int, tail ...[]byte) []byte {
	var e mp
	n := 0
	for _, x := range tail {
		n += countValues(x)
	}
	e = e.arr(5 + n).str("BlockStored").hashes(hashes...)
	if parent != nil {
		e = e.u(*parent)
	} else {
		e = e.null()
	}
	e = e.tokens(tokens).i(int64(bs))
	for _, x := range tail {
		e = e.raw(x)
	}
	return e
}

func v(f func(mp) mp) []byte { return f(nil) }

// countValues returns the number of consecutive msgpack values in b.
func countValues(b []byte) int {
	n := 0
	for len(b) > 0 {
		rest, err := msgp.Skip(b)
		if err != nil {
			panic(err)
		}
		b = rest
		n++
	}
	return n
}

func u64p(x uint64) *uint64 { return &x }

const hashA = uint64(0xdab89baa7b5857c0)

// payloadA is wire-formats §1.8 payload A: positional batch, one BlockStored.
func payloadA(t testing.TB) []byte {
	b := golden(t, `93 cb 41 da 39 de 00 20 00 00 91
		98 ab 'BlockStored' 91 cf da b8 9b aa 7b 58 57 c0 c0 94 01 02 03 04 04 c0 a3 'GPU' c0
		00`)
	require.Len(t, b, 48)
	return b
}

// payloadB is wire-formats §1.8 payload B: the same content with a map event.
func payloadB(t testing.TB) []byte {
	b := golden(t, `93 cb 41 da 39 de 00 20 00 00 91
		88
		a4 'type' ab 'BlockStored'
		ac 'block_hashes' 91 cf da b8 9b aa 7b 58 57 c0
		b1 'parent_block_hash' c0
		a9 'token_ids' 94 01 02 03 04
		aa 'block_size' 04
		a7 'lora_id' c0
		a6 'medium' a3 'GPU'
		a9 'lora_name' c0
		00`)
	require.Len(t, b, 130)
	return b
}

func storedA() kvindex.Event {
	return kvindex.Event{
		Kind: kvindex.EventStored, Tier: kvindex.TierDevice,
		BlockHashes: []uint64{hashA}, Tokens: []uint32{1, 2, 3, 4}, BlockSize: 4,
	}
}

func newTestDecoder(t testing.TB, opts DecoderOptions) *Decoder {
	t.Helper()
	d, err := NewDecoder(opts)
	require.NoError(t, err)
	return d
}

// skips builds an expected Skipped array.
func skips(kv ...any) [NumSkipReasons]int {
	var out [NumSkipReasons]int
	for i := 0; i < len(kv); i += 2 {
		out[kv[i].(SkipReason)] = kv[i+1].(int)
	}
	return out
}

// --- golden and table tests ---

func TestDecodeGoldenPayloads(t *testing.T) {
	sha := make([]byte, 32)
	for i := range sha {
		sha[i] = byte(i + 1)
	}
	removedArr := golden(t, `93 cb 41 da 39 de 00 20 00 00 91
		93 ac 'BlockRemoved' 91 cf da b8 9b aa 7b 58 57 c0 a3 'GPU' 00`)
	removedMap := golden(t, `93 cb 41 da 39 de 00 20 00 00 91
		83 a4 'type' ac 'BlockRemoved' ac 'block_hashes' 91 cf da b8 9b aa 7b 58 57 c0 a6 'medium' a3 'GPU' 00`)
	clearedArr := golden(t, `93 cb 41 da 39 de 00 20 00 00 91 91 b0 'AllBlocksCleared' 00`)
	clearedMap := golden(t, `93 cb 41 da 39 de 00 20 00 00 91 81 a4 'type' b0 'AllBlocksCleared' 00`)
	binHash := golden(t, `92 cb 41 da 39 de 00 20 00 00 91
		93 ac 'BlockRemoved' 91 c4 20 `+hex.EncodeToString(sha)+` a3 'GPU'`)
	negHash := golden(t, `93 cb 41 da 39 de 00 20 00 00 91
		93 ac 'BlockRemoved' 91 d3 da b8 9b aa 7b 58 57 c0 a3 'GPU' 00`)
	// Payload B as vLLM 0.26 really sends it: 11 keys.
	payloadB11 := golden(t, `93 cb 41 da 39 de 00 20 00 00 91
		8b
		a4 'type' ab 'BlockStored'
		ac 'block_hashes' 91 cf da b8 9b aa 7b 58 57 c0
		b1 'parent_block_hash' c0
		a9 'token_ids' 94 01 02 03 04
		aa 'block_size' 04
		a7 'lora_id' c0
		a6 'medium' a3 'GPU'
		a9 'lora_name' c0
		aa 'extra_keys' 91 c0
		a9 'group_idx' 00
		b2 'kv_cache_spec_kind' ae 'full_attention'
		00`)

	removed := kvindex.Event{Kind: kvindex.EventRemoved, Tier: kvindex.TierDevice, BlockHashes: []uint64{hashA}}
	cleared := kvindex.Event{Kind: kvindex.EventCleared}

	tests := []struct {
		name    string
		payload []byte
		rank    int
		hasRank bool
		want    []kvindex.Event
	}{
		{"payload A positional", payloadA(t), 0, true, []kvindex.Event{storedA()}},
		{"payload B map", payloadB(t), 0, true, []kvindex.Event{storedA()}},
		{"payload B with vLLM 0.26 defaults", payloadB11, 0, true, []kvindex.Event{storedA()}},
		{"removed positional", removedArr, 0, true, []kvindex.Event{removed}},
		{"removed map", removedMap, 0, true, []kvindex.Event{removed}},
		{"cleared positional", clearedArr, 0, true, []kvindex.Event{cleared}},
		{"cleared map", clearedMap, 0, true, []kvindex.Event{cleared}},
		{"sha256 bytes hash, two-element batch", binHash, 0, false, []kvindex.Event{{
			Kind: kvindex.EventRemoved, BlockHashes: []uint64{0x191a1b1c1d1e1f20},
		}}},
		{"negative int64 hash", negHash, 0, true, []kvindex.Event{removed}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDecoder(t, DecoderOptions{})
			b, err := d.Decode(tc.payload)
			require.NoError(t, err)
			require.Equal(t, 1760000000.5, b.Timestamp)
			require.Equal(t, tc.hasRank, b.HasDPRank)
			require.Equal(t, tc.rank, b.DPRank)
			require.Equal(t, tc.want, b.Events)
			require.Zero(t, b.SkippedTotal())
		})
	}
}

func TestDecodeEvents(t *testing.T) {
	toks8 := seqTokens(100, 8)
	tests := []struct {
		name    string
		payload []byte
		want    []kvindex.Event
		skipped [NumSkipReasons]int
	}{
		{
			name:    "parent hash and int64-reinterpreted block hashes",
			payload: arrayBatch(0, storedArr([]uint64{7, 1 << 63}, u64p(5), toks8, 4)),
			want: []kvindex.Event{{Kind: kvindex.EventStored, BlockHashes: []uint64{7, 1 << 63},
				ParentHash: 5, HasParent: true, Tokens: toks8, BlockSize: 4}},
		},
		{
			name: "no parent spelled nil, absent, integer 0 and zero bytes",
			payload: arrayBatch(noRank,
				storedArr([]uint64{1}, nil, toks8[:4], 4),
				storedArr([]uint64{2}, u64p(0), toks8[:4], 4),
				v(func(e mp) mp {
					return e.m(4).str("type").str("BlockStored").str("block_hashes").hashes(3).
						str("token_ids").tokens(toks8[:4]).str("block_size").i(4)
				}),
				v(func(e mp) mp {
					return e.arr(5).str("BlockStored").hashes(4).bin(make([]byte, 32)).tokens(toks8[:4]).i(4)
				}),
				v(func(e mp) mp { return e.arr(5).str("BlockStored").hashes(5).i(0).tokens(toks8[:4]).i(4) }),
			),
			want: []kvindex.Event{
				{Kind: kvindex.EventStored, BlockHashes: []uint64{1}, Tokens: toks8[:4], BlockSize: 4},
				{Kind: kvindex.EventStored, BlockHashes: []uint64{2}, Tokens: toks8[:4], BlockSize: 4},
				{Kind: kvindex.EventStored, BlockHashes: []uint64{3}, Tokens: toks8[:4], BlockSize: 4},
				{Kind: kvindex.EventStored, BlockHashes: []uint64{4}, Tokens: toks8[:4], BlockSize: 4},
				{Kind: kvindex.EventStored, BlockHashes: []uint64{5}, Tokens: toks8[:4], BlockSize: 4},
			},
		},
		{
			name: "events sent as encoded bytes (llm-d storage publisher) and stores without tokens",
			payload: arrayBatch(noRank,
				v(func(e mp) mp { return e.bin(storedArr([]uint64{6}, u64p(0), toks8[:4], 4)) }),
				v(func(e mp) mp {
					return e.bin(v(func(e mp) mp { return e.arr(3).str("BlockRemoved").hashes(6).str("SHARED_STORAGE") }))
				}),
				v(func(e mp) mp { return e.bin(append(storedArr([]uint64{7}, nil, toks8[:4], 4), 0xc0)) }), // trailing byte
				v(func(e mp) mp { return e.bin([]byte{0x01}) }),                                            // not an event
				v(func(e mp) mp { return e.arr(5).str("BlockStored").hashes(8).null().arr(0).i(0) }),
			),
			want: []kvindex.Event{
				{Kind: kvindex.EventStored, BlockHashes: []uint64{6}, Tokens: toks8[:4], BlockSize: 4},
				{Kind: kvindex.EventRemoved, Tier: kvindex.TierDisk, BlockHashes: []uint64{6}},
			},
			skipped: skips(SkipMalformed, 2, SkipNoTokens, 1),
		},
		{
			name: "TensorRT-LLM's C++ writer: every integer as int64",
			payload: v(func(e mp) mp {
				e = e.arr(3).f(1).arr(1).m(5).str("type").str("BlockStored").
					str("block_hashes").arr(1).raw([]byte{0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe}).
					str("parent_block_hash").null().str("token_ids").arr(4)
				for _, tk := range toks8[:4] {
					e = e.raw([]byte{0xd3, 0, 0, 0, 0, 0, 0, 0, byte(tk)})
				}
				return e.str("block_size").raw([]byte{0xd3, 0, 0, 0, 0, 0, 0, 0, 4}).raw([]byte{0xd3, 0, 0, 0, 0, 0, 0, 0, 2})
			}),
			want: []kvindex.Event{{Kind: kvindex.EventStored, BlockHashes: []uint64{^uint64(1)}, Tokens: toks8[:4], BlockSize: 4}},
		},
		{
			name: "SGLang short tuple ending at lora_id, negative hashes, two-element batch",
			payload: arrayBatch(noRank, v(func(e mp) mp {
				return e.arr(6).str("BlockStored").arr(2).i(-2).i(-3).i(-1).tokens(toks8).i(4).null()
			})),
			want: []kvindex.Event{{Kind: kvindex.EventStored, BlockHashes: []uint64{^uint64(1), ^uint64(2)},
				ParentHash: ^uint64(0), HasParent: true, Tokens: toks8, BlockSize: 4}},
		},
		{
			name: "SGLang tuple ending at block_size",
			payload: arrayBatch(0, v(func(e mp) mp {
				return e.arr(5).str("BlockStored").hashes(1).null().tokens(toks8[:4]).i(4)
			})),
			want: []kvindex.Event{{Kind: kvindex.EventStored, BlockHashes: []uint64{1}, Tokens: toks8[:4], BlockSize: 4}},
		},
		{
			name: "SGLang medium CPU_PINNED and metadata map with cache salt",
			payload: arrayBatch(0, storedArr([]uint64{1}, nil, toks8[:4], 4,
				v(func(e mp) mp { return e.null() }),
				v(func(e mp) mp { return e.str("CPU_PINNED") }),
				v(func(e mp) mp { return e.m(2).str("cache_salt").str("tenant-a").str("other").i(1) }),
			)),
			want: []kvindex.Event{{Kind: kvindex.EventStored, Tier: kvindex.TierHost, BlockHashes: []uint64{1},
				Tokens: toks8[:4], BlockSize: 4, CacheSalt: "tenant-a"}},
		},
		{
			name: "SGLang removed without medium, extra trailing elements ignored",
			payload: arrayBatch(0,
				v(func(e mp) mp { return e.arr(2).str("BlockRemoved").hashes(3, 4) }),
				v(func(e mp) mp { return e.arr(6).str("BlockRemoved").hashes(5).str("DISK").i(0).str("x").arr(0) }),
				v(func(e mp) mp { return e.arr(2).str("AllBlocksCleared").str("whatever") }),
			),
			want: []kvindex.Event{
				{Kind: kvindex.EventRemoved, BlockHashes: []uint64{3, 4}},
				{Kind: kvindex.EventRemoved, Tier: kvindex.TierDisk, BlockHashes: []uint64{5}},
				{Kind: kvindex.EventCleared},
			},
		},
		{
			name: "bigram token ids: one pair per token, the first element is the token",
			payload: arrayBatch(0,
				v(func(e mp) mp {
					e = e.arr(5).str("BlockStored").hashes(1, 2).null().arr(8)
					for i := range 8 {
						e = e.arr(2).u(uint64(10 + i)).u(uint64(11 + i))
					}
					return e.i(4)
				}),
				v(func(e mp) mp { // pairs that do not overlap
					return e.arr(5).str("BlockStored").hashes(3).null().arr(2).arr(2).u(1).u(2).arr(2).u(5).u(6).i(2)
				}),
			),
			want: []kvindex.Event{{Kind: kvindex.EventStored, BlockHashes: []uint64{1, 2},
				Tokens: seqTokens(10, 8), BlockSize: 4}},
			skipped: skips(SkipMalformed, 1),
		},
		{
			name: "all token widths",
			payload: arrayBatch(0, v(func(e mp) mp {
				return e.arr(5).str("BlockStored").hashes(1).null().
					arr(4).raw([]byte{0x05}).raw([]byte{0xd0, 0x7f}).raw([]byte{0xd3, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}).
					raw([]byte{0xcf, 0, 0, 0, 0, 0, 0, 1, 0}).i(4)
			})),
			want: []kvindex.Event{{Kind: kvindex.EventStored, BlockHashes: []uint64{1},
				Tokens: []uint32{5, 127, 0xffffffff, 256}, BlockSize: 4}},
		},
		{
			name: "non-main group, non-full-attention kind and non-local locality are ignored",
			payload: arrayBatch(0,
				storedMap([]uint64{1}, nil, toks8[:4], 4, v(func(e mp) mp { return e.str("group_idx").i(1) })),
				storedArr([]uint64{2}, nil, toks8[:4], 4, v(func(e mp) mp {
					return e.null().str("GPU").null().null().i(2)
				})),
				storedMap([]uint64{3}, nil, toks8[:4], 4, v(func(e mp) mp { return e.str("kv_cache_spec_kind").str("sliding_window") })),
				storedArr([]uint64{4}, nil, toks8[:4], 4, v(func(e mp) mp {
					return e.null().str("GPU").null().null().i(0).str("mamba")
				})),
				storedMap([]uint64{5}, nil, toks8[:4], 4, v(func(e mp) mp { return e.str("locality").str("REMOTE") })),
				storedMap([]uint64{6}, nil, toks8[:4], 4, v(func(e mp) mp { return e.str("locality").str("somewhere") })),
				v(func(e mp) mp {
					return e.m(3).str("type").str("BlockRemoved").str("block_hashes").hashes(7).str("group_idx").i(3)
				}),
				// Kept: group 0, MLA kind, LOCAL locality (lower case), explicit nils.
				storedMap([]uint64{8}, nil, toks8[:4], 4, v(func(e mp) mp {
					return e.str("group_idx").i(0).str("kv_cache_spec_kind").str("MLA_attention").
						str("locality").str("local").str("kv_cache_spec_sliding_window").null()
				})),
				storedMap([]uint64{9}, nil, toks8[:4], 4, v(func(e mp) mp {
					return e.str("group_idx").null().str("kv_cache_spec_kind").null().str("locality").null()
				})),
			),
			want: []kvindex.Event{
				{Kind: kvindex.EventStored, BlockHashes: []uint64{8}, Tokens: toks8[:4], BlockSize: 4},
				{Kind: kvindex.EventStored, BlockHashes: []uint64{9}, Tokens: toks8[:4], BlockSize: 4},
			},
			skipped: skips(SkipNonMainGroup, 3, SkipNonMainKind, 2, SkipLocality, 2),
		},
		{
			name: "a filtered field before the type key still reports an unknown type",
			payload: arrayBatch(0, v(func(e mp) mp {
				return e.m(2).str("group_idx").i(4).str("type").str("BlockUpdated")
			})),
			skipped: skips(SkipUnknownType, 1),
		},
		{
			name: "unknown tags are skipped and the other events still decode",
			payload: arrayBatch(0,
				v(func(e mp) mp { return e.arr(3).str("BlockUpdated").hashes(1).map0() }),
				storedArr([]uint64{1}, nil, toks8[:4], 4),
				v(func(e mp) mp { return e.m(2).str("type").str("Snapshot").str("block_hashes").str("not even hashes") }),
				v(func(e mp) mp { return e.arr(2).str("BlockRemoved").hashes(1) }),
			),
			want: []kvindex.Event{
				{Kind: kvindex.EventStored, BlockHashes: []uint64{1}, Tokens: toks8[:4], BlockSize: 4},
				{Kind: kvindex.EventRemoved, BlockHashes: []uint64{1}},
			},
			skipped: skips(SkipUnknownType, 2),
		},
		{
			name: "corrupted events in the middle are skipped",
			payload: arrayBatch(0,
				storedArr([]uint64{1}, nil, toks8[:4], 4),
				v(func(e mp) mp { return e.arr(5).str("BlockStored").str("hashes?").null().tokens(toks8[:4]).i(4) }),
				v(func(e mp) mp { return e.arr(5).str("BlockStored").hashes(2).str("parent?").tokens(toks8[:4]).i(4) }),
				v(func(e mp) mp { return e.arr(5).str("BlockStored").hashes(2).null().arr(1).str("tok").i(4) }),
				v(func(e mp) mp { return e.arr(5).str("BlockStored").hashes(2).null().tokens(toks8[:4]).i(-4) }),
				v(func(e mp) mp { return e.arr(1).str("BlockStored") }),
				v(func(e mp) mp { return e.arr(0) }),
				v(func(e mp) mp { return e.str("BlockStored") }),
				v(func(e mp) mp { return e.arr(1).i(3) }),
				v(func(e mp) mp { return e.m(1).str("block_hashes").hashes(1) }),
				v(func(e mp) mp { return e.m(1).i(1).hashes(1) }),
				v(func(e mp) mp {
					return e.m(3).str("type").str("BlockRemoved").str("block_hashes").hashes(1).str("block_hashes").hashes(2)
				}),
				v(func(e mp) mp { return e.arr(3).str("BlockRemoved").hashes(1).i(42) }),
				v(func(e mp) mp { return e.arr(4).str("BlockRemoved").hashes(1).null().str("zero") }),
				v(func(e mp) mp { return e.arr(2).str("BlockRemoved").arr(1).f(1.5) }),
				v(func(e mp) mp { return e.arr(5).str("BlockStored").hashes(2).null().arr(2).arr(2).i(1).i(2).i(3).i(4) }),
				v(func(e mp) mp {
					return e.arr(5).str("BlockStored").hashes(2).null().arr(2).arr(2).i(1).i(2).arr(3).i(2).i(3).i(4).i(4)
				}),
				storedMap([]uint64{3}, nil, toks8[:4], 4),
			),
			want: []kvindex.Event{
				{Kind: kvindex.EventStored, BlockHashes: []uint64{1}, Tokens: toks8[:4], BlockSize: 4},
				{Kind: kvindex.EventStored, BlockHashes: []uint64{3}, Tokens: toks8[:4], BlockSize: 4},
			},
			skipped: skips(SkipMalformed, 16),
		},
		{
			name: "token ids outside uint32 and unknown media are skipped",
			payload: arrayBatch(0,
				v(func(e mp) mp { return e.arr(5).str("BlockStored").hashes(1).null().arr(1).i(-1).i(1) }),
				v(func(e mp) mp { return e.arr(5).str("BlockStored").hashes(1).null().arr(1).u(1 << 32).i(1) }),
				v(func(e mp) mp { return e.arr(5).str("BlockStored").hashes(1).null().arr(1).u(1 << 63).i(1) }),
				v(func(e mp) mp { return e.arr(3).str("BlockRemoved").hashes(1).str("TAPE") }),
				storedArr([]uint64{1}, nil, toks8[:4], 4, v(func(e mp) mp { return e.null().str("a-very-long-medium-name") })),
				v(func(e mp) mp { return e.arr(3).str("BlockRemoved").hashes(1).str("cuda") }),
			),
			want:    []kvindex.Event{{Kind: kvindex.EventRemoved, BlockHashes: []uint64{1}}},
			skipped: skips(SkipTokenRange, 3, SkipUnknownMedium, 2),
		},
		{
			name: "lora_name wins over lora_id; a lone lora_id names the adapter",
			payload: arrayBatch(0,
				storedArr([]uint64{1}, nil, toks8[:4], 4, v(func(e mp) mp { return e.i(7).str("GPU").str("sql-adapter") })),
				storedArr([]uint64{2}, nil, toks8[:4], 4, v(func(e mp) mp { return e.i(7).str("GPU").null() })),
				storedArr([]uint64{3}, nil, toks8[:4], 4, v(func(e mp) mp { return e.str("a1") })),
				storedArr([]uint64{4}, nil, toks8[:4], 4, v(func(e mp) mp { return e.i(0) })),
				storedMap([]uint64{5}, nil, toks8[:4], 4, v(func(e mp) mp { return e.str("lora_id").u(1 << 63) })),
			),
			want: []kvindex.Event{
				{Kind: kvindex.EventStored, BlockHashes: []uint64{1}, Tokens: toks8[:4], BlockSize: 4, LoRAName: "sql-adapter"},
				{Kind: kvindex.EventStored, BlockHashes: []uint64{2}, Tokens: toks8[:4], BlockSize: 4, LoRAName: "lora-id:7"},
				{Kind: kvindex.EventStored, BlockHashes: []uint64{3}, Tokens: toks8[:4], BlockSize: 4, LoRAName: "lora-id:a1"},
				{Kind: kvindex.EventStored, BlockHashes: []uint64{4}, Tokens: toks8[:4], BlockSize: 4},
				{Kind: kvindex.EventStored, BlockHashes: []uint64{5}, Tokens: toks8[:4], BlockSize: 4, LoRAName: "lora-id:9223372036854775808"},
			},
		},
		{
			name: "block size nil means the index's; unknown keys are ignored",
			payload: arrayBatch(0, v(func(e mp) mp {
				return e.m(6).str("type").str("BlockStored").str("future").m(1).str("x").arr(1).i(1).
					str("block_hashes").hashes(1).str("token_ids").tokens(toks8[:4]).str("block_size").null().
					str("is_eagle").raw([]byte{0xc2})
			})),
			want: []kvindex.Event{{Kind: kvindex.EventStored, BlockHashes: []uint64{1}, Tokens: toks8[:4]}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDecoder(t, DecoderOptions{})
			b, err := d.Decode(tc.payload)
			require.NoError(t, err)
			if tc.want == nil {
				require.Empty(t, b.Events)
			} else {
				require.Equal(t, tc.want, b.Events)
			}
			require.Equal(t, tc.skipped, b.Skipped)
		})
	}
}

func (e mp) map0() mp { return e.m(0) }

func TestDecodeExtraKeys(t *testing.T) {
	toks := seqTokens(1, 8)
	mm := v(func(e mp) mp { return e.arr(2).str("img-1").i(3) })
	hex64 := strings.Repeat("ab", 32)
	decodeOne := func(t *testing.T, ev []byte) kvindex.Event {
		t.Helper()
		d := newTestDecoder(t, DecoderOptions{})
		b, err := d.Decode(arrayBatch(0, ev))
		require.NoError(t, err)
		require.Zero(t, b.SkippedTotal(), "skipped: %v", b.Skipped)
		require.Len(t, b.Events, 1)
		ev0 := b.Events[0]
		ev0.Extra = append([]uint64(nil), ev0.Extra...)
		if len(ev0.Extra) == 0 {
			ev0.Extra = nil
		}
		return ev0
	}
	extraKeys := func(entries ...[]byte) []byte {
		e := mp(nil).str("extra_keys").arr(len(entries))
		for _, x := range entries {
			e = e.raw(x)
		}
		return e
	}
	null := v(func(e mp) mp { return e.null() })
	empty := v(func(e mp) mp { return e.arr(0) })

	t.Run("no extras leave Extra nil", func(t *testing.T) {
		ev := decodeOne(t, storedMap([]uint64{1, 2}, nil, toks, 4, extraKeys(null, empty)))
		require.Nil(t, ev.Extra)
	})
	t.Run("a multimodal key marks only its block", func(t *testing.T) {
		ev := decodeOne(t, storedMap([]uint64{1, 2}, nil, toks, 4,
			extraKeys(null, v(func(e mp) mp { return e.arr(1).raw(mm) }))))
		require.Len(t, ev.Extra, 2)
		require.Zero(t, ev.Extra[0])
		require.NotZero(t, ev.Extra[1])
	})
	t.Run("different keys give different digests, equal keys equal ones", func(t *testing.T) {
		other := v(func(e mp) mp { return e.arr(2).str("img-2").i(3) })
		ev := decodeOne(t, storedMap([]uint64{1, 2}, u64p(9), toks, 4,
			extraKeys(v(func(e mp) mp { return e.arr(1).raw(mm) }), v(func(e mp) mp { return e.arr(1).raw(other) }))))
		ev2 := decodeOne(t, storedMap([]uint64{1, 2}, u64p(9), toks, 4,
			extraKeys(v(func(e mp) mp { return e.arr(1).raw(mm) }), null)))
		require.NotEqual(t, ev.Extra[0], ev.Extra[1])
		require.Equal(t, ev.Extra[0], ev2.Extra[0])
	})
	t.Run("the LoRA name in every block is not an extra", func(t *testing.T) {
		lora := v(func(e mp) mp { return e.arr(1).str("sql") })
		ev := decodeOne(t, storedMap([]uint64{1, 2}, nil, toks, 4,
			v(func(e mp) mp { return e.str("lora_name").str("sql") }), extraKeys(lora, lora)))
		require.Nil(t, ev.Extra)
		require.Equal(t, "sql", ev.LoRAName)
		require.Empty(t, ev.CacheSalt)
	})
	t.Run("a plain string in the first block of a sequence is the cache salt", func(t *testing.T) {
		ev := decodeOne(t, storedMap([]uint64{1, 2}, nil, toks, 4,
			extraKeys(v(func(e mp) mp { return e.arr(2).str("sql").str("tenant-7") }), null),
			v(func(e mp) mp { return e.str("lora_name").str("sql") })))
		require.Nil(t, ev.Extra)
		require.Equal(t, "tenant-7", ev.CacheSalt)
		require.Equal(t, "sql", ev.LoRAName)
	})
	t.Run("an explicit salt equal to the key is not an extra; a different string is", func(t *testing.T) {
		ev := decodeOne(t, storedMap([]uint64{1}, nil, toks[:4], 4,
			v(func(e mp) mp { return e.str("cache_salt").str("s1") }),
			extraKeys(v(func(e mp) mp { return e.arr(1).str("s1") }))))
		require.Nil(t, ev.Extra)
		ev = decodeOne(t, storedMap([]uint64{1}, nil, toks[:4], 4,
			v(func(e mp) mp { return e.str("cache_salt").str("s1") }),
			extraKeys(v(func(e mp) mp { return e.arr(1).str("s2") }))))
		require.Len(t, ev.Extra, 1)
		require.NotZero(t, ev.Extra[0])
		require.Equal(t, "s1", ev.CacheSalt)
	})
	t.Run("strings after a parent and hex digests are extras", func(t *testing.T) {
		ev := decodeOne(t, storedMap([]uint64{1}, u64p(3), toks[:4], 4,
			extraKeys(v(func(e mp) mp { return e.arr(1).str("tenant-7") }))))
		require.Len(t, ev.Extra, 1)
		require.Empty(t, ev.CacheSalt)
		ev = decodeOne(t, storedMap([]uint64{1}, nil, toks[:4], 4,
			extraKeys(v(func(e mp) mp { return e.arr(1).str(hex64) }))))
		require.Len(t, ev.Extra, 1)
		require.Empty(t, ev.CacheSalt)
	})
	t.Run("a bare bytes entry is an extra", func(t *testing.T) {
		ev := decodeOne(t, storedMap([]uint64{1}, u64p(3), toks[:4], 4,
			extraKeys(v(func(e mp) mp { return e.bin([]byte{1, 2, 3}) }))))
		require.Len(t, ev.Extra, 1)
		require.NotZero(t, ev.Extra[0])
	})
	t.Run("extras with the wrong entry count are malformed", func(t *testing.T) {
		d := newTestDecoder(t, DecoderOptions{})
		b, err := d.Decode(arrayBatch(0, storedMap([]uint64{1, 2}, nil, toks, 4,
			extraKeys(v(func(e mp) mp { return e.arr(1).raw(mm) })))))
		require.NoError(t, err)
		require.Empty(t, b.Events)
		require.Equal(t, skips(SkipMalformed, 1), b.Skipped)
	})
	t.Run("positional extra_keys", func(t *testing.T) {
		ev := decodeOne(t, storedArr([]uint64{1}, u64p(2), toks[:4], 4,
			null, v(func(e mp) mp { return e.str("GPU") }), null,
			v(func(e mp) mp { return e.arr(1).arr(1).raw(mm) })))
		require.Len(t, ev.Extra, 1)
		require.NotZero(t, ev.Extra[0])
	})
}

func TestDecodeBatchEnvelope(t *testing.T) {
	ev := storedArr([]uint64{1}, nil, seqTokens(0, 4), 4)
	mapBatch := func(rankKey string, rank []byte) []byte {
		e := mp(nil).m(3).str("ts").f(12.5).str("events").arr(1).raw(ev)
		return e.str(rankKey).raw(rank)
	}
	tests := []struct {
		name    string
		payload []byte
		ts      float64
		rank    int
		hasRank bool
	}{
		{"array with rank", arrayBatch(3, ev), 1760000000.5, 3, true},
		{"array without rank", arrayBatch(noRank, ev), 1760000000.5, 0, false},
		{"array with nil rank", arrayBatch(nilRank, ev), 1760000000.5, 0, false},
		{"array with extra elements", append(mp(nil).arr(4).i(17).arr(1).raw(ev).i(2), mp(nil).str("later")...), 17, 2, true},
		{"map data_parallel_rank", mapBatch("data_parallel_rank", mp(nil).i(5)), 12.5, 5, true},
		{"map dp_rank", mapBatch("dp_rank", mp(nil).i(6)), 12.5, 6, true},
		{"map attn_dp_rank", mapBatch("attn_dp_rank", mp(nil).u(7)), 12.5, 7, true},
		{"map nil rank", mapBatch("data_parallel_rank", mp(nil).null()), 12.5, 0, false},
		{"map unknown key", mapBatch("origin", mp(nil).str("x")), 12.5, 0, false},
		{"map without ts, non-string key", mp(nil).m(2).i(1).i(2).str("events").arr(1).raw(ev), 0, 0, false},
		{"float32 ts", mp(nil).arr(2).raw(msgp.AppendFloat32(nil, 2.5)).arr(1).raw(ev), 2.5, 0, false},
		{"uint ts", mp(nil).arr(2).u(1 << 40).arr(1).raw(ev), 1 << 40, 0, false},
		{"nil ts", mp(nil).arr(2).null().arr(1).raw(ev), 0, 0, false},
		{"empty events", mp(nil).arr(2).f(1).arr(0), 1, 0, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDecoder(t, DecoderOptions{})
			b, err := d.Decode(tc.payload)
			require.NoError(t, err)
			require.Equal(t, tc.ts, b.Timestamp)
			require.Equal(t, tc.hasRank, b.HasDPRank)
			require.Equal(t, tc.rank, b.DPRank)
			if tc.name != "empty events" {
				require.Len(t, b.Events, 1)
			}
		})
	}
}

func TestDecodeMalformedBatches(t *testing.T) {
	good := payloadA(t)
	ev := storedArr([]uint64{1}, nil, seqTokens(0, 4), 4)
	tests := []struct {
		name    string
		payload []byte
	}{
		{"empty", nil},
		{"invalid byte", []byte{0xc1}},
		{"not a container", mp(nil).str("hello")},
		{"array of one", mp(nil).arr(1).f(1)},
		{"array declares more than it holds", mp(nil).arr(3).f(1).arr(0)},
		{"ts is a string", mp(nil).arr(2).str("now").arr(0)},
		{"events is not an array", mp(nil).arr(2).f(1).m(0)},
		{"rank is negative", mp(nil).arr(3).f(1).arr(0).i(-1)},
		{"rank is too large", mp(nil).arr(3).f(1).arr(0).i(1 << 40)},
		{"rank is a string", mp(nil).arr(3).f(1).arr(0).str("0")},
		{"truncated event", good[:len(good)-3]},
		{"truncated ts", good[:5]},
		{"trailing bytes", append(append([]byte(nil), good...), 0x00)},
		{"map without events", mp(nil).m(1).str("ts").f(1)},
		{"map with duplicate events", mp(nil).m(2).str("events").arr(0).str("events").arr(0)},
		{"map declares more than it holds", mp(nil).m(9).str("events").arr(0)},
		{"map with truncated value", mp(nil).m(1).str("x").raw([]byte{0xd9, 0x05, 'a'})},
		{"map with bad rank", mp(nil).m(2).str("events").arr(0).str("dp_rank").f(1)},
		{"events array32 declaring 4G events", mp(nil).arr(2).f(1).raw([]byte{0xdd, 0xff, 0xff, 0xff, 0xff}).raw(ev)},
		{"event with array32 of 4G tokens", mp(nil).arr(2).f(1).arr(1).arr(5).str("BlockStored").hashes(1).null().
			raw([]byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02})},
		{"event with str32 of 4 GiB", mp(nil).arr(2).f(1).arr(1).arr(2).str("BlockRemoved").raw([]byte{0xdb, 0xff, 0xff, 0xff, 0xff, 'x'})},
		{"event with map32 of 4G entries", mp(nil).arr(2).f(1).arr(1).raw([]byte{0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, 'x'})},
		{"deep nesting", append(append(mp(nil).arr(2).f(1).arr(1), []byte(strings.Repeat("\x91", 100000))...), 0x01, 0x00)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDecoder(t, DecoderOptions{})
			b, err := d.Decode(tc.payload)
			require.ErrorIs(t, err, ErrMalformed)
			require.Nil(t, b)
			require.True(t, strings.HasPrefix(err.Error(), "kvevents: "), err.Error())
			// The decoder stays usable.
			b, err = d.Decode(good)
			require.NoError(t, err)
			require.Equal(t, []kvindex.Event{storedA()}, b.Events)
		})
	}
}

func TestDecodeHugeDeclaredLengthsDoNotAllocate(t *testing.T) {
	d := newTestDecoder(t, DecoderOptions{})
	hostile := [][]byte{
		mp(nil).arr(2).f(1).raw([]byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0x90}),
		mp(nil).m(1).str("events").raw([]byte{0xdd, 0x7f, 0xff, 0xff, 0xff}),
		mp(nil).arr(2).f(1).arr(1).arr(5).str("BlockStored").raw([]byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0x01}),
		mp(nil).raw([]byte{0xdf, 0xff, 0xff, 0xff, 0xff}),
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range 100 {
		for _, p := range hostile {
			_, err := d.Decode(p)
			require.ErrorIs(t, err, ErrMalformed)
		}
	}
	runtime.ReadMemStats(&after)
	// Only the small error values may be allocated: far below one 4G-element slice.
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20))
}

func TestDecodeLimits(t *testing.T) {
	toks := seqTokens(0, 8)
	payload := arrayBatch(0,
		storedArr([]uint64{1, 2}, nil, toks, 4),
		storedArr([]uint64{1, 2, 3}, nil, append(toks, seqTokens(8, 4)...), 4),
		storedArr([]uint64{1}, nil, toks, 8),
		v(func(e mp) mp { return e.arr(2).str("BlockRemoved").hashes(1, 2, 3) }),
		v(func(e mp) mp { return e.arr(1).str("AllBlocksCleared") }),
		v(func(e mp) mp { return e.arr(1).str("AllBlocksCleared") }),
	)
	d := newTestDecoder(t, DecoderOptions{MaxEvents: 3, MaxBlocksPerEvent: 2, MaxTokensPerEvent: 8})
	b, err := d.Decode(payload)
	require.NoError(t, err)
	require.Len(t, b.Events, 3)
	require.Equal(t, []uint64{1, 2}, b.Events[0].BlockHashes)
	require.Equal(t, 8, b.Events[1].BlockSize)
	require.Equal(t, kvindex.EventCleared, b.Events[2].Kind)
	// Too many hashes (event 2), too many hashes (removed), one event over MaxEvents.
	require.Equal(t, skips(SkipLimit, 3), b.Skipped)

	d = newTestDecoder(t, DecoderOptions{MaxTokensPerEvent: 7})
	b, err = d.Decode(arrayBatch(0,
		storedArr([]uint64{1, 2}, nil, toks, 4),
		storedArr([]uint64{1}, nil, toks[:4], 9),
		v(func(e mp) mp {
			e = e.arr(5).str("BlockStored").hashes(1, 2).null().arr(8)
			for i := range 8 {
				e = e.arr(2).i(int64(i)).i(int64(i + 1))
			}
			return e.i(4)
		}),
	))
	require.NoError(t, err)
	require.Empty(t, b.Events)
	require.Equal(t, skips(SkipLimit, 3), b.Skipped)
}

func TestNewDecoderValidatesOptions(t *testing.T) {
	_, err := NewDecoder(DecoderOptions{MaxEvents: -1, MaxTokensPerEvent: -5})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.Contains(t, err.Error(), "MaxEvents")
	require.Contains(t, err.Error(), "MaxTokensPerEvent")
	d, err := NewDecoder(DecoderOptions{})
	require.NoError(t, err)
	require.Equal(t, DecoderOptions{
		MaxEvents: DefaultMaxEvents, MaxBlocksPerEvent: DefaultMaxBlocksPerEvent,
		MaxTokensPerEvent: DefaultMaxTokensPerEvent, MaxInternedStrings: DefaultMaxInternedStrings,
	}, d.opts)
}

func TestDecodeReusesBuffers(t *testing.T) {
	d := newTestDecoder(t, DecoderOptions{})
	p1 := arrayBatch(0,
		storedArr([]uint64{1, 2}, nil, seqTokens(0, 8), 4),
		storedArr([]uint64{3}, u64p(2), seqTokens(8, 4), 4),
	)
	b, err := d.Decode(p1)
	require.NoError(t, err)
	require.Len(t, b.Events, 2)
	// Slices are capped: appending to one event's hashes cannot clobber the next.
	require.Equal(t, len(b.Events[0].BlockHashes), cap(b.Events[0].BlockHashes))
	require.Equal(t, len(b.Events[0].Tokens), cap(b.Events[0].Tokens))
	_ = append(b.Events[0].BlockHashes, 99)
	require.Equal(t, []uint64{3}, b.Events[1].BlockHashes)

	b2, err := d.Decode(payloadA(t))
	require.NoError(t, err)
	require.Same(t, b, b2, "the Batch is reused")
	require.Equal(t, []kvindex.Event{storedA()}, b2.Events)

	// A failed decode leaves no stale events behind.
	_, err = d.Decode([]byte{0x90})
	require.ErrorIs(t, err, ErrMalformed)
	require.Empty(t, d.batch.Events)
}

func TestDecodeZeroAllocsSteadyState(t *testing.T) {
	payloads := [][]byte{
		payloadA(t),
		payloadB(t),
		arrayBatch(0,
			storedMap([]uint64{1, 2}, u64p(7), seqTokens(1000, 32), 16,
				v(func(e mp) mp { return e.str("lora_name").str("adapter-1") }),
				v(func(e mp) mp { return e.str("cache_salt").str("tenant") }),
				v(func(e mp) mp { return e.str("extra_keys").arr(2).null().arr(1).arr(2).str("img").i(0) }),
				v(func(e mp) mp { return e.str("medium").str("cpu") }),
				v(func(e mp) mp { return e.str("kv_cache_spec_kind").str("full_attention") }),
			),
			storedArr([]uint64{3}, nil, seqTokens(0, 16), 16, v(func(e mp) mp { return e.i(12) })),
			v(func(e mp) mp { return e.arr(3).str("BlockRemoved").hashes(1, 2).str("GPU") }),
			v(func(e mp) mp { return e.arr(3).str("Unknown").hashes(1, 2).str("GPU") }),
		),
	}
	d := newTestDecoder(t, DecoderOptions{})
	for _, p := range payloads {
		_, err := d.Decode(p)
		require.NoError(t, err)
	}
	allocs := testing.AllocsPerRun(100, func() {
		for _, p := range payloads {
			if _, err := d.Decode(p); err != nil {
				panic(err)
			}
		}
	})
	require.Zero(t, allocs)
	b, err := d.Decode(payloads[2])
	require.NoError(t, err)
	require.Equal(t, "adapter-1", b.Events[0].LoRAName)
	require.Equal(t, "tenant", b.Events[0].CacheSalt)
	require.Equal(t, kvindex.TierHost, b.Events[0].Tier)
	require.Equal(t, "lora-id:12", b.Events[1].LoRAName)
	require.Equal(t, skips(SkipUnknownType, 1), b.Skipped)
}

func TestDecodeInternTableIsBounded(t *testing.T) {
	d := newTestDecoder(t, DecoderOptions{MaxInternedStrings: 2})
	long := strings.Repeat("n", maxInternedLen+1)
	for _, name := range []string{"a", "b", "c", "d", long} {
		b, err := d.Decode(arrayBatch(0, storedArr([]uint64{1}, nil, seqTokens(0, 4), 4,
			v(func(e mp) mp { return e.null().str("GPU").str(name) }))))
		require.NoError(t, err)
		require.Equal(t, name, b.Events[0].LoRAName)
	}
	require.Len(t, d.intern, 2)
}

func TestSkipReasonString(t *testing.T) {
	seen := map[string]bool{}
	for r := range SkipReason(NumSkipReasons) {
		s := r.String()
		require.NotEmpty(t, s)
		require.False(t, seen[s], "duplicate name %q", s)
		seen[s] = true
	}
	require.Equal(t, "skip_reason(200)", SkipReason(200).String())
	require.Equal(t, "non_main_group", SkipNonMainGroup.String())
}

func TestTierOfMedium(t *testing.T) {
	tests := map[string]kvindex.Tier{
		"": kvindex.TierDevice, "GPU": kvindex.TierDevice, "gpu": kvindex.TierDevice, "Cuda": kvindex.TierDevice,
		"CPU": kvindex.TierHost, "cpu_pinned": kvindex.TierHost, "HOST": kvindex.TierHost,
		"DISK": kvindex.TierDisk, "LOCAL_DISK": kvindex.TierDisk, "external": kvindex.TierDisk, "NVME": kvindex.TierDisk,
		// vLLM's offloading mediums and connectors' names.
		"Disk": kvindex.TierDisk, "FS": kvindex.TierDisk, "OBJ": kvindex.TierDisk,
		"SHARED_STORAGE": kvindex.TierDisk, "OBJECT_STORE": kvindex.TierDisk, "file_system": kvindex.TierDisk,
	}
	for name, want := range tests {
		got, ok := tierOf([]byte(name))
		require.True(t, ok, name)
		require.Equal(t, want, got, name)
	}
	for _, name := range []string{"TAPE", "GPU ", "a-medium-name-longer-than-16"} {
		_, ok := tierOf([]byte(name))
		require.False(t, ok, name)
	}
}

func TestSkipValueMatchesMsgp(t *testing.T) {
	inputs := [][]byte{
		payloadA(t), payloadB(t),
		{0xc0}, {0xc2}, {0xca, 0, 0, 0, 0}, {0xd4, 1, 2}, {0xd8, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		{0xc7, 2, 5, 'a', 'b'}, {0xc8, 0, 1, 5, 'a'}, {0xc9, 0, 0, 0, 1, 5, 'a'},
		{0xc4, 2, 1, 2}, {0xc5, 0, 1, 9}, {0xc6, 0, 0, 0, 1, 9}, {0xd9, 1, 'x'}, {0xda, 0, 1, 'x'}, {0xdb, 0, 0, 0, 1, 'x'},
		{0xdc, 0, 2, 1, 2}, {0xdd, 0, 0, 0, 1, 3}, {0xde, 0, 1, 1, 2}, {0xdf, 0, 0, 0, 1, 0xa1, 'k', 0xc0},
		{0xcc, 1}, {0xcd, 1, 2}, {0xce, 1, 2, 3, 4}, {0xcf, 1, 2, 3, 4, 5, 6, 7, 8},
		{0xd0, 1}, {0xd1, 1, 2}, {0xd2, 1, 2, 3, 4}, {0xd3, 1, 2, 3, 4, 5, 6, 7, 8},
		{0x92, 0x81, 0xa1, 'a', 0x01, 0xff, 0x07},
	}
	for _, in := range inputs {
		for cut := 0; cut <= len(in); cut++ {
			b := in[:cut]
			mine, err1 := skipValue(b)
			theirs, err2 := msgp.Skip(b)
			require.Equal(t, err1 == nil, err2 == nil, "input % x: mine %v, msgp %v", b, err1, err2)
			if err1 == nil {
				require.Equal(t, len(theirs), len(mine), "input % x", b)
			}
		}
	}
	_, err := skipValue([]byte{0xc1})
	require.True(t, errors.Is(err, errPrefix))
}

func TestSkipValueDeepNesting(t *testing.T) {
	deep := append([]byte(strings.Repeat("\x91", 1<<20)), 0x01, 0x02)
	rest, err := skipValue(deep)
	require.NoError(t, err)
	require.Equal(t, []byte{0x02}, rest)
}
