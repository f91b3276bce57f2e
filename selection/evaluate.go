package selection

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/reservation"
)

// evaluation is one look at a partition's candidates for a request.
type evaluation struct {
	rs          *rankSet
	cands       []candidate
	allBusy     bool
	bestOverlap int
	bestPrefill int
	margin      float64   // see Decision.Margin; set by choose when detail is on
	in          costInput // the request side of every cost of this evaluation
	// candidates is the number of eligible ranks: len(cands) for the full
	// scan, more for the sparse decision, whose cands are the touched ranks.
	candidates int
	// spread is how many peers' bookings choose prices and inBurst whether
	// the decision is in a burst (see Peers); sim is its working memory,
	// kept for reuse.
	spread  int
	inBurst bool
	sim     []candidate
}

// evalScratch is one decision's working memory, pooled so the hot path does not
// allocate.
type evalScratch struct {
	matches  []kvindex.Match // the request's overlaps, from the index
	rs       *rankSet        // the rank snapshot matchIdx refers to
	matchIdx []int32         // matchIdx[j]: rank index of matches[j] in rs, -1 if none
	cands    []candidate
	refs     []reservation.Rank
	loads    []reservation.CandidateLoad
	byIdx    []int32
	allowed  []int32 // the allowed ranks' indices, ascending
	ev       evaluation
	sparse   sparseScratch
	// the previous resolve on this scratch, for reuse (see resolve)
	memoRS   *rankSet
	memoKeys []catalog.WorkerRank
	memoIdx  []int32
}

var scratchPool = sync.Pool{New: func() any { return new(evalScratch) }}

// refresh re-maps the matches when the partition's ranks changed since sc.rs.
func (sc *evalScratch) refresh(p *partition) {
	if cur := p.ranksOf(); cur != sc.rs {
		sc.resolve(cur)
	}
}

// resolve maps sc.matches to rank indices of rs into sc.matchIdx. Consecutive
// requests on one scratch usually match the same worker ranks in the same
// order (a shared system prompt, listed in the index's order), so a match
// naming the same worker rank as the previous resolve's at that position reuses
// its index instead of a map lookup.
func (sc *evalScratch) resolve(rs *rankSet) {
	sc.rs = rs
	if sc.memoRS != rs {
		sc.memoRS, sc.memoKeys, sc.memoIdx = rs, sc.memoKeys[:0], sc.memoIdx[:0]
	}
	idx := sc.matchIdx[:0]
	for j, m := range sc.matches {
		if j < len(sc.memoKeys) && sc.memoKeys[j] == m.Worker {
			idx = append(idx, sc.memoIdx[j])
			continue
		}
		i, ok := rs.pos[m.Worker]
		if !ok {
			i = -1
		}
		idx = append(idx, i)
	}
	sc.matchIdx = idx
	sc.memoKeys = sc.memoKeys[:0]
	for _, m := range sc.matches {
		sc.memoKeys = append(sc.memoKeys, m.Worker)
	}
	sc.memoIdx = append(sc.memoIdx[:0], idx...)
}

