package kvindex

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"

	"github.com/kvselect/kvselect/catalog"
)

// Errors returned by Apply, wrapped with context. Every rejected event leaves the
// index unchanged and is counted in Stats.
var (
	// ErrUnknownParent: a stored run names a parent block the worker rank does not
	// hold (the event was lost, or arrived before its parent). The run is dropped,
	// never attached at the root.
	ErrUnknownParent = errors.New("kvindex: parent block unknown")
	// ErrTokenCount: a stored run does not carry exactly one block size of tokens
	// per block hash.
	ErrTokenCount = errors.New("kvindex: token count does not match blocks")
	// ErrUnknownBlock: a removal names blocks the worker rank does not hold (their
	// store was lost or skipped, or the engine removes what it never announced).
	// The blocks it does hold are removed; the unknown ones change nothing.
	ErrUnknownBlock = errors.New("kvindex: removed block unknown")
	// ErrRankFull: storing the run would make the worker rank hold more blocks
	// on its tier than its limit (Options.MaxBlocksPerRank, SetRankLimit): an
	// engine that stores without ever removing is broken or hostile, and must
	// not grow the index without bound. The run is refused.
	ErrRankFull = errors.New("kvindex: worker rank holds its limit of blocks")
	// ErrIndexFull: storing the run would take the index past the most nodes
	// it can name (MaxNodes). The run is refused.
	ErrIndexFull = errors.New("kvindex: index holds the most nodes it can")
	// ErrInvalidEvent: the event is malformed (unknown kind or tier, negative rank,
	// empty worker name, repeated block hashes, extra digests of the wrong length).
	ErrInvalidEvent = errors.New("kvindex: invalid event")
)

// Options configure an Index.
type Options struct {
	// BlockSize is the number of tokens per index block; it must be positive and
	// equal the block size requests are hashed with. Required.
	BlockSize int
	// MaxBlocksPerRank is the most engine blocks one worker rank may hold on one
	// tier, unless SetRankLimit says otherwise for its worker; stores beyond it
	// are refused with ErrRankFull. 0 means DefaultMaxBlocksPerRank; negative is
	// invalid.
	MaxBlocksPerRank int
	// OnStored, when set, is called after every stored run is applied, with the
	// worker rank and the keys (sequence hashes, as Hasher computes them) of the
	// index blocks the run covers, in prefix order. It runs under the lock of
	// the index's tree, so calls never overlap: it must be quick, must not keep
	// keys, and must not call the Index.
	OnStored func(w catalog.WorkerRank, keys []uint64)
}

// DefaultMaxBlocksPerRank is Options.MaxBlocksPerRank's default: about 1M
// blocks, more than any one engine's cache holds (a 16-token block of a large
// model is hundreds of KiB of KV cache).
const DefaultMaxBlocksPerRank = 1 << 20

// Index is the event-fed block index: for each worker rank it knows which blocks
// are in its KV cache, on which tier, and answers which worker ranks hold the
// longest prefix of a request. It is safe for concurrent use: any number of
// FindMatches calls run in parallel with each other, and Apply calls for
// different worker ranks run in parallel except while they change the tree;
// ClearRank and RemoveWorker run alone.
//
// Locks, always taken in this order:
//   - ranksMu guards the worker-rank registry (t.workers, t.slots, t.slotKeys, t.free,
//     which are also written only under mu) and limits. Apply holds it for
//     reading; whatever adds or drops a worker rank, or reads every rank's
//     block maps (Snapshot, Stats, LoadRanks), holds it for writing, which
//     also waits for every Apply in progress.
//   - workerState.mu guards one worker rank's block maps, duplicates and
//     ratio: Apply holds it for the whole event, so an event's map work (a
//     probe per block, the costliest part of applying it after decoding and
//     hashing) runs outside mu, in parallel with other worker ranks'.
//   - mu guards the tree (nodes, holder sets, marks, counters). Lookups hold
//     it for reading; Apply holds it for writing only while it changes
//     nodes.
type Index struct {
	blockSize int
	maxBlocks int
	// maxNodes is MaxNodes (lower in tests).
	maxNodes int
	onStored func(catalog.WorkerRank, []uint64)

	ranksMu sync.RWMutex
	mu      sync.RWMutex
	t       tree
	// limits are per-worker block limits set by SetRankLimit. Guarded by
	// ranksMu.
	limits map[string]int

	// Counters, readable without the lock.
	applied        atomic.Uint64
	unknownParent  atomic.Uint64
	rejected       atomic.Uint64
	unknownRemoves atomic.Uint64
	dupStores      atomic.Uint64
	unknownClears  atomic.Uint64
	emptyEvents    atomic.Uint64
}

