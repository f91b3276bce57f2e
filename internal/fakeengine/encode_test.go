package fakeengine

import (
	"encoding/hex"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/tinylib/msgp/msgp"
)

// unhex turns a hex dump (spaces and newlines allowed) into bytes.
func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.Join(strings.Fields(s), ""))
	require.NoError(t, err)
	return b
}

// str is the fixstr encoding of a short ASCII string, for hand-built fixtures.
func str(s string) string {
	return hex.EncodeToString(append([]byte{0xa0 | byte(len(s))}, s...))
}

const goldenHash uint64 = 0xdab89baa7b5857c0 // 15760518052499183552

// goldenBatch is the content of the research doc's §1.8 payloads: one BlockStored
// of one 4-token block, medium GPU, rank 0, ts 1760000000.5.
func goldenBatch(events ...Event) Batch {
	if events == nil {
		events = []Event{{
			Kind:        BlockStored,
			BlockHashes: []uint64{goldenHash},
			TokenIDs:    []uint32{1, 2, 3, 4},
			BlockSize:   4,
			Medium:      "GPU",
		}}
	}
	return Batch{Timestamp: 1760000000.5, Events: events, DPRank: 0, HasDPRank: true}
}

func TestAppendBatchGoldenArray(t *testing.T) {
	// Payload A of wire-formats.md §1.8 (48 bytes).
	want := unhex(t, `
		93
		cb 41 da 39 de 00 20 00 00
		91
		 98
		  ab 42 6c 6f 63 6b 53 74 6f 72 65 64
		  91 cf da b8 9b aa 7b 58 57 c0
		  c0
		  94 01 02 03 04
		  04
		  c0
		  a3 47 50 55
		  c0
		00`)
	require.Len(t, want, 48)
	got := AppendBatch(nil, goldenBatch(), Format{Events: EncodingArray})
	require.Equal(t, want, got)
}

func TestAppendBatchGoldenMap(t *testing.T) {
	// Payload B of wire-formats.md §1.8 (130 bytes).
	want := unhex(t, `
		93 cb 41 da 39 de 00 20 00 00 91
		88
		 a4 74 79 70 65  ab 42 6c 6f 63 6b 53 74 6f 72 65 64
		 ac 62 6c 6f 63 6b 5f 68 61 73 68 65 73  91 cf da b8 9b aa 7b 58 57 c0
		 b1 70 61 72 65 6e 74 5f 62 6c 6f 63 6b 5f 68 61 73 68  c0
		 a9 74 6f 6b 65 6e 5f 69 64 73  94 01 02 03 04
		 aa 62 6c 6f 63 6b 5f 73 69 7a 65  04
		 a7 6c 6f 72 61 5f 69 64  c0
		 a6 6d 65 64 69 75 6d  a3 47 50 55
		 a9 6c 6f 72 61 5f 6e 61 6d 65  c0
		00`)
	require.Len(t, want, 130)
	got := AppendBatch(nil, goldenBatch(), Format{Events: EncodingMap})
	require.Equal(t, want, got)
}

func TestAppendBatchGoldenOtherEvents(t *testing.T) {
	const head = "93 cb 41 da 39 de 00 20 00 00"
	removed := Event{Kind: BlockRemoved, BlockHashes: []uint64{goldenHash}, Medium: "GPU"}
	cleared := Event{Kind: AllBlocksCleared}
	hash := "cf da b8 9b aa 7b 58 57 c0"
	cases := []struct {
		name string
		ev   Event
		f    Format
		want string
	}{
		{"removed/array", removed, Format{Events: EncodingArray},
			head + " 91 93" + str("BlockRemoved") + "91" + hash + str("GPU") + "00"},
		{"removed/map", removed, Format{},
			head + " 91 83" + str("type") + str("BlockRemoved") + str("block_hashes") + "91" + hash +
				str("medium") + str("GPU") + "00"},
		{"cleared/array", cleared, Format{Events: EncodingArray},
			head + " 91 91 b0" + hex.EncodeToString([]byte("AllBlocksCleared")) + "00"},
		{"cleared/map", cleared, Format{},
			head + " 91 81" + str("type") + "b0" + hex.EncodeToString([]byte("AllBlocksCleared")) + "00"},
		{"removed/int64", removed, Format{Events: EncodingArray, Hashes: HashInt64},
			head + " 91 93" + str("BlockRemoved") + "91 d3 da b8 9b aa 7b 58 57 c0" + str("GPU") + "00"},
		{"removed/int64-positive", Event{Kind: BlockRemoved, BlockHashes: []uint64{5, 1 << 40}},
			Format{Events: EncodingArray, Hashes: HashInt64},
			head + " 91 93" + str("BlockRemoved") + "92 05 cf 00 00 01 00 00 00 00 00 c0 00"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := AppendBatch(nil, goldenBatch(tc.ev), tc.f)
			require.Equal(t, unhex(t, tc.want), got)
		})
	}
}

