package fakeengine

import (
	"crypto/sha256"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/tinylib/msgp/msgp"
)

func TestDialectNames(t *testing.T) {
	ds := Dialects()
	require.Len(t, ds, int(numDialects))
	require.Equal(t, DialectVLLMMap, ds[0], "the default comes first")
	for i, d := range ds {
		require.Equal(t, Dialect(i), d)
		got, err := ParseDialect(d.String())
		require.NoError(t, err)
		require.Equal(t, d, got)
		require.NotEqual(t, "unknown dialect", d.Summary())
		_, err = New(d.Apply(Options{}))
		require.NoError(t, err, "%s is valid", d)
	}
	got, err := ParseDialect(" SGLang-EAGLE ")
	require.NoError(t, err)
	require.Equal(t, DialectSGLangEAGLE, got)
	_, err = ParseDialect("vllm")
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Contains(t, err.Error(), "vllm-map, vllm-array")
	require.Equal(t, "Dialect(200)", Dialect(200).String())
	require.Equal(t, Options{BlockSize: 3}, Dialect(200).Apply(Options{BlockSize: 3}))
}

func TestDialectApply(t *testing.T) {
	base := Options{BlockSize: 4, Topic: "t", DPRank: 2, HashSeed: 9, OmitDPRank: true, BatchAsMap: true}
	cases := []struct {
		d    Dialect
		want Options // the wire fields; the others come from base
	}{
		{DialectVLLMMap, Options{ExtraFields: true}},
		{DialectVLLMArray, Options{Encoding: EncodingArray, ReplayLayout: ReplayNoTopic}},
		{DialectSGLang, Options{Encoding: EncodingArray, ArrayFullLength: true, HashFormat: HashInt64,
			HashScheme: HashSchemeSHA256, ReplayLayout: ReplayNoTopic}},
		{DialectSGLangEAGLE, Options{Encoding: EncodingArray, ArrayFullLength: true, HashFormat: HashInt64,
			HashScheme: HashSchemeSHA256, ReplayLayout: ReplayNoTopic, TokenPairs: true}},
		{DialectTRTLLM, Options{HashFormat: HashInt64, HashScheme: HashSchemeRadixKey}},
		{DialectZeroParent, Options{Encoding: EncodingArray, ReplayLayout: ReplayNoTopic, RootParent: RootParentZero}},
		{DialectFirstSeq1, Options{ExtraFields: true, FirstSeq: 1}},
		{DialectExternal, Options{Encoding: EncodingArray, ReplayLayout: ReplayNoTopic, RootParent: RootParentZero, FirstSeq: 1}},
		{DialectHybrid, Options{ExtraFields: true, HybridGroups: true}},
	}
	require.Len(t, cases, int(numDialects))
	for _, tc := range cases {
		t.Run(tc.d.String(), func(t *testing.T) {
			want := tc.want
			want.BlockSize, want.Topic, want.DPRank, want.HashSeed = 4, "t", 2, 9
			require.Equal(t, want, tc.d.Apply(base))
			// Apply overrides earlier wire choices, so presets never mix.
			require.Equal(t, want, tc.d.Apply(DialectSGLangEAGLE.Apply(DialectExternal.Apply(base))))
		})
	}
}