// evaluate scores every eligible candidate of sc.rs, reading their loads from
// the ledger at one point of its history.
func (s *SelectionService) evaluate(p *partition, pr *prepared, sc *evalScratch) (*evaluation, error) {
	rs := sc.rs
	if len(rs.ranks) == 0 {
		return nil, s.errNotReady(pr.model)
	}
	var cands []candidate
	var refs []reservation.Rank
	var byIdx []int32                       // rank index -> candidate index; nil when every rank is eligible
	ejected, nowNanos := p.ejectedAt(s.now) // worker -> end of its ejection; nil: none in force
	var held map[string]int64               // with filters, the ejections they apply (see applyFilters)
	filtering := s.pol != nil && len(s.pol.filters) > 0
	if filtering {
		held, ejected = ejected, nil
	}
	if pr.allowed == nil && ejected == nil {
		cands = append(sc.cands[:0], rs.template...)
		refs = rs.refs
	} else {
		if cap(sc.byIdx) < len(rs.ranks) {
			sc.byIdx = make([]int32, len(rs.ranks))
		}
		byIdx = sc.byIdx[:len(rs.ranks)]
		var idxs []int32 // with an allowed subset, its ranks: what is evaluated
		if pr.allowed != nil {
			idxs = sc.allowed[:0]
			for id := range pr.allowed {
				idxs = append(idxs, rs.byWorker[id]...)
			}
			slices.Sort(idxs)
			sc.allowed = idxs
		}
		filter := func(skipEjected bool) {
			cands, refs = sc.cands[:0], sc.refs[:0]
			try := func(i int32) {
				if until, ok := ejected[rs.ranks[i].key.WorkerID]; skipEjected && ok && until > nowNanos {
					return
				}
				byIdx[i] = int32(len(cands))
				cands = append(cands, rs.template[i])
				refs = append(refs, rs.refs[i])
			}
			if pr.allowed != nil {
				for _, i := range sc.matchIdx { // the only other ranks byIdx is read for
					if i >= 0 {
						byIdx[i] = -1
					}
				}
				for _, i := range idxs {
					byIdx[i] = -1
				}
				for _, i := range idxs {
					try(i)
				}
				return
			}
			for i := range rs.ranks {
				byIdx[i] = -1
				try(int32(i))
			}
		}
		filter(ejected != nil)
		if len(cands) == 0 && ejected != nil {
			filter(false) // every eligible worker is ejected: ejection yields
		}
		sc.refs = refs
		if len(cands) == 0 {
			sc.cands = cands
			return nil, fmt.Errorf("%w: none of the %d allowed workers serves model %q", ErrNoEndpoints, len(pr.allowed), pr.model)
		}
	}
	sc.cands = cands
	sc.loads = s.ledger.AppendRankLoads(sc.loads[:0], refs, pr.active)
	// Shared hashes are chained, so the request's blocks active on a rank are
	// a leading run of it: what extends past the cached prefix is being
	// computed there now.
	inflight := pr.w.inflightW > 0 && pr.w.assumeReuse && s.cfg.UseKVEvents
	for i := range cands {
		l := &sc.loads[i]
		cands[i].activePrefill = l.Load.ActivePrefillTokens
		cands[i].activeBlocks = l.Load.ActiveBlocks
		cands[i].activeRequests = l.Load.ActiveRequests
		cands[i].newBlocks = l.NewBlocks + pr.private // private blocks are new everywhere
		cands[i].stamp = l.Stamp
		if inflight {
			cands[i].inflight = len(pr.active) - l.NewBlocks
		}
	}
	for j, m := range sc.matches {
		ci := sc.matchIdx[j]
		if ci >= 0 && byIdx != nil {
			ci = byIdx[ci]
		}
		if ci >= 0 {
			c := &cands[ci]
			c.device, c.host, c.disk = m.Device, m.Host, m.Disk
		}
	}
	if inflight {
		for i := range cands {
			c := &cands[i]
			c.pending = max(0, c.inflight-c.device-c.host-c.disk)
		}
	}
	if filtering {
		var err error
		if cands, refs, err = s.applyFilters(pr, sc, cands, held, nowNanos); err != nil {
			return nil, err
		}
		sc.cands = cands
	}
	ev := &sc.ev
	*ev = evaluation{rs: rs, cands: cands, bestPrefill: math.MaxInt, candidates: len(cands), sim: ev.sim}
	in := costInput{isl: pr.isl, blockSize: s.cfg.BlockSize}
	if pr.w.predictive {
		in.now = s.now().UnixNano()
		cal := s.ledger.Calibration()
		in.calibrated = pr.w.learn && cal.Ready
		in.overhead, in.perRequest = cal.Overhead, cal.ActiveRequest
		var arrivals, tokTime float64 // sums: recent bookings, seconds per prefill token
		fixed := 1 / pr.w.rate
		for i := range cands {
			c := &cands[i]
			since, slow, arr := s.ledger.RankClock(refs[i], in.now)
			c.since = since
			if in.calibrated {
				if slow <= 0 {
					slow = 1
				}
				c.tokTime, c.queueTime = cal.OwnToken*slow, cal.QueuedToken*slow
			} else {
				c.tokTime, c.queueTime = fixed, fixed
			}
			c.arrivals = arr
			c.pressure = rs.ranks[c.idx].pressure.load()
			arrivals += arr
			tokTime += c.tokTime
		}
		in.meanArrivals = arrivals / float64(len(cands))
		if pr.w.balanceW > 0 || pr.w.satGrowth > 0 {
			// The balance term's unit, and the saturation's: the
			// candidates' mean time to prefill the model's mean prompt.
			in.promptTime = p.promptMean(pr.isl, pr.peek) * tokTime / float64(len(cands))
		}
		in.backlogW = backlogWeight(&pr.w, cands, in.promptTime)
	}
	if pr.w.decay > 0 {
		in.minPrefill = math.MaxInt64
		for i := range cands {
			in.minPrefill = min(in.minPrefill, cands[i].activePrefill)
		}
	}
	ev.in = in
	busy := 0
	for i := range cands {
		c := &cands[i]
		c.cost = cost(c, &in, &pr.w)
		ev.bestOverlap = max(ev.bestOverlap, c.device)
		ev.bestPrefill = min(ev.bestPrefill, effectivePrefill(c, pr, &pr.w, s.cfg.BlockSize))
		if s.busy(c) {
			busy++
		}
	}
	if s.pol != nil && len(s.pol.terms) > 0 {
		if err := s.priceAll(pr, rs, cands); err != nil {
			return nil, err
		}
	}
	ev.allBusy = busy == len(cands)
	if s.routers.count.Load() > 0 {
		ev.spread, ev.inBurst = s.spreadCount(p, s.now().UnixNano())
	}
	return ev, nil
}

