package selection

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/btree"
	"github.com/kvselect/kvselect/reservation"
)

// The sparse decision (temperature 0, no queueing) evaluates one by one only
// the ranks a request touches, and takes the best of all the others from an
// order kept as their loads change.
//
// A rank is cold for a request when the index reports none of the request's
// blocks on it (no device, host or disk match), none of the request's blocks
// is active on it in the ledger (so no in-flight credit, and all of the
// request's blocks are new there) and it is not the session's pin. With the
// overlap credit decay off, a cold rank's cost (logit) is then
//
//	scale x (A + T)/bs + (B + N) + w x R
//
// for its active prefill A, active blocks B and active requests R, the
// prompt's T tokens and the request's N new blocks: a function of the rank's
// load point (A, B, R) alone, the same for every cold rank, and, as a real
// number, the rank's key scale x A/bs + B + w x R plus a constant of the
// request. (With decay on, every candidate's credit depends on the least
// active prefill among all of them, so the decision keeps the full scan; so
// does a request whose cold ranks would get a credit, one listing a hash
// twice with the in-flight credit on.)
//
// costOrder keeps the ranks grouped by load point, the groups ordered by key.
// A decision computes the exact cost (logit itself) of each group whose key
// lies within a tolerance of the least key with an eligible member: beyond
// it, the key's margin over that least key exceeds any rounding of the
// floating-point cost by many orders of magnitude, so no group beyond can
// cost as little as the cheapest in it. Its cheapest cold cost and tie set
// are therefore the full scan's restricted to the cold ranks; the touched
// ranks are evaluated as the full scan evaluates them.

// loadPoint is what a cold rank's cost depends on.
type loadPoint struct {
	prefill  int64
	blocks   int
	requests int
}

func pointOf(l reservation.Load) loadPoint {
	return loadPoint{prefill: l.ActivePrefillTokens, blocks: l.ActiveBlocks, requests: l.ActiveRequests}
}

// costGroup is the ranks at one load point.
type costGroup struct {
	key     float64
	pt      loadPoint
	members []int32 // rank indices, in no order
	// a query's count of its members excluded from the cold pick; valid when
	// mark is the order's epoch
	mark uint64
	excl int
}

// costOrder is a rank set's ranks grouped by load point, the groups in a
// B-tree by key. Every change of a rank's load in the ledger reaches it
// through the ledger's hooks (partition.syncLoad), which re-read the load
// under mu, so the last sync after a change sees it. Safe for concurrent use.
type costOrder struct {
	mu    sync.Mutex
	ready atomic.Bool // filled: the sparse decision may use it
	// what the key is made of: the service's weights (a request that
	// overrides them keeps the full scan)
	scale, arw, bs float64
	trackPrefill   bool

	tree    *btree.BTreeG[*costGroup]
	groupOf []*costGroup // rank index -> its group, nil until placed
	pos     []int32      // rank index -> its position in its group's members
	xmark   []uint64     // rank index -> the epoch of the query that excluded it
	epoch   uint64
	spare   []*costGroup
	probe   costGroup
}

func groupLess(a, b *costGroup) bool {
	switch {
	case a.key != b.key:
		return a.key < b.key
	case a.pt.prefill != b.pt.prefill:
		return a.pt.prefill < b.pt.prefill
	case a.pt.blocks != b.pt.blocks:
		return a.pt.blocks < b.pt.blocks
	}
	return a.pt.requests < b.pt.requests
}

func newCostOrder(w weights, blockSize int) *costOrder {
	return &costOrder{
		scale: w.scale, arw: w.activeReqWeight, bs: float64(blockSize), trackPrefill: w.trackPrefill,
		tree: btree.NewG(16, groupLess),
	}
}

// key is pt's request-independent cost (see the comment at the top).
func (o *costOrder) key(pt loadPoint) float64 {
	k := float64(pt.blocks) + o.arw*float64(pt.requests)
	if o.trackPrefill {
		k += o.scale * float64(pt.prefill) / o.bs
	}
	return k
}

// fits reports whether a request with weights w may use the order.
func (o *costOrder) fits(w *weights) bool {
	return w.scale == o.scale && w.trackPrefill == o.trackPrefill && w.activeReqWeight == o.arw
}

