package selection

import (
	"container/heap"
	"maps"
	"math"
	mrand "math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/reservation"
)

// rankInfo is one schedulable (worker, rank) of a partition.
type rankInfo struct {
	key        catalog.WorkerRank
	endpoint   string
	blockSize  int
	maxBatched int
	health     *rankHealth       // nil without feed checks
	labels     map[string]string // the worker's, never written (the policy seams read them)
	pressure   *rankPressure     // its cache pressure (with KV events)
}

// member is a schedulable worker of a partition, as its rank snapshot needs
// it. A stored member is replaced, never mutated.
type member struct {
	id         string
	endpoint   string
	blockSize  int
	maxBatched int
	dpStart    int
	ranks      int
	health     []*rankHealth     // one per rank, in rank order; nil without feed checks
	labels     map[string]string // the catalog record's copy, never written
}

// equal reports whether m and o build the same ranks (the same feed states
// included).
func (m *member) equal(o *member) bool {
	return m.id == o.id && m.endpoint == o.endpoint && m.blockSize == o.blockSize &&
		m.maxBatched == o.maxBatched && m.dpStart == o.dpStart && m.ranks == o.ranks &&
		slices.Equal(m.health, o.health) && maps.Equal(m.labels, o.labels)
}

// partition is everything one model needs. Without queueing a decision books
// with reservation.Ledger.BookAt (see the package doc); with queueing, pick and
// book happen under mu.
type partition struct {
	model string
	// prefix is what requests are matched against: index with KV events,
	// approx without (the one set of the two).
	prefix prefixIndex
	index  *kvindex.Index  // with KV events
	approx *kvindex.Approx // without
	// fallback holds, with KV events, the recent bookings of ranks whose feed
	// is not trusted (see FeedHealth); untrusted counts those ranks, so the
	// request path looks at fallback only when one exists.
	fallback  *kvindex.Approx
	untrusted atomic.Int32
	// promptTokens is the model's mean prompt length over its recent
	// predictive decisions (float64 bits; 0 before the first), the
	// balance term's time scale (see promptMean).
	promptTokens atomic.Uint64
	// burst is the run of this service's own bookings (see Peers).
	burst burst

	// set is the schedulable ranks, an immutable snapshot built from members
	// and replaced whole by build; lookups read it without mu and re-check it
	// under mu before booking.
	set atomic.Pointer[rankSet]
	// members is the model's schedulable workers by id, what the next
	// snapshot is built from: the service's worker changes keep it (under
	// the service's mu), build reads it. ver counts its changes; while the
	// published snapshot was built from an older version, ranksOf builds a
	// new one first, so a change set costs one build, at the next decision,
	// however many workers it upserted. memMu guards members and the
	// changes of ver; it is a leaf lock.
	memMu   sync.Mutex
	members map[string]*member
	// pressure holds each rank's cache pressure (catalog.WorkerRank ->
	// *rankPressure), kept across snapshots: the routing applier finds a
	// rank's without a lock, builds hand it to the rank's rankInfo.
	pressure sync.Map
	ver      atomic.Uint64
	// buildMu serialises builds, so snapshots are published in the order
	// they read members. Lock order: mu (a queued decision builds under
	// it), then buildMu, then memMu; a build takes no other lock of the
	// service's.
	buildMu sync.Mutex
	// ledger resolves a snapshot's load handles; newOrder makes its empty
	// cost order (nil with queueing, see sparse.go).
	ledger   *reservation.Ledger
	newOrder func() *costOrder
	// mu is held for writing by settle and by the queueing path's
	// pick-and-book, and for reading by a lock-free booking's re-check of set
	// and its BookAt, so no booking lands on a rank a change removed.
	mu    sync.RWMutex
	rng   lockedRand
	queue waitQueue
	seq   uint64
	epoch time.Time

	sigMu   sync.Mutex
	changed chan struct{} // closed and replaced when capacity may have freed
	// ejected is the workers MarkFailed took out of the picks, each with the
	// end of its ejection (unix nanos): a map published whole and never
	// changed after (writers copy it under ejectMu), so the request path
	// reads it without a lock; nil when there is none.
	ejectMu sync.Mutex
	ejected atomic.Pointer[map[string]int64]
	// sessions is the model's session pins.
	sessions *sessionTable
	// inflight counts SelectAndReserve calls in progress that may wait (only
	// with queueing): a load drop needs to wake someone only when one may be
	// waiting.
	inflight atomic.Int64
}

