package reservation

import (
	"hash/maphash"
	"slices"
	"sync"
)

// hashBuf holds a booking's sequence hashes, ordered by block stripe, and
// idx[i], the stripe entry of seqs[i]. Recycled through hashBufPool.
type hashBuf struct {
	seqs []uint64
	idx  []int32
	runs stripeRuns
}

// maxPooledHashes bounds the hash buffer a recycled booking keeps.
const maxPooledHashes = 4096

var hashBufPool = sync.Pool{New: func() any { return new(hashBuf) }}

func putHashBuf(b *hashBuf) {
	if cap(b.seqs) > maxPooledHashes || cap(b.idx) > maxPooledHashes {
		return
	}
	b.seqs, b.idx = b.seqs[:0], b.idx[:0]
	hashBufPool.Put(b)
}

const (
	// blockStripes is the number of independently locked parts of the block
	// index; a hash's part is chosen by its bits.
	blockStripes = 8
	stripeShift  = 61 // 64 - log2(blockStripes)
	// idStripes is the number of independently locked parts of the id map.
	idStripes = 32
)

// blockStripe is one part of the inverted block index with its lock, padded so
// that neighbouring stripes do not share a cache line.
type blockStripe struct {
	mu sync.Mutex
	a  activeBlocks
	_  [64]byte
}

// idStripe is one part of the map from reservation id to live booking.
type idStripe struct {
	mu sync.Mutex
	m  map[ID]*booking
	_  [48]byte
}

// stripeOf returns the block stripe of sequence hash h for a ledger's seed.
func stripeOf(h, seed uint64) int {
	return int(((h ^ seed) * 0xD6E8FEB86659FD93) >> stripeShift)
}

// idStripe returns the id-map stripe of id.
func (l *Ledger) idStripe(id ID) *idStripe {
	return &l.ids[maphash.String(l.idSeed, string(id))%idStripes]
}

// stripeRuns marks where each block stripe's hashes end in a slice grouped by
// stripe: stripe s holds [runs[s-1], runs[s]) (from 0 for stripe 0).
type stripeRuns [blockStripes]int32

// span returns the bounds of stripe s.
func (r *stripeRuns) span(s int) (int, int) {
	if s == 0 {
		return 0, int(r[0])
	}
	return int(r[s-1]), int(r[s])
}

// byStripe writes src to dst grouped by block stripe (a counting sort), records
// the runs and returns dst resized to len(src).
func (l *Ledger) byStripe(dst, src []uint64, runs *stripeRuns) []uint64 {
	var start [blockStripes]int32
	seed := l.stripeSeed
	for _, h := range src {
		start[stripeOf(h, seed)]++
	}
	at := int32(0)
	for i, n := range start {
		start[i] = at
		at += n
		runs[i] = at
	}
	dst = slices.Grow(dst[:0], len(src))[:len(src)]
	for _, h := range src {
		s := stripeOf(h, seed)
		dst[start[s]] = h
		start[s]++
	}
	return dst
}

// eachStripe calls f for every block stripe that holds hashes of a slice grouped
// by runs (see byStripe), in stripe order, with the stripe's mutex held and the
// bounds of its run. It is how every caller walks the block index: one stripe
// locked at a time, never two.
func (l *Ledger) eachStripe(runs *stripeRuns, f func(a *activeBlocks, from, to int)) {
	for s := range l.blocks {
		from, to := runs.span(s)
		if from == to {
			continue
		}
		st := &l.blocks[s]
		st.mu.Lock()
		f(&st.a, from, to)
		st.mu.Unlock()
	}
}

// addRefs adds bk's references to the block index, one stripe at a time, records
// the entry of each hash in bk.buf.idx and returns how many hashes were new to
// bk's worker rank. bk.rank.mu must be held.
func (l *Ledger) addRefs(bk *booking) int {
	buf, slot := bk.buf, bk.rank.slot
	seqs, idx := buf.seqs, buf.idx[:len(buf.seqs)]
	added := 0
	l.eachStripe(&buf.runs, func(a *activeBlocks, from, to int) {
		for i := from; i < to; i++ {
			j, isNew := a.inc(seqs[i], slot)
			idx[i] = j
			if isNew {
				added++
			}
		}
	})
	buf.idx = idx
	return added
}

// dropRefs removes bk's references from the block index, sweeping each stripe it
// touched, and returns how many hashes bk's worker rank no longer holds.
// bk.rank.mu must be held.
func (l *Ledger) dropRefs(bk *booking) int {
	buf, slot := bk.buf, bk.rank.slot
	seqs, idx := buf.seqs, buf.idx
	gone := 0
	l.eachStripe(&buf.runs, func(a *activeBlocks, from, to int) {
		for i := from; i < to; i++ {
			if a.dec(idx[i], seqs[i], slot) {
				gone++
			}
		}
		a.sweep()
	})
	return gone
}
