package kvindex

import (
	"container/heap"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/catalog"
)

// Approximate-index defaults (Dynamo's router_ttl_secs and max_tree_size).
const (
	DefaultApproxTTL       = 120 * time.Second
	DefaultApproxMaxBlocks = 1 << 20
)

// ErrInvalidOptions reports an options struct that fails validation.
var ErrInvalidOptions = errors.New("kvindex: invalid options")

// ApproxOptions configure an Approx index. The zero value means the defaults.
type ApproxOptions struct {
	// TTL is how long a recorded routing decision is assumed to stay cached.
	// Recording the same block again refreshes it. Default DefaultApproxTTL; must
	// not be negative.
	TTL time.Duration
	// MaxBlocks caps the (block, worker rank) entries. When a record exceeds it,
	// the entries closest to expiry (deepest first among equals) are pruned down
	// to 80% of the cap. Default DefaultApproxMaxBlocks; must be in [0, MaxNodes/2]
	// (the tree grows by a record before it prunes).
	MaxBlocks int
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// Approx is the index for workers that publish no KV events: it remembers the
// router's own decisions (which worker rank was sent which prefix) for a TTL and
// answers FindMatches from them, all on the device tier. It is safe for concurrent
// use; expired entries are never reported.
type Approx struct {
	ttl  time.Duration
	max  int
	now  func() time.Time
	mu   sync.RWMutex
	t    tree
	exp  map[approxKey]int64 // current expiry (unix ns) of each entry
	heap expiryHeap
	// nextExpiry is the earliest expiry in the heap (unix ns), or MaxInt64.
	nextExpiry atomic.Int64
	pruned     atomic.Uint64
	expired    atomic.Uint64
}

type approxKey struct {
	ws  *workerState
	seq uint64
}

type expiryItem struct {
	at    int64
	depth int32
	key   approxKey
}

// expiryHeap orders entries by expiry, and deeper blocks first among equal
// expiries so pruning never leaves a hole in a recorded prefix.
type expiryHeap []expiryItem

func (h expiryHeap) Len() int { return len(h) }
func (h expiryHeap) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].depth > h[j].depth
}
func (h expiryHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *expiryHeap) Push(x any)   { *h = append(*h, x.(expiryItem)) }
func (h *expiryHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	*h = old[:len(old)-1]
	return it
}

// NewApprox returns an empty approximate index.
func NewApprox(opts ApproxOptions) (*Approx, error) {
	var errs []error
	if opts.TTL < 0 {
		errs = append(errs, fmt.Errorf("TTL %v is negative", opts.TTL))
	}
	if opts.MaxBlocks < 0 || opts.MaxBlocks > MaxNodes/2 {
		errs = append(errs, fmt.Errorf("MaxBlocks %d is out of range [0, %d]", opts.MaxBlocks, MaxNodes/2))
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, errors.Join(errs...))
	}
	if opts.TTL == 0 {
		opts.TTL = DefaultApproxTTL
	}
	if opts.MaxBlocks == 0 {
		opts.MaxBlocks = DefaultApproxMaxBlocks
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	a := &Approx{ttl: opts.TTL, max: opts.MaxBlocks, now: opts.Now, t: newTree(), exp: make(map[approxKey]int64)}
	a.nextExpiry.Store(maxInt64)
	return a, nil
}

const maxInt64 = int64(^uint64(0) >> 1)

