package kvindex

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"
)

// refXXH64 hashes b with seed through the xxhash package's streaming API, as an
// independent reference for the in-place and unrolled paths.
func refXXH64(seed uint64, b []byte) uint64 {
	d := xxhash.NewWithSeed(seed)
	_, _ = d.Write(b)
	return d.Sum64()
}

func leTokens(toks []uint32) []byte {
	b := make([]byte, 0, 4*len(toks))
	for _, t := range toks {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	return b
}

func TestHashLayoutMatchesReference(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, bs := range []int{1, 3, 16, 64, 100} {
		toks := make([]uint32, bs*5+bs/2)
		for i := range toks {
			toks[i] = r.Uint32()
		}
		for _, opts := range []HashOptions{{}, {LoRAName: "sql-adapter"}, {CacheSalt: "tenant-a"}, {LoRAName: "x", CacheSalt: "y"}} {
			h, err := NewHasher(bs, opts)
			require.NoError(t, err)
			got := h.SeqHashes(toks)
			require.Len(t, got, 5)
			var prev uint64
			for i := range got {
				seed := opts.laterSeed()
				if i == 0 {
					seed = opts.seed()
				}
				local := refXXH64(seed, leTokens(toks[i*bs:(i+1)*bs]))
				if i == 0 {
					prev = local
				} else {
					var pair [16]byte
					binary.LittleEndian.PutUint64(pair[:8], prev)
					binary.LittleEndian.PutUint64(pair[8:], local)
					prev = refXXH64(1337, pair[:])
				}
				require.Equal(t, prev, got[i], "bs %d block %d %+v", bs, i, opts)
			}
		}
	}
}

func TestSeedMixing(t *testing.T) {
	require.Equal(t, uint64(1337), HashOptions{}.seed())
	require.Equal(t, 1337+xxhash.Sum64String("lora"), HashOptions{LoRAName: "lora"}.seed())
	require.Equal(t, 1337+refXXH64(1, []byte("salt")), HashOptions{CacheSalt: "salt"}.seed())
	require.Equal(t, 1337+xxhash.Sum64String("l")+refXXH64(1, []byte("s")), HashOptions{LoRAName: "l", CacheSalt: "s"}.seed())
	require.Equal(t, 1337+xxhash.Sum64String("l"), HashOptions{LoRAName: "l", CacheSalt: "s"}.laterSeed())
}

func TestChainHashMatchesReference(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for range 1000 {
		a, b := r.Uint64(), r.Uint64()
		var pair [16]byte
		binary.LittleEndian.PutUint64(pair[:8], a)
		binary.LittleEndian.PutUint64(pair[8:], b)
		require.Equal(t, refXXH64(1337, pair[:]), chainHash(a, b))
	}
}

func TestExtraDigestChangesOnlyItsBlock(t *testing.T) {
	h, err := NewHasher(2, HashOptions{})
	require.NoError(t, err)
	toks := []uint32{1, 2}
	require.Equal(t, blockHash(h.first, toks, 0), refXXH64(1337, leTokens(toks)))
	withExtra := append(leTokens(toks), 7, 0, 0, 0, 0, 0, 0, 0)
	require.Equal(t, refXXH64(1337, withExtra), blockHash(h.later, toks, 7))
}

// Golden vectors pin the byte layout: these values must never change, on any
// machine, or every deployed router disagrees with its peers' snapshots and logs.
func TestHashGoldenVectors(t *testing.T) {
	toks := make([]uint32, 40)
	for i := range toks {
		toks[i] = uint32(i * 1000)
	}
	cases := []struct {
		opts HashOptions
		bs   int
		want []uint64
	}{
		{HashOptions{}, 16, []uint64{0x4e069a84268e767d, 0x37782b73a8d689c3}},
		{HashOptions{LoRAName: "adapter-1"}, 16, []uint64{0xb8729e0f1e7f2593, 0xc68c6a6dfd75f0d9}},
		{HashOptions{CacheSalt: "tenant"}, 8, []uint64{0xe833376fd0cb09ae, 0x49426c04923af091, 0x58a7e17b8f750c0b, 0x08a2b986cb3d4718, 0xc4dae3150be0656d}},
	}
	for _, c := range cases {
		h, err := NewHasher(c.bs, c.opts)
		require.NoError(t, err)
		require.Equal(t, c.want, h.SeqHashes(toks), "%+v bs %d", c.opts, c.bs)
	}
}

func TestHasherEdges(t *testing.T) {
	for _, bs := range []int{0, -1} {
		_, err := NewHasher(bs, HashOptions{})
		require.ErrorIs(t, err, ErrBlockSize)
	}
	h, err := NewHasher(4, HashOptions{})
	require.NoError(t, err)
	require.Nil(t, h.SeqHashes(nil))
	require.Nil(t, h.SeqHashes([]uint32{1, 2, 3}))
	require.Len(t, h.SeqHashes([]uint32{1, 2, 3, 4, 5}), 1)
	var zero Hasher
	require.Nil(t, zero.SeqHashes([]uint32{1, 2, 3, 4}))
	// Same prefix, same hashes; a change in block 1 changes hash 1 and all after.
	a := h.SeqHashes([]uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
	b := h.SeqHashes([]uint32{1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12})
	require.Equal(t, a[0], b[0])
	require.NotEqual(t, a[1], b[1])
	require.NotEqual(t, a[2], b[2])
	// LoRA isolates.
	l, _ := NewHasher(4, HashOptions{LoRAName: "x"})
	require.NotEqual(t, a[0], l.SeqHashes([]uint32{1, 2, 3, 4})[0])
}

func TestAppendSeqHashesDoesNotAllocate(t *testing.T) {
	h, _ := NewHasher(16, HashOptions{})
	toks := make([]uint32, 8192)
	buf := make([]uint64, 0, 512)
	allocs := testing.AllocsPerRun(20, func() { buf = h.AppendSeqHashes(buf[:0], toks) })
	require.Zero(t, allocs)
	require.Len(t, buf, 512)
}

func TestXXH64MatchesReference(t *testing.T) {
	r := rand.New(rand.NewPCG(8, 9))
	for n := range 300 {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		seed := r.Uint64()
		require.Equal(t, refXXH64(seed, b), xxh64(seed, b), "len %d", n)
		require.Equal(t, refXXH64(0, b), xxh64(0, b), "len %d", n)
	}
}

func FuzzXXH64(f *testing.F) {
	f.Add(uint64(1337), []byte("tokens"))
	f.Fuzz(func(t *testing.T, seed uint64, b []byte) {
		if got, want := xxh64(seed, b), refXXH64(seed, b); got != want {
			t.Fatalf("xxh64(%d, %x) = %x, want %x", seed, b, got, want)
		}
	})
}
