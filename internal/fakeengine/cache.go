package fakeengine

import (
	"crypto/sha256"
	"encoding/binary"
	"io"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// blockHasher computes the engine's chained block hashes in one of three
// schemes (see HashScheme). The schemes are private to the fake engine (consumers
// must treat engine hashes as opaque). Each block's input is
//
//	link || le32 tokens... || extra keys
//
// where the extra keys mirror vLLM: the LoRA name on every block, the cache salt
// on block 0 only, each written as a tag byte, a le32 length and the bytes. The
// link and the digest depend on the scheme:
//
//   - chain: link is 0x00 for the first block, 0x01 || le64(h[i-1]) otherwise;
//     h[i] = XXH64(seed, input).
//   - sha256 (SGLang): link is the previous 32-byte digest, nothing for the first
//     block; d[i] = SHA-256(input) and h[i] = be64(d[i][:8]).
//   - radix-key (TensorRT-LLM): link is the previous 32-byte key, le64(seed)
//     for the first block; k[i] = SHA-256(input) and h[i] = be64(k[i][:8]), the
//     key's leading bytes, which TensorRT-LLM writes as a signed int64.
type blockHasher struct {
	scheme    HashScheme
	seed      uint64
	blockSize int
}

func (bh blockHasher) appendHashes(dst []uint64, tokens []uint32, lora, salt string) []uint64 {
	if len(tokens) < bh.blockSize {
		return dst
	}
	switch bh.scheme {
	case HashSchemeSHA256:
		return bh.appendSHA256(dst, tokens, lora, salt)
	case HashSchemeRadixKey:
		return bh.appendRadixKeys(dst, tokens, lora, salt)
	}
	d := xxhash.NewWithSeed(bh.seed)
	var buf [64]byte
	var parent uint64
	for i := 0; (i+1)*bh.blockSize <= len(tokens); i++ {
		d.ResetWithSeed(bh.seed)
		if i == 0 {
			buf[0] = 0
			_, _ = d.Write(buf[:1])
		} else {
			buf[0] = 1
			binary.LittleEndian.PutUint64(buf[1:9], parent)
			_, _ = d.Write(buf[:9])
		}
		bh.writeBlock(d, &buf, tokens, i, lora, salt)
		parent = d.Sum64()
		dst = append(dst, parent)
	}
	return dst
}

func (bh blockHasher) appendSHA256(dst []uint64, tokens []uint32, lora, salt string) []uint64 {
	d := sha256.New()
	var buf [64]byte
	var digest [sha256.Size]byte
	for i := 0; (i+1)*bh.blockSize <= len(tokens); i++ {
		d.Reset()
		if i > 0 {
			_, _ = d.Write(digest[:])
		}
		bh.writeBlock(d, &buf, tokens, i, lora, salt)
		d.Sum(digest[:0])
		dst = append(dst, binary.BigEndian.Uint64(digest[:8]))
	}
	return dst
}

func (bh blockHasher) appendRadixKeys(dst []uint64, tokens []uint32, lora, salt string) []uint64 {
	d := sha256.New()
	var buf [64]byte
	var key [sha256.Size]byte
	for i := 0; (i+1)*bh.blockSize <= len(tokens); i++ {
		d.Reset()
		if i == 0 {
			binary.LittleEndian.PutUint64(buf[:8], bh.seed)
			_, _ = d.Write(buf[:8])
		} else {
			_, _ = d.Write(key[:])
		}
		bh.writeBlock(d, &buf, tokens, i, lora, salt)
		d.Sum(key[:0])
		dst = append(dst, binary.BigEndian.Uint64(key[:8]))
	}
	return dst
}

// writeBlock writes block i's tokens (le32) and extra keys to w.
func (bh blockHasher) writeBlock(w io.Writer, buf *[64]byte, tokens []uint32, i int, lora, salt string) {
	n := 0
	for _, t := range tokens[i*bh.blockSize : (i+1)*bh.blockSize] {
		binary.LittleEndian.PutUint32(buf[n:], t)
		n += 4
		if n == len(buf) {
			_, _ = w.Write(buf[:n])
			n = 0
		}
	}
	_, _ = w.Write(buf[:n])
	if lora != "" {
		writeKey(w, buf, 'L', lora)
	}
	if salt != "" && i == 0 {
		writeKey(w, buf, 'S', salt)
	}
}

func writeKey(w io.Writer, buf *[64]byte, tag byte, s string) {
	buf[0] = tag
	binary.LittleEndian.PutUint32(buf[1:5], uint32(len(s)))
	_, _ = w.Write(buf[:5])
	_, _ = io.WriteString(w, s)
}

// extraKeys returns vLLM-style per-block extra keys for blocks [from, to) of a
// request, or nil when no block has any.
func extraKeys(from, to int, lora, salt string) [][]string {
	if lora == "" && (salt == "" || from > 0) {
		return nil
	}
	out := make([][]string, 0, to-from)
	for i := from; i < to; i++ {
		var keys []string
		if lora != "" {
			keys = append(keys, lora)
		}
		if salt != "" && i == 0 {
			keys = append(keys, salt)
		}
		out = append(out, keys)
	}
	return out
}

// cachedBlock is one entry of the LRU list.
type cachedBlock struct {
	hash       uint64
	parent     uint64
	hasParent  bool
	tokens     []uint32
	lora, salt string
	prev, next *cachedBlock
}

// lruCache is the prefix cache model: a map of blocks plus an intrusive list from
// most (head) to least (tail) recently used. Not safe for concurrent use; the
// Engine's mutex guards it.
//
// Invariant: a cached block's parent is cached and sits nearer the head. Serve
// keeps it by touching a request's blocks from the last to the first, so a prefix
// is always more recent than its extensions and eviction from the tail removes
// extensions before their prefixes.
type lruCache struct {
	capacity   int
	blocks     map[uint64]*cachedBlock
	head, tail *cachedBlock
}

func newLRUCache(capacity int) lruCache {
	return lruCache{capacity: capacity, blocks: make(map[uint64]*cachedBlock)}
}

func (c *lruCache) len() int { return len(c.blocks) }

func (c *lruCache) unlink(b *cachedBlock) {
	if b.prev != nil {
		b.prev.next = b.next
	} else {
		c.head = b.next
	}
	if b.next != nil {
		b.next.prev = b.prev
	} else {
		c.tail = b.prev
	}
	b.prev, b.next = nil, nil
}

func (c *lruCache) pushFront(b *cachedBlock) {
	b.prev = nil
	b.next = c.head
	if c.head != nil {
		c.head.prev = b
	}
	c.head = b
	if c.tail == nil {
		c.tail = b
	}
}

func (c *lruCache) touch(b *cachedBlock) {
	if c.head == b {
		return
	}
	c.unlink(b)
	c.pushFront(b)
}

// evictTail removes and returns the least recently used block.
func (c *lruCache) evictTail() *cachedBlock {
	b := c.tail
	if b == nil {
		return nil
	}
	c.unlink(b)
	delete(c.blocks, b.hash)
	return b
}

func (c *lruCache) clear() {
	c.blocks = make(map[uint64]*cachedBlock)
	c.head, c.tail = nil, nil
}

// heldPrefix counts the leading hashes that are cached.
func (c *lruCache) heldPrefix(hashes []uint64) int {
	n := 0
	for n < len(hashes) {
		if _, ok := c.blocks[hashes[n]]; !ok {
			break
		}
		n++
	}
	return n
}

// serveResult is what one simulated request did to the cache.
type serveResult struct {
	hits    int
	stored  int // blocks [hits, hits+stored) were added
	evicted []uint64
	tokens  []uint32 // tokens of the stored blocks (a private copy)
}

// serve simulates one request over the precomputed chain hashes: leading cached
// blocks are hits, the following blocks are stored (as many as fit next to the
// hits), least recently used blocks not used by this request are evicted to make
// room, and every block of the request is then touched from the last to the first.
func (c *lruCache) serve(hashes []uint64, tokens []uint32, blockSize int, lora, salt string) serveResult {
	var r serveResult
	r.hits = c.heldPrefix(hashes)
	// Touch the hits first so eviction below never reaches them: they are at the
	// head and at least `need` other blocks sit behind them.
	for i := r.hits - 1; i >= 0; i-- {
		c.touch(c.blocks[hashes[i]])
	}
	r.stored = min(len(hashes)-r.hits, c.capacity-r.hits)
	for c.len()+r.stored > c.capacity {
		r.evicted = append(r.evicted, c.evictTail().hash)
	}
	// One private copy of the stored tokens; the blocks and the event share it.
	r.tokens = slices.Clone(tokens[r.hits*blockSize : (r.hits+r.stored)*blockSize])
	for i := r.hits + r.stored - 1; i >= 0; i-- {
		if i < r.hits {
			c.touch(c.blocks[hashes[i]])
			continue
		}
		j := i - r.hits
		b := &cachedBlock{
			hash:   hashes[i],
			tokens: r.tokens[j*blockSize : (j+1)*blockSize : (j+1)*blockSize],
			lora:   lora,
			salt:   salt,
		}
		if i > 0 {
			b.parent, b.hasParent = hashes[i-1], true
		}
		c.blocks[b.hash] = b
		c.pushFront(b)
	}
	return r
}
