package kvindex

import (
	"iter"
	"math/bits"
	"sync"
	"unsafe"

	"github.com/kvselect/kvselect/catalog"
)

// node is one block of the radix tree. Its key is the block's sequence hash, which
// names the whole prefix up to and including the block, so a node's children are
// keyed by their own sequence hashes and never collide.
//
// A node is 32 bytes and holds no pointer: it lives in the tree's arena and
// names its parent, its only child and its ext by their ids, so the garbage
// collector never scans the nodes. The common case (one child or none, holders
// whose slots fit one 64-bit word, device tier only) needs nothing more.
// Everything rarer lives in its ext, allocated on demand and freed when it
// becomes idle.
type node struct {
	// idx and bits are the device-tier holder set when it fits one word;
	// when it spans several words it lives in ext.devWide and bits is zero.
	// idx, up and bits have sword's layout, up where sword has its padding
	// (which == ignores), so devWords reads them in place as a one-word set
	// that nobody writes through.
	idx uint32
	// up is the parent's id shifted left by one, and markSame in bit 0.
	up   uint32
	bits uint64
	key  uint64
	// child is the only child when the node has exactly one; ext.kids holds all
	// children when it has two or more (then child is 0).
	child nodeID
	ext   extID
}

// nodeID names a node in its tree's arena; 0 names none. extID names a
// nodeExt the same way.
type (
	nodeID uint32
	extID  uint32
)

// rootID is the root's id; the root is the one node with no parent.
const rootID nodeID = 1

// The arena holds nodes in chunks of chunkLen (128 KiB), which never move, so
// a *node stays valid while its node is in the tree. Ids fit 31 bits (up
// keeps a parent's id there): the root's and MaxNodes others.
const (
	chunkBits = 12
	chunkLen  = 1 << chunkBits
	chunkMask = chunkLen - 1
)

// MaxNodes is the most nodes (index blocks held by some worker rank, shared
// prefixes counted once) an Index or Approx holds: an Index refuses a stored
// run that could take it past MaxNodes with ErrIndexFull. It is far beyond
// what fits in memory on most machines (64 GiB of nodes).
const MaxNodes = 1<<31 - 2

// markSame, in a node's up: the node is its parent's only child and has the
// same holders as its parent on every tier, so a walk that reaches it from its
// parent keeps its candidates as they are. A change of a node's holders
// recomputes the node's mark and its only child's (except while a worker rank
// is dropped: see tree.dropping).
const markSame uint32 = 1

// nodeExt holds what few nodes need.
type nodeExt struct {
	// kids holds all children, by key, when the node has two or more (it
	// is empty otherwise); the root's are in tree.rootKids.
	kids       blockMap
	devWide    *[]sword
	host, disk slotSet
	// extras counts the tree's extra entries of this node (memberships beyond
	// the first of a tier and slot), so releasing a membership of a node that
	// has none skips the lookup.
	extras int
}

func (e *nodeExt) idle() bool {
	return e.kids.slots == nil && e.devWide == nil && e.host.empty() && e.disk.empty() && e.extras == 0
}

// Exts live in chunks of extChunkLen, which never move.
const (
	extChunkBits = 8
	extChunkLen  = 1 << extChunkBits
	extChunkMask = extChunkLen - 1
)

// Sizes used by the memory estimate: a node, a node chunk with its free
// bitmap, and a nodeExt.
const (
	nodeBytes  = 32
	chunkBytes = chunkLen*nodeBytes + int(unsafe.Sizeof(chunkFree{}))
	extBytes   = int(unsafe.Sizeof(nodeExt{}))
)

func (n *node) parent() nodeID { return nodeID(n.up >> 1) }

func (n *node) same() bool { return n.up&markSame != 0 }

func (n *node) setSame(same bool) {
	if same {
		n.up |= markSame
	} else {
		n.up &^= markSame
	}
}

// at returns the node id names; valid while that node is in the tree.
func (t *tree) at(id nodeID) *node { return &t.chunks[id>>chunkBits][id&chunkMask] }

// warm loads the nodes ids name, so that their cache misses overlap where
// the work on each would wait for them in turn (see blockMap.warm).
//
//go:noinline
func (t *tree) warm(ids []nodeID) (sum uint32) {
	for _, id := range ids {
		sum += t.at(id).up
	}
	return sum
}

// extOf returns n's ext, or nil.
func (t *tree) extOf(n *node) *nodeExt {
	if n.ext == 0 {
		return nil
	}
	return t.ext(n.ext)
}