// New returns an empty Index.
func New(opts Options) (*Index, error) {
	if opts.BlockSize <= 0 {
		return nil, fmt.Errorf("%w: Options.BlockSize is %d, want > 0", ErrBlockSize, opts.BlockSize)
	}
	if opts.MaxBlocksPerRank < 0 {
		return nil, fmt.Errorf("%w: Options.MaxBlocksPerRank is %d, want >= 0", ErrInvalidEvent, opts.MaxBlocksPerRank)
	}
	mb := opts.MaxBlocksPerRank
	if mb == 0 {
		mb = DefaultMaxBlocksPerRank
	}
	return &Index{blockSize: opts.BlockSize, maxBlocks: mb, maxNodes: MaxNodes, onStored: opts.OnStored, t: newTree(), limits: map[string]int{}}, nil
}

// SetRankLimit sets how many engine blocks each rank of worker may hold per
// tier (n <= 0: back to Options.MaxBlocksPerRank). It does not drop blocks a
// rank already holds beyond a lowered limit; it refuses further stores.
// RemoveWorker forgets the limit.
func (ix *Index) SetRankLimit(worker string, n int) {
	ix.ranksMu.Lock()
	defer ix.ranksMu.Unlock()
	if n <= 0 {
		delete(ix.limits, worker)
		return
	}
	ix.limits[worker] = n
}

// BlockSize returns the tokens per index block.
func (ix *Index) BlockSize() int { return ix.blockSize }

// storePlan is the work of a stored event computed before taking the lock.
type storePlan struct {
	locals []uint64 // local hash of every index block
	keys   []uint64 // the index blocks' keys, for Options.OnStored
	seen   hashSet  // scratch of checkDistinct
	// old holds, per engine block, the node its hash mapped to before the
	// event (0 when none); now the node it maps to after it, and slots its
	// slot in the worker rank's map, for the map updates after the tree's.
	old, now []nodeID
	slots    []*blockSlot
	ratio    int
}

// pending is the node a stored run's new hash maps to between finding its
// slot and the tree's part (see storeRanked): never a node's id.
const pending = ^nodeID(0)

// release returns the plan to the pool.
func (p *storePlan) release() {
	clear(p.slots) // the pooled plan keeps no pointer into a table
	p.old, p.now, p.slots = p.old[:0], p.now[:0], p.slots[:0]
	planPool.Put(p)
}

var planPool = sync.Pool{New: func() any { return new(storePlan) }}

// Apply applies one event of worker rank w. It returns nil when the event was
// applied, or a wrapped ErrUnknownParent, ErrBlockSize, ErrTokenCount or
// ErrInvalidEvent, in which case nothing changed. A removal that names blocks the
// worker rank does not hold removes the others and returns a wrapped
// ErrUnknownBlock. Clearing an unknown worker rank and a stored event with no
// blocks are counted no-ops, not errors.
func (ix *Index) Apply(w catalog.WorkerRank, ev Event) error {
	if w.WorkerID == "" || w.Rank < 0 {
		ix.rejected.Add(1)
		return fmt.Errorf("%w: worker rank %q/%d", ErrInvalidEvent, w.WorkerID, w.Rank)
	}
	if !ev.Tier.valid() {
		ix.rejected.Add(1)
		return fmt.Errorf("%w: tier %d", ErrInvalidEvent, ev.Tier)
	}
	switch ev.Kind {
	case EventStored:
		return ix.store(w, &ev)
	case EventRemoved:
		if n := ix.remove(w, ev.Tier, ev.BlockHashes); n > 0 {
			return fmt.Errorf("%w: %d of %d blocks on worker rank %s", ErrUnknownBlock, n, len(ev.BlockHashes), w)
		}
		return nil
	case EventCleared:
		ix.ClearRank(w)
		return nil
	default:
		ix.rejected.Add(1)
		return fmt.Errorf("%w: kind %d", ErrInvalidEvent, ev.Kind)
	}
}

