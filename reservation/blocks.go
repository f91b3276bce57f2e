package reservation

// holder is one worker rank's reference count on an active block. The worker
// rank is named by its slot, a small dense number the ledger assigns to each
// worker rank's load entry.
type holder struct {
	slot int32
	refs int32
}

// blockRefs lists the worker ranks that have one block active. first is in use
// unless the block is idle (first.refs == 0); more holds any further worker
// ranks sorted by slot, so a block active on a single worker rank (the common
// case) needs no allocation of its own, and a block active on many (a shared
// system prompt) is searched in log time.
type blockRefs struct {
	first  holder
	more   []holder
	hash   uint64 // the block's sequence hash, for the sweep
	listed bool   // on activeBlocks.idleList
}

// search returns the position of slot in e.more, or where it would be inserted,
// and whether it is there.
func (e *blockRefs) search(slot int32) (int, bool) {
	lo, hi := 0, len(e.more)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if e.more[m].slot < slot {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo, lo < len(e.more) && e.more[lo].slot == slot
}

// activeBlocks is the inverted index of active blocks: sequence hash -> the
// worker ranks whose live bookings contain it, each with a reference count (a
// booking that lists a hash twice holds two references). The hash table is
// pointer-free and points into a slab whose free entries are reused, so churn
// allocates nothing once both have reached the peak number of active blocks.
//
// A block whose last reference goes stays in the table as an idle entry (no
// holder), because the same prefix is often booked again soon (a system prompt,
// the next turn of a conversation): re-activating it is one lookup instead of a
// removal and an insertion. Entries that go idle are listed; once there are more
// than maxIdle idle entries, the sweep walks the list and removes the ones still
// idle. The sweep's cost is the entries listed since the last one, so each idle
// entry costs amortised constant time whatever the live ones, and the table
// holds the live blocks plus at most maxIdle idle ones.
//
// It is not safe for concurrent use; the Ledger keeps one per block stripe,
// under the stripe's mutex.
type activeBlocks struct {
	index    blockTable
	slab     []blockRefs
	free     []int32
	idle     int     // entries in index with no holder
	idleList []int32 // slab entries that went idle since the last sweep (listed)
}

// maxIdle is the number of idle entries an activeBlocks (one stripe of the
// ledger's index) keeps: with 8 stripes, up to 16384 freed blocks in all
// (about 1.5 MB), enough to hold the prefixes a router sees again within
// seconds.
const maxIdle = 2048

// live returns the number of blocks with at least one holder.
func (a *activeBlocks) live() int { return a.index.len() - a.idle }

func newActiveBlocks() activeBlocks {
	return activeBlocks{index: newBlockTable()}
}

// inc adds one reference of slot to block h. It returns the block's entry index,
// which stays valid while the reference lasts, and whether slot did not hold h
// before.
func (a *activeBlocks) inc(h uint64, slot int32) (int32, bool) {
	a.index.reserve()
	pos, ok := a.index.find(h)
	if !ok {
		var i int32
		if n := len(a.free); n > 0 {
			i = a.free[n-1]
			a.free = a.free[:n-1]
		} else {
			i = int32(len(a.slab))
			a.slab = append(a.slab, blockRefs{})
		}
		e := &a.slab[i]
		e.first = holder{slot: slot, refs: 1}
		e.more = e.more[:0]
		e.hash = h
		a.index.insertAt(pos, h, i)
		return i, true
	}
	i := a.index.slots[pos].val - 1
	e := &a.slab[i]
	if e.first.refs == 0 { // idle: becomes active again (it may stay listed)
		e.first = holder{slot: slot, refs: 1}
		a.idle--
		return i, true
	}
	if e.first.slot == slot {
		e.first.refs++
		return i, false
	}
	j, ok := e.search(slot)
	if ok {
		e.more[j].refs++
		return i, false
	}
	e.more = append(e.more, holder{})
	copy(e.more[j+1:], e.more[j:])
	e.more[j] = holder{slot: slot, refs: 1}
	return i, true
}

// dec drops one reference of slot on block h, whose entry index inc returned,
// and reports whether slot no longer holds h. The reference must exist: the
// ledger only drops what it added. A block's last reference leaves it idle; the
// caller runs sweep when it is done dropping.
func (a *activeBlocks) dec(i int32, h uint64, slot int32) bool {
	e := &a.slab[i]
	if e.first.slot == slot && e.first.refs > 0 {
		e.first.refs--
		if e.first.refs > 0 {
			return false
		}
		if n := len(e.more); n > 0 { // promote the last, which keeps more sorted
			e.first = e.more[n-1]
			e.more = e.more[:n-1]
			return true
		}
		a.idle++
		if !e.listed {
			e.listed = true
			a.idleList = append(a.idleList, i)
		}
		return true
	}
	j, ok := e.search(slot)
	if !ok {
		panic("reservation: internal error: dropping a block reference that is not held")
	}
	e.more[j].refs--
	if e.more[j].refs > 0 {
		return false
	}
	copy(e.more[j:], e.more[j+1:])
	e.more = e.more[:len(e.more)-1]
	return true
}

// holders returns the entry of block h, or nil when no worker rank has it active.
// The pointer is valid until the next inc, dec or sweep.
func (a *activeBlocks) holders(h uint64) *blockRefs {
	i, ok := a.index.get(h)
	if !ok || a.slab[i].first.refs == 0 {
		return nil
	}
	return &a.slab[i]
}

// sweep removes every idle entry once there are more than maxIdle of them,
// walking the entries listed as they went idle (those re-activated since are
// kept). Live entries keep their slab indices.
func (a *activeBlocks) sweep() {
	if a.idle <= maxIdle {
		return
	}
	for _, i := range a.idleList {
		e := &a.slab[i]
		e.listed = false
		if e.first.refs == 0 {
			a.index.remove(e.hash)
			a.free = append(a.free, i)
			a.idle--
		}
	}
	if a.idle != 0 {
		panic("reservation: internal error: an idle block was not listed")
	}
	a.idleList = a.idleList[:0]
}

// requestScratch answers "how many of this request's distinct blocks does each
// worker rank already have active" in one pass over the request: it deduplicates
// the request's hashes in an open-addressing set and counts, per slot, the
// distinct hashes that slot holds. Set entries carry the epoch of the pass that
// wrote them, so the set is never cleared; the counts, one per slot (one per
// worker rank entry), are zero outside a pass, and a pass lists the slots it
// counts (touched) and zeroes them when the next begins, so a pass costs the
// request and its holders, never the number of slots.
//
// It is not safe for concurrent use: each read takes its own from a pool.
type requestScratch struct {
	epoch  uint32
	set    []setEntry // length a power of two
	counts []int32    // indexed by slot; the first slots entries are in use
	uniq   []uint64   // the pass's distinct hashes, in request order
	sorted []uint64   // uniq grouped by block stripe
	runs   stripeRuns // the stripes' runs in sorted
	slots  []int32    // AppendRankLoads: each candidate's slot, -1 for none
	// touched lists the slots this pass counted, in the order first counted;
	// with record set, ranks[i] is the entry of touched[i], read under the
	// stripe lock that found it.
	touched []int32
	record  bool
	ranks   []*rankState
	// given[slot] == epoch marks the candidates AppendRequestLoads was given.
	given []uint32
}

type setEntry struct {
	h     uint64
	epoch uint32
}

// begin starts a pass over a request of n hashes for a ledger with slots slots.
func (s *requestScratch) begin(n int, slots int32) {
	s.epoch++
	if s.epoch == 0 { // wrapped: old entries could look current
		clear(s.set)
		clear(s.given)
		s.epoch = 1
	}
	size := 16
	for size < 2*n {
		size <<= 1
	}
	if len(s.set) < size {
		s.set = make([]setEntry, size)
	}
	for _, slot := range s.touched {
		s.counts[slot] = 0
	}
	s.touched = s.touched[:0]
	clear(s.ranks)
	s.ranks = s.ranks[:0]
	if len(s.counts) < int(slots) {
		s.counts = make([]int32, max(int(slots), 2*len(s.counts)))
	}
}

// add inserts h into the pass's set and reports whether it was new.
func (s *requestScratch) add(h uint64) bool {
	mask := uint64(len(s.set) - 1)
	// Fibonacci hashing spreads any input, including small test values.
	i := (h * 0x9E3779B97F4A7C15) >> 32 & mask
	for {
		e := &s.set[i]
		if e.epoch != s.epoch {
			e.h, e.epoch = h, s.epoch
			return true
		}
		if e.h == h {
			return false
		}
		i = (i + 1) & mask
	}
}

// credit counts one more distinct request block for every holder of e.
func (s *requestScratch) credit(l *Ledger, e *blockRefs) {
	// A holder may be a worker rank that came after the pass began, with a
	// slot beyond the counts; nobody asks for it.
	counts := s.counts
	if slot := e.first.slot; int(slot) < len(counts) {
		if counts[slot] == 0 {
			s.touch(l, slot)
		}
		counts[slot]++
	}
	for _, o := range e.more {
		if int(o.slot) < len(counts) {
			if counts[o.slot] == 0 {
				s.touch(l, o.slot)
			}
			counts[o.slot]++
		}
	}
}

// touch lists slot as counted in this pass and, when the pass records
// holders, its entry. The stripe lock of the block that names slot is held.
func (s *requestScratch) touch(l *Ledger, slot int32) {
	s.touched = append(s.touched, slot)
	if s.record {
		s.ranks = append(s.ranks, l.slotRank(slot))
	}
}

// shared returns how many distinct request blocks slot holds in this pass.
func (s *requestScratch) shared(slot int32) int { return int(s.counts[slot]) }