// ext returns the ext id names.
func (t *tree) ext(id extID) *nodeExt { return &t.exts[id>>extChunkBits][id&extChunkMask] }

// newNode takes a free id (a detached node's, or the arena's next) for a node
// with key below parent.
func (t *tree) newNode(key uint64, parent nodeID) nodeID {
	id := t.takeFree()
	if id == 0 {
		if t.nextID > MaxNodes+1 { // callers keep to MaxNodes
			panic("kvindex: node arena exhausted")
		}
		id = t.nextID
		if int(id>>chunkBits) == len(t.chunks) {
			t.chunks = append(t.chunks, new([chunkLen]node))
			t.freeIDs = append(t.freeIDs, chunkFree{})
		}
		t.nextID++
	}
	*t.at(id) = node{key: key, up: uint32(parent) << 1}
	return id
}

// chunkFree is a chunk's free ids: a bitmap (bit i of word w is the id at
// w<<6|i in the chunk), how many are set, the first word that may have one,
// and whether the chunk is on the tree's partial list.
type chunkFree struct {
	bits   [chunkLen / 64]uint64
	n      int32
	cursor int32
	listed bool
}

// takeFree returns a detached node's id for reuse, or 0 when there is none.
// It takes the lowest free id of the chunk that last had one freed, so a
// run stored at once gets ascending ids in one chunk, near each other (and
// often adjacent, for walks: see next), as a run of fresh ids does.
func (t *tree) takeFree() nodeID {
	for k := len(t.partial); k > 0; k = len(t.partial) {
		c := t.partial[k-1]
		f := &t.freeIDs[c]
		if f.n == 0 {
			f.listed = false
			t.partial = t.partial[:k-1]
			continue
		}
		for w := f.cursor; ; w++ {
			if b := f.bits[w]; b != 0 {
				i := bits.TrailingZeros64(b)
				f.bits[w] = b &^ (1 << i)
				f.n--
				f.cursor = w
				return nodeID(c)<<chunkBits | nodeID(w)<<6 | nodeID(i)
			}
		}
	}
	return 0
}

// freeNode zeroes the detached node id and makes its id free for reuse.
func (t *tree) freeNode(id nodeID) {
	*t.at(id) = node{}
	c, w := id>>chunkBits, int32(id&chunkMask)>>6
	f := &t.freeIDs[c]
	f.bits[w] |= 1 << (id & 63)
	f.n++
	f.cursor = min(f.cursor, w)
	if !f.listed {
		f.listed = true
		t.partial = append(t.partial, int32(c))
	}
}

// kids returns n's table of children when n keeps one (the root always,
// another node while it has two or more children), or nil.
func (t *tree) kids(n *node) *blockMap {
	if n == t.root {
		return &t.rootKids
	}
	if e := t.extOf(n); e != nil && e.kids.slots != nil {
		return &e.kids
	}
	return nil
}

// devWords returns the device-tier holders; valid until the node changes.
func (t *tree) devWords(n *node) []sword {
	if n.ext != 0 {
		if e := t.ext(n.ext); e.devWide != nil {
			return *e.devWide
		}
	}
	if n.bits == 0 {
		return nil
	}
	return unsafe.Slice((*sword)(unsafe.Pointer(&n.idx)), 1)
}

// devSet returns the device-tier holders as a slotSet sharing n's wide words.
func (t *tree) devSet(n *node) slotSet {
	s := slotSet{one: sword{idx: n.idx, bits: n.bits}}
	if e := t.extOf(n); e != nil {
		s.more = e.devWide
	}
	return s
}

// emptySet stands for the lower tiers of a node without ext; never written.
var emptySet slotSet

// sameHolders reports whether a and b have the same holders on every tier.
func (t *tree) sameHolders(a, b *node) bool {
	if a.ext != b.ext { // two nodes never share an ext: equal ids are 0
		return t.sameExtHolders(a, b)
	}
	return a.bits == b.bits && a.idx == b.idx
}

func (t *tree) sameExtHolders(a, b *node) bool {
	ad, bd := t.devSet(a), t.devSet(b)
	return ad.equal(&bd) && t.lower(a, TierHost).equal(t.lower(b, TierHost)) && t.lower(a, TierDisk).equal(t.lower(b, TierDisk))
}

// lower returns n's holders on the host or disk tier.
func (t *tree) lower(n *node, tier Tier) *slotSet {
	e := t.extOf(n)
	switch {
	case e == nil:
		return &emptySet
	case tier == TierDisk:
		return &e.disk
	default:
		return &e.host
	}
}