func (ix *Index) store(w catalog.WorkerRank, ev *Event) error {
	nb := len(ev.BlockHashes)
	if nb == 0 {
		ix.emptyEvents.Add(1)
		return nil
	}
	bs := ev.BlockSize
	if bs == 0 {
		bs = ix.blockSize
	}
	if bs < 0 || bs%ix.blockSize != 0 {
		ix.rejected.Add(1)
		return fmt.Errorf("%w: event block size %d is not a multiple of the index block size %d", ErrBlockSize, bs, ix.blockSize)
	}
	if len(ev.Tokens) != nb*bs {
		ix.rejected.Add(1)
		return fmt.Errorf("%w: %d tokens for %d blocks of %d", ErrTokenCount, len(ev.Tokens), nb, bs)
	}
	if ev.Extra != nil && len(ev.Extra) != nb {
		ix.rejected.Add(1)
		return fmt.Errorf("%w: %d extra digests for %d blocks", ErrInvalidEvent, len(ev.Extra), nb)
	}
	plan := planPool.Get().(*storePlan)
	defer plan.release()
	if err := checkDistinct(ev, plan); err != nil {
		ix.rejected.Add(1)
		return err
	}

	// Hash outside the lock: local hashes do not depend on the tree.
	plan.ratio = bs / ix.blockSize
	plan.keys = plan.keys[:0]
	// A run that starts the sequence salts its first block; a run that continues
	// one inherits the salt through the chain (see HashOptions.seed).
	ho := HashOptions{LoRAName: ev.LoRAName, CacheSalt: ev.CacheSalt}
	first, later := ho.seed(), ho.laterSeed()
	if ev.HasParent {
		first = later
	}
	plan.locals = plan.locals[:0]
	for j := range nb {
		var extra uint64
		if ev.Extra != nil {
			extra = ev.Extra[j]
		}
		for s := range plan.ratio {
			off := j*bs + s*ix.blockSize
			seed := later
			if j == 0 && s == 0 {
				seed = first
			}
			plan.locals = append(plan.locals, blockHash(seed, ev.Tokens[off:off+ix.blockSize], extra))
		}
	}

	ix.ranksMu.RLock()
	ws := ix.t.worker(w, false)
	if ws == nil {
		// The worker rank's first store adds it to the registry: apply it
		// alone.
		ix.ranksMu.RUnlock()
		ix.ranksMu.Lock()
		defer ix.ranksMu.Unlock()
		ws = ix.t.worker(w, false)
	} else {
		defer ix.ranksMu.RUnlock()
	}
	if ws != nil {
		ws.mu.Lock()
		defer ws.mu.Unlock()
	}
	return ix.storeRanked(w, ws, ev, plan)
}