func TestDialectOptionsValidation(t *testing.T) {
	cases := []struct {
		name string
		o    Options
		want string
	}{
		{"absent root with arrays", Options{Encoding: EncodingArray, RootParent: RootParentAbsent}, "RootParentAbsent needs EncodingMap"},
		{"unknown root form", Options{RootParent: 9}, "unknown RootParent 9"},
		{"pairs of one token", Options{BlockSize: 1, TokenPairs: true}, "TokenPairs needs BlockSize >= 2"},
		{"full length with maps", Options{ArrayFullLength: true}, "ArrayFullLength needs EncodingArray"},
		{"unknown scheme", Options{HashScheme: 9}, "unknown HashScheme 9"},
		{"first seq is the end marker", Options{FirstSeq: EndSeq}, "FirstSeq is EndSeq"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.o)
			require.ErrorIs(t, err, ErrInvalidOptions)
			require.Contains(t, err.Error(), tc.want)
		})
	}
	// Every problem is reported at once.
	_, err := New(Options{Encoding: EncodingMap, ArrayFullLength: true, HashScheme: 9, FirstSeq: EndSeq})
	require.ErrorIs(t, err, ErrInvalidOptions)
	for _, want := range []string{"ArrayFullLength", "HashScheme", "FirstSeq"} {
		require.Contains(t, err.Error(), want)
	}
	for _, ok := range []Options{
		{RootParent: RootParentAbsent}, {Encoding: EncodingArray, RootParent: RootParentZero},
		{BlockSize: 2, TokenPairs: true}, {Encoding: EncodingArray, ArrayFullLength: true, OmitDPRank: true},
		{HybridGroups: true, Encoding: EncodingArray}, {FirstSeq: EndSeq - 1},
	} {
		_, err := New(ok)
		require.NoError(t, err, "%+v", ok)
	}
}

// refSHA256 is SGLang's page hash as wire-formats.md §3.1 describes it, written
// independently of blockHasher (no LoRA, no salt).
func refSHA256(tokens []uint32, bs int) []uint64 {
	var out []uint64
	var prev []byte
	for i := 0; (i+1)*bs <= len(tokens); i++ {
		h := sha256.New()
		h.Write(prev)
		for _, t := range tokens[i*bs : (i+1)*bs] {
			h.Write(binary.LittleEndian.AppendUint32(nil, t))
		}
		prev = h.Sum(nil)
		out = append(out, binary.BigEndian.Uint64(prev[:8]))
	}
	return out
}

// refRadixKey is the documented radix-key chain (no LoRA, no salt): SHA-256 over
// the previous key (le64(seed) for the first block) and the tokens, published as
// the key's first 8 bytes big-endian.
func refRadixKey(tokens []uint32, bs int, seed uint64) []uint64 {
	var out []uint64
	prev := binary.LittleEndian.AppendUint64(nil, seed)
	for i := 0; (i+1)*bs <= len(tokens); i++ {
		h := sha256.New()
		h.Write(prev)
		for _, t := range tokens[i*bs : (i+1)*bs] {
			h.Write(binary.LittleEndian.AppendUint32(nil, t))
		}
		prev = h.Sum(nil)
		out = append(out, binary.BigEndian.Uint64(prev[:8]))
	}
	return out
}

func TestHashSchemes(t *testing.T) {
	p := seqTokens(70000, 37) // 4 blocks of 8 and a partial one; tokens above 16 bits
	chain := newCacheEngine(t, Options{BlockSize: 8}).BlockHashes(p, "", "")
	sg := newCacheEngine(t, Options{BlockSize: 8, HashScheme: HashSchemeSHA256})
	rk := newCacheEngine(t, Options{BlockSize: 8, HashScheme: HashSchemeRadixKey})

	require.Equal(t, refSHA256(p, 8), sg.BlockHashes(p, "", ""))
	require.Equal(t, refRadixKey(p, 8, DefaultHashSeed), rk.BlockHashes(p, "", ""))
	require.NotEqual(t, chain, sg.BlockHashes(p, "", ""))
	require.NotEqual(t, chain, rk.BlockHashes(p, "", ""))

	// SHA-256 ignores the seed; the radix key uses it.
	require.Equal(t, sg.BlockHashes(p, "", ""),
		newCacheEngine(t, Options{BlockSize: 8, HashScheme: HashSchemeSHA256, HashSeed: 3}).BlockHashes(p, "", ""))
	require.NotEqual(t, rk.BlockHashes(p, "", ""),
		newCacheEngine(t, Options{BlockSize: 8, HashScheme: HashSchemeRadixKey, HashSeed: 3}).BlockHashes(p, "", ""))

	for _, e := range []*Engine{sg, rk} {
		h := e.BlockHashes(p, "", "")
		require.Len(t, h, 4)
		// Chained: a different first block changes every later hash.
		q := append([]uint32{1}, p[1:]...)
		for i, x := range e.BlockHashes(q, "", "") {
			require.NotEqual(t, h[i], x)
		}
		// LoRA (every block) and salt (block 0, so every block by chaining) isolate.
		for i, x := range e.BlockHashes(p, "ad", "") {
			require.NotEqual(t, h[i], x)
		}
		for i, x := range e.BlockHashes(p, "", "s") {
			require.NotEqual(t, h[i], x)
		}
	}
}

