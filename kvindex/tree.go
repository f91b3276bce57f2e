package kvindex

import (
	"sync"
	"unsafe"

	"github.com/kvselect/kvselect/catalog"
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
	// several words it lives in ext.devWide and dev's word is zero. Its padding
	// carries the node's marks.
	dev devWord
	ext *nodeExt
}

// devWord is a node's inline device word. It has sword's layout, field for
// field, with the node's marks where sword has its padding, so devWords reads
// it in place as a one-word set.
type devWord struct {
	idx   uint32
	marks uint32
	bits  uint64
}

// Node marks.
const (
	// markSame: the node is its parent's only child and has the same holders
	// as its parent on every tier, so a walk that reaches it from its parent
	// keeps its candidates as they are. A change of a node's holders
	// recomputes the node's mark and its only child's (except while a worker
	// rank is dropped: see tree.dropping).
	markSame uint32 = 1 << iota
)

// nodeExt holds what few nodes need.
type nodeExt struct {
	kids       map[uint64]*node
	devWide    *[]sword
	host, disk slotSet
	// extras counts the tree's extra entries of this node (memberships beyond
	// the first of a tier and slot), so releasing a membership of a node that
	// has none skips the lookup.
	extras int
}

func (e *nodeExt) idle() bool {
	return e.kids == nil && e.devWide == nil && e.host.empty() && e.disk.empty() && e.extras == 0
}

// Sizes used by the memory estimate (extBytes is the allocation size class).
const (
	nodeBytes = 48
	extBytes  = 80
)

// maxSpareNodes bounds the detached nodes a tree keeps for reuse (48 KiB).
const maxSpareNodes = 1024

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
	return unsafe.Slice((*sword)(unsafe.Pointer(&n.dev)), 1)
}

// devSet returns the device-tier holders as a slotSet sharing n's wide words.
func (n *node) devSet() slotSet {
	s := slotSet{one: sword{idx: n.dev.idx, bits: n.dev.bits}}
	if n.ext != nil {
		s.more = n.ext.devWide
	}
	return s
}

func (n *node) same() bool { return n.dev.marks&markSame != 0 }

func (n *node) setSame(same bool) {
	if same {
		n.dev.marks |= markSame
	} else {
		n.dev.marks &^= markSame
	}
}

// emptySet stands for the lower tiers of a node without ext; never written.
var emptySet slotSet

// sameHolders reports whether a and b have the same holders on every tier.
func sameHolders(a, b *node) bool {
	if a.ext != b.ext { // two nodes never share an ext: equal pointers are nil
		return sameExtHolders(a, b)
	}
	return a.dev.bits == b.dev.bits && a.dev.idx == b.dev.idx
}

func sameExtHolders(a, b *node) bool {
	ad, bd := a.devSet(), b.devSet()
	return ad.equal(&bd) && a.lower(TierHost).equal(b.lower(TierHost)) && a.lower(TierDisk).equal(b.lower(TierDisk))
}

// lower returns n's holders on the host or disk tier.
func (n *node) lower(tier Tier) *slotSet {
	switch {
	case n.ext == nil:
		return &emptySet
	case tier == TierDisk:
		return &n.ext.disk
	default:
		return &n.ext.host
	}
}