// storeRanked applies a stored run of w, whose state is ws (nil when w is
// new), once hashed: checks, map probes, then the tree under mu, then the map
// updates. The caller holds ranksMu (for writing when ws is nil) and ws.mu.
func (ix *Index) storeRanked(w catalog.WorkerRank, ws *workerState, ev *Event, plan *storePlan) error {
	nb := len(ev.BlockHashes)
	if ws != nil && ws.ratio != 0 && ws.ratio != plan.ratio && !ws.holdsAny() {
		ws.ratio = 0
	}
	if ws != nil && ws.ratio != 0 && ws.ratio != plan.ratio {
		ix.rejected.Add(1)
		return fmt.Errorf("%w: event block size %d differs from the %d this worker rank used before", ErrBlockSize, plan.ratio*ix.blockSize, ws.ratio*ix.blockSize)
	}
	limit, held := ix.maxBlocks, 0
	if l, ok := ix.limits[w.WorkerID]; ok {
		limit = l
	}
	if ws != nil {
		held = ws.blocks[ev.Tier].count()
	}
	if held+nb > limit {
		ix.rejected.Add(1)
		return fmt.Errorf("%w: %d blocks held on tier %d and %d more, limit %d, worker rank %s", ErrRankFull, held, ev.Tier, nb, limit, w)
	}
	t := &ix.t
	parent := rootID
	if ev.HasParent {
		// ws maps the parent, so it holds it: nothing but ws's own events
		// (which wait for ws.mu) can detach it before mu is taken.
		p := ws.find(ev.ParentHash, ev.Tier)
		if p == 0 {
			ix.unknownParent.Add(1)
			return fmt.Errorf("%w: parent %#x of %d blocks on worker rank %s", ErrUnknownParent, ev.ParentHash, nb, w)
		}
		parent = p
	}
	created := ws == nil
	if created {
		// Lookups read the registry under mu. Alone here: the caller holds
		// ranksMu for writing.
		ix.mu.Lock()
		ws = t.worker(w, true)
		ix.mu.Unlock()
	}
	m := &ws.blocks[ev.Tier]
	// Each hash's slot is found once: a new hash is added as pending, and
	// the tree's node is written into its slot after the tree's part. With
	// room made first, no slot moves in between (a table moves its entries
	// only to grow, shrink or close a removal's gap), and the slots warmed
	// are the ones probed.
	m.room(nb)
	if nb > 1 {
		m.warm(ev.BlockHashes)
	}
	plan.old, plan.slots = plan.old[:0], plan.slots[:0]
	for _, hash := range ev.BlockHashes {
		s, found := m.slot(hash, pending)
		old := nodeID(0)
		if found {
			old = s.id
		}
		plan.old = append(plan.old, old)
		plan.slots = append(plan.slots, s)
	}
	if err := ix.storeTree(w, ws, ev, parent, plan); err != nil {
		for j, hash := range ev.BlockHashes {
			if plan.old[j] == 0 {
				m.remove(hash)
			}
		}
		if created {
			ix.mu.Lock()
			t.dropWorker(ws)
			ix.mu.Unlock()
		}
		return err
	}
	ws.ratio = plan.ratio

	// The maps follow the tree. Until they do, ws's map is behind its
	// memberships, which nobody sees: every reader of the maps holds ws.mu
	// or ranksMu for writing.
	for j, s := range plan.slots {
		s.id = plan.now[j]
	}
	return nil
}

// storeTree is the tree's part of a stored run, under mu: it finds or adds
// the run's nodes below parent (into plan.now, one per engine block), holds
// them for ws, and releases what the run's hashes named before (plan.old).
// It refuses a run that could take the tree past MaxNodes, changing nothing.
func (ix *Index) storeTree(w catalog.WorkerRank, ws *workerState, ev *Event, parent nodeID, plan *storePlan) error {
	ix.lockTree()
	defer ix.mu.Unlock()
	t := &ix.t
	if t.nodes+len(plan.locals) > ix.maxNodes {
		ix.rejected.Add(1)
		return fmt.Errorf("%w: %d nodes and up to %d more, worker rank %s", ErrIndexFull, t.nodes, len(plan.locals), w)
	}
	cur, curNode := parent, t.at(parent)
	plan.now = plan.now[:0]
	for j := range ev.BlockHashes {
		for s := range plan.ratio {
			local := plan.locals[j*plan.ratio+s]
			key := local
			if cur != rootID {
				key = chainHash(curNode.key, local)
			}
			cur, curNode = t.childNode(cur, curNode, key)
			if ix.onStored != nil {
				plan.keys = append(plan.keys, key)
			}
		}
		plan.now = append(plan.now, cur)
		old := plan.old[j]
		if old == cur {
			if ws.dups == nil {
				ws.dups = make(map[uint64]uint32)
			}
			ws.dups[tierKey(ev.BlockHashes[j], ev.Tier)]++
			ix.dupStores.Add(1)
			continue
		}
		// Hold the new path before releasing an old mapping of the same hash, so
		// shared ancestors are never pruned in between.
		for n, nn, s := cur, curNode, 0; ; nn = t.at(n) {
			t.holdNode(ws, n, nn, ev.Tier)
			if s++; s == plan.ratio {
				break
			}
			n = nn.parent()
		}
		if old != 0 {
			// The hash now names other content: the old block is gone, however
			// many times it was stored.
			t.releaseBlock(ws, old, ev.Tier, plan.ratio)
			delete(ws.dups, tierKey(ev.BlockHashes[j], ev.Tier))
		} else {
			t.mapEntries++
		}
	}
	ix.applied.Add(1)
	if ix.onStored != nil {
		ix.onStored(w, plan.keys)
	}
	return nil
}

