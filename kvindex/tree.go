package kvindex

import (
	"math/bits"
	"sync"
	"unsafe"
)

// node is one block of the radix tree. Its key is the block's sequence hash, which
// names the whole prefix up to and including the block, so a node's children are
// keyed by their own sequence hashes and never collide.
//
// A node is 48 bytes: the common case (one child or none, holders whose slots fit
// one 64-bit word, device tier only) needs nothing more. Everything rarer lives in
// ext, allocated on demand and freed when it becomes idle.
type node struct {
	key    uint64
	parent *node
	// child is the only child when the node has exactly one; ext.kids holds all
	// children when it has two or more (then child is nil).
	child *node
	// dev is the device-tier holder set when it fits one word; when it spans
	// several words it lives in ext.devWide and dev is zero.
	dev sword
	ext *nodeExt
}

// nodeExt holds what few nodes need.
type nodeExt struct {
	kids       map[uint64]*node
	devWide    *[]sword
	host, disk slotSet
}

func (e *nodeExt) idle() bool {
	return e.kids == nil && e.devWide == nil && e.host.empty() && e.disk.empty()
}

// Sizes used by the memory estimate.
const (
	nodeBytes = 48
	extBytes  = 64
)

func (n *node) kids() map[uint64]*node {
	if n.ext == nil {
		return nil
	}
	return n.ext.kids
}

// devWords returns the device-tier holders; valid until the node changes.
func (n *node) devWords() []sword {
	if n.ext != nil && n.ext.devWide != nil {
		return *n.ext.devWide
	}
	if n.dev.bits == 0 {
		return nil
	}
	return unsafe.Slice(&n.dev, 1)
}

func (n *node) hasLower() bool {
	return n.ext != nil && (!n.ext.host.empty() || !n.ext.disk.empty())
}

func (n *node) childFor(key uint64) *node {
	if c := n.child; c != nil {
		if c.key == key {
			return c
		}
		return nil
	}
	if k := n.kids(); k != nil {
		return k[key]
	}
	return nil
}

func (n *node) childless() bool { return n.child == nil && len(n.kids()) == 0 }

func (n *node) unheld() bool {
	return n.dev.bits == 0 && (n.ext == nil || (n.ext.devWide == nil && n.ext.host.empty() && n.ext.disk.empty()))
}

// workerState is what the tree knows about one worker rank.
type workerState struct {
	key  WorkerRank
	slot uint32
	// blocks maps, per tier, an engine block hash to the deepest node that block
	// covers. A block covers ratio nodes: the mapped node and its ratio-1
	// ancestors. The host and disk maps are created on first use.
	blocks [numTiers]map[uint64]*node
	// dups counts repeated stores of the same block beyond the first, keyed by
	// tierKey; absent means one. Almost always nil.
	dups map[uint64]uint32
	// ratio is the engine block size divided by the index block size, fixed by
	// the first store (0 until then).
	ratio int
}

// heldKey names one membership of a worker rank in a node on a tier.
type heldKey struct {
	n    *node
	tier Tier
}

// tree is the single-goroutine core shared by Index and Approx: nodes, worker
// ranks and their slots, and the membership bookkeeping. Callers hold the owner's
// lock.
//
// Invariants:
//   - a node is reachable from the root iff some worker rank holds it or one of its
//     descendants; a node that becomes unheld and childless is detached at once, so
//     memory never outlives the blocks that justify it;
//   - a worker rank's blocks map points only at nodes where its slot is set on the
//     block's tier, and each membership is counted once per mapped block covering
//     it (the first in the slot bit, the rest in extra);
//   - slots are dense: a removed worker rank's slot is reused by the next new one.
type tree struct {
	root    node
	workers map[WorkerRank]*workerState
	slots   []*workerState // slot -> state, nil when free
	free    []uint32       // free slots

	// extra counts memberships beyond the first of a (node, tier, slot); almost
	// always empty.
	extra map[extraKey]uint32

	nodes        int
	entries      int // memberships on any tier
	lowerEntries int // memberships on the host and disk tiers
	setBytes     int
	kidMapBytes  int
	mapEntries   int // entries in worker block maps
}