// setMember makes m the member of its worker, replacing the one it had. It
// reports whether the published snapshot may hold ranks the change takes
// away or alters (the worker had another member): the caller must then
// settle before it counts the change done. Setting an equal member changes
// nothing. O(1).
func (p *partition) setMember(m *member) (removes bool) {
	p.memMu.Lock()
	defer p.memMu.Unlock()
	old := p.members[m.id]
	if old != nil && old.equal(m) {
		return false
	}
	if p.members == nil {
		p.members = make(map[string]*member)
	}
	p.members[m.id] = m
	p.ver.Add(1)
	return old != nil
}

// dropMember removes worker id's member, if it has one, and reports whether
// it had (the caller must then settle). O(1).
func (p *partition) dropMember(id string) (removes bool) {
	p.memMu.Lock()
	defer p.memMu.Unlock()
	if _, ok := p.members[id]; !ok {
		return false
	}
	delete(p.members, id)
	p.ver.Add(1)
	return true
}

// settle makes a change of members that took ranks away binding: it waits for
// the build in progress, which may have read the members before the change
// (so no build resolves a load handle of a removed worker after settle), and
// for the lock-free bookings in flight, which hold mu for reading from their
// re-check of set to their BookAt. Any re-check after it builds a snapshot
// with the change, or finds one built, and decides again: no booking lands on
// a rank the change removed, and none on its old endpoint.
func (p *partition) settle() {
	// Empty critical sections: barriers.
	p.buildMu.Lock()
	p.buildMu.Unlock()
	p.mu.Lock()
	p.mu.Unlock()
}

// ranksOf returns the partition's current snapshot (never nil), built first
// when members changed since the published one was.
func (p *partition) ranksOf() *rankSet {
	if rs := p.published(); rs.ver == p.ver.Load() {
		return rs
	}
	return p.build()
}

// published returns the snapshot published last, whether or not members
// changed since (never nil). For the ledger's hooks, which must not build.
func (p *partition) published() *rankSet {
	if rs := p.set.Load(); rs != nil {
		return rs
	}
	return &emptyRanks
}

// build replaces the snapshot with one of the members as they are now,
// sorted by worker id and rank, resolving their load entries in the ledger,
// and returns it; when another build did that meanwhile, it returns that
// one. O(r log r) for r ranks. The new snapshot's cost order is filled from
// the ledger after it is published (see syncLoad).
func (p *partition) build() *rankSet {
	p.buildMu.Lock()
	defer p.buildMu.Unlock()
	if rs := p.published(); rs.ver == p.ver.Load() {
		return rs
	}
	type byID struct {
		id string
		m  *member
	}
	p.memMu.Lock()
	ver := p.ver.Load()
	ms := make([]byID, 0, len(p.members))
	n := 0
	for id, m := range p.members {
		ms = append(ms, byID{id, m})
		n += m.ranks
	}
	p.memMu.Unlock()
	// Sorted on the ids alone: the comparisons touch no member.
	slices.SortFunc(ms, func(a, b byID) int { return strings.Compare(a.id, b.id) })

	rs := &rankSet{
		ver:      ver,
		ranks:    make([]rankInfo, 0, n),
		pos:      make(map[catalog.WorkerRank]int32, n),
		byWorker: make(map[string][]int32, len(ms)),
		template: make([]candidate, n),
	}
	if p.newOrder != nil {
		rs.order = p.newOrder()
	}
	keys := make([]catalog.WorkerRank, n)
	idx := make([]int32, n) // byWorker's slices, one backing array
	for _, e := range ms {
		m := e.m
		first := len(rs.ranks)
		for r := range m.ranks {
			i := len(rs.ranks)
			ri := rankInfo{
				key:        catalog.WorkerRank{WorkerID: m.id, Rank: m.dpStart + r},
				endpoint:   m.endpoint,
				blockSize:  m.blockSize,
				maxBatched: m.maxBatched,
				labels:     m.labels,
			}
			if m.health != nil {
				ri.health = m.health[r]
			}
			ri.pressure = p.pressureOf(ri.key)
			rs.ranks = append(rs.ranks, ri)
			rs.pos[ri.key] = int32(i)
			keys[i] = ri.key
			rs.template[i] = candidate{idx: i, maxBatched: ri.maxBatched}
			idx[i] = int32(i)
		}
		if m.ranks > 0 {
			rs.byWorker[m.id] = idx[first : first+m.ranks : first+m.ranks]
		}
	}
	rs.refs = p.ledger.AppendRanks(make([]reservation.Rank, 0, n), keys)
	p.set.Store(rs)
	if rs.order != nil {
		// After the publication: a load change the fill does not see is one
		// whose hook finds this snapshot (syncLoad), so none is lost.
		rs.order.fill(p.ledger, rs.refs)
	}
	return rs
}

