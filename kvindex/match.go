package kvindex

import (
	"math/bits"
	"slices"
	"sync"
	"unsafe"

	"github.com/kvselect/kvselect/catalog"
)

// Match is one worker rank's overlap with a request: the number of consecutive
// leading blocks it holds on the device tier, and how many further consecutive
// blocks it holds when host memory, and then disk, are counted too.
type Match struct {
	Worker catalog.WorkerRank
	// Device is the number of leading blocks held on the device tier.
	Device int
	// Host is the number of blocks after those that are held on device or host.
	Host int
	// Disk is the number of blocks after those that are held on any tier.
	Disk int
}

// Total returns Device + Host + Disk, the length of the prefix held on any tier.
func (m Match) Total() int { return m.Device + m.Host + m.Disk }

// MatchOptions tune FindMatches. The zero value matches every worker rank to the
// full depth.
type MatchOptions struct {
	// StopAtOne ends the walk as soon as a single candidate remains; that
	// candidate's counts are then lower bounds. Use it when only the winner's
	// identity matters.
	StopAtOne bool
	// Candidates, when non-nil, restricts the result to these worker ranks.
	// Unknown ones are ignored; an empty non-nil slice matches nothing.
	Candidates []catalog.WorkerRank
}

// matchScratch holds a walk's buffers; pooled so lookups do not allocate.
type matchScratch struct {
	c       [numTiers][]sword
	dh, any []sword
	gone    []sword
	lvl     [2][]int32
	mask    []sword
	maskSet slotSet
}

var scratchPool = sync.Pool{New: func() any { return new(matchScratch) }}

// appendMatches walks the tree along seqs and appends one Match per worker rank
// holding at least the first block. The caller holds the owner's lock (read is
// enough: the walk writes nothing shared).
func (t *tree) appendMatches(dst []Match, seqs []uint64, opts MatchOptions) []Match {
	if len(seqs) == 0 || len(t.workers) == 0 {
		return dst
	}
	n, id := t.kidFor(t.root, seqs[0])
	if n == nil {
		return dst
	}
	sc := scratchPool.Get().(*matchScratch)
	defer scratchPool.Put(sc)

	var mask []sword
	if opts.Candidates != nil {
		sc.maskSet = slotSet{}
		for _, w := range opts.Candidates {
			if ws := t.workers[w]; ws != nil {
				sc.maskSet.add(ws.slot)
			}
		}
		mask = append(sc.mask[:0], sc.maskSet.words()...)
		sc.mask = mask
		if len(mask) == 0 {
			return dst
		}
	}
	if t.lowerEntries == 0 {
		return t.walkDevice(dst, sc, n, id, seqs, mask, opts.StopAtOne)
	}
	return t.walkTiers(dst, sc, n, id, seqs, mask, opts.StopAtOne)
}

// walkDevice is the walk when no worker holds anything below the device tier.
// A marked node (markSame) costs it a key comparison; a node whose holders fit
// its inline word, against a single candidate word, a few instructions; other
// nodes the merge of narrow.
func (t *tree) walkDevice(dst []Match, sc *matchScratch, n *node, id nodeID, seqs []uint64, mask []sword, stopAtOne bool) []Match {
	cand := sc.intersectInto(sc.c[0][:0], t.devWords(n), mask)
	sc.c[0] = cand
	live := countWords(cand)
	depth := 1
	gone := sc.gone[:0]
	for live > 0 && depth < len(seqs) {
		if stopAtOne && live == 1 {
			break
		}
		// t.next, by hand (it does not inline).
		var c *node
		switch cid := n.child; {
		case cid == id+1 && cid&chunkMask != 0:
			c = (*node)(unsafe.Add(unsafe.Pointer(n), nodeBytes))
			id = cid
		case cid != 0:
			c = t.at(cid)
			id = cid
		default:
			c, id = t.kidFor(n, seqs[depth])
		}
		if c == nil || c.key != seqs[depth] {
			break
		}
		switch {
		case c.same(): // the parent's holders: cand stays as it is
		case len(cand) == 1 && c.ext == 0:
			// One candidate word against c's inline word, without the merge.
			w := cand[0]
			keep := w.bits & c.bits
			if c.idx != w.idx {
				keep = 0
			}
			if keep != w.bits {
				gone = append(gone[:0], sword{idx: w.idx, bits: w.bits &^ keep})
				cand[0].bits = keep
				if keep == 0 {
					cand = cand[:0]
				}
			}
		default:
			cand, gone = narrow(cand, t.devWords(c), gone[:0])
		}
		if len(gone) != 0 { // rare: kept out of the loop, which stays in registers
			dst = t.appendDevice(dst, gone, depth)
			live -= countWords(gone)
			gone = gone[:0]
		}
		n = c
		depth++
	}
	sc.gone = gone
	dst = t.appendDevice(dst, cand, depth)
	sc.c[0] = cand[:0]
	return dst
}

