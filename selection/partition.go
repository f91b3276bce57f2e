package selection

import (
	"container/heap"
	"maps"
	"math"
	mrand "math/rand/v2"
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
	health     *rankHealth // nil without feed checks
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

	// set is the schedulable ranks, replaced whole (under mu held for writing)
	// when the catalog changes; lookups read it without mu and re-check it
	// under mu before booking.
	set atomic.Pointer[rankSet]
	// mu is held for writing by rebuild and by the queueing path's
	// pick-and-book, and for reading by a lock-free booking's re-check of set
	// and its BookAt, so no booking lands on a rank a rebuild removed.
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

// rebuild replaces the candidate list with the schedulable records of the model,
// resolving their load entries in ledger and, when health is not nil, their
// feed state.
// order, when not nil, is the new snapshot's empty cost order: it is filled
// from the ledger after the snapshot is published (see syncLoad).
func (p *partition) rebuild(recs []catalog.Record, ledger *reservation.Ledger, health func(catalog.WorkerRank) *rankHealth, order *costOrder) {
	var ranks []rankInfo
	for _, r := range recs {
		w := r.Worker
		for _, rank := range w.Ranks() {
			ri := rankInfo{
				key:        catalog.WorkerRank{Worker: w.ID, Rank: rank},
				endpoint:   w.Endpoint,
				blockSize:  w.BlockSize,
				maxBatched: w.MaxNumBatchedTokens,
			}
			if health != nil {
				ri.health = health(ri.key)
			}
			ranks = append(ranks, ri)
		}
	}
	rs := &rankSet{
		ranks:    ranks,
		pos:      make(map[catalog.WorkerRank]int32, len(ranks)),
		byWorker: make(map[string][]int32, len(recs)),
		template: make([]candidate, len(ranks)),
		order:    order,
	}
	keys := make([]catalog.WorkerRank, len(ranks))
	for i, r := range ranks {
		rs.pos[r.key] = int32(i)
		rs.byWorker[r.key.Worker] = append(rs.byWorker[r.key.Worker], int32(i))
		keys[i] = r.key
		rs.template[i] = candidate{idx: i, maxBatched: r.maxBatched}
	}
	rs.refs = ledger.AppendRanks(make([]reservation.Rank, 0, len(ranks)), keys)
	p.mu.Lock()
	p.set.Store(rs)
	p.mu.Unlock()
	if order != nil {
		// After the publication: a load change the fill does not see is one
		// whose hook finds this snapshot (syncLoad), so none is lost.
		order.fill(ledger, rs.refs)
	}
}

// syncLoad moves worker rank w in the current snapshot's cost order to its
// load in ledger now (a hook of the ledger: w's load changed).
func (p *partition) syncLoad(w catalog.WorkerRank, ledger *reservation.Ledger) {
	rs := p.ranksOf()
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
	ranks    []rankInfo
	pos      map[catalog.WorkerRank]int32
	byWorker map[string][]int32 // worker id -> its rank indices, ascending
	refs     []reservation.Rank
	template []candidate
	// order is the ranks ordered by what their load costs any request that
	// none of them holds (sparse.go); nil with queueing.
	order *costOrder
}

// ranksOf returns the partition's current snapshot (never nil).
func (p *partition) ranksOf() *rankSet {
	if rs := p.set.Load(); rs != nil {
		return rs
	}
	return &emptyRanks
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
	tier  int
	score float64
	seq   uint64
	index int // position in the heap, -1 when not queued
}

// waitQueue is a max-heap: higher strict tier first, then higher score, then
// earlier enqueue.
type waitQueue []*waiter

func (q waitQueue) Len() int { return len(q) }
func (q waitQueue) Less(i, j int) bool {
	a, b := q[i], q[j]
	if a.tier != b.tier {
		return a.tier > b.tier
	}
	if a.score != b.score {
		return a.score > b.score
	}
	return a.seq < b.seq
}
func (q waitQueue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].index, q[j].index = i, j
}
func (q *waitQueue) Push(x any) {
	w := x.(*waiter)
	w.index = len(*q)
	*q = append(*q, w)
}
func (q *waitQueue) Pop() any {
	old := *q
	w := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	w.index = -1
	return w
}

func (q *waitQueue) remove(w *waiter) {
	if w.index >= 0 {
		heap.Remove(q, w.index)
	}
}

func (q waitQueue) head() *waiter {
	if len(q) == 0 {
		return nil
	}
	return q[0]
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