// Record notes that the request with sequence hashes seqs was routed to worker
// rank w: w is assumed to hold every block of it until the TTL passes. Recording
// an empty request or an invalid worker rank does nothing.
func (a *Approx) Record(w catalog.WorkerRank, seqs []uint64) {
	if len(seqs) == 0 || w.WorkerID == "" || w.Rank < 0 {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.now().UnixNano()
	a.expireLocked(now)
	at := now + int64(a.ttl)
	t := &a.t
	ws := t.worker(w, true)
	ws.ratio = 1
	m := &ws.blocks[TierDevice]
	cur := rootID
	for i, seq := range seqs {
		cur = t.child(cur, seq)
		k := approxKey{ws, seq}
		if m.get(seq) == 0 {
			m.put(seq, cur)
			t.mapEntries++
			t.hold(ws, cur, TierDevice)
		}
		if a.exp[k] == at {
			continue // already recorded at this instant: nothing to refresh
		}
		a.exp[k] = at
		heap.Push(&a.heap, expiryItem{at: at, depth: int32(i), key: k})
	}
	if len(a.exp) > a.max {
		a.pruneLocked(a.max * 8 / 10)
	}
	if len(a.heap) > 2*len(a.exp)+1024 {
		a.compactLocked()
	}
	a.publishNext()
}

// expireLocked removes entries whose expiry is at or before now.
func (a *Approx) expireLocked(now int64) {
	for len(a.heap) > 0 && a.heap[0].at <= now {
		it := heap.Pop(&a.heap).(expiryItem)
		if a.drop(it) {
			a.expired.Add(1)
		}
	}
}

// pruneLocked removes the earliest-expiring entries until at most keep remain.
func (a *Approx) pruneLocked(keep int) {
	for len(a.exp) > keep && len(a.heap) > 0 {
		it := heap.Pop(&a.heap).(expiryItem)
		if a.drop(it) {
			a.pruned.Add(1)
		}
	}
}

// drop removes the entry of a heap item unless the item is stale (the entry was
// refreshed or removed since). It reports whether an entry was removed.
func (a *Approx) drop(it expiryItem) bool {
	cur, ok := a.exp[it.key]
	if !ok || cur != it.at {
		return false
	}
	delete(a.exp, it.key)
	ws := it.key.ws
	m := &ws.blocks[TierDevice]
	if n := m.get(it.key.seq); n != 0 {
		m.remove(it.key.seq)
		a.t.mapEntries--
		a.t.release(ws, n, TierDevice)
	}
	if m.count() == 0 {
		a.t.dropWorker(ws)
	}
	return true
}

// compactLocked rebuilds the heap without stale items.
func (a *Approx) compactLocked() {
	live := a.heap[:0]
	for _, it := range a.heap {
		if cur, ok := a.exp[it.key]; ok && cur == it.at {
			live = append(live, it)
		}
	}
	a.heap = live
	heap.Init(&a.heap)
}

func (a *Approx) publishNext() {
	if len(a.heap) == 0 {
		a.nextExpiry.Store(maxInt64)
		return
	}
	a.nextExpiry.Store(a.heap[0].at)
}

// expire removes every entry whose TTL has passed. AppendMatches calls it once
// the earliest expiry has come; Record expires under its own lock.
func (a *Approx) expire() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.expireLocked(a.now().UnixNano())
	a.publishNext()
}

// RemoveWorker forgets every rank of worker. It returns the number of worker
// ranks removed.
func (a *Approx) RemoveWorker(worker string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for w, ws := range a.t.workers {
		if w.WorkerID != worker {
			continue
		}
		for seq := range ws.blocks[TierDevice].all() {
			delete(a.exp, approxKey{ws, seq})
		}
		a.t.dropWorker(ws)
		n++
	}
	return n
}

// FindMatches is Index.FindMatches over the recorded decisions that have not
// expired; every match is on the device tier.
func (a *Approx) FindMatches(seqs []uint64, opts MatchOptions) []Match {
	return a.AppendMatches(nil, seqs, opts)
}

// AppendMatches is FindMatches appending to dst.
func (a *Approx) AppendMatches(dst []Match, seqs []uint64, opts MatchOptions) []Match {
	if a.now().UnixNano() >= a.nextExpiry.Load() {
		a.expire()
	}
	a.mu.RLock()
	defer a.mu.RUnlock()
	return a.t.appendMatches(dst, seqs, opts)
}

// approxStats is a snapshot of an Approx index.
type approxStats struct {
	Nodes       int
	Entries     int
	WorkerRanks int
	ApproxBytes int64
	// Expired counts entries removed because their TTL passed.
	Expired uint64
	// Pruned counts entries removed to respect MaxBlocks.
	Pruned uint64
}

// stats returns a snapshot.
func (a *Approx) stats() approxStats {
	var s Stats
	a.mu.RLock()
	a.t.stats(&s)
	extra := int64(len(a.exp))*48 + int64(cap(a.heap))*32
	a.mu.RUnlock()
	return approxStats{Nodes: s.Nodes, Entries: s.Entries, WorkerRanks: s.WorkerRanks,
		ApproxBytes: s.ApproxBytes + extra, Expired: a.expired.Load(), Pruned: a.pruned.Load()}
}