// remark recomputes the marks that the holders of n (the node id names)
// decide, after they changed: n's own, when n is its parent's only child,
// and its only child's.
func (t *tree) remark(id nodeID, n *node) {
	if p := n.parent(); p != 0 {
		if pn := t.at(p); pn.child == id {
			n.setSame(t.sameHolders(n, pn))
		}
	}
	if c := n.child; c != 0 {
		cn := t.at(c)
		cn.setSame(t.sameHolders(cn, n))
	}
}

func (t *tree) hasLower(n *node) bool {
	e := t.extOf(n)
	return e != nil && (!e.host.empty() || !e.disk.empty())
}

// childFor returns n's child with key, or 0 and nil.
func (t *tree) childFor(n *node, key uint64) (nodeID, *node) {
	if c := n.child; c != 0 {
		if cn := t.at(c); cn.key == key {
			return c, cn
		}
		return 0, nil
	}
	if k := t.kids(n); k != nil {
		if c := k.get(key); c != 0 {
			return c, t.at(c)
		}
	}
	return 0, nil
}

// next is childFor for the walks: the child with key of n, whose id is id,
// or nil. A child that took the id after its parent's (a run stored at once
// into a fresh arena) is the next node of the chunk: its address follows from
// n's, so a walk along such a run never waits for the chunk table, and the
// next node's load can start before n's child id arrives.
func (t *tree) next(n *node, id nodeID, key uint64) (*node, nodeID) {
	c := n.child
	var cn *node
	switch {
	case c == id+1 && c&chunkMask != 0:
		cn = (*node)(unsafe.Add(unsafe.Pointer(n), nodeBytes))
	case c != 0:
		cn = t.at(c)
	default:
		return t.kidFor(n, key)
	}
	if cn.key != key {
		return nil, 0
	}
	return cn, c
}

// kidFor returns n's child with key from n's table of children, and its
// id, or nil.
func (t *tree) kidFor(n *node, key uint64) (*node, nodeID) {
	if k := t.kids(n); k != nil {
		if c := k.get(key); c != 0 {
			return t.at(c), c
		}
	}
	return nil, 0
}

// children yields n's children, key and id, in no particular order.
func (t *tree) children(n *node) iter.Seq2[uint64, nodeID] {
	return func(yield func(uint64, nodeID) bool) {
		if n.child != 0 {
			yield(t.at(n.child).key, n.child)
			return
		}
		if k := t.kids(n); k != nil {
			for key, c := range k.all() {
				if !yield(key, c) {
					return
				}
			}
		}
	}
}

func (t *tree) childless(n *node) bool {
	if n.child != 0 {
		return false
	}
	k := t.kids(n)
	return k == nil || k.count() == 0
}

func (t *tree) unheld(n *node) bool {
	if n.bits != 0 {
		return false
	}
	e := t.extOf(n)
	return e == nil || (e.devWide == nil && e.host.empty() && e.disk.empty())
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
	gone []nodeID
}

// heldKey names one membership of a worker rank in a node on a tier.
type heldKey struct {
	n    nodeID
	tier Tier
}