// checkDistinct rejects a stored run whose block hashes repeat each other or the
// parent: applying it would make a block its own ancestor.
func checkDistinct(ev *Event, plan *storePlan) error {
	hs := ev.BlockHashes
	if len(hs) <= 32 {
		for i, h := range hs {
			if ev.HasParent && h == ev.ParentHash {
				return fmt.Errorf("%w: block %#x is its own parent", ErrInvalidEvent, h)
			}
			for _, g := range hs[:i] {
				if g == h {
					return fmt.Errorf("%w: block %#x repeats in one stored run", ErrInvalidEvent, h)
				}
			}
		}
		return nil
	}
	// Longer runs: a set of the hashes (and the parent).
	s := &plan.seen
	s.reset(len(hs) + 1)
	if ev.HasParent {
		s.add(ev.ParentHash)
	}
	for _, h := range hs {
		if !s.add(h) {
			return fmt.Errorf("%w: block %#x repeats in one stored run or is its own parent", ErrInvalidEvent, h)
		}
	}
	return nil
}

// hashSet is checkDistinct's set of a long run's hashes: open addressing
// with linear probing, at most half full, placed by a keyed mix (the seed
// is random per set, so an engine that chooses its hashes cannot make them
// collide). A slot is in use while its mark is the set's, so emptying the
// set for the next run costs nothing. Sorting the hashes instead took 5% of
// applying the Dynamo-shaped events.
type hashSet struct {
	keys  []uint64
	marks []uint32
	mark  uint32
	seed  uint64
}

// reset empties s and sizes it for n hashes.
func (s *hashSet) reset(n int) {
	if size := 2 * n; size > len(s.keys) {
		s.keys, s.marks = make([]uint64, size), make([]uint32, size)
		s.seed = rand.Uint64()
	}
	if s.mark++; s.mark == 0 { // wrapped: the old marks could be taken as live
		clear(s.marks)
		s.mark = 1
	}
}

// add adds h and reports whether it was absent.
func (s *hashSet) add(h uint64) bool {
	for i := keyedSlot(h, s.seed, len(s.keys)); ; {
		if s.marks[i] != s.mark {
			s.keys[i], s.marks[i] = h, s.mark
			return true
		}
		if s.keys[i] == h {
			return false
		}
		if i++; i == len(s.keys) {
			i = 0
		}
	}
}

// find resolves an engine block hash of ws to its node, trying tier first and then
// the others (a parent may sit on another tier than its children). ws may be nil.
func (ws *workerState) find(hash uint64, tier Tier) nodeID {
	if ws == nil {
		return 0
	}
	if n := ws.blocks[tier].get(hash); n != 0 {
		return n
	}
	for t := range Tier(numTiers) {
		if t == tier {
			continue
		}
		if n := ws.blocks[t].get(hash); n != 0 {
			return n
		}
	}
	return 0
}

// tierMap returns the block map of tier t.
func (ws *workerState) tierMap(t Tier) *blockMap { return &ws.blocks[t] }

func (ws *workerState) holdsAny() bool {
	for i := range ws.blocks {
		if ws.blocks[i].count() > 0 {
			return true
		}
	}
	return false
}