// syncLoad moves worker rank w in the current snapshot's cost order to its
// load in ledger now (a hook of the ledger: w's load changed).
func (p *partition) syncLoad(w catalog.WorkerRank, ledger *reservation.Ledger) {
	rs := p.published()
	if rs.order == nil {
		return
	}
	if i, ok := rs.pos[w]; ok {
		rs.order.sync(i, ledger, rs.refs[i])
	}
}

// untrustedRank reports whether rs's rank w is routed on its own bookings.
func (rs *rankSet) untrustedRank(w catalog.WorkerRank) bool {
	i, ok := rs.pos[w]
	return ok && rs.ranks[i].health != nil && rs.ranks[i].health.untrusted.Load()
}

// prefixIndex is what the request path needs of a partition's index, the
// event-fed kvindex.Index or the approximate kvindex.Approx.
type prefixIndex interface {
	AppendMatches(dst []kvindex.Match, seqs []uint64, opts kvindex.MatchOptions) []kvindex.Match
	RemoveWorker(worker string) int
}

// matches returns every rank's overlap with seqs, in buf's storage: from the
// event index (ranks whose feed is not trusted from the fallback), or from the
// approximate index without KV events. It takes no partition lock; the indexes
// have their own.
func (p *partition) matches(buf []kvindex.Match, seqs []uint64) []kvindex.Match {
	ms := p.prefix.AppendMatches(buf[:0], seqs, kvindex.MatchOptions{})
	if p.untrusted.Load() > 0 {
		ms = p.withFallback(ms, seqs)
	}
	return ms
}

// withFallback replaces, in the event index's matches ms, those of untrusted
// ranks by the fallback index's matches of those ranks.
func (p *partition) withFallback(ms []kvindex.Match, seqs []uint64) []kvindex.Match {
	rs := p.ranksOf()
	out := ms[:0]
	for _, m := range ms {
		if !rs.untrustedRank(m.Worker) {
			out = append(out, m)
		}
	}
	n := len(out)
	out = p.fallback.AppendMatches(out, seqs, kvindex.MatchOptions{})
	keep := out[:n]
	for _, m := range out[n:] {
		if rs.untrustedRank(m.Worker) {
			keep = append(keep, m)
		}
	}
	return keep
}

// lockedRand is a random source safe for concurrent use, so that a partition's
// picks draw from one seeded sequence.
type lockedRand struct {
	mu sync.Mutex
	r  *mrand.Rand
}

func (l *lockedRand) IntN(n int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.IntN(n)
}

func (l *lockedRand) Float64() float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Float64()
}

// rankSet is an immutable snapshot of a partition's schedulable ranks, with
// what every evaluation needs prebuilt: a ledger handle and a candidate per
// rank.
type rankSet struct {
	ver      uint64 // the version of the partition's members it was built from
	ranks    []rankInfo
	pos      map[catalog.WorkerRank]int32
	byWorker map[string][]int32 // worker id -> its rank indices, ascending
	refs     []reservation.Rank
	template []candidate
	// order is the ranks ordered by what their load costs any request that
	// none of them holds (sparse.go); nil with queueing.
	order *costOrder
}