// appendDevice appends a device-only Match of depth blocks for every slot of ws.
// It grows dst once and writes the Matches in place: appending them one by
// one cost twice as much at a thousand matches (each append of a struct that
// holds a string).
func (t *tree) appendDevice(dst []Match, ws []sword, depth int) []Match {
	keys := t.slotKeys
	i, n := len(dst), countWords(ws)
	dst = slices.Grow(dst, n)[:i+n]
	for _, w := range ws {
		for b := w.bits; b != 0; b &= b - 1 {
			m := &dst[i]
			m.Worker, m.Device, m.Host, m.Disk = keys[w.idx<<6|uint32(bits.TrailingZeros64(b))], depth, 0, 0
			i++
		}
	}
	return dst
}

// walkTiers is the general walk: three nested candidate sets, device (c[0]),
// device or host (c[1]) and any tier (c[2]). lvl0 and lvl1 record the depth at which
// a slot left c[0] and c[1]; a slot is reported when it leaves c[2].
func (t *tree) walkTiers(dst []Match, sc *matchScratch, n *node, id nodeID, seqs []uint64, mask []sword, stopAtOne bool) []Match {
	if need := len(t.slots); cap(sc.lvl[0]) < need {
		sc.lvl[0] = make([]int32, need)
		sc.lvl[1] = make([]int32, need)
	}
	lvl0, lvl1 := sc.lvl[0][:len(t.slots)], sc.lvl[1][:len(t.slots)]
	var c [numTiers][]sword
	dev, dh, anyTier := sc.tierWords(t, n)
	c[0] = sc.intersectInto(sc.c[0][:0], dev, mask)
	c[1] = sc.intersectInto(sc.c[1][:0], dh, mask)
	c[2] = sc.intersectInto(sc.c[2][:0], anyTier, mask)
	setLevel(lvl0, c[2], 0)
	setLevel(lvl1, c[2], 0)
	live := countWords(c[2])
	depth := 1
	gone := sc.gone[:0]
	for live > 0 && depth < len(seqs) {
		if stopAtOne && live == 1 {
			break
		}
		var ch *node
		ch, id = t.next(n, id, seqs[depth])
		if ch == nil {
			break
		}
		if ch.same() { // the parent's holders on every tier: nothing leaves
			n = ch
			depth++
			continue
		}
		dev, dh, anyTier = sc.tierWords(t, ch)
		c[0], gone = narrow(c[0], dev, gone[:0])
		setLevel(lvl0, gone, depth)
		c[1], gone = narrow(c[1], dh, gone[:0])
		setLevel(lvl1, gone, depth)
		c[2], gone = narrow(c[2], anyTier, gone[:0])
		if len(gone) != 0 {
			dst = t.appendTiered(dst, gone, lvl0, lvl1, depth)
			live -= countWords(gone)
		}
		n = ch
		depth++
	}
	sc.gone = gone
	setLevel(lvl0, c[0], depth)
	setLevel(lvl1, c[1], depth)
	dst = t.appendTiered(dst, c[2], lvl0, lvl1, depth)
	for tier := range numTiers {
		sc.c[tier] = c[tier][:0]
	}
	return dst
}