// remove drops the given blocks of w and returns how many of them w did not hold.
func (ix *Index) remove(w catalog.WorkerRank, tier Tier, hashes []uint64) (unknown int) {
	if len(hashes) == 0 {
		ix.emptyEvents.Add(1)
		return 0
	}
	ix.ranksMu.RLock()
	ws := ix.t.worker(w, false)
	if ws == nil {
		ix.ranksMu.RUnlock()
		ix.unknownRemoves.Add(uint64(len(hashes)))
		return len(hashes)
	}
	ws.mu.Lock()
	unknown = ix.removeRanked(ws, tier, hashes)
	empty := !ws.holdsAny()
	ws.mu.Unlock()
	ix.ranksMu.RUnlock()
	if empty {
		ix.dropIfEmpty(w)
	}
	return unknown
}

// removeRanked unmaps hashes from ws's map of tier, then releases their
// nodes under mu, and returns how many ws did not hold. The caller holds
// ranksMu and ws.mu.
func (ix *Index) removeRanked(ws *workerState, tier Tier, hashes []uint64) (unknown int) {
	m := &ws.blocks[tier]
	if len(hashes) > 1 {
		m.warm(hashes)
	}
	gone := ws.gone[:0]
	for _, hash := range hashes {
		// A block stored k times needs k removes; only the last releases it.
		if len(ws.dups) > 0 && m.get(hash) != 0 {
			k := tierKey(hash, tier)
			if c := ws.dups[k]; c > 0 {
				if c == 1 {
					delete(ws.dups, k)
				} else {
					ws.dups[k] = c - 1
				}
				continue
			}
		}
		n := m.remove(hash)
		if n == 0 {
			ix.unknownRemoves.Add(1)
			unknown++
			continue
		}
		gone = append(gone, n)
	}
	if len(gone) > 0 {
		// Until mu is taken ws's memberships are ahead of its map, which
		// nobody sees (see storeRanked), and lookups see the blocks held as
		// before the event.
		ix.releaseTree(ws, tier, gone)
	}
	ws.gone = gone[:0]
	if unknown < len(hashes) {
		ix.applied.Add(1)
	}
	return unknown
}

// treeSpins bounds the times lockTree tries the lock before it blocks:
// about 25 us of failed tries.
const treeSpins = 1 << 14

// lockTree takes mu for writing, as an event's tree part does. Two engines'
// feeds meet here, and a tree part takes microseconds, less than a blocked
// goroutine takes to run again once woken (tens of microseconds on a
// virtual machine): with sync.RWMutex's Lock, which spins about a
// microsecond and then blocks, each core sat idle a quarter of the time
// while two feeds applied at once (BenchmarkDynamoApplySources: 1.2-1.6x on
// two cores against 1.8-1.9x with this). lockTree tries the lock up to
// treeSpins times, about as long as a long tree part, and only then blocks,
// so the spinning a preempted holder or a stream of lookups can cost is
// bounded.
func (ix *Index) lockTree() {
	for range treeSpins {
		if ix.mu.TryLock() {
			return
		}
	}
	ix.mu.Lock()
}

// rlockTree takes mu for reading, as a lookup does, trying it up to
// treeSpins times before it blocks, for the reason lockTree does: a lookup
// that met an event's tree part blocked and ran again only tens of
// microseconds later (BenchmarkDynamoLookupsUnderFeed: p99 106 us beside
// one feed, against 6 us beside a feed into another index; 10-11 us with
// this).
func (ix *Index) rlockTree() {
	for range treeSpins {
		if ix.mu.TryRLock() {
			return
		}
	}
	ix.mu.RLock()
}

// releaseTree releases, under mu, the blocks of ws whose deepest nodes are
// nodes.
func (ix *Index) releaseTree(ws *workerState, tier Tier, nodes []nodeID) {
	ix.lockTree()
	defer ix.mu.Unlock()
	t := &ix.t
	t.mapEntries -= len(nodes)
	if len(nodes) > 1 {
		t.warm(nodes)
	}
	for _, n := range nodes {
		t.releaseBlock(ws, n, tier, max(ws.ratio, 1))
	}
}