func TestAppendBatchHashBytes32(t *testing.T) {
	got := AppendBatch(nil, goldenBatch(Event{Kind: BlockRemoved, BlockHashes: []uint64{goldenHash}}),
		Format{Events: EncodingArray, Hashes: HashBytes32})
	prefix := unhex(t, "93 cb 41 da 39 de 00 20 00 00 91 93"+str("BlockRemoved")+"91 c4 20")
	require.Equal(t, prefix, got[:len(prefix)])
	digest := got[len(prefix) : len(prefix)+32]
	require.Equal(t, unhex(t, "da b8 9b aa 7b 58 57 c0"), digest[24:], "hash in the last 8 bytes")
	require.NotEqual(t, make([]byte, 24), digest[:24], "filler is not zero")
	require.Equal(t, unhex(t, "c0 00"), got[len(prefix)+32:])

	d := decodeBatch(t, got)
	require.Equal(t, []uint64{goldenHash}, asHashes(t, d.events[0]["block_hashes"]))
}

func TestAppendBatchShapes(t *testing.T) {
	stored := Event{
		Kind: BlockStored, BlockHashes: []uint64{7, goldenHash}, ParentHash: 3, HasParent: true,
		TokenIDs: seqTokens(100, 4), BlockSize: 2, LoRAName: "ad", Medium: "GPU",
		ExtraKeys: [][]string{{"ad", "salt"}, {"ad"}},
	}
	for _, f := range []Format{
		{}, {Events: EncodingArray}, {BatchAsMap: true}, {Hashes: HashInt64}, {Hashes: HashBytes32},
		{ExtraFields: true}, {Events: EncodingArray, ExtraFields: true, BatchAsMap: true, Hashes: HashBytes32},
	} {
		for _, hasDP := range []bool{true, false} {
			b := Batch{Timestamp: 12.25, Events: []Event{stored, {Kind: BlockRemoved, BlockHashes: []uint64{9}}}, DPRank: 3, HasDPRank: hasDP}
			d := decodeBatch(t, AppendBatch(nil, b, f))
			require.Equal(t, 12.25, d.ts)
			require.Equal(t, hasDP, d.hasDP)
			if hasDP {
				require.Equal(t, int64(3), asInt(t, d.dp))
			}
			require.Len(t, d.events, 2)
			s := d.events[0]
			require.Equal(t, "BlockStored", s["type"])
			require.Equal(t, []uint64{7, goldenHash}, asHashes(t, s["block_hashes"]))
			require.Equal(t, uint64(3), asHash(t, s["parent_block_hash"]))
			require.Equal(t, seqTokens(100, 4), asTokens(t, s["token_ids"]))
			require.Equal(t, int64(2), asInt(t, s["block_size"]))
			require.Nil(t, s["lora_id"])
			require.Equal(t, "GPU", s["medium"])
			require.Equal(t, "ad", s["lora_name"])
			require.Equal(t, []any{[]any{"ad", "salt"}, []any{"ad"}}, s["extra_keys"])
			if f.ExtraFields {
				require.Len(t, s, 11)
				require.Equal(t, int64(0), asInt(t, s["group_idx"]))
				require.Equal(t, "full_attention", s["kv_cache_spec_kind"])
			} else {
				require.Len(t, s, 9)
			}
			r := d.events[1]
			require.Equal(t, "BlockRemoved", r["type"])
			require.Equal(t, []uint64{9}, asHashes(t, r["block_hashes"]))
			require.Nil(t, r["medium"])
		}
	}
}