type extraKey struct {
	held heldKey
	slot uint32
}

func newTree() tree {
	return tree{
		root:    node{ext: &nodeExt{kids: make(map[uint64]*node)}},
		workers: make(map[WorkerRank]*workerState),
		extra:   make(map[extraKey]uint32),
	}
}

// tierKey folds a tier into an engine block hash, to count duplicates of blocks
// on several tiers in one map. Device keys are the hash itself.
func tierKey(hash uint64, t Tier) uint64 {
	switch t {
	case TierHost:
		return hash ^ 0x9e3779b97f4a7c15
	case TierDisk:
		return hash ^ 0xc2b2ae3d27d4eb4f
	default:
		return hash
	}
}

func (t *tree) worker(w WorkerRank, create bool) *workerState {
	if ws := t.workers[w]; ws != nil || !create {
		return ws
	}
	ws := &workerState{key: w}
	ws.blocks[TierDevice] = make(map[uint64]*node)
	if n := len(t.free); n > 0 {
		ws.slot = t.free[n-1]
		t.free = t.free[:n-1]
		t.slots[ws.slot] = ws
	} else {
		ws.slot = uint32(len(t.slots))
		t.slots = append(t.slots, ws)
	}
	t.workers[w] = ws
	return ws
}

// child returns parent's child with key, creating it when absent.
func (t *tree) child(parent *node, key uint64) *node {
	if c := parent.childFor(key); c != nil {
		return c
	}
	c := &node{key: key, parent: parent}
	switch kids := parent.kids(); {
	case kids != nil:
		kids[key] = c
		t.kidMapBytes += 24
	case parent.child == nil:
		parent.child = c
	default:
		t.ensureExt(parent)
		parent.ext.kids = map[uint64]*node{parent.child.key: parent.child, key: c}
		parent.child = nil
		t.kidMapBytes += 96
	}
	t.nodes++
	return c
}

func (t *tree) ensureExt(n *node) {
	if n.ext == nil {
		n.ext = &nodeExt{}
		t.setBytes += extBytes
	}
}

func (t *tree) freeExtIfIdle(n *node) {
	if n.ext != nil && n != &t.root && n.ext.idle() {
		n.ext = nil
		t.setBytes -= extBytes
	}
}

// addSlot adds slot to n's holders on tier and reports whether it was absent.
func (t *tree) addSlot(n *node, tier Tier, slot uint32) bool {
	if tier == TierDevice {
		s := slotSet{one: n.dev}
		if n.ext != nil {
			s.more = n.ext.devWide
		}
		before := s.extraBytes()
		added := s.add(slot)
		t.setBytes += s.extraBytes() - before
		t.storeDev(n, s)
		return added
	}
	t.ensureExt(n)
	s := &n.ext.host
	if tier == TierDisk {
		s = &n.ext.disk
	}
	before := s.extraBytes()
	added := s.add(slot)
	t.setBytes += s.extraBytes() - before
	return added
}

// removeSlot removes slot from n's holders on tier and reports whether it was
// present.
func (t *tree) removeSlot(n *node, tier Tier, slot uint32) bool {
	if tier == TierDevice {
		s := slotSet{one: n.dev}
		if n.ext != nil {
			s.more = n.ext.devWide
		}
		before := s.extraBytes()
		removed := s.remove(slot)
		t.setBytes += s.extraBytes() - before
		t.storeDev(n, s)
		return removed
	}
	if n.ext == nil {
		return false
	}
	s := &n.ext.host
	if tier == TierDisk {
		s = &n.ext.disk
	}
	before := s.extraBytes()
	removed := s.remove(slot)
	t.setBytes += s.extraBytes() - before
	t.freeExtIfIdle(n)
	return removed
}