// fill places every rank at its load now and makes the order ready.
func (o *costOrder) fill(l *reservation.Ledger, refs []reservation.Rank) {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := len(refs)
	o.groupOf, o.pos, o.xmark = make([]*costGroup, n), make([]int32, n), make([]uint64, n)
	for i, r := range refs {
		ld, _ := l.RankLoad(r)
		o.place(int32(i), pointOf(ld))
	}
	o.ready.Store(true)
}

// sync moves rank i (handle ref) to its load in l now.
func (o *costOrder) sync(i int32, l *reservation.Ledger, ref reservation.Rank) {
	o.mu.Lock()
	if int(i) < len(o.groupOf) { // else fill, which reads it later, has not started
		ld, _ := l.RankLoad(ref)
		o.place(i, pointOf(ld))
	}
	o.mu.Unlock()
}

// place puts rank i in the group of pt. o.mu is held.
func (o *costOrder) place(i int32, pt loadPoint) {
	g := o.groupOf[i]
	if g != nil {
		if g.pt == pt {
			return
		}
		o.leave(g, i)
	}
	o.probe.key, o.probe.pt = o.key(pt), pt
	ng, ok := o.tree.Get(&o.probe)
	if !ok {
		if n := len(o.spare); n > 0 {
			ng = o.spare[n-1]
			o.spare = o.spare[:n-1]
		} else {
			ng = new(costGroup)
		}
		ng.key, ng.pt, ng.mark = o.probe.key, pt, 0
		o.tree.ReplaceOrInsert(ng)
	}
	o.pos[i] = int32(len(ng.members))
	ng.members = append(ng.members, i)
	o.groupOf[i] = ng
}

// leave takes rank i out of its group g, dropping g when it empties.
func (o *costOrder) leave(g *costGroup, i int32) {
	p, last := o.pos[i], len(g.members)-1
	moved := g.members[last]
	g.members[p] = moved
	o.pos[moved] = p
	g.members = g.members[:last]
	o.groupOf[i] = nil
	if last == 0 {
		o.tree.Delete(g)
		o.spare = append(o.spare, g)
	}
}

// coldTier is one group of a query's window: how many of its members are
// eligible, and what each costs the request.
type coldTier struct {
	g    *costGroup
	n    int
	cost float64
}

// window appends to dst, in key order, the groups with eligible members
// (members not in excluded) whose key is within tolerance of the key at
// which need eligible members are reached, each with the cost of a cold rank
// of its load point (cold: the request's cold candidate, whose load fields
// are replaced). excluded must not repeat a rank. o.mu is held, and must
// stay held while the tiers are used.
func (o *costOrder) window(dst []coldTier, excluded []int32, need int, cold candidate, in costInput, w *weights) []coldTier {
	o.epoch++
	for _, i := range excluded {
		g := o.groupOf[i]
		o.xmark[i] = o.epoch
		if g.mark != o.epoch {
			g.mark, g.excl = o.epoch, 0
		}
		g.excl++
	}
	got, limit := 0, math.Inf(1)
	o.tree.Ascend(func(g *costGroup) bool {
		if g.key > limit {
			return false
		}
		n := len(g.members)
		if g.mark == o.epoch {
			n -= g.excl
		}
		if n == 0 {
			return true
		}
		c := cold
		c.activePrefill, c.activeBlocks, c.activeRequests = g.pt.prefill, g.pt.blocks, g.pt.requests
		cost := logit(&c, in, w)
		dst = append(dst, coldTier{g: g, n: n, cost: cost})
		if got += n; got >= need && math.IsInf(limit, 1) {
			// Float64 costs and keys are within a few units of 1e-16 of
			// their real values, relatively: 1e-9 is a wide margin.
			limit = g.key + 1e-9*(math.Abs(g.key)+math.Abs(cost)+1)
		}
		return true
	})
	return dst
}

// member returns g's j-th eligible member in the order of its members list,
// skipping excluded (the current query's exclusions). Its cost is the
// exclusions, whatever the size of g. o.mu is held.
func (o *costOrder) member(g *costGroup, j int, excluded, scratch []int32) (int32, []int32) {
	skip := scratch[:0]
	if g.mark == o.epoch && g.excl > 0 {
		for _, i := range excluded {
			if o.groupOf[i] == g {
				skip = append(skip, o.pos[i])
			}
		}
		slices.Sort(skip)
	}
	q := int32(j)
	for _, p := range skip {
		if p > q {
			break
		}
		q++
	}
	return g.members[q], skip
}