func TestAppendBatchExtraFieldsNilKeys(t *testing.T) {
	ev := Event{Kind: BlockStored, BlockHashes: []uint64{1, 2}, TokenIDs: seqTokens(0, 2), BlockSize: 1}
	d := decodeBatch(t, AppendBatch(nil, Batch{Events: []Event{ev}}, Format{ExtraFields: true}))
	require.Equal(t, []any{nil, nil}, d.events[0]["extra_keys"], "one nil per block, like vLLM v0.26")
	d = decodeBatch(t, AppendBatch(nil, Batch{Events: []Event{ev}}, Format{}))
	_, has := d.events[0]["extra_keys"]
	require.False(t, has, "omitted when default")
}

func BenchmarkAppendBatch(b *testing.B) {
	hashes := make([]uint64, 16)
	for i := range hashes {
		hashes[i] = splitmix64(uint64(i))
	}
	batch := Batch{Timestamp: 1, HasDPRank: true, Events: []Event{{
		Kind: BlockStored, BlockHashes: hashes, TokenIDs: seqTokens(1000, 256), BlockSize: 16, Medium: "GPU",
	}}}
	for _, f := range []struct {
		name string
		f    Format
	}{{"map", Format{}}, {"array", Format{Events: EncodingArray}}} {
		b.Run(f.name, func(b *testing.B) {
			b.ReportAllocs()
			buf := make([]byte, 0, 4096)
			for b.Loop() {
				buf = AppendBatch(buf[:0], batch, f.f)
			}
		})
	}
}

// rawEvent returns the first event of an encoded batch as msgp decodes it
// generically: a map for map events, a slice for positional ones.
func rawEvent(t *testing.T, payload []byte) any {
	t.Helper()
	v, rest, err := msgp.ReadIntfBytes(payload)
	require.NoError(t, err)
	require.Empty(t, rest)
	var events any
	switch b := v.(type) {
	case []any:
		events = b[1]
	case map[string]any:
		events = b["events"]
	}
	return events.([]any)[0]
}

func TestAppendBatchRootParent(t *testing.T) {
	root := Event{Kind: BlockStored, BlockHashes: []uint64{goldenHash}, TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 4, Medium: "GPU"}
	child := root
	child.ParentHash, child.HasParent = 7, true
	cases := []struct {
		form RootParentForm
		enc  Encoding
		want string // hex of the parent_block_hash value of the root; "" for absent
	}{
		{RootParentNil, EncodingMap, "c0"},
		{RootParentNil, EncodingArray, "c0"},
		{RootParentAbsent, EncodingMap, ""},
		{RootParentAbsent, EncodingArray, "c0"}, // a position cannot be left out
		{RootParentZero, EncodingMap, "00"},
		{RootParentZero, EncodingArray, "00"},
	}
	for _, tc := range cases {
		t.Run(tc.form.String()+"/"+tc.enc.String(), func(t *testing.T) {
			f := Format{Events: tc.enc, RootParent: tc.form}
			got := AppendBatch(nil, goldenBatch(root), f)
			parentKey, tokensKey := "", ""
			if tc.enc == EncodingMap {
				parentKey, tokensKey = str("parent_block_hash"), str("token_ids")
			}
			hashes := "91 cf da b8 9b aa 7b 58 57 c0"
			if tc.want == "" {
				require.NotContains(t, hex.EncodeToString(got), hex.EncodeToString([]byte("parent_block_hash")))
				require.Len(t, rawEvent(t, got), 7, "one key fewer")
			} else {
				require.Contains(t, hex.EncodeToString(got),
					hex.EncodeToString(unhex(t, hashes+parentKey+tc.want+tokensKey+"94 01 02 03 04")))
			}
			// A run with a parent writes it in every form.
			d := decodeBatch(t, AppendBatch(nil, goldenBatch(child), f))
			require.Equal(t, uint64(7), asHash(t, d.events[0]["parent_block_hash"]))
		})
	}
}

func TestAppendBatchTokenPairs(t *testing.T) {
	ev := Event{Kind: BlockStored, BlockHashes: []uint64{5, 6}, TokenIDs: []uint32{1, 2, 3, 300}, BlockSize: 2}
	for _, enc := range []Encoding{EncodingMap, EncodingArray} {
		got := AppendBatch(nil, goldenBatch(ev), Format{Events: enc, TokenPairs: true})
		// One pair per token, the last repeating its token; 300 is a uint16.
		require.Contains(t, hex.EncodeToString(got), hex.EncodeToString(unhex(t, "94 92 01 02 92 02 03 92 03 cd 01 2c 92 cd 01 2c cd 01 2c")))
		d := decodeBatch(t, got)
		require.Equal(t, []uint32{1, 2, 3, 300}, asTokens(t, d.events[0]["token_ids"]))
	}
	// One token is one pair.
	one := Event{Kind: BlockStored, BlockHashes: []uint64{5}, TokenIDs: []uint32{9}, BlockSize: 1}
	d := decodeBatch(t, AppendBatch(nil, goldenBatch(one), Format{TokenPairs: true}))
	require.Equal(t, []any{[]any{int64(9), int64(9)}}, d.events[0]["token_ids"])
}