var emptyRanks rankSet

// signal wakes every waiter so the head of the queue re-checks capacity.
func (p *partition) signal() {
	p.sigMu.Lock()
	close(p.changed)
	p.changed = make(chan struct{})
	p.sigMu.Unlock()
}

// signalIfWaiting is signal for the hot path (every Free): it does nothing when
// no request of the model is in flight. A request counts itself in flight before
// it takes its wake-up channel, so no wake-up it needs can be skipped.
func (p *partition) signalIfWaiting() {
	if p.inflight.Load() > 0 {
		p.signal()
	}
}

func (p *partition) waitChan() <-chan struct{} {
	p.sigMu.Lock()
	defer p.sigMu.Unlock()
	return p.changed
}

// waiter is a request in the admission queue.
type waiter struct {
	tier     int
	class    int32   // its class's index (0 without classes)
	cost     float64 // its deficit round robin cost: uncached prompt tokens, >= 1
	deadline int64   // unix nanos on the service's clock; noDeadline: none
	score    float64 // its order within its class after the deadline (higher first)
	seq      uint64
	index    int // position in its lane's heap, -1 when not queued
	lane     *lane
	// expired: another request's look at the queue took it out at its
	// deadline (see waitQueue.expire); it is refused when it wakes.
	expired bool
}

// waitQueue is a model's admission queue: strict tiers, highest first;
// within a tier a deficit round robin across the classes that have waiters
// (a lane each), by their quanta; within a lane the earliest deadline first,
// then the higher score (Config.QueuePolicy), then the earlier arrival.
// Without classes every waiter is in class 0, one lane a tier, and the order
// is the tiers' then the score's, as before classes. It is guarded by the
// partition's mu; head changes the round robin's state, so it needs mu
// exclusively.
type waitQueue struct {
	n         int
	deadlines int          // waiters with a deadline
	tiers     []*tierQueue // highest tier first
	perClass  []int        // waiters by class
}

// tierQueue is one strict tier: its lanes with waiters, in round robin
// order. pos is the lane whose turn it is; credited: it has had its quantum
// this turn.
type tierQueue struct {
	tier     int
	ring     []*lane
	pos      int
	credited bool
	lanes    map[int32]*lane // every lane of the tier, empty ones included
}

// lane is one class's waiters in one tier, a heap by deadline, score and
// arrival, with the class's deficit.
type lane struct {
	t       *tierQueue
	class   int32
	quantum float64
	deficit float64
	inRing  bool
	heap    []*waiter
}

func (q *waitQueue) Len() int { return q.n }

// classWaiting is how many waiters of class c the queue holds.
func (q *waitQueue) classWaiting(c int32) int {
	if int(c) < len(q.perClass) {
		return q.perClass[c]
	}
	return 0
}

// push queues w in its tier's lane of its class (quantum: the class's).
func (q *waitQueue) push(w *waiter, quantum float64) {
	var t *tierQueue
	i := 0
	for ; i < len(q.tiers); i++ {
		if q.tiers[i].tier == w.tier {
			t = q.tiers[i]
			break
		}
		if q.tiers[i].tier < w.tier {
			break
		}
	}
	if t == nil {
		t = &tierQueue{tier: w.tier, lanes: make(map[int32]*lane, 1)}
		q.tiers = append(q.tiers, nil)
		copy(q.tiers[i+1:], q.tiers[i:])
		q.tiers[i] = t
	}
	l := t.lanes[w.class]
	if l == nil {
		l = &lane{t: t, class: w.class, quantum: quantum}
		t.lanes[w.class] = l
	}
	w.lane = l
	heap.Push((*laneHeap)(l), w)
	if !l.inRing {
		// A lane that starts waiting joins at the end of the round: just
		// before the lane whose turn it is. A lane that was alone, served
		// without the round robin, starts its turn afresh.
		l.inRing, l.deficit = true, 0
		if len(t.ring) == 1 {
			t.ring[0].deficit, t.credited = 0, false
		}
		t.ring = append(t.ring, nil)
		copy(t.ring[t.pos+1:], t.ring[t.pos:])
		t.ring[t.pos] = l
		if len(t.ring) > 1 {
			t.pos++
		}
	}
	q.n++
	if w.deadline != noDeadline {
		q.deadlines++
	}
	for int(w.class) >= len(q.perClass) {
		q.perClass = append(q.perClass, 0)
	}
	q.perClass[w.class]++
}