// appendTiered appends a Match for every slot of ws, which left the any-tier set
// at depth and the device and device-or-host sets at the depths lvl0 and lvl1
// record.
func (t *tree) appendTiered(dst []Match, ws []sword, lvl0, lvl1 []int32, depth int) []Match {
	keys := t.slotKeys
	i, n := len(dst), countWords(ws)
	dst = slices.Grow(dst, n)[:i+n]
	for _, w := range ws {
		for b := w.bits; b != 0; b &= b - 1 {
			slot := w.idx<<6 | uint32(bits.TrailingZeros64(b))
			d0, d1 := int(lvl0[slot]), int(lvl1[slot])
			m := &dst[i]
			m.Worker, m.Device, m.Host, m.Disk = keys[slot], d0, d1-d0, depth-d1
			i++
		}
	}
	return dst
}

// tierWords returns n's device set, its device-or-host set and its any-tier set.
// The last two live in sc's buffers (or alias the first when n holds nothing below
// the device tier) and are valid until the next call.
func (sc *matchScratch) tierWords(t *tree, n *node) (dev, dh, anyTier []sword) {
	dev = t.devWords(n)
	if !t.hasLower(n) {
		return dev, dev, dev
	}
	e := t.extOf(n)
	sc.dh = unionInto(sc.dh[:0], dev, e.host.words())
	sc.any = unionInto(sc.any[:0], sc.dh, e.disk.words())
	return dev, sc.dh, sc.any
}

// narrow intersects cand with set in place, both sorted by word index: each word
// of cand keeps the bits set also has, words left empty are dropped, and the
// bits removed are appended to gone. It is the one merge-intersect of the walks.
func narrow(cand, set, gone []sword) (kept, dropped []sword) {
	out, j := 0, 0
	for _, w := range cand {
		for j < len(set) && set[j].idx < w.idx {
			j++
		}
		var keep uint64
		if j < len(set) && set[j].idx == w.idx {
			keep = w.bits & set[j].bits
		}
		if g := w.bits &^ keep; g != 0 {
			gone = append(gone, sword{idx: w.idx, bits: g})
		}
		if keep != 0 {
			cand[out] = sword{idx: w.idx, bits: keep}
			out++
		}
	}
	return cand[:out], gone
}

// setLevel records depth in lvl for every slot of ws.
func setLevel(lvl []int32, ws []sword, depth int) {
	for _, w := range ws {
		for b := w.bits; b != 0; b &= b - 1 {
			lvl[w.idx<<6|uint32(bits.TrailingZeros64(b))] = int32(depth)
		}
	}
}

// intersectInto appends a ∩ mask to dst (a itself when mask is nil), using
// sc.gone for the bits left out.
func (sc *matchScratch) intersectInto(dst, a, mask []sword) []sword {
	dst = append(dst, a...)
	if mask == nil {
		return dst
	}
	dst, sc.gone = narrow(dst, mask, sc.gone[:0])
	return dst
}

// unionInto appends a ∪ b to dst.
func unionInto(dst, a, b []sword) []sword {
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j == len(b) || (i < len(a) && a[i].idx < b[j].idx):
			dst = append(dst, a[i])
			i++
		case i == len(a) || b[j].idx < a[i].idx:
			dst = append(dst, b[j])
			j++
		default:
			dst = append(dst, sword{idx: a[i].idx, bits: a[i].bits | b[j].bits})
			i++
			j++
		}
	}
	return dst
}

func countWords(ws []sword) int {
	n := 0
	for _, w := range ws {
		n += bits.OnesCount64(w.bits)
	}
	return n
}