// busy reports whether c's active prefill exceeds the queue threshold times its
// max_num_batched_tokens. Always false when queueing is off.
func (s *SelectionService) busy(c *candidate) bool {
	if s.cfg.QueueThreshold == nil {
		return false
	}
	base := c.maxBatched
	if base <= 0 {
		base = DefaultMaxNumBatchedTokens
	}
	return float64(c.activePrefill) > *s.cfg.QueueThreshold*float64(base)
}

func effectivePrefill(c *candidate, pr *prepared, w *weights, bs int) int {
	cached := min(cachedTokens(c, w, bs), pr.isl)
	return pr.isl - cached
}

// errStale is commit's report of a lock-free booking a concurrent one made stale.
var errStale = errors.New("selection: decision stale")

// commit picks among the candidates (choose) and books the pick (book).
func (s *SelectionService) commit(p *partition, pr *prepared, ev *evaluation, reserve, lockFree bool) (Result, error) {
	c, pinned, err := s.choose(p, pr, ev)
	if err != nil {
		return Result{}, err
	}
	return s.book(p, pr, ev, c, pinned, reserve, lockFree)
}

// choose picks among the candidates that are not busy (all of them when every
// one is busy, which only Select reaches): the session's pin, or the policy's
// Picker, or by cost. It sets ev.margin; its error is the Picker's.
func (s *SelectionService) choose(p *partition, pr *prepared, ev *evaluation) (candidate, bool, error) {
	pool := ev.cands
	if !ev.allBusy && s.cfg.QueueThreshold != nil {
		n := 0
		for _, c := range ev.cands {
			if !s.busy(&c) {
				pool[n] = c
				n++
			}
		}
		pool = pool[:n]
	}
	spreading := ev.spread > 0 && len(pool) > 1
	if spreading {
		ev.sim = spread(pool, ev.sim, ev.in, &pr.w, ev.spread)
		s.st.spread.Add(1)
	}
	var best1, best2 float64
	best1i := -1
	if s.detail { // the two cheapest, before pick may reuse the costs
		best1, best2 = math.Inf(1), math.Inf(1)
		for i := range pool {
			switch cost := pool[i].cost; {
			case cost < best1:
				best1, best2, best1i = cost, best1, pool[i].idx
			case cost < best2:
				best2 = cost
			}
		}
	}
	c, pinned := s.pinnedChoice(ev, pool, pr)
	switch {
	case pinned:
	case s.pol != nil && s.pol.picker != nil:
		i, err := s.pickWith(pr, ev, pool)
		if err != nil {
			return candidate{}, false, err
		}
		c = pool[i]
	case ev.inBurst && pr.w.temperature <= 0:
		c = pool[cheapest(pool)] // ties as the peers' bookings broke them (see Peers)
	default:
		c = pool[pick(pool, pr.w.temperature, &p.rng)]
	}
	// pick may reuse cost for softmax weights: recompute for the result.
	c.cost = cost(&c, &ev.in, &pr.w)
	switch {
	case !s.detail || len(pool) < 2:
		ev.margin = 0
	case c.idx == best1i:
		ev.margin = best2 - c.cost
	default:
		ev.margin = best1 - c.cost
	}
	return c, pinned, nil
}