// dropIfEmpty drops worker rank w if it holds no block: a removal that
// emptied it frees its slot here, under the locks that change the registry.
func (ix *Index) dropIfEmpty(w catalog.WorkerRank) {
	ix.ranksMu.Lock()
	defer ix.ranksMu.Unlock()
	if ws := ix.t.worker(w, false); ws != nil && !ws.holdsAny() {
		ix.mu.Lock()
		ix.t.dropWorker(ws)
		ix.mu.Unlock()
	}
}

// ClearRank drops every block of worker rank w, on every tier (the engine's
// AllBlocksCleared, or a restart). Its cost is proportional to the blocks w holds.
// Clearing an unknown worker rank is a counted no-op.
func (ix *Index) ClearRank(w catalog.WorkerRank) {
	ix.ranksMu.Lock()
	defer ix.ranksMu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ws := ix.t.worker(w, false)
	if ws == nil {
		ix.unknownClears.Add(1)
		return
	}
	ix.t.dropWorker(ws)
	ix.applied.Add(1)
}

// RemoveWorker drops every block of every rank of worker. Its cost is
// proportional to the blocks the worker holds plus the number of worker ranks.
// It returns the number of worker ranks removed.
func (ix *Index) RemoveWorker(worker string) int {
	ix.ranksMu.Lock()
	defer ix.ranksMu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	delete(ix.limits, worker)
	n := 0
	for w, ws := range ix.t.workers {
		if w.WorkerID == worker {
			ix.t.dropWorker(ws)
			n++
		}
	}
	if n == 0 {
		ix.unknownClears.Add(1)
	}
	return n
}

// FindMatches returns, for every worker rank that holds at least the first block
// of the request, how many consecutive leading blocks it holds per tier. seqs are
// the request's sequence hashes (Hasher.SeqHashes). The walk stops as soon as no
// candidate is left. Results come in no particular order.
//
// While events are being applied concurrently a lookup may undercount (it sees the
// index before a store), never overcount.
func (ix *Index) FindMatches(seqs []uint64, opts MatchOptions) []Match {
	return ix.AppendMatches(nil, seqs, opts)
}

// AppendMatches is FindMatches appending to dst; it does not allocate when dst has
// room for the result.
func (ix *Index) AppendMatches(dst []Match, seqs []uint64, opts MatchOptions) []Match {
	ix.rlockTree()
	defer ix.mu.RUnlock()
	return ix.t.appendMatches(dst, seqs, opts)
}

// Stats is a snapshot of an index's size and counters.
type Stats struct {
	// Nodes is the number of distinct blocks (prefixes) in the tree.
	Nodes int
	// Entries is the number of (block, worker rank, tier) memberships.
	Entries int
	// WorkerRanks is the number of worker ranks holding at least one block.
	WorkerRanks int
	// ApproxBytes estimates the memory the index structures use.
	ApproxBytes int64

	// Applied counts events that changed or were checked against the index.
	Applied uint64
	// DroppedUnknownParent counts stored runs dropped because their parent was
	// unknown.
	DroppedUnknownParent uint64
	// Rejected counts events rejected as invalid (block size, token count, shape).
	Rejected uint64
	// UnknownRemoves counts removed block hashes the worker rank did not hold.
	UnknownRemoves uint64
	// DuplicateStores counts blocks stored again while already held; each needs
	// its own remove.
	DuplicateStores uint64
	// UnknownClears counts clears and removals of worker ranks the index did not
	// know.
	UnknownClears uint64
	// EmptyEvents counts stored or removed events with no block hashes.
	EmptyEvents uint64
}

// Stats returns a snapshot of the index.
func (ix *Index) Stats() Stats {
	var s Stats
	ix.ranksMu.Lock() // the block maps' sizes: no Apply in progress
	ix.mu.RLock()
	ix.t.stats(&s)
	ix.mu.RUnlock()
	ix.ranksMu.Unlock()
	s.Applied = ix.applied.Load()
	s.DroppedUnknownParent = ix.unknownParent.Load()
	s.Rejected = ix.rejected.Load()
	s.UnknownRemoves = ix.unknownRemoves.Load()
	s.DuplicateStores = ix.dupStores.Load()
	s.UnknownClears = ix.unknownClears.Load()
	s.EmptyEvents = ix.emptyEvents.Load()
	return s
}
