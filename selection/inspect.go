package selection

import (
	"context"
	"slices"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
)

// WorkerLoad is the active load of one schedulable (worker, rank).
type WorkerLoad struct {
	catalog.WorkerRank
	ActivePrefillTokens int64
	ActiveBlocks        int
	ActiveRequests      int
	MaxNumBatchedTokens int
	Busy                bool
	// PrefillRate is the rank's calibrated prefill rate in tokens per
	// second and Slowness how its token times compare with the fleet's
	// (reservation.PrefillClock; Stats.Calibration is the fit they come
	// from): 0 until the fit is Ready, Slowness until the rank's own
	// completions separate its speed from the overhead. They are this
	// service's own observation: replicas that share their bookings time
	// the completions they hear themselves, so theirs may differ.
	PrefillRate, Slowness float64
	// RecentBookings is the rank's recent bookings, decayed over
	// PredictiveCost.BalanceWindow (reservation.PrefillClock's Arrivals):
	// what the predictive cost's balance term compares with the mean.
	RecentBookings float64
	// CachePressure is the share, in [0, 1], of the device blocks the
	// rank's engine reported storing lately that its removals matched: how
	// full its cache runs (0 where it never fills, and without KV events).
	// The predictive cost's eviction term reads it
	// (PredictiveCost.EvictionWeight).
	CachePressure        float64
	PotentialPrefill     int64 // PotentialLoads only: prefill tokens if this request went here
	PotentialDecodeBlock int   // PotentialLoads only: active blocks if this request went here
}

// Loads returns the load of every schedulable rank of model ("" = catalog.DefaultModel),
// sorted by worker and rank. Unknown model: nil.
func (s *SelectionService) Loads(model string) []WorkerLoad {
	p := s.partition(model)
	if p == nil {
		return nil
	}
	rs := p.ranksOf()
	loads := s.ledger.AppendRankLoads(nil, rs.refs, nil)
	out := make([]WorkerLoad, len(rs.ranks))
	now := s.now()
	for i, r := range rs.ranks {
		out[i] = s.workerLoad(r, loads[i].Load)
		clk := s.ledger.PrefillClock(rs.refs[i], now)
		out[i].PrefillRate, out[i].Slowness, out[i].RecentBookings = clk.Rate, clk.Slowness, clk.Arrivals
		out[i].CachePressure = r.pressure.load()
	}
	sortLoads(out)
	return out
}

func (s *SelectionService) workerLoad(r rankInfo, l reservation.Load) WorkerLoad {
	c := candidate{activePrefill: l.ActivePrefillTokens, maxBatched: r.maxBatched}
	return WorkerLoad{
		WorkerRank:          r.key,
		ActivePrefillTokens: l.ActivePrefillTokens, ActiveBlocks: l.ActiveBlocks, ActiveRequests: l.ActiveRequests,
		MaxNumBatchedTokens: r.maxBatched, Busy: s.busy(&c),
	}
}

func sortLoads(ls []WorkerLoad) {
	slices.SortFunc(ls, func(a, b WorkerLoad) int { return a.WorkerRank.Compare(b.WorkerRank) })
}

func (s *SelectionService) partition(model string) *partition {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.partitions[modelOf(model)]
}

// Scored is one eligible rank's view of a request: its overlap, its load if the
// request went there, and its cost. PotentialLoads returns it, and the policy
// seams (Filter, CostTerm, Picker) see each candidate through it.
type Scored struct {
	WorkerLoad
	// Endpoint is the worker's host:port, Labels its labels
	// (catalog.Worker.Labels), shared: never write them.
	Endpoint string
	Labels   map[string]string
	Overlap  Overlap
	// EffectivePrefillTokens is the prompt length minus weighted cached tokens.
	EffectivePrefillTokens int
	// Cost is the rank's cost for the request (see the seams for what it is
	// when they are called), in seconds when Predicted (the predictive cost
	// decides), else Dynamo's blocks.
	Cost      float64
	Predicted bool
}

