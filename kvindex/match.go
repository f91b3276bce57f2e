package kvindex

import (
	"math/bits"
	"sync"

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
	n := t.root.childFor(seqs[0])
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
		return t.walkDevice(dst, sc, n, seqs, mask, opts.StopAtOne)
	}
	return t.walkTiers(dst, sc, n, seqs, mask, opts.StopAtOne)
}

// walkDevice is the walk when no worker holds anything below the device tier.
func (t *tree) walkDevice(dst []Match, sc *matchScratch, n *node, seqs []uint64, mask []sword, stopAtOne bool) []Match {
	cand := intersectInto(sc.c[0][:0], n.devWords(), mask)
	sc.c[0] = cand
	live := countWords(cand)
	depth := 1
	for live > 0 && depth < len(seqs) {
		if stopAtOne && live == 1 {
			break
		}
		c := n.childFor(seqs[depth])
		if c == nil {
			break
		}
		var dropped int
		cand, dropped, dst = t.narrow(dst, cand, c.devWords(), depth)
		live -= dropped
		n = c
		depth++
	}
	for _, w := range cand {
		for b := w.bits; b != 0; b &= b - 1 {
			slot := w.idx<<6 | uint32(bits.TrailingZeros64(b))
			dst = append(dst, Match{Worker: t.slots[slot].key, Device: depth})
		}
	}
	sc.c[0] = cand[:0]
	return dst
}

// narrow intersects cand with set in place, appends a device-only Match at depth
// for every slot that dropped out, and compacts away empty words.
func (t *tree) narrow(dst []Match, cand, set []sword, depth int) ([]sword, int, []Match) {
	out, j, dropped := 0, 0, 0
	for _, w := range cand {
		for j < len(set) && set[j].idx < w.idx {
			j++
		}
		var keep uint64
		if j < len(set) && set[j].idx == w.idx {
			keep = w.bits & set[j].bits
		}
		for gone := w.bits &^ keep; gone != 0; gone &= gone - 1 {
			slot := w.idx<<6 | uint32(bits.TrailingZeros64(gone))
			dst = append(dst, Match{Worker: t.slots[slot].key, Device: depth})
			dropped++
		}
		if keep != 0 {
			cand[out] = sword{idx: w.idx, bits: keep}
			out++
		}
	}
	return cand[:out], dropped, dst
}

// walkTiers is the general walk: three nested candidate sets, device (c[0]),
// device or host (c[1]) and any tier (c[2]). lvl0 and lvl1 record the depth at which
// a slot left c[0] and c[1]; a slot is reported when it leaves c[2].
func (t *tree) walkTiers(dst []Match, sc *matchScratch, n *node, seqs []uint64, mask []sword, stopAtOne bool) []Match {
	if need := len(t.slots); cap(sc.lvl[0]) < need {
		sc.lvl[0] = make([]int32, need)
		sc.lvl[1] = make([]int32, need)
	}
	lvl0, lvl1 := sc.lvl[0][:len(t.slots)], sc.lvl[1][:len(t.slots)]
	var c [numTiers][]sword
	dev, dh, anyTier := sc.tierWords(n)
	c[0] = intersectInto(sc.c[0][:0], dev, mask)
	c[1] = intersectInto(sc.c[1][:0], dh, mask)
	c[2] = intersectInto(sc.c[2][:0], anyTier, mask)
	for _, w := range c[2] {
		for b := w.bits; b != 0; b &= b - 1 {
			slot := w.idx<<6 | uint32(bits.TrailingZeros64(b))
			lvl0[slot], lvl1[slot] = 0, 0
		}
	}
	live := countWords(c[2])
	depth := 1
	for live > 0 && depth < len(seqs) {
		if stopAtOne && live == 1 {
			break
		}
		ch := n.childFor(seqs[depth])
		if ch == nil {
			break
		}
		dev, dh, anyTier = sc.tierWords(ch)
		c[0] = narrowLevel(c[0], dev, lvl0, depth)
		c[1] = narrowLevel(c[1], dh, lvl1, depth)
		c[2], sc.gone = narrowGone(c[2], anyTier, sc.gone[:0])
		for _, w := range sc.gone {
			for b := w.bits; b != 0; b &= b - 1 {
				slot := w.idx<<6 | uint32(bits.TrailingZeros64(b))
				dst = appendTiered(dst, t.slots[slot].key, int(lvl0[slot]), int(lvl1[slot]), depth)
				live--
			}
		}
		n = ch
		depth++
	}
	for _, w := range c[0] {
		for b := w.bits; b != 0; b &= b - 1 {
			lvl0[w.idx<<6|uint32(bits.TrailingZeros64(b))] = int32(depth)
		}
	}
	for _, w := range c[1] {
		for b := w.bits; b != 0; b &= b - 1 {
			lvl1[w.idx<<6|uint32(bits.TrailingZeros64(b))] = int32(depth)
		}
	}
	for _, w := range c[2] {
		for b := w.bits; b != 0; b &= b - 1 {
			slot := w.idx<<6 | uint32(bits.TrailingZeros64(b))
			dst = appendTiered(dst, t.slots[slot].key, int(lvl0[slot]), int(lvl1[slot]), depth)
		}
	}
	for tier := range numTiers {
		sc.c[tier] = c[tier][:0]
	}
	return dst
}

func appendTiered(dst []Match, w catalog.WorkerRank, d0, d1, d2 int) []Match {
	return append(dst, Match{Worker: w, Device: d0, Host: d1 - d0, Disk: d2 - d1})
}

// tierWords returns n's device set, its device-or-host set and its any-tier set.
// The last two live in sc's buffers (or alias the first when n holds nothing below
// the device tier) and are valid until the next call.
func (sc *matchScratch) tierWords(n *node) (dev, dh, anyTier []sword) {
	dev = n.devWords()
	if !n.hasLower() {
		return dev, dev, dev
	}
	sc.dh = unionInto(sc.dh[:0], dev, n.ext.host.words())
	sc.any = unionInto(sc.any[:0], sc.dh, n.ext.disk.words())
	return dev, sc.dh, sc.any
}

// narrowLevel intersects cand with set in place and records depth in lvl for every
// slot that dropped out.
func narrowLevel(cand, set []sword, lvl []int32, depth int) []sword {
	out, j := 0, 0
	for _, w := range cand {
		for j < len(set) && set[j].idx < w.idx {
			j++
		}
		var keep uint64
		if j < len(set) && set[j].idx == w.idx {
			keep = w.bits & set[j].bits
		}
		for gone := w.bits &^ keep; gone != 0; gone &= gone - 1 {
			lvl[w.idx<<6|uint32(bits.TrailingZeros64(gone))] = int32(depth)
		}
		if keep != 0 {
			cand[out] = sword{idx: w.idx, bits: keep}
			out++
		}
	}
	return cand[:out]
}

// narrowGone intersects cand with set in place and appends the dropped bits to
// gone.
func narrowGone(cand, set, gone []sword) ([]sword, []sword) {
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

// intersectInto appends a ∩ mask to dst (a itself when mask is nil).
func intersectInto(dst, a, mask []sword) []sword {
	if mask == nil {
		return append(dst, a...)
	}
	j := 0
	for _, w := range a {
		for j < len(mask) && mask[j].idx < w.idx {
			j++
		}
		if j < len(mask) && mask[j].idx == w.idx {
			if b := w.bits & mask[j].bits; b != 0 {
				dst = append(dst, sword{idx: w.idx, bits: b})
			}
		}
	}
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