// walk reads a payload with msgp's streaming readers, element by element, and
// returns the batch length and every event's length (array items or map keys).
func walk(t *testing.T, payload []byte) (batchLen uint32, eventLens []uint32) {
	t.Helper()
	n, b, err := msgp.ReadArrayHeaderBytes(payload)
	require.NoError(t, err)
	_, b, err = msgp.ReadFloat64Bytes(b)
	require.NoError(t, err)
	m, b, err := msgp.ReadArrayHeaderBytes(b)
	require.NoError(t, err)
	for range m {
		var k uint32
		if msgp.NextType(b) == msgp.MapType {
			k, _, err = msgp.ReadMapHeaderBytes(b)
		} else {
			k, _, err = msgp.ReadArrayHeaderBytes(b)
		}
		require.NoError(t, err)
		eventLens = append(eventLens, k)
		b, err = msgp.Skip(b)
		require.NoError(t, err)
	}
	for i := uint32(2); i < n; i++ {
		b, err = msgp.Skip(b)
		require.NoError(t, err)
	}
	require.Empty(t, b)
	return n, eventLens
}

// TestDialectsServe runs the same three requests through every dialect, over
// ZMQ and replay, and checks that each batch says what the dialect promises.
func TestDialectsServe(t *testing.T) {
	const bs = 4
	a := seqTokens(0, 2*bs+1) // two blocks and a partial one
	ab := append(seqTokens(0, 2*bs), seqTokens(500, bs)...)
	c := seqTokens(900, 4*bs) // evicts everything
	for _, d := range Dialects() {
		t.Run(d.String(), func(t *testing.T) {
			o := d.Apply(Options{BlockSize: bs, CapacityBlocks: 4, EnableReplay: true})
			e := startEngine(t, o)
			sub := subscribe(t, e)
			require.Equal(t, o.FirstSeq, e.NextSeq())

			var live [][]byte
			for i, p := range [][]uint32{a, ab, c} {
				r, err := e.Serve(Request{Tokens: p})
				require.NoError(t, err)
				require.Equal(t, o.FirstSeq+uint64(i), r.Seq)
				seq, payload := recvLive(t, sub, DefaultTopic)
				require.Equal(t, o.FirstSeq+uint64(i), seq)
				live = append(live, payload)
			}
			replay := requestReplay(t, dealer(t, e), 0, o.ReplayLayout, DefaultTopic)
			require.Len(t, replay, 3)
			for i, r := range replay {
				require.Equal(t, o.FirstSeq+uint64(i), r.seq)
				require.Equal(t, live[i], r.payload)
			}

			wantKinds := [][]string{{"BlockStored"}, {"BlockStored"}, {"BlockRemoved", "BlockStored"}}
			wantHashes := [][]uint64{
				e.BlockHashes(a, "", ""), e.BlockHashes(ab, "", "")[2:],
				e.BlockHashes(a, "", ""), e.BlockHashes(c, "", ""),
			}
			wantHashes[2] = append(wantHashes[2], e.BlockHashes(ab, "", "")[2])
			wantTokens := [][]uint32{a[:2*bs], ab[2*bs:], nil, c}
			k := 0
			for i, payload := range live {
				n, lens := walk(t, payload)
				require.Equal(t, uint32(3), n, "batch with the rank")
				dec := decodeBatch(t, payload)
				var main, mirror []map[string]any
				var mainLens []uint32
				for j, ev := range dec.events {
					if g, ok := ev["group_idx"]; ok && g != nil && asInt(t, g) == MirrorGroup {
						mirror = append(mirror, ev)
						continue
					}
					main = append(main, ev)
					mainLens = append(mainLens, lens[j])
				}
				require.Len(t, main, len(wantKinds[i]), "one stored event per request")
				for j, ev := range main {
					require.Equal(t, wantKinds[i][j], ev["type"])
					require.ElementsMatch(t, wantHashes[k], asHashes(t, ev["block_hashes"]), "scheme %s", o.HashScheme)
					if ev["type"] == "BlockStored" {
						require.Equal(t, wantTokens[k], asTokens(t, ev["token_ids"]))
						checkStoredShape(t, o, ev, mainLens[j])
						if i == 1 {
							require.Equal(t, e.BlockHashes(ab, "", "")[1], asHash(t, ev["parent_block_hash"]))
						} else {
							checkRootParent(t, o, ev)
						}
					}
					if o.HybridGroups || o.ExtraFields {
						require.Equal(t, int64(0), asInt(t, ev["group_idx"]))
					}
					k++
				}
				if !o.HybridGroups {
					require.Empty(t, mirror)
					continue
				}
				require.Len(t, mirror, len(main))
				for j, m := range mirror {
					ev := main[j]
					require.Equal(t, ev["type"], m["type"])
					var want []uint64
					for _, h := range asHashes(t, ev["block_hashes"]) {
						want = append(want, mirrorHash(h))
					}
					require.Equal(t, want, asHashes(t, m["block_hashes"]))
					if m["type"] == "BlockStored" {
						require.Equal(t, MirrorSpecKind, m["kv_cache_spec_kind"])
						require.Equal(t, int64(MirrorSlidingWindow), asInt(t, m["kv_cache_spec_sliding_window"]))
						require.Equal(t, asTokens(t, ev["token_ids"]), asTokens(t, m["token_ids"]))
						if ev["parent_block_hash"] != nil {
							require.Equal(t, mirrorHash(asHash(t, ev["parent_block_hash"])), asHash(t, m["parent_block_hash"]))
						}
					}
				}
			}
			// The truth describes the main group only.
			require.Equal(t, 4, e.Blocks())
			require.Equal(t, 4, e.HeldPrefix(c, "", ""))
			for _, b := range e.Snapshot() {
				require.Contains(t, e.BlockHashes(c, "", ""), b.Hash)
			}
		})
	}
}