// PotentialLoads scores req against every eligible rank without picking or
// booking: overlap, the load each would have with the request, and the cost.
// The policy's filters and cost terms apply (its Classifier does not: nothing
// is admitted). Errors as Select.
func (s *SelectionService) PotentialLoads(ctx context.Context, req Request) ([]Scored, error) {
	ps, _ := s.pol.begin(ctx, &req, false)
	defer s.pol.end(ps)
	pr, err := s.prepare(&req)
	if err != nil {
		return nil, err
	}
	pr.peek, pr.pol = true, ps
	defer pr.release()
	p := s.partition(pr.model)
	if p == nil {
		return nil, errNoModel(pr.model)
	}
	sc := &evalScratch{matches: p.matches(nil, pr.seqs)}
	sc.resolve(p.ranksOf())
	pr.w.forRanks(len(sc.rs.ranks))
	ev, err := s.evaluate(p, pr, sc)
	if err != nil {
		return nil, err
	}
	rs := sc.rs
	out := make([]Scored, len(ev.cands))
	now := s.now()
	for i := range ev.cands {
		s.view(&out[i], rs, &ev.cands[i], pr, now)
	}
	slices.SortFunc(out, func(a, b Scored) int { return a.WorkerRank.Compare(b.WorkerRank) })
	return out, nil
}

// ReadyStatus tells whether the service can route.
type ReadyStatus struct {
	// Ready is true when at least one worker is schedulable.
	Ready bool
	// Schedulable and Workers count schedulable workers and all workers.
	Schedulable, Workers int
}

// Ready reports whether any worker is schedulable.
func (s *SelectionService) Ready() ReadyStatus {
	recs := s.cat.List()
	st := ReadyStatus{Workers: len(recs)}
	for _, r := range recs {
		if r.Lifecycle == catalog.Schedulable {
			st.Schedulable++
		}
	}
	st.Ready = st.Schedulable > 0 && !s.closed.Load()
	return st
}

// Stats is a snapshot of the service's counters.
type Stats struct {
	Selections, Bookings, PrefillCompleted, Frees uint64
	// UnknownReservations counts PrefillComplete, Reservations.Free and
	// Reservations.Renew calls for ids that were not booked.
	UnknownReservations uint64
	// Rejected counts failed Select and SelectAndReserve calls; Conflicts the
	// duplicate reservation ids among them.
	Rejected, Conflicts uint64
	// Retries counts decisions made again because a concurrent booking reached
	// the chosen worker first (lock-free booking, without queueing).
	Retries uint64
	// Queued counts requests that waited; QueueRejected those refused because
	// the queue was full; QueueCanceled those withdrawn by their context.
	Queued, QueueRejected, QueueCanceled uint64
	// QueueWaitTotal is the time requests spent waiting, summed.
	QueueWaitTotal int64
	// Waiting is the number of requests in admission queues now.
	Waiting int
	// ChosenOverlapBlocks and BestOverlapBlocks sum, over decisions, the device
	// overlap of the chosen worker and the best overlap any eligible worker had;
	// RequestBlocks sums the requests' blocks. Chosen/Request is the hit rate the
	// router achieved, Best/Request the hit rate it could have reached.
	ChosenOverlapBlocks, BestOverlapBlocks, RequestBlocks uint64
	// Expired counts bookings released because their lease passed, Dropped
	// those released because their worker was deleted (Workers().Delete, or a
	// reconcile that removed it): every booking is freed, expired or dropped,
	// so once nothing is in flight Bookings = Frees + Expired + Dropped.
	Expired, Dropped uint64
	// Failures counts MarkFailed calls.
	Failures uint64
	// RemoteBookings counts peers' bookings accepted by ReplicaPlane.Book. Expired,
	// Dropped and the Ledger figures count them too (Bookings, Frees and
	// PrefillCompleted do not).
	RemoteBookings uint64
	// Sessions is the number of session pins held now (all models);
	// SessionHits counts bookings that went to their session's pin,
	// SessionMoves those that moved it (the pin was not schedulable or, soft,
	// too costly); SessionsEvicted pins dropped because the table was full,
	// SessionsExpired pins that idled out.
	Sessions                                                    int
	SessionHits, SessionMoves, SessionsEvicted, SessionsExpired uint64
	// Moves counts bookings moved to the rank that served them
	// (Reservations.Move, Booking.Move).
	Moves uint64
	// WorkerRefusals counts the workers Workers().Upsert refused, by reason:
	// RefusedTooManyRanks (ErrTooManyRanks) and RefusedInvalid
	// (ErrBadRequest). Every reason is present, zero or not.
	WorkerRefusals map[string]uint64
	// Spread counts the decisions that priced the bookings peers were
	// likely making in the same instant (see Peers).
	Spread uint64
	// Held counts the requests ReplicaPlane.Hold told to wait for the
	// peers' bookings of their burst (Peers.Hold).
	Held uint64
	// Filtered counts the candidates each policy filter excluded, by the
	// filter's name (SelectionServiceBuilder.Filter), in the last
	// evaluation of each Select and SelectAndReserve (a queued request is
	// evaluated again as capacity frees); nil without filters.
	Filtered map[string]uint64
	// ClassifierRefusals counts the requests the policy's Classifier
	// refused (ErrRefused).
	ClassifierRefusals uint64
	// PolicyFullScans counts the decisions that would have been sparse but
	// took the full scan because a picker, or a filter or a cost term
	// without a scope, is set (docs/POLICY.md).
	PolicyFullScans uint64
	// Classes is each policy class's figures (Config.Classes), by name;
	// nil without classes.
	Classes map[string]ClassStats
	// DeadlineRefused counts the requests refused because their deadline
	// passed while they waited (RefusedDeadline), with or without classes.
	DeadlineRefused uint64
	// Ledger is the reservation ledger's own snapshot.
	Ledger reservation.Stats
	// Calibration is the ledger's fit of the bookings' times to first
	// token, what the predictive cost prices a rank's queue and prompt with
	// once it is Ready (reservation.Calibration).
	Calibration reservation.Calibration
}