func TestAppendBatchArrayFullLength(t *testing.T) {
	f := Format{Events: EncodingArray, ArrayFullLength: true}
	// Payload A of wire-formats.md §1.8 in SGLang's shape: no lora_name.
	want := unhex(t, `
		93 cb 41 da 39 de 00 20 00 00
		91
		 97
		  ab 42 6c 6f 63 6b 53 74 6f 72 65 64
		  91 cf da b8 9b aa 7b 58 57 c0
		  c0
		  94 01 02 03 04
		  04
		  c0
		  a3 47 50 55
		00`)
	require.Equal(t, want, AppendBatch(nil, goldenBatch(), f))

	// The rank is always there, nil when unset.
	b := goldenBatch()
	b.HasDPRank = false
	got := AppendBatch(nil, b, f)
	require.Equal(t, want[:len(want)-1], got[:len(got)-1])
	require.Equal(t, byte(0xc0), got[len(got)-1])
	v, _, err := msgp.ReadIntfBytes(AppendBatch(nil, b, Format{BatchAsMap: true, ArrayFullLength: true}))
	require.NoError(t, err)
	rank, has := v.(map[string]any)["data_parallel_rank"]
	require.True(t, has, "map batch carries the rank key too")
	require.Nil(t, rank)

	cases := []struct {
		name string
		ev   Event
		n    int
	}{
		{"nil medium still written", Event{Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{1}, BlockSize: 1}, 7},
		{"lora", Event{Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{1}, BlockSize: 1, LoRAName: "ad"}, 8},
		{"extra keys", Event{Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{1}, BlockSize: 1,
			ExtraKeys: [][]string{{"salt"}}}, 9},
		{"removed", Event{Kind: BlockRemoved, BlockHashes: []uint64{1}}, 3},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ev := rawEvent(t, AppendBatch(nil, goldenBatch(tc.ev), f)).([]any)
			require.Len(t, ev, tc.n)
			if tc.ev.Kind == BlockStored {
				require.Nil(t, ev[storedMedium])
			}
		})
	}
}

func TestAppendBatchGroups(t *testing.T) {
	mirror := Event{
		Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{1, 2}, BlockSize: 2, Medium: "GPU",
		GroupIdx: 1, SpecKind: "sliding_window", SlidingWindow: 128, HasGroup: true,
	}
	main := Event{Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{1, 2}, BlockSize: 2, HasGroup: true}
	removed := Event{Kind: BlockRemoved, BlockHashes: []uint64{1}, GroupIdx: 1, HasGroup: true}
	for _, enc := range []Encoding{EncodingMap, EncodingArray} {
		t.Run(enc.String(), func(t *testing.T) {
			f := Format{Events: enc}
			d := decodeBatch(t, AppendBatch(nil, goldenBatch(mirror, main, removed), f))
			m := d.events[0]
			require.Equal(t, int64(1), asInt(t, m["group_idx"]))
			require.Equal(t, "sliding_window", m["kv_cache_spec_kind"])
			require.Equal(t, int64(128), asInt(t, m["kv_cache_spec_sliding_window"]))
			require.Nil(t, m["extra_keys"])
			if enc == EncodingArray {
				require.Len(t, m, numStoredFields, "extra_keys held by nil up to position 11")
			} else {
				require.Len(t, m, 11, "no extra_keys key")
			}
			require.Equal(t, int64(0), asInt(t, d.events[1]["group_idx"]))
			require.Equal(t, "full_attention", d.events[1]["kv_cache_spec_kind"])
			_, has := d.events[1]["kv_cache_spec_sliding_window"]
			require.False(t, has, "no window for full attention")
			require.Len(t, d.events[2], 4)
			require.Equal(t, int64(1), asInt(t, d.events[2]["group_idx"]))
		})
	}
}