// twoLeast folds cost, held by m candidates, into the two least costs so far
// (counted with multiplicity).
func twoLeast(b1, b2, cost float64, m int) (float64, float64) {
	switch {
	case cost < b1:
		if m >= 2 {
			return cost, cost
		}
		return cost, b1
	case cost < b2:
		return b1, cost
	}
	return b1, b2
}

// rankMarks maps rank indices to values for one pass, without clearing
// between passes.
type rankMarks struct {
	ep  uint32
	at  []uint32
	val []int32
}

// reset starts a pass over n ranks.
func (m *rankMarks) reset(n int) {
	if m.ep++; m.ep == 0 {
		clear(m.at)
		m.ep = 1
	}
	if len(m.at) < n {
		m.at, m.val = make([]uint32, n), make([]int32, n)
	}
}

func (m *rankMarks) set(i, v int32) { m.at[i], m.val[i] = m.ep, v }

// get returns i's value in this pass, if set.
func (m *rankMarks) get(i int32) (int32, bool) {
	if m.at[i] != m.ep {
		return 0, false
	}
	return m.val[i], true
}

// sparseScratch is the sparse decision's working memory (in evalScratch).
type sparseScratch struct {
	marks rankMarks // rank index -> candidate position, or -1 when ejected
	touch []touched
	excl  []int32
	tiers []coldTier
	skip  []int32
	ej    []int32 // with filters, the ejected workers' ranks
	filt  filterScratch
}

// touched is a rank the request touches and the index of its load.
type touched struct{ idx, load int32 }

// sparseOK reports whether the request may take the sparse decision (see
// the comment at the top): temperature 0, no queueing, the service's
// weights for the key, no credit decay, the Dynamo cost (the predictive
// one's queued work drains with time, so an order of it would not stay
// current), no fallbacks asked for (they need
// the next-cheapest ranks on distinct endpoints: the full scan lists them),
// no allowed subset (evaluated whole instead, see evaluate) and no policy
// seam that needs every candidate (a picker, a filter or a cost term without
// a scope: counted, see fullScanFor).
func (s *SelectionService) sparseOK(pr *prepared, rs *rankSet, matched int) bool {
	o := rs.order
	return o != nil && s.scan != scanFull && s.cfg.QueueThreshold == nil &&
		pr.w.temperature <= 0 && (pr.w.decay == 0 || !pr.w.trackPrefill) && !pr.w.predictive && pr.fallback == 0 &&
		pr.allowed == nil && o.fits(&pr.w) && o.ready.Load() &&
		(s.scan == scanSparse || len(rs.ranks) >= sparseMinRanks && 4*matched <= len(rs.ranks)) &&
		!s.fullScanFor()
}

// sparseMinRanks is the smallest rank set the sparse decision is used for by
// default: below it the full scan costs about as little. Nor is it used by
// default for a request the index matches on more than a quarter of the
// ranks (a system prompt every rank caches): evaluating most ranks one by one
// costs more than the scan.
const sparseMinRanks = 128

// scanMode chooses between the decisions; tests and benchmarks force one.
type scanMode uint8

const (
	scanAuto   scanMode = iota // sparse where sparseOK allows, from sparseMinRanks ranks
	scanFull                   // always the full scan
	scanSparse                 // sparse wherever sparseOK allows, at any size
)

