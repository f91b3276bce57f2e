package reservation

import (
	"sync"
	"sync/atomic"

	"github.com/google/btree"
	"github.com/kvselect/kvselect/catalog"
)

// rankState is one worker rank's load entry. It is created by the first Book on
// the worker rank or by AppendRanks and lives until RemoveWorker, so concurrent
// calls can hold it without the registry lock.
//
// The load counters are atomics: Book, settlements and PrefillComplete change
// them under mu, and AppendRankLoads reads them without it. version is a sequence
// counter: odd while a Book is changing the entry, advanced by two per Book.
type rankState struct {
	// What AppendRankLoads reads, together in one cache line.
	version  atomic.Uint64
	prefill  atomic.Int64
	blocks   atomic.Int64 // distinct active hashes
	private  atomic.Int64 // sum of the private blocks of the live bookings
	requests atomic.Int64
	dead     atomic.Bool // removed from the registry by RemoveWorker; set under mu
	slot     int32       // dense number naming the worker rank in the block index

	key catalog.WorkerRank

	clock prefillClock

	mu   sync.Mutex
	head *booking // live bookings, doubly linked
	// leases orders the live bookings by deadline; made by the first Book
	// (leaseTree), so a worker rank registered and never booked (most of a
	// large fleet at start-up) holds none.
	leases   *btree.BTreeG[*booking]
	released bool // its slot has been given back
}

func (r *rankState) load() Load {
	return Load{
		ActivePrefillTokens: r.prefill.Load(),
		ActiveBlocks:        int(r.blocks.Load() + r.private.Load()),
		ActiveRequests:      int(r.requests.Load()),
	}
}

// current reports whether a decision made on what s saw of a worker rank still
// holds for r, its entry now: r is the entry s saw (or s saw none and r has
// never been booked) and no Book has reached r since. r.mu must be held.
func (s Stamp) current(r *rankState) bool {
	v := r.version.Load()
	if s.r == nil {
		return v == 0
	}
	return s.r == r && s.v == v
}

// leaseTree returns r's lease tree, making it on the first booking. r.mu is
// held.
func (r *rankState) leaseTree() *btree.BTreeG[*booking] {
	if r.leases == nil {
		r.leases = btree.NewG(16, leaseLess)
	}
	return r.leases
}

// rankFor returns the load entry of w, creating it if there is none.
func (l *Ledger) rankFor(w catalog.WorkerRank) *rankState {
	if r := l.lookup(w); r != nil {
		return r
	}
	l.regMu.Lock()
	defer l.regMu.Unlock()
	if r := l.ranks[w]; r != nil {
		return r
	}
	r := &rankState{key: w}
	if n := len(l.freeSlots); n > 0 {
		r.slot = l.freeSlots[n-1]
		l.freeSlots = l.freeSlots[:n-1]
	} else {
		r.slot = l.nextSlot.Add(1) - 1
	}
	l.setSlot(r)
	l.ranks[w] = r
	l.byWorker[w.WorkerID] = append(l.byWorker[w.WorkerID], r)
	return r
}

// setSlot records r as the holder of its slot. l.regMu is held for writing.
func (l *Ledger) setSlot(r *rankState) {
	var tab []*rankState
	if p := l.bySlot.Load(); p != nil {
		tab = *p
	}
	if int(r.slot) >= len(tab) {
		grown := make([]*rankState, max(int(r.slot)+1, 2*len(tab), 64))
		copy(grown, tab)
		tab = grown
		l.bySlot.Store(&tab)
	}
	tab[r.slot] = r
}

// slotRank returns the entry holding slot, which a block's holder names.
// The caller holds that block's stripe lock (see bySlot).
func (l *Ledger) slotRank(slot int32) *rankState {
	if p := l.bySlot.Load(); p != nil && int(slot) < len(*p) {
		return (*p)[slot]
	}
	return nil
}

// lookup returns the load entry of w, or nil when w has none.
func (l *Ledger) lookup(w catalog.WorkerRank) *rankState {
	l.regMu.RLock()
	r := l.ranks[w]
	l.regMu.RUnlock()
	return r
}

// rankList returns the registered worker ranks.
func (l *Ledger) rankList() []*rankState {
	l.regMu.RLock()
	defer l.regMu.RUnlock()
	out := make([]*rankState, 0, len(l.ranks))
	for _, r := range l.ranks {
		out = append(out, r)
	}
	return out
}

// release gives a removed worker rank's slot back, once. r.mu must be held and
// r must have no booking left.
func (l *Ledger) release(r *rankState) {
	if r.released {
		return
	}
	r.released = true
	l.regMu.Lock()
	l.freeSlots = append(l.freeSlots, r.slot)
	l.regMu.Unlock()
}

// Rank is a resolved handle on one worker rank's load entry, from AppendRanks.
// It spares AppendRankLoads a lookup by name per candidate. A handle whose
// worker was removed since it was made still works: AppendRankLoads looks it up
// again by name.
type Rank struct {
	key catalog.WorkerRank
	r   *rankState
}

// AppendRanks appends a handle for each of workers to dst, making an empty load
// entry for each worker rank that has none, and returns the extended slice. An
// entry lives until RemoveWorker of its worker; callers resolve a worker's
// ranks when they start considering it and again after removing it.
func (l *Ledger) AppendRanks(dst []Rank, workers []catalog.WorkerRank) []Rank {
	for _, w := range workers {
		dst = append(dst, Rank{key: w, r: l.rankFor(w)})
	}
	return dst
}