// storeDev writes a device set back into n's inline word or ext.
func (t *tree) storeDev(n *node, s slotSet) {
	n.dev = s.one
	if s.more != nil {
		t.ensureExt(n)
		n.ext.devWide = s.more
		return
	}
	if n.ext != nil {
		n.ext.devWide = nil
		t.freeExtIfIdle(n)
	}
}

// hold adds one membership of ws in n on tier.
func (t *tree) hold(ws *workerState, n *node, tier Tier) {
	if !t.addSlot(n, tier, ws.slot) {
		t.extra[extraKey{heldKey{n, tier}, ws.slot}]++
		return
	}
	t.entries++
	if tier != TierDevice {
		t.lowerEntries++
	}
}

// release removes one membership of ws in n on tier and prunes what became
// unreferenced.
func (t *tree) release(ws *workerState, n *node, tier Tier) {
	k := extraKey{heldKey{n, tier}, ws.slot}
	if c, ok := t.extra[k]; ok {
		if c <= 1 {
			delete(t.extra, k)
		} else {
			t.extra[k] = c - 1
		}
		return
	}
	if !t.removeSlot(n, tier, ws.slot) {
		return
	}
	t.entries--
	if tier != TierDevice {
		t.lowerEntries--
	}
	t.prune(n)
}

// prune detaches n, and then its ancestors, while they are unheld and childless.
func (t *tree) prune(n *node) {
	for n != &t.root && n.unheld() && n.childless() {
		p := n.parent
		if p.child == n {
			p.child = nil
		} else if kids := p.kids(); kids != nil {
			delete(kids, n.key)
			t.kidMapBytes -= 24
			if len(kids) == 1 && p != &t.root {
				for _, only := range kids {
					p.child = only
				}
				p.ext.kids = nil
				t.kidMapBytes -= 72
				t.freeExtIfIdle(p)
			}
		}
		n.parent = nil
		t.freeExtIfIdle(n)
		t.nodes--
		n = p
	}
}

// releaseBlock releases the ratio nodes one mapped block covers, deepest first.
func (t *tree) releaseBlock(ws *workerState, n *node, tier Tier, ratio int) {
	for i := 0; i < ratio && n != nil && n != &t.root; i++ {
		p := n.parent
		t.release(ws, n, tier)
		n = p
	}
}

// dropWorker releases every block of ws and frees its slot. Cost is proportional
// to the blocks ws holds.
func (t *tree) dropWorker(ws *workerState) {
	ratio := max(ws.ratio, 1)
	for tier := range Tier(numTiers) {
		for _, n := range ws.blocks[tier] {
			t.releaseBlock(ws, n, tier, ratio)
		}
		t.mapEntries -= len(ws.blocks[tier])
	}
	delete(t.workers, ws.key)
	t.slots[ws.slot] = nil
	t.free = append(t.free, ws.slot)
}

// stats fills the structural part of s.
func (t *tree) stats(s *Stats) {
	s.Nodes = t.nodes
	s.Entries = t.entries
	s.WorkerRanks = len(t.workers)
	s.ApproxBytes = int64(t.nodes)*nodeBytes + int64(t.setBytes) + int64(t.kidMapBytes) +
		int64(t.mapEntries)*blockMapEntryBytes + int64(len(t.workers))*256
}

// blockMapEntryBytes approximates the cost of one entry of a worker's block map
// (8-byte key, 8-byte pointer, control byte and load-factor slack).
const blockMapEntryBytes = 20

// Match is one worker rank's overlap with a request: the number of consecutive
// leading blocks it holds on the device tier, and how many further consecutive
// blocks it holds when host memory, and then disk, are counted too.
type Match struct {
	Worker WorkerRank
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
	Candidates []WorkerRank
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

func appendTiered(dst []Match, w WorkerRank, d0, d1, d2 int) []Match {
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
