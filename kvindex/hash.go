package kvindex

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"unsafe"

	"github.com/cespare/xxhash/v2"
)

// baseSeed is the seed of every block hash before LoRA and cache-salt mixing, and
// the seed of every chain hash.
const baseSeed uint64 = 1337

// ErrBlockSize reports a block size that is not positive, or an event block size
// that is not a whole multiple of the index's.
var ErrBlockSize = errors.New("kvindex: invalid block size")

// HashOptions isolate blocks that hold equal tokens but must never be shared: two
// LoRA adapters, or two tenants separated by a cache salt. Empty strings count as
// absent.
type HashOptions struct {
	LoRAName  string
	CacheSalt string
}

// seed returns the seed of the first block of a sequence for these options (see
// Hasher for the formula). Later blocks use laterSeed, which leaves the salt out:
// like vLLM, which mixes the cache salt into the first block only, the salt
// reaches every later block through the hash chain. That is what lets the index
// apply a stored run that continues a salted sequence without knowing the salt.
func (o HashOptions) seed() uint64 {
	seed := o.laterSeed()
	if o.CacheSalt != "" {
		var d xxhash.Digest
		d.ResetWithSeed(1)
		_, _ = d.WriteString(o.CacheSalt)
		seed += d.Sum64()
	}
	return seed
}

// laterSeed returns the seed of every block but the first: 1337 mixed with the
// LoRA name only.
func (o HashOptions) laterSeed() uint64 {
	seed := baseSeed
	if o.LoRAName != "" {
		seed += xxhash.Sum64String(o.LoRAName)
	}
	return seed
}

// Hasher turns token ids into the chained block hashes the index is keyed by. It is
// a small immutable value, safe for concurrent use, and cheap to copy.
//
// Byte layout (stable across machines and releases; golden vectors in the tests):
//
//   - Only complete blocks are hashed; a trailing partial block is ignored.
//   - local[i] = XXH64(seed, bytes) where bytes are the block's token ids, each
//     written as 4 bytes little-endian, followed, only when the block carries an
//     extra-key digest x != 0, by x as 8 bytes little-endian.
//   - The seed of every block is 1337, plus (wrapping) XXH64(LoRAName, seed 0)
//     when LoRAName is set; block 0 of a sequence adds XXH64(CacheSalt, seed 1)
//     when CacheSalt is set. The salt reaches later blocks through the chain.
//   - seq[0] = local[0]; seq[i] = XXH64(1337, le64(seq[i-1]) || le64(local[i])).
//
// seq[i] therefore names the whole prefix of blocks 0..i, so equal seq hashes mean
// equal prefixes (up to 64-bit collisions).
type Hasher struct {
	blockSize int
	first     uint64 // seed of block 0
	later     uint64 // seed of blocks 1..
}

// NewHasher returns a Hasher for blocks of blockSize tokens. blockSize must be
// positive (ErrBlockSize otherwise).
func NewHasher(blockSize int, opts HashOptions) (Hasher, error) {
	if blockSize <= 0 {
		return Hasher{}, fmt.Errorf("%w: %d tokens per block, want > 0", ErrBlockSize, blockSize)
	}
	return Hasher{blockSize: blockSize, first: opts.seed(), later: opts.laterSeed()}, nil
}

// blocks returns the number of complete blocks in n tokens.
func (h Hasher) blocks(n int) int {
	if h.blockSize <= 0 {
		return 0
	}
	return n / h.blockSize
}

// SeqHashes returns the sequence hash of every complete block of tokens. Nil or
// short input yields nil.
func (h Hasher) SeqHashes(tokens []uint32) []uint64 {
	n := h.blocks(len(tokens))
	if n == 0 {
		return nil
	}
	return h.AppendSeqHashes(make([]uint64, 0, n), tokens)
}

// AppendSeqHashes appends the sequence hash of every complete block of tokens to dst
// and returns the extended slice. It does not allocate when dst has room.
func (h Hasher) AppendSeqHashes(dst []uint64, tokens []uint32) []uint64 {
	n := h.blocks(len(tokens))
	var prev uint64
	for i := 0; i < n; i++ {
		if i == 0 {
			prev = blockHash(h.first, tokens[:h.blockSize], 0)
		} else {
			prev = chainHash(prev, blockHash(h.later, tokens[i*h.blockSize:(i+1)*h.blockSize], 0))
		}
		dst = append(dst, prev)
	}
	return dst
}