// checkStoredShape checks the event length and the field forms of a stored event.
func checkStoredShape(t *testing.T, o Options, ev map[string]any, n uint32) {
	t.Helper()
	require.Equal(t, MediumGPU, ev["medium"])
	switch {
	case o.ArrayFullLength:
		require.Equal(t, uint32(storedMedium+1), n, "SGLang stops at medium")
	case o.Encoding == EncodingArray && !o.HybridGroups && !o.ExtraFields:
		require.Equal(t, uint32(storedLoRAName+1), n)
	case o.HybridGroups || o.ExtraFields:
		require.Equal(t, "full_attention", ev["kv_cache_spec_kind"])
	}
	pairs := false
	if toks := ev["token_ids"].([]any); len(toks) > 0 {
		_, pairs = toks[0].([]any)
	}
	require.Equal(t, o.TokenPairs, pairs)
	for _, h := range ev["block_hashes"].([]any) {
		if o.HashFormat == HashUint64 {
			require.IsType(t, uint64(0), h, "unsigned hashes")
		}
	}
}

func checkRootParent(t *testing.T, o Options, ev map[string]any) {
	t.Helper()
	v, has := ev["parent_block_hash"]
	switch o.RootParent {
	case RootParentAbsent:
		require.False(t, has)
	case RootParentZero:
		require.True(t, has)
		require.Equal(t, int64(0), asInt(t, v))
	default:
		require.True(t, has)
		require.Nil(t, v)
	}
}