// decideSparse is evaluate and choose for a request sparseOK admits: it
// returns the evaluation (its candidates are the touched ranks only), the
// chosen candidate and whether a session pin chose it; ok false when the
// request must take the full scan after all. errStale reports a chosen cold
// rank whose load changed since the order placed it (the order is synced, and
// the caller decides again); any other error (a cost term's) fails the
// request. The policy's cost terms and filters, all scoped (sparseOK),
// touch the ranks of the workers their scopes name; so do, with filters, the
// ejected workers' (see filterSparse).
func (s *SelectionService) decideSparse(p *partition, pr *prepared, sc *evalScratch) (ev *evaluation, c candidate, pinned, ok bool, err error) {
	rs := sc.rs
	n := len(rs.ranks)
	if n == 0 {
		return nil, candidate{}, false, false, nil
	}
	sp := &sc.sparse
	sp.marks.reset(n)
	excl := sp.excl[:0]
	// With filters (all scoped: sparseOK), the ejected workers' ranks are
	// touched: the filters judge them first, as in the full scan
	// (filterSparse), and ejection comes after.
	filtering := s.pol != nil && len(s.pol.filters) > 0
	ej := sp.ej[:0]
	ejected, nowNanos := p.ejectedAt(s.now)
	for w, until := range ejected {
		if until <= nowNanos {
			continue
		}
		for _, i := range rs.byWorker[w] {
			if filtering {
				ej = append(ej, i)
			} else if _, seen := sp.marks.get(i); !seen {
				sp.marks.set(i, -1)
				excl = append(excl, i)
			}
		}
	}
	sp.ej = ej
	ejectedRanks := len(excl)
	if ejectedRanks == n {
		return nil, candidate{}, false, false, nil // ejection yields: the full scan says how
	}
	// The touched ranks: index matches, the session's pin, then (from the
	// ledger) the holders of the request's active blocks.
	tc := sp.touch[:0]
	refs := sc.refs[:0]
	add := func(i int32) {
		if _, seen := sp.marks.get(i); !seen {
			sp.marks.set(i, 0)
			tc = append(tc, touched{idx: i, load: int32(len(refs))})
			refs = append(refs, rs.refs[i])
		}
	}
	for _, i := range sc.matchIdx {
		if i >= 0 {
			add(i)
		}
	}
	if pr.pinned {
		if i, known := rs.pos[pr.pin]; known {
			add(i)
		}
	}
	terms := s.pol != nil && len(s.pol.terms) > 0
	if terms {
		for _, id := range s.scope(pr) {
			for _, i := range rs.byWorker[id] {
				add(i)
			}
		}
	}
	if filtering {
		s.filterScopes(pr, rs, &sp.filt, add)
		for _, i := range ej {
			add(i)
		}
	}
	if s.scan == scanAuto && 4*len(tc) > n {
		// Scopes naming more than a quarter of the ranks: evaluating them
		// one by one costs more than the full scan (as for matches).
		sp.touch, sp.excl, sc.refs = tc, excl, refs
		return nil, candidate{}, false, false, nil
	}
	var distinct int
	sc.loads, distinct = s.ledger.AppendRequestLoads(sc.loads[:0], refs, pr.active)
	sc.refs = refs
	for li := len(refs); li < len(sc.loads); li++ {
		i, known := rs.pos[sc.loads[li].Worker]
		if !known {
			continue // a rank of another model, or one this snapshot lacks
		}
		if _, seen := sp.marks.get(i); !seen {
			sp.marks.set(i, 0)
			tc = append(tc, touched{idx: i, load: int32(li)})
		}
	}
	inflight := pr.w.inflightW > 0 && pr.w.assumeReuse && s.cfg.UseKVEvents
	if inflight && len(pr.active) != distinct {
		// A hash listed twice would count as in flight on every rank,
		// giving cold ranks a credit: their cost would not follow the key.
		sp.touch, sp.excl = tc, excl
		return nil, candidate{}, false, false, nil
	}
	slices.SortFunc(tc, func(a, b touched) int { return int(a.idx - b.idx) })
	cands := sc.cands[:0]
	for k, t := range tc {
		sp.marks.set(t.idx, int32(k))
		excl = append(excl, t.idx)
		l := &sc.loads[t.load]
		c := rs.template[t.idx]
		c.activePrefill, c.activeBlocks, c.activeRequests = l.Load.ActivePrefillTokens, l.Load.ActiveBlocks, l.Load.ActiveRequests
		c.newBlocks = l.NewBlocks + pr.private
		c.stamp = l.Stamp
		if inflight {
			c.inflight = len(pr.active) - l.NewBlocks
		}
		cands = append(cands, c)
	}
	sc.cands = cands
	sp.touch = tc
	for j, m := range sc.matches {
		if i := sc.matchIdx[j]; i >= 0 {
			if k, _ := sp.marks.get(i); k >= 0 {
				c := &cands[k]
				c.device, c.host, c.disk = m.Device, m.Host, m.Disk
			}
		}
	}
	if inflight {
		for k := range cands {
			c := &cands[k]
			c.pending = max(0, c.inflight-c.device-c.host-c.disk)
		}
	}
	cold := n - ejectedRanks - len(tc) // the ranks the order prices
	candidates := n - ejectedRanks
	if filtering {
		var yield bool
		cands, cold, yield, err = s.filterSparse(pr, rs, &sp.filt, cands, cold, ejected, nowNanos)
		if err != nil || yield {
			sp.excl = excl
			return nil, candidate{}, false, !yield, err
		}
		for _, t := range tc {
			sp.marks.set(t.idx, -1)
		}
		for k := range cands {
			sp.marks.set(int32(cands[k].idx), int32(k))
		}
		sc.cands, candidates = cands, len(cands)+cold
	}
	in := costInput{isl: pr.isl, blockSize: s.cfg.BlockSize}
	ev = &sc.ev
	*ev = evaluation{rs: rs, cands: cands, bestPrefill: math.MaxInt, candidates: candidates, in: in}
	best1, best2 := math.Inf(1), math.Inf(1)
	var now time.Time // the cost terms' clock
	if terms {
		now = s.now()
	}
	for k := range cands {
		c := &cands[k]
		c.cost = logit(c, in, &pr.w)
		if terms {
			var v *Scored // the filters' view of c, else price makes one
			if filtering {
				v = &pr.pol.views[k]
			}
			if err := s.price(pr, rs, c, v, now); err != nil {
				sp.touch, sp.excl = tc, excl
				return nil, candidate{}, false, true, err
			}
		}
		best1, best2 = twoLeast(best1, best2, c.cost, 1)
		ev.bestOverlap = max(ev.bestOverlap, c.device)
		ev.bestPrefill = min(ev.bestPrefill, effectivePrefill(c, pr, &pr.w, s.cfg.BlockSize))
	}
	coldCand := candidate{newBlocks: distinct + pr.private}
	need := 1
	if s.detail {
		need = 2
	}
	o := rs.order
	o.mu.Lock()
	tiers := sp.tiers[:0]
	if cold > 0 { // else an AdmitsOnly filter left every cold rank out
		tiers = o.window(tiers, excl, need, coldCand, in, &pr.w)
	}
	sp.tiers, sp.excl = tiers, excl
	if len(tiers) > 0 {
		ev.bestPrefill = min(ev.bestPrefill, pr.isl)
	}
	for _, t := range tiers {
		best1, best2 = twoLeast(best1, best2, t.cost, t.n)
	}
	// The session's pin, as pinnedChoice decides it (no rank is busy
	// without queueing, so pool and candidates are the same).
	if pr.pinned {
		if i, known := rs.pos[pr.pin]; known {
			if k, _ := sp.marks.get(i); k >= 0 {
				pc := cands[k]
				blocks := float64(pr.isl) / float64(s.cfg.BlockSize)
				if s.cfg.Sessions.Mode == SessionHard || pc.cost <= best1+s.cfg.Sessions.SoftSlack*(pr.w.scale*blocks+blocks) {
					c, pinned = pc, true
				}
			}
		}
	}
	var coldPick int32 = -1
	var coldPt loadPoint
	if !pinned {
		hotTies, ties := 0, 0
		for k := range cands {
			if cands[k].cost == best1 {
				hotTies++
			}
		}
		ties = hotTies
		for _, t := range tiers {
			if t.cost == best1 {
				ties += t.n
			}
		}
		k := 0
		if ties > 1 {
			k = p.rng.IntN(ties) // one draw, as pick draws over the same ties
		}
		if k < hotTies {
			for j := range cands {
				if cands[j].cost == best1 {
					if k == 0 {
						c = cands[j]
						break
					}
					k--
				}
			}
		} else {
			k -= hotTies
			for _, t := range tiers {
				if t.cost != best1 {
					continue
				}
				if k < t.n {
					coldPick, sp.skip = o.member(t.g, k, excl, sp.skip)
					coldPt = t.g.pt
					break
				}
				k -= t.n
			}
		}
	}
	o.mu.Unlock()
	if coldPick >= 0 {
		ld, st := s.ledger.RankLoad(rs.refs[coldPick])
		if pointOf(ld) != coldPt {
			// The order has not heard of this change yet: place the rank
			// and decide again.
			o.sync(coldPick, s.ledger, rs.refs[coldPick])
			return nil, candidate{}, false, true, errStale
		}
		c = rs.template[coldPick]
		c.activePrefill, c.activeBlocks, c.activeRequests = coldPt.prefill, coldPt.blocks, coldPt.requests
		c.newBlocks = coldCand.newBlocks
		c.stamp = st
		c.cost = logit(&c, in, &pr.w)
	}
	if s.detail && ev.candidates >= 2 {
		if c.cost == best1 {
			ev.margin = best2 - c.cost
		} else {
			ev.margin = best1 - c.cost
		}
	}
	return ev, c, pinned, true, nil
}