// remark recomputes the marks that n's holders decide, after they changed:
// n's own, when n is its parent's only child, and its only child's.
func remark(n *node) {
	if p := n.parent; p != nil && p.child == n {
		n.setSame(sameHolders(n, p))
	}
	if c := n.child; c != nil {
		c.setSame(sameHolders(c, n))
	}
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
	// mu guards blocks, dups and ratio in an Index (see Index); Approx
	// leaves it alone.
	mu   sync.Mutex
	key  catalog.WorkerRank
	slot uint32
	// blocks maps, per tier, an engine block hash to the deepest node that block
	// covers. A block covers ratio nodes: the mapped node and its ratio-1
	// ancestors.
	blocks [numTiers]blockMap
	// dups counts repeated stores of the same block beyond the first, keyed by
	// tierKey; absent means one. Almost always nil.
	dups map[uint64]uint32
	// ratio is the engine block size divided by the index block size, fixed by
	// the first store (0 until then).
	ratio int
	// gone is a removal's scratch: the nodes it unmapped, released under the
	// tree's lock after the map work (Index only; empty between events).
	gone []*node
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
//   - slots are dense: a removed worker rank's slot is reused by the next new one;
//   - a detached node is referenced by nothing but spare (at most maxSpareNodes
//     of them), so child may reuse it;
//   - a node's ext.extras is the number of extra entries naming it (its ext
//     exists while that is not zero);
//   - a node has markSame only if it is its parent's only child (child, not
//     in a kids map) and has its parent's holders on every tier, and then it
//     has it unless dropWorker left it unmarked (see dropping): every other
//     change of holders or children recomputes the marks it affects.
type tree struct {
	root    node
	workers map[catalog.WorkerRank]*workerState
	slots   []*workerState // slot -> state, nil when free
	// slotKeys is slot -> worker rank (the zero key when free), dense, so
	// that a walk's results read their keys from one array rather than
	// from each rank's state (at 4,096 ranks sharing a prompt, a cache miss
	// per rank).
	slotKeys []catalog.WorkerRank
	free     []uint32 // free slots
	// spare holds up to maxSpareNodes detached nodes for child to reuse, so
	// the steady store-and-evict of a full cache allocates nothing.
	spare []*node

	// extra counts memberships beyond the first of a (node, tier, slot); almost
	// always empty.
	extra map[extraKey]uint32

	// dropping is set while dropWorker runs. Taking one worker rank's slot
	// off every node it holds keeps each mark true (a marked node and its
	// parent both lose it), so the marks are not recomputed then; the cost is
	// that nodes it leaves equal to their parents stay unmarked until their
	// holders next change, and a walk merges there meanwhile.
	dropping bool

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
		workers: make(map[catalog.WorkerRank]*workerState),
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

func (t *tree) worker(w catalog.WorkerRank, create bool) *workerState {
	if ws := t.workers[w]; ws != nil || !create {
		return ws
	}
	ws := &workerState{key: w}
	if n := len(t.free); n > 0 {
		ws.slot = t.free[n-1]
		t.free = t.free[:n-1]
		t.slots[ws.slot] = ws
		t.slotKeys[ws.slot] = w
	} else {
		ws.slot = uint32(len(t.slots))
		t.slots = append(t.slots, ws)
		t.slotKeys = append(t.slotKeys, w)
	}
	t.workers[w] = ws
	return ws
}

// child returns parent's child with key, creating it when absent.
func (t *tree) child(parent *node, key uint64) *node {
	if c := parent.childFor(key); c != nil {
		return c
	}
	var c *node
	if n := len(t.spare); n > 0 {
		c = t.spare[n-1]
		t.spare = t.spare[:n-1]
		*c = node{key: key, parent: parent}
	} else {
		c = &node{key: key, parent: parent}
	}
	switch kids := parent.kids(); {
	case kids != nil:
		kids[key] = c
		t.kidMapBytes += 24
	case parent.child == nil:
		parent.child = c
		c.setSame(sameHolders(c, parent))
	default:
		t.ensureExt(parent)
		parent.child.setSame(false)
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
	var added bool
	if tier == TierDevice {
		s := n.devSet()
		before := s.extraBytes()
		added = s.add(slot)
		t.setBytes += s.extraBytes() - before
		t.storeDev(n, s)
	} else {
		t.ensureExt(n)
		s := &n.ext.host
		if tier == TierDisk {
			s = &n.ext.disk
		}
		before := s.extraBytes()
		added = s.add(slot)
		t.setBytes += s.extraBytes() - before
	}
	if added {
		remark(n)
	}
	return added
}

// removeSlot removes slot from n's holders on tier and reports whether it was
// present.
func (t *tree) removeSlot(n *node, tier Tier, slot uint32) bool {
	var removed bool
	if tier == TierDevice {
		s := n.devSet()
		before := s.extraBytes()
		removed = s.remove(slot)
		t.setBytes += s.extraBytes() - before
		t.storeDev(n, s)
	} else {
		if n.ext == nil {
			return false
		}
		s := &n.ext.host
		if tier == TierDisk {
			s = &n.ext.disk
		}
		before := s.extraBytes()
		removed = s.remove(slot)
		t.setBytes += s.extraBytes() - before
		t.freeExtIfIdle(n)
	}
	if removed && !t.dropping {
		remark(n)
	}
	return removed
}

// storeDev writes a device set back into n's inline word or ext.
func (t *tree) storeDev(n *node, s slotSet) {
	n.dev.idx, n.dev.bits = s.one.idx, s.one.bits
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
		k := extraKey{heldKey{n, tier}, ws.slot}
		if t.extra[k] == 0 {
			t.ensureExt(n)
			n.ext.extras++
		}
		t.extra[k]++
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
	if n.ext != nil && n.ext.extras > 0 {
		k := extraKey{heldKey{n, tier}, ws.slot}
		if c, ok := t.extra[k]; ok {
			if c <= 1 {
				delete(t.extra, k)
				n.ext.extras--
				t.freeExtIfIdle(n)
			} else {
				t.extra[k] = c - 1
			}
			return
		}
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
					only.setSame(sameHolders(only, p))
				}
				p.ext.kids = nil
				t.kidMapBytes -= 72
				t.freeExtIfIdle(p)
			}
		}
		n.parent = nil
		t.freeExtIfIdle(n)
		t.nodes--
		if len(t.spare) < maxSpareNodes && n.ext == nil {
			t.spare = append(t.spare, n)
		}
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
	t.dropping = true
	ratio := max(ws.ratio, 1)
	for tier := range Tier(numTiers) {
		m := &ws.blocks[tier]
		for _, n := range m.all() {
			t.releaseBlock(ws, n, tier, ratio)
		}
		t.mapEntries -= m.count()
	}
	t.dropping = false
	delete(t.workers, ws.key)
	t.slots[ws.slot] = nil
	t.slotKeys[ws.slot] = catalog.WorkerRank{}
	t.free = append(t.free, ws.slot)
}

// stats fills the structural part of s.
func (t *tree) stats(s *Stats) {
	s.Nodes = t.nodes
	s.Entries = t.entries
	maps := 0
	for _, ws := range t.workers {
		// A worker rank a removal emptied is dropped right after; until
		// then it holds no block and does not count.
		if ws.holdsAny() {
			s.WorkerRanks++
		}
		for i := range ws.blocks {
			maps += ws.blocks[i].bytes()
		}
	}
	s.ApproxBytes = int64(t.nodes)*nodeBytes + int64(t.setBytes) + int64(t.kidMapBytes) +
		int64(maps) + int64(len(t.workers))*workerStateBytes
}

// workerStateBytes approximates a worker rank's fixed cost: its state and its
// entry in the tree's worker map.
const workerStateBytes = 256