// head returns the waiter to admit next (nil when none): the top tier's
// round robin turn. It credits the lane whose turn it is once per turn, and
// passes the turn on while the lane's next waiter costs more than its
// deficit; when a whole round passes that way, it adds at once the rounds
// every lane would still wait, so a request far larger than its quantum
// costs one more round, not one per quantum.
func (q *waitQueue) head() *waiter {
	if q.n == 0 {
		return nil
	}
	t := q.tiers[0]
	if len(t.ring) == 1 {
		return t.ring[0].heap[0]
	}
	for passed := 0; ; {
		l := t.ring[t.pos]
		if !t.credited {
			l.deficit += l.quantum
			t.credited = true
		}
		if w := l.heap[0]; w.cost <= l.deficit {
			return w
		}
		t.credited = false
		t.pos = (t.pos + 1) % len(t.ring)
		if passed++; passed == len(t.ring) {
			// Every lane was credited once and none could admit: skip the
			// empty rounds before the first that can.
			rounds := math.Inf(1)
			for _, l := range t.ring {
				rounds = math.Min(rounds, math.Ceil((l.heap[0].cost-l.deficit)/l.quantum))
			}
			if rounds > 1 {
				for _, l := range t.ring {
					l.deficit += (rounds - 1) * l.quantum
				}
			}
			passed = 0
		}
	}
}

// remove takes w out of the queue, if it is queued. admitted: w is the head
// being admitted, whose cost its lane's deficit pays.
func (q *waitQueue) remove(w *waiter, admitted bool) {
	if w.index < 0 {
		return
	}
	l, t := w.lane, w.lane.t
	if admitted {
		// A lane alone in its tier is served without the round robin, and
		// owes nothing when another joins.
		if len(t.ring) > 1 {
			l.deficit -= w.cost
		} else {
			l.deficit = 0
		}
	}
	heap.Remove((*laneHeap)(l), w.index)
	q.n--
	if w.deadline != noDeadline {
		q.deadlines--
	}
	q.perClass[w.class]--
	if len(l.heap) > 0 {
		return
	}
	// The lane is empty: it leaves the round and forgets its deficit.
	i := slices.Index(t.ring, l)
	t.ring = slices.Delete(t.ring, i, i+1)
	l.inRing, l.deficit = false, 0
	switch {
	case i < t.pos:
		t.pos--
	case i == t.pos:
		t.credited = false
	}
	if t.pos >= len(t.ring) {
		t.pos = 0
	}
	if len(t.ring) == 0 {
		ti := slices.Index(q.tiers, t)
		q.tiers = slices.Delete(q.tiers, ti, ti+1)
	}
}

// expire takes out every waiter whose deadline is at or before now, marking
// it expired, and reports whether it took any. Each lane's earliest
// deadline is its top, so this looks at one waiter a lane.
func (q *waitQueue) expire(now int64) bool {
	if q.deadlines == 0 {
		return false
	}
	took := false
	for ti := 0; ti < len(q.tiers); {
		t := q.tiers[ti]
		for li := 0; li < len(t.ring); {
			l := t.ring[li]
			for len(l.heap) > 0 && l.heap[0].deadline <= now {
				w := l.heap[0]
				w.expired, took = true, true
				q.remove(w, false) // the last one takes l out of the ring
			}
			if l.inRing {
				li++
			}
		}
		if ti < len(q.tiers) && q.tiers[ti] == t {
			ti++
		}
	}
	return took
}

// laneHeap orders a lane's waiters: earliest deadline, then higher score,
// then earlier arrival.
type laneHeap lane