func TestSHA256HashesAreSignedOnTheWire(t *testing.T) {
	for _, dl := range []Dialect{DialectSGLang, DialectTRTLLM} {
		t.Run(dl.String(), func(t *testing.T) {
			e := newCacheEngine(t, dl.Apply(Options{BlockSize: 2}))
			p := seqTokens(0, 64)
			_, err := e.Serve(Request{Tokens: p})
			require.NoError(t, err)
			d := lastBatch(t, e)
			negative := 0
			for i, h := range d.events[0]["block_hashes"].([]any) {
				want := e.BlockHashes(p, "", "")[i]
				switch v := h.(type) {
				case int64:
					require.Less(t, v, int64(0), "non-negative ids are written unsigned, as msgspec does")
					require.Equal(t, want, uint64(v))
					negative++
				case uint64:
					require.Equal(t, want, v)
				}
			}
			require.Positive(t, negative, "32 SHA-256 ids include negative ones")
		})
	}
}

// TestTRTLLMEventKeys checks that the trtllm dialect writes exactly the keys of
// TensorRT-LLM's publisher: no extra_keys, no group fields.
func TestTRTLLMEventKeys(t *testing.T) {
	e := newCacheEngine(t, DialectTRTLLM.Apply(Options{BlockSize: 2, CapacityBlocks: 2}))
	_, err := e.Serve(Request{Tokens: seqTokens(0, 4)})
	require.NoError(t, err)
	_, err = e.Serve(Request{Tokens: seqTokens(100, 4)}) // evicts both
	require.NoError(t, err)
	d := lastBatch(t, e)
	require.Len(t, d.events, 2)
	keys := func(ev map[string]any) []string {
		var out []string
		for k := range ev {
			out = append(out, k)
		}
		return out
	}
	require.Equal(t, "BlockRemoved", d.events[0]["type"])
	require.ElementsMatch(t, []string{"type", "block_hashes", "medium"}, keys(d.events[0]))
	require.Equal(t, "BlockStored", d.events[1]["type"])
	require.ElementsMatch(t, []string{"type", "block_hashes", "parent_block_hash", "token_ids",
		"block_size", "lora_id", "medium", "lora_name"}, keys(d.events[1]))
	require.Equal(t, MediumGPU, d.events[1]["medium"])
	require.Nil(t, d.events[1]["lora_name"])
	require.Nil(t, d.events[1]["parent_block_hash"])
	require.True(t, d.hasDP, "the rank is always set")
}

func TestRestartWithFirstSeq(t *testing.T) {
	e := startEngine(t, Options{FirstSeq: 5, EnableReplay: true, ReplayLayout: ReplayNoTopic, ReplayBuffer: 2})
	require.Equal(t, uint64(5), e.NextSeq())
	for i := range 3 {
		r, err := e.Serve(Request{Tokens: seqTokens(i*100, 16)})
		require.NoError(t, err)
		require.Equal(t, uint64(5+i), r.Seq)
	}
	st := e.Stats()
	require.Equal(t, uint64(8), st.NextSeq)
	require.Equal(t, 2, st.Buffered, "the ring rolled over")
	require.Equal(t, uint64(6), st.BufferedOldest)
	require.Equal(t, uint64(7), st.BufferedNewest)
	d := dealer(t, e)
	got := requestReplay(t, d, 0, ReplayNoTopic, "")
	require.Equal(t, []uint64{6, 7}, []uint64{got[0].seq, got[1].seq})

	e.Restart()
	require.Equal(t, uint64(5), e.NextSeq(), "back to FirstSeq, not 0")
	require.Empty(t, requestReplay(t, d, 0, ReplayNoTopic, ""))
	r, err := e.Serve(Request{Tokens: seqTokens(0, 16)})
	require.NoError(t, err)
	require.Equal(t, Result{StoredBlocks: 1, Published: true, Seq: 5}, r)
	got = requestReplay(t, d, 0, ReplayNoTopic, "")
	require.Len(t, got, 1)
	require.Equal(t, uint64(5), got[0].seq)
	require.Len(t, requestReplay(t, d, 5, ReplayNoTopic, ""), 1)
	require.Empty(t, requestReplay(t, d, 6, ReplayNoTopic, ""))
}