// Stats returns the counters.
func (s *SelectionService) Stats() Stats {
	ls := s.ledger.Stats()
	waiting, sessions := 0, 0
	s.mu.RLock()
	for _, p := range s.partitions {
		p.mu.RLock()
		waiting += p.queue.Len()
		p.mu.RUnlock()
		sessions += p.sessions.len()
	}
	s.mu.RUnlock()
	return Stats{
		Selections: s.st.selections.Load(), Bookings: s.st.bookings.Load(),
		PrefillCompleted: s.st.prefillDone.Load(), Frees: s.st.frees.Load(),
		UnknownReservations: s.st.unknownIDs.Load(), Rejected: s.st.rejected.Load(), Conflicts: s.st.conflicts.Load(),
		Retries: s.st.retries.Load(),
		Queued:  s.st.queued.Load(), QueueRejected: s.st.queueRejected.Load(), QueueCanceled: s.st.queueCanceled.Load(),
		QueueWaitTotal: s.st.queueWaitNanos.Load(), Waiting: waiting,
		ChosenOverlapBlocks: s.st.chosenOverlap.Load(), BestOverlapBlocks: s.st.bestOverlap.Load(), RequestBlocks: s.st.requestBlocks.Load(),
		Expired: uint64(ls.Expired), Dropped: uint64(ls.Removed), Failures: s.st.failures.Load(),
		RemoteBookings: s.st.remoteBookings.Load(), Spread: s.st.spread.Load(), Held: s.st.held.Load(), Ledger: ls, Calibration: s.ledger.Calibration(),
		Sessions: sessions, SessionHits: s.st.sessionHits.Load(), SessionMoves: s.st.sessionMoves.Load(),
		SessionsEvicted: s.st.sessionsEvicted.Load(), SessionsExpired: s.st.sessionsExpired.Load(),
		Moves:    s.st.moves.Load(),
		Filtered: s.pol.filteredStats(), ClassifierRefusals: s.pol.refusedStats(), PolicyFullScans: s.st.policyFullScans.Load(),
		Classes: s.classes.stats(), DeadlineRefused: s.st.deadlineRefused.Load(),
		WorkerRefusals: map[string]uint64{
			RefusedTooManyRanks: s.st.refusedRanks.Load(),
			RefusedInvalid:      s.st.refusedInvalid.Load(),
		},
	}
}