func (h *laneHeap) Len() int { return len(h.heap) }
func (h *laneHeap) Less(i, j int) bool {
	a, b := h.heap[i], h.heap[j]
	if a.deadline != b.deadline {
		return a.deadline < b.deadline
	}
	if a.score != b.score {
		return a.score > b.score
	}
	return a.seq < b.seq
}
func (h *laneHeap) Swap(i, j int) {
	h.heap[i], h.heap[j] = h.heap[j], h.heap[i]
	h.heap[i].index, h.heap[j].index = i, j
}
func (h *laneHeap) Push(x any) {
	w := x.(*waiter)
	w.index = len(h.heap)
	h.heap = append(h.heap, w)
}
func (h *laneHeap) Pop() any {
	old := h.heap
	w := old[len(old)-1]
	old[len(old)-1] = nil
	h.heap = old[:len(old)-1]
	w.index = -1
	return w
}

// eject takes worker out of the picks until until; a later end wins.
func (p *partition) eject(worker string, until time.Time) {
	p.ejectMu.Lock()
	defer p.ejectMu.Unlock()
	old := p.ejected.Load()
	m := map[string]int64{}
	if old != nil {
		if u, ok := (*old)[worker]; ok && u >= until.UnixNano() {
			return
		}
		maps.Copy(m, *old)
	}
	m[worker] = until.UnixNano()
	p.ejected.Store(&m)
}

// unEject ends worker's ejection, if any.
func (p *partition) unEject(worker string) {
	p.ejectMu.Lock()
	defer p.ejectMu.Unlock()
	old := p.ejected.Load()
	if old == nil {
		return
	}
	if _, ok := (*old)[worker]; !ok {
		return
	}
	m := maps.Clone(*old)
	delete(m, worker)
	if len(m) == 0 {
		p.ejected.Store(nil)
		return
	}
	p.ejected.Store(&m)
}

// ejectedAt returns the ejections (worker -> end, unix nanos) at least one of
// which is still in force at now(), with that now, or nil. A published set
// whose ejections have all ended is dropped, so the request path is back on
// its unfiltered path; now is called only while a set is published.
func (p *partition) ejectedAt(now func() time.Time) (map[string]int64, int64) {
	m := p.ejected.Load()
	if m == nil {
		return nil, 0
	}
	t := now().UnixNano()
	for _, until := range *m {
		if until > t {
			return *m, t
		}
	}
	p.ejectMu.Lock()
	p.ejected.CompareAndSwap(m, nil) // unless an eject just published another
	p.ejectMu.Unlock()
	return nil, 0
}

// promptKeep is the weight the mean prompt length keeps at each decision:
// it follows about the last 256 prompts.
const promptKeep = 255.0 / 256

// promptMean folds a decision's prompt of isl tokens into p's mean prompt
// length and returns the new mean; with peek it returns what the mean would
// become and changes nothing. Concurrent decisions may each load the
// old mean and store their own update, losing the others': the mean then
// skips a few prompts (and a decision made again counts its prompt again),
// which is harmless for what it scales, and it costs the request path no
// lock.
func (p *partition) promptMean(isl int, peek bool) float64 {
	m := math.Float64frombits(p.promptTokens.Load())
	if m == 0 {
		m = float64(isl)
	} else {
		m = m*promptKeep + float64(isl)*(1-promptKeep)
	}
	if !peek {
		p.promptTokens.Store(math.Float64bits(m))
	}
	return m
}

// pressureOf returns rank w's cache pressure, made on first use (without
// an allocation after that: the apply path calls it per event).
func (p *partition) pressureOf(w catalog.WorkerRank) *rankPressure {
	if pv, ok := p.pressure.Load(w); ok {
		return pv.(*rankPressure)
	}
	pv, _ := p.pressure.LoadOrStore(w, new(rankPressure))
	return pv.(*rankPressure)
}

// resetPressure forgets rank w's cache pressure (its cache was cleared), if
// it has one.
func (p *partition) resetPressure(w catalog.WorkerRank) {
	if pv, ok := p.pressure.Load(w); ok {
		pv.(*rankPressure).reset()
	}
}
