package reservation

import (
	"slices"
	"sync"

	"github.com/kvselect/kvselect/catalog"
)

// Load is a worker rank's active load.
type Load struct {
	// ActivePrefillTokens is the sum of the prefill tokens of live bookings whose
	// prefill has not completed.
	ActivePrefillTokens int64
	// ActiveBlocks is the number of distinct sequence hashes over live bookings
	// plus the sum of their private blocks.
	ActiveBlocks int
	// ActiveRequests is the number of live bookings.
	ActiveRequests int
}

// CandidateLoad is a candidate worker rank's load and the number of the request's
// sequence hashes that would be new to it, as returned by AppendLoads (the
// request's private blocks, new everywhere, are the caller's to add).
type CandidateLoad struct {
	Worker    catalog.WorkerRank
	Load      Load
	NewBlocks int
	// Stamp is what the read saw of Worker, for BookAt.
	Stamp Stamp
}

// Load returns the active load of worker rank w; the zero Load when it has none.
func (l *Ledger) Load(w catalog.WorkerRank) Load {
	r := l.lookup(w)
	if r == nil {
		return Load{}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.load()
}

// AppendLoads appends to dst, for each of workers in order, its load, the
// number of seqs it does not have active and a Stamp of what was
// read, and returns the extended slice. It is AppendRankLoads with one lookup
// by name per candidate (unresolved handles).
func (l *Ledger) AppendLoads(dst []CandidateLoad, workers []catalog.WorkerRank, seqs []uint64) []CandidateLoad {
	refs := make([]Rank, len(workers))
	for i, w := range workers {
		refs[i].key = w
	}
	return l.AppendRankLoads(dst, refs, seqs)
}

// AppendRankLoads appends to dst, for each of ranks in order, its load, the
// number of seqs it does not have active and a Stamp of what was
// read, and returns the extended slice. Its cost is one pass over seqs, one
// index lookup per distinct hash when any candidate has active blocks, one
// increment per worker rank holding each of them, and a few atomic reads per
// candidate; never one lookup per (candidate, hash). It takes no lock a Book or
// Free holds for long: candidates' loads are read without their locks, the
// block index a stripe at a time. The selection service calls it on its hot
// path.
//
// Each candidate's load is read at one point; different candidates' at nearby
// points, and a candidate being booked concurrently may be read mid-change
// (BookAt then refuses a booking on it).
func (l *Ledger) AppendRankLoads(dst []CandidateLoad, ranks []Rank, seqs []uint64) []CandidateLoad {
	if len(ranks) == 0 {
		return dst
	}
	base := len(dst)
	dst = slices.Grow(dst, len(ranks))[:base+len(ranks)]
	sc := scratchPool.Get().(*requestScratch)
	slots := slices.Grow(sc.slots[:0], len(ranks))[:len(ranks)]
	anyBlocks := false
	for i, k := range ranks {
		c := &dst[base+i]
		c.Worker = k.key
		slots[i] = -1
		r := k.r
		if r == nil || r.dead.Load() { // no entry when resolved, or removed since: by name
			r = l.lookup(k.key)
		}
		if r == nil {
			c.Load, c.Stamp = Load{}, Stamp{}
			continue
		}
		// The version first: a Book that starts after it changes it.
		c.Stamp = Stamp{r: r, v: r.version.Load()}
		shared := r.blocks.Load()
		c.Load = Load{
			ActivePrefillTokens: r.prefill.Load(),
			ActiveBlocks:        int(shared + r.private.Load()),
			ActiveRequests:      int(r.requests.Load()),
		}
		slots[i] = r.slot
		anyBlocks = anyBlocks || shared > 0
	}
	// Read after the candidates: every slot they hold is below it.
	nslots := l.nextSlot.Load()
	distinct := l.scanRequest(sc, seqs, nslots, anyBlocks)
	for i, slot := range slots {
		c := &dst[base+i]
		c.NewBlocks = distinct
		if slot >= 0 {
			c.NewBlocks -= min(sc.shared(slot), distinct)
		}
	}
	sc.slots = slots
	scratchPool.Put(sc)
	return dst
}

// AppendRequestLoads is AppendRankLoads for a caller that names only some
// candidates: it appends, for each of ranks in order, its CandidateLoad, then
// one for every other worker rank that has any of seqs active (in no
// particular order; a worker rank that was never resolved or booked has none),
// and returns the extended slice and the number of distinct hashes in seqs
// (what a worker rank holding none of them would find new). Its cost is one
// pass over seqs, the holders of its hashes and the candidates named, whatever
// the number of worker ranks in the ledger. Loads are read as AppendRankLoads
// reads them; a holder's after the pass that found it.
func (l *Ledger) AppendRequestLoads(dst []CandidateLoad, ranks []Rank, seqs []uint64) ([]CandidateLoad, int) {
	base := len(dst)
	dst = slices.Grow(dst, len(ranks))[:base+len(ranks)]
	sc := scratchPool.Get().(*requestScratch)
	slots := slices.Grow(sc.slots[:0], len(ranks))[:len(ranks)]
	for i, k := range ranks {
		c := &dst[base+i]
		c.Worker = k.key
		slots[i] = -1
		r := k.r
		if r == nil || r.dead.Load() {
			r = l.lookup(k.key)
		}
		if r == nil {
			c.Load, c.Stamp = Load{}, Stamp{}
			continue
		}
		c.Stamp, c.Load = r.read()
		slots[i] = r.slot
	}
	nslots := l.nextSlot.Load()
	sc.record = true
	distinct := l.scanRequest(sc, seqs, nslots, true)
	sc.record = false
	if len(sc.given) < int(nslots) {
		sc.given = make([]uint32, max(int(nslots), 2*len(sc.given)))
	}
	for i, slot := range slots {
		c := &dst[base+i]
		c.NewBlocks = distinct
		if slot >= 0 {
			if int(slot) < len(sc.given) {
				sc.given[slot] = sc.epoch
			}
			c.NewBlocks -= min(sc.shared(slot), distinct)
		}
	}
	for i, slot := range sc.touched {
		r := sc.ranks[i]
		if (int(slot) < len(sc.given) && sc.given[slot] == sc.epoch) || r == nil || r.dead.Load() {
			continue
		}
		st, ld := r.read()
		dst = append(dst, CandidateLoad{Worker: r.key, Load: ld, Stamp: st, NewBlocks: distinct - min(sc.shared(slot), distinct)})
	}
	clear(sc.ranks) // no entry outlives the pass in the pool
	sc.ranks = sc.ranks[:0]
	sc.slots = slots
	scratchPool.Put(sc)
	return dst, distinct
}

// RankLoad returns the load of k's worker rank and a Stamp of what was read,
// for BookAt; the zero Load and Stamp when it has no entry.
func (l *Ledger) RankLoad(k Rank) (Load, Stamp) {
	r := k.r
	if r == nil || r.dead.Load() {
		r = l.lookup(k.key)
	}
	if r == nil {
		return Load{}, Stamp{}
	}
	st, ld := r.read()
	return ld, st
}

// read returns a Stamp of r and its load, the version read first: a Book that
// starts after it changes it.
func (r *rankState) read() (Stamp, Load) {
	st := Stamp{r: r, v: r.version.Load()}
	return st, r.load()
}

// scratchPool recycles the per-call scratch of scanRequest.
var scratchPool = sync.Pool{New: func() any { return new(requestScratch) }}

// scanRequest deduplicates seqs into sc and, when lookup is set, counts per slot
// (below slots) how many of the distinct hashes it has active, locking one
// block stripe at a time. It returns the number of distinct hashes; the counts
// are valid until sc's next use.
func (l *Ledger) scanRequest(sc *requestScratch, seqs []uint64, slots int32, lookup bool) int {
	sc.begin(len(seqs), slots)
	uniq := sc.uniq[:0]
	for _, h := range seqs {
		if sc.add(h) {
			uniq = append(uniq, h)
		}
	}
	sc.uniq = uniq
	if !lookup || len(uniq) == 0 {
		return len(uniq)
	}
	sorted := l.byStripe(sc.sorted, uniq, &sc.runs)
	sc.sorted = sorted
	l.eachStripe(&sc.runs, func(a *activeBlocks, from, to int) {
		if a.live() == 0 {
			return
		}
		for _, h := range sorted[from:to] {
			if e := a.holders(h); e != nil {
				sc.credit(l, e)
			}
		}
	})
	return len(uniq)
}