// book completes the result for the chosen candidate c and books it when
// reserve is set: with BookAt at the stamp of c's load when lockFree
// (errStale when a concurrent booking reached it since), plainly otherwise.
// p.mu is held, for reading at least, when reserve is set.
func (s *SelectionService) book(p *partition, pr *prepared, ev *evaluation, c candidate, pinned, reserve, lockFree bool) (Result, error) {
	r := ev.rs.ranks[c.idx]
	eff := effectivePrefill(&c, pr, &pr.w, s.cfg.BlockSize)
	res := Result{
		WorkerRank: r.key, Endpoint: r.endpoint, BlockSize: s.cfg.BlockSize,
		Overlap:                Overlap{Device: c.device, Host: c.host, Disk: c.disk},
		RequestBlocks:          len(pr.seqs),
		EffectivePrefillTokens: eff,
		PotentialDecodeBlocks:  c.activeBlocks + c.newBlocks,
		Cost:                   c.cost,
		Busy:                   ev.allBusy,
	}
	if pr.fallback > 0 {
		res.Fallbacks = s.fallbacks(ev, pr, r.endpoint)
	}
	if reserve {
		prefill := 0
		if pr.w.trackPrefill {
			prefill = eff
		}
		b := reservation.Booking{
			ID: pr.id, Worker: r.key, SeqHashes: pr.active, PrivateBlocks: pr.private,
			PrefillTokens: prefill, ExpectedOutputTokens: pr.expected,
		}
		var err error
		if lockFree {
			err = s.ledger.BookAt(b, c.stamp)
		} else {
			err = s.ledger.Book(b)
		}
		if err != nil {
			return Result{}, s.bookError(err)
		}
		if p.approx != nil {
			p.approx.Record(r.key, pr.seqs)
		}
		if r.health != nil {
			if r.health.untrusted.Load() {
				p.fallback.Record(r.key, pr.seqs)
			}
			s.booked(r.health, pr.seqs, c.device+c.host+c.disk, pr.id)
		}
		s.st.bookings.Add(1)
		if w := s.routers.window.Load(); w > 0 && s.routers.count.Load() > 0 {
			p.burst.booked(s.now().UnixNano(), w)
		}
		if pr.session != "" {
			p.sessions.put(pr.session, r.key, s.now().UnixNano())
			switch {
			case pinned:
				s.st.sessionHits.Add(1)
			case pr.pinned:
				s.st.sessionMoves.Add(1)
			}
		}
		if s.obs != nil {
			s.obs.Booked(BookingEvent{
				ID: pr.id, Model: pr.model, Worker: r.key, SeqHashes: pr.active, PrivateBlocks: pr.private,
				PrefillTokens: prefill, ExpectedOutputTokens: pr.expected, Lease: s.cfg.ActiveRequestExpiry,
				Session: pr.session,
			})
		}
		res.ReservationID = pr.id
	}
	s.st.selections.Add(1)
	s.st.chosenOverlap.Add(uint64(c.device))
	s.st.bestOverlap.Add(uint64(ev.bestOverlap))
	s.st.requestBlocks.Add(uint64(len(pr.seqs)))
	return res, nil
}

// bookError maps a ledger error of a booking to the service's errors.
func (s *SelectionService) bookError(err error) error {
	switch {
	case errors.Is(err, reservation.ErrStale):
		return errStale
	case errors.Is(err, reservation.ErrConflict):
		s.st.conflicts.Add(1)
		return fmt.Errorf("%w: %w", ErrConflict, err)
	default:
		return fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
}