// tree is the single-goroutine core shared by Index and Approx: nodes, worker
// ranks and their slots, and the membership bookkeeping. Callers hold the owner's
// lock.
//
// Invariants:
//   - a node is reachable from the root iff some worker rank holds it or one of its
//     descendants; a node that becomes unheld and childless is detached at once,
//     and its id is freed for the next new node (the arena keeps the most nodes
//     it ever held, and reuses them);
//   - a worker rank's blocks map points only at nodes where its slot is set on the
//     block's tier, and each membership is counted once per mapped block covering
//     it (the first in the slot bit, the rest in extra);
//   - slots are dense: a removed worker rank's slot is reused by the next new one;
//   - a detached node's id is set in its chunk's free bitmap and named
//     nowhere else, and its node is zero; a chunk with a free id is on
//     partial;
//   - a node's ext.extras is the number of extra entries naming it (its ext
//     exists while that is not zero);
//   - a node has markSame only if it is its parent's only child (child, not
//     in a kids map) and has its parent's holders on every tier, and then it
//     has it unless dropWorker left it unmarked (see dropping): every other
//     change of holders or children recomputes the marks it affects.
type tree struct {
	// chunks is the node arena: id i is chunks[i>>chunkBits][i&chunkMask].
	// Ids below nextID have been handed out; those of detached nodes are
	// free: freeIDs[c] of chunk c, and partial lists the chunks that have
	// some. Id 0 names nothing, rootID the root.
	chunks  []*[chunkLen]node
	nextID  nodeID
	freeIDs []chunkFree
	partial []int32
	// exts holds the nodes' exts in chunks of extChunkLen: ext id i is
	// exts[i>>extChunkBits][i&extChunkMask]. Ids below nextExt have been
	// handed out (0 is none); freed ones are in freeExts, their ext zero.
	exts     []*[extChunkLen]nodeExt
	nextExt  extID
	freeExts []extID
	// root is the root node (at rootID), and rootKids its children: the
	// one table every walk starts from, kept here so that a cold lookup
	// reaches it in a miss or two.
	root     *node
	rootKids blockMap
	workers  map[catalog.WorkerRank]*workerState
	slots    []*workerState // slot -> state, nil when free
	// slotKeys is slot -> worker rank (the zero key when free), dense, so
	// that a walk's results read their keys from one array rather than
	// from each rank's state (at 4,096 ranks sharing a prompt, a cache miss
	// per rank).
	slotKeys []catalog.WorkerRank
	free     []uint32 // free slots

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
	t := tree{
		chunks:  []*[chunkLen]node{new([chunkLen]node)},
		freeIDs: make([]chunkFree, 1),
		nextID:  rootID + 1,
		nextExt: 1,
		workers: make(map[catalog.WorkerRank]*workerState),
		extra:   make(map[extraKey]uint32),
	}
	t.root = t.at(rootID)
	return t
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

// child returns parent's child with key, creating it when absent. It may
// grow the arena, which moves no node.
func (t *tree) child(parent nodeID, key uint64) nodeID {
	c, _ := t.childNode(parent, t.at(parent), key)
	return c
}

// childNode is child for a caller that has the parent's node, pn, and
// wants the child's.
func (t *tree) childNode(parent nodeID, pn *node, key uint64) (nodeID, *node) {
	if c, cn := t.childFor(pn, key); c != 0 {
		return c, cn
	}
	c := t.newNode(key, parent)
	cn := t.at(c)
	switch kids := t.kids(pn); {
	case kids != nil:
		before := kids.bytes()
		kids.put(key, c)
		t.kidMapBytes += kids.bytes() - before
	case pn.child == 0:
		pn.child = c
		cn.setSame(t.sameHolders(cn, pn))
	default:
		only := t.at(pn.child)
		only.setSame(false)
		kids := &t.ensureExt(pn).kids
		kids.put(only.key, pn.child)
		kids.put(key, c)
		pn.child = 0
		t.kidMapBytes += kids.bytes()
	}
	t.nodes++
	return c, cn
}

// ensureExt returns n's ext, giving it one when it has none.
func (t *tree) ensureExt(n *node) *nodeExt {
	if n.ext != 0 {
		return t.ext(n.ext)
	}
	if k := len(t.freeExts); k > 0 {
		n.ext = t.freeExts[k-1]
		t.freeExts = t.freeExts[:k-1]
	} else {
		n.ext = t.nextExt
		if int(n.ext>>extChunkBits) == len(t.exts) {
			t.exts = append(t.exts, new([extChunkLen]nodeExt))
		}
		t.nextExt++
	}
	return t.ext(n.ext)
}

func (t *tree) freeExtIfIdle(n *node) {
	if e := t.extOf(n); e != nil && e.idle() {
		*e = nodeExt{}
		t.freeExts = append(t.freeExts, n.ext)
		n.ext = 0
	}
}

// addSlot adds slot to the holders on tier of n, the node id names, and
// reports whether it was absent.
func (t *tree) addSlot(id nodeID, n *node, tier Tier, slot uint32) bool {
	var added bool
	if tier == TierDevice {
		s := t.devSet(n)
		before := s.extraBytes()
		added = s.add(slot)
		t.setBytes += s.extraBytes() - before
		t.storeDev(n, s)
	} else {
		e := t.ensureExt(n)
		s := &e.host
		if tier == TierDisk {
			s = &e.disk
		}
		before := s.extraBytes()
		added = s.add(slot)
		t.setBytes += s.extraBytes() - before
	}
	if added {
		t.remark(id, n)
	}
	return added
}

// removeSlot removes slot from the holders on tier of n, the node id names,
// and reports whether it was present.
func (t *tree) removeSlot(id nodeID, n *node, tier Tier, slot uint32) bool {
	var removed bool
	if tier == TierDevice {
		s := t.devSet(n)
		before := s.extraBytes()
		removed = s.remove(slot)
		t.setBytes += s.extraBytes() - before
		t.storeDev(n, s)
	} else {
		e := t.extOf(n)
		if e == nil {
			return false
		}
		s := &e.host
		if tier == TierDisk {
			s = &e.disk
		}
		before := s.extraBytes()
		removed = s.remove(slot)
		t.setBytes += s.extraBytes() - before
		t.freeExtIfIdle(n)
	}
	if removed && !t.dropping {
		t.remark(id, n)
	}
	return removed
}

// storeDev writes a device set back into n's inline word or ext.
func (t *tree) storeDev(n *node, s slotSet) {
	n.idx, n.bits = s.one.idx, s.one.bits
	if s.more != nil {
		t.ensureExt(n).devWide = s.more
		return
	}
	if e := t.extOf(n); e != nil {
		e.devWide = nil
		t.freeExtIfIdle(n)
	}
}

// hold adds one membership of ws in node id on tier.
func (t *tree) hold(ws *workerState, id nodeID, tier Tier) { t.holdNode(ws, id, t.at(id), tier) }

// holdNode is hold for a caller that has the node, n.
func (t *tree) holdNode(ws *workerState, id nodeID, n *node, tier Tier) {
	if !t.addSlot(id, n, tier, ws.slot) {
		k := extraKey{heldKey{id, tier}, ws.slot}
		if t.extra[k] == 0 {
			t.ensureExt(n).extras++
		}
		t.extra[k]++
		return
	}
	t.entries++
	if tier != TierDevice {
		t.lowerEntries++
	}
}

// release removes one membership of ws in node id on tier and prunes what
// became unreferenced.
func (t *tree) release(ws *workerState, id nodeID, tier Tier) {
	n := t.at(id)
	if e := t.extOf(n); e != nil && e.extras > 0 {
		k := extraKey{heldKey{id, tier}, ws.slot}
		if c, ok := t.extra[k]; ok {
			if c <= 1 {
				delete(t.extra, k)
				e.extras--
				t.freeExtIfIdle(n)
			} else {
				t.extra[k] = c - 1
			}
			return
		}
	}
	if !t.removeSlot(id, n, tier, ws.slot) {
		return
	}
	t.entries--
	if tier != TierDevice {
		t.lowerEntries--
	}
	t.prune(id, n)
}

// prune detaches n, the node id names, and then its ancestors, while they
// are unheld and childless.
func (t *tree) prune(id nodeID, n *node) {
	for id != rootID {
		if !t.unheld(n) || !t.childless(n) {
			return
		}
		p := n.parent()
		pn := t.at(p)
		if pn.child == id {
			pn.child = 0
		} else if kids := t.kids(pn); kids != nil {
			before := kids.bytes()
			kids.remove(n.key)
			t.kidMapBytes += kids.bytes() - before
			if kids.count() == 1 && p != rootID {
				for _, only := range kids.all() {
					pn.child = only
					on := t.at(only)
					on.setSame(t.sameHolders(on, pn))
				}
				t.kidMapBytes -= kids.bytes()
				*kids = blockMap{}
				t.freeExtIfIdle(pn)
			}
		}
		t.freeExtIfIdle(n)
		t.freeNode(id)
		t.nodes--
		id, n = p, pn
	}
}

// releaseBlock releases the ratio nodes one mapped block covers, deepest first.
func (t *tree) releaseBlock(ws *workerState, id nodeID, tier Tier, ratio int) {
	for i := 0; i < ratio && id != 0 && id != rootID; i++ {
		p := t.at(id).parent()
		t.release(ws, id, tier)
		id = p
	}
}

// dropWorker releases every block of ws and frees its slot. Cost is proportional
// to the blocks ws holds.
func (t *tree) dropWorker(ws *workerState) {
	t.dropping = true
	ratio := max(ws.ratio, 1)
	for tier := range Tier(numTiers) {
		m := &ws.blocks[tier]
		for _, id := range m.all() {
			t.releaseBlock(ws, id, tier, ratio)
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
	// The arenas count whole: they keep the most nodes and exts the tree
	// ever held.
	s.ApproxBytes = int64(len(t.chunks)*chunkBytes+len(t.exts)*extChunkLen*extBytes) + int64(t.setBytes) + int64(t.kidMapBytes) +
		int64(maps) + int64(len(t.workers))*workerStateBytes
}

// workerStateBytes approximates a worker rank's fixed cost: its state and its
// entry in the tree's worker map.
const workerStateBytes = 256