// chainHash returns the sequence hash of a block whose parent has sequence hash
// parent and whose own local hash is local: XXH64(1337, le64(parent) || le64(local)).
func chainHash(parent, local uint64) uint64 {
	return xxh64Two(baseSeed, parent, local)
}

// littleEndian is true when uint32 values are laid out little-endian in memory, so
// a token slice can be hashed in place.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// blockHash hashes one block of tokens (and an optional extra digest) with seed.
func blockHash(seed uint64, tokens []uint32, extra uint64) uint64 {
	if littleEndian && extra == 0 {
		if len(tokens) == 0 {
			return xxh64(seed, nil)
		}
		return xxh64(seed, unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), len(tokens)*4))
	}
	var d xxhash.Digest
	d.ResetWithSeed(seed)
	var buf [256]byte
	for len(tokens) > 0 {
		k := min(len(tokens), len(buf)/4)
		for i, t := range tokens[:k] {
			binary.LittleEndian.PutUint32(buf[i*4:], t)
		}
		_, _ = d.Write(buf[:k*4])
		tokens = tokens[k:]
	}
	if extra != 0 {
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], extra)
		_, _ = d.Write(b[:])
	}
	return d.Sum64()
}

// XXH64 primes.
const (
	prime1 uint64 = 11400714785074694791
	prime2 uint64 = 14029467366897019727
	prime3 uint64 = 1609587929392839161
	prime4 uint64 = 9650029242287828579
	prime5 uint64 = 2870177450012600261
)

// xxh64 is the XXH64 specification over b with seed, written for short inputs:
// no streaming state, no copying.
func xxh64(seed uint64, b []byte) uint64 {
	n := len(b)
	var h uint64
	if n >= 32 {
		v1, v2, v3, v4 := seed+prime1+prime2, seed+prime2, seed, seed-prime1
		for len(b) >= 32 {
			v1 = xxStep(v1, binary.LittleEndian.Uint64(b[0:8]))
			v2 = xxStep(v2, binary.LittleEndian.Uint64(b[8:16]))
			v3 = xxStep(v3, binary.LittleEndian.Uint64(b[16:24]))
			v4 = xxStep(v4, binary.LittleEndian.Uint64(b[24:32]))
			b = b[32:]
		}
		h = bits.RotateLeft64(v1, 1) + bits.RotateLeft64(v2, 7) + bits.RotateLeft64(v3, 12) + bits.RotateLeft64(v4, 18)
		h = xxMerge(h, v1)
		h = xxMerge(h, v2)
		h = xxMerge(h, v3)
		h = xxMerge(h, v4)
	} else {
		h = seed + prime5
	}
	h += uint64(n)
	for ; len(b) >= 8; b = b[8:] {
		h ^= xxRound(binary.LittleEndian.Uint64(b))
		h = bits.RotateLeft64(h, 27)*prime1 + prime4
	}
	if len(b) >= 4 {
		h ^= uint64(binary.LittleEndian.Uint32(b)) * prime1
		h = bits.RotateLeft64(h, 23)*prime2 + prime3
		b = b[4:]
	}
	for _, c := range b {
		h ^= uint64(c) * prime5
		h = bits.RotateLeft64(h, 11) * prime1
	}
	return xxAvalanche(h)
}

// xxh64Two is XXH64 of exactly 16 bytes, le64(a) || le64(b), with seed: the
// short-input path of the specification, unrolled.
func xxh64Two(seed, a, b uint64) uint64 {
	h := seed + prime5 + 16
	h ^= xxRound(a)
	h = bits.RotateLeft64(h, 27)*prime1 + prime4
	h ^= xxRound(b)
	h = bits.RotateLeft64(h, 27)*prime1 + prime4
	return xxAvalanche(h)
}

func xxAvalanche(h uint64) uint64 {
	h ^= h >> 33
	h *= prime2
	h ^= h >> 29
	h *= prime3
	h ^= h >> 32
	return h
}

// xxRound is the specification's round(0, v).
func xxRound(v uint64) uint64 {
	v *= prime2
	v = bits.RotateLeft64(v, 31)
	return v * prime1
}

// xxStep is round(acc, v).
func xxStep(acc, v uint64) uint64 {
	acc += v * prime2
	acc = bits.RotateLeft64(acc, 31)
	return acc * prime1
}

func xxMerge(acc, v uint64) uint64 {
	acc ^= xxRound(v)
	return acc*prime1 + prime4
}
