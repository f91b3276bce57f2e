package selection

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/kvindex/kvevents"
	"github.com/kvselect/kvselect/reservation"
)

// SelectionService picks and books workers for requests. It is safe for concurrent
// use. Build it with SelectionServiceBuilder; Close it to stop its goroutines.
//
// Workers and requests are partitioned by model: each model has its own index,
// candidate list, admission queue and lock, so a request is only ever routed to a
// worker of its model, and models never contend with each other.
type SelectionService struct {
	cfg    Config
	base   weights
	now    func() time.Time
	logger *slog.Logger
	rec    Recorder
	tracer Tracer
	detail bool     // a Recorder or a Tracer wants Decision.Margin
	scan   scanMode // tests force the full scan or the sparse decision
	// Set by tests while no request is in flight: beforeBook runs between
	// a lock-free decision's evaluation and its booking, onQueued when a
	// request has joined an admission queue, before it first waits.
	beforeBook, onQueued func()
	obs                  BookingObserver // nil: no replication
	pol                  *policy         // the policy seams; nil: none (policy.go)
	// classes is fair admission's policy classes; nil: none (classes.go)
	classes *classSet

	cat    *catalog.Catalog
	ledger *reservation.Ledger

	// mu guards partitions and workerPart, and is held for reading while an
	// event is applied, so a deleted worker's late events cannot reach an index.
	mu         sync.RWMutex
	partitions map[string]*partition
	workerPart map[string]*partition
	seeds      *mrand.Rand
	// partOf mirrors workerPart for readers that must not take mu (the ledger's
	// hook runs on goroutines that may hold it).
	partOf sync.Map

	feed    *kvevents.Feed // nil without KV events
	handler *kvevents.IndexHandler
	gate    *cutGate // between feed and handler, for index snapshots (warm.go)
	bound   net.Addr // the bind listener's address, when BindEvents was used
	// warnedReasons holds the reason codes warnUnroutable logged.
	warnedReasons sync.Map
	// peers attributes the topics and peers of engines that dial in to the
	// bind listener: the workers by their endpoints' hosts, kept in step
	// with the catalog under mu (it has its own lock too).
	peers kvevents.Peers
	// anyPeer lets the bind listener take events from any address.
	anyPeer bool
	// rankRange is each worker's first data-parallel rank and rank count, so
	// events of ranks it does not have are refused. Guarded by mu.
	rankRange map[string][2]int

	// trust is cfg.FeedTrust with defaults; health is every event-mode rank's
	// feed state (see feedhealth.go), guarded by healthMu (taken after mu).
	trust    FeedTrust
	healthMu sync.Mutex
	health   map[catalog.WorkerRank]*rankHealth
	// healthIdx mirrors health for the index's store hook, which must not
	// take healthMu; samples maps a sampled booking's id to its parity sample.
	healthIdx sync.Map
	samples   sync.Map

	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closed    atomic.Bool
	closeOnce sync.Once

	st serviceCounters
	// routers is what the replica plane said of the other routers (Peers).
	routers peerState
}

type serviceCounters struct {
	selections, bookings, prefillDone, frees, unknownIDs, rejected, failures, remoteBookings atomic.Uint64
	queued, queueRejected, queueCanceled, conflicts, retries                                 atomic.Uint64
	chosenOverlap, bestOverlap, requestBlocks                                                atomic.Uint64
	sessionHits, sessionMoves, sessionsEvicted, sessionsExpired, moves                       atomic.Uint64
	queueWaitNanos                                                                           atomic.Int64
	spread, held, policyFullScans                                                            atomic.Uint64
	deadlineRefused                                                                          atomic.Uint64
	// refusedRanks and refusedInvalid count Workers().Upsert's refusals
	// (WorkerRefusals).
	refusedRanks, refusedInvalid atomic.Uint64
}

// newService builds the service o describes; o has every default filled in.
func newService(o *SelectionServiceBuilder) (*SelectionService, error) {
	cfg, now, logger, fo, external, bind, anyPeer := o.cfg, o.clock, o.logger, o.feedOpts, o.external, o.bindAddr, o.anyPeer
	s := &SelectionService{
		cfg: cfg, base: cfg.weights(), now: now, logger: logger, rec: o.recorder, obs: o.observer, tracer: o.tracer,
		detail:     o.tracer != nil || o.recorderSet,
		partitions: make(map[string]*partition),
		workerPart: make(map[string]*partition),
		rankRange:  make(map[string][2]int),
		seeds:      mrand.New(o.rng),
		trust:      cfg.FeedTrust.normalized(),
		health:     make(map[catalog.WorkerRank]*rankHealth),
		pol:        newPolicy(o),
		classes:    newClassSet(cfg.Classes, cfg.DefaultClass),
	}
	s.cat = catalog.New(catalog.Options{
		Requirements: catalog.Requirements{KVEvents: cfg.UseKVEvents && !external && bind == "", Queueing: cfg.QueueThreshold != nil, Endpoints: cfg.Endpoints},
		MaxRanks:     cmp.Or(cfg.MaxWorkerRanks, DefaultMaxWorkerRanks),
		Now:          now,
	})
	var err error
	s.ledger, err = reservation.New(reservation.Options{
		Now:           now,
		DefaultLease:  cfg.ActiveRequestExpiry,
		ArrivalWindow: cfg.Predictive.BalanceWindow,
		PrefillRate:   cfg.Predictive.PrefillTokensPerSecond,
		OnChange:      s.loadDropped,
		OnRaise:       s.loadRaised,
	})
	if err != nil {
		return nil, fmt.Errorf("selection: ledger: %w", err)
	}
	if cfg.UseKVEvents && !external {
		s.handler, err = kvevents.NewIndexHandler(routingApplier{s}, kvevents.HandlerOptions{BlockSize: cfg.BlockSize, Logger: logger})
		if err != nil {
			return nil, fmt.Errorf("selection: event handler: %w", err)
		}
		s.gate = newCutGate(s.handler)
		s.feed, err = kvevents.NewFeed(kvevents.FeedOptions{
			Handler: s.gate, QueueLen: fo.QueueLen,
			ReconnectMin: fo.ReconnectMin, ReconnectMax: fo.ReconnectMax, Logger: logger,
		})
		if err != nil {
			return nil, fmt.Errorf("%w: event feed: %w", ErrInvalidConfig, err)
		}
		if bind != "" {
			bc := kvevents.BindConfig{Endpoint: bind, Attribute: s.peers.Attribute, ReplayEndpoint: s.replayOf}
			if !anyPeer {
				bc.Admit, bc.Peer = s.peers.Admit, s.peers.Peer
			}
			s.anyPeer = anyPeer
			s.bound, err = s.feed.Bind(bc)
			if err != nil {
				return nil, fmt.Errorf("%w: binding the event feed at %q: %w", ErrInvalidConfig, bind, err)
			}
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	if s.feed != nil {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			_ = s.feed.Run(ctx)
		}()
	}
	if s.handler != nil && !s.trust.Off {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			t := time.NewTicker(s.trust.CheckInterval)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					s.checkFeeds(s.now())
				}
			}
		}()
	}
	if sweep := o.sweep; sweep > 0 {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			t := time.NewTicker(sweep)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					s.Reservations().Expire()
				}
			}
		}()
	}
	return s, nil
}

// Close stops the event feed and the expiry sweeper and waits for them; requests
// waiting in admission queues return ErrClosed. Later calls return ErrClosed.
// Close is idempotent and safe to call concurrently.
func (s *SelectionService) Close() error {
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		s.cancel()
		s.wg.Wait()
		s.mu.RLock()
		for _, p := range s.partitions {
			p.signal()
		}
		s.mu.RUnlock()
	})
	return nil
}

// routingApplier sends each event to the index of its worker's partition. Events of
// unknown workers (deleted, or never added) are refused.
type routingApplier struct{ s *SelectionService }

var errUnroutable = errors.New("selection: event for a worker not in the catalog")

func (r routingApplier) Apply(w catalog.WorkerRank, ev kvindex.Event) error {
	r.s.mu.RLock()
	defer r.s.mu.RUnlock()
	p := r.s.workerPart[w.WorkerID]
	if p == nil || p.index == nil {
		return errUnroutable
	}
	if !r.s.rankKnownLocked(w) {
		rr := r.s.rankRange[w.WorkerID]
		return fmt.Errorf("%w: rank %d of worker %q (ranks %d..%d)", kvevents.ErrUnknownRank, w.Rank, w.WorkerID, rr[0], rr[0]+rr[1]-1)
	}
	if err := p.index.Apply(w, ev); err != nil {
		return err
	}
	switch {
	case ev.Kind == kvindex.EventCleared:
		p.resetPressure(w)
	case ev.Tier != kvindex.TierDevice:
	case ev.Kind == kvindex.EventStored:
		p.pressureOf(w).event(len(ev.BlockHashes), 0)
	case ev.Kind == kvindex.EventRemoved:
		p.pressureOf(w).event(0, len(ev.BlockHashes))
	}
	return nil
}

// rankLimitFactor times a worker's declared KV capacity is the most blocks one
// of its ranks may hold per tier in the index (kvindex.SetRankLimit); it
// leaves room for removals that lag behind stores.
const rankLimitFactor = 4

// Apply applies one KV event of a worker rank to its model's index, for
// services built with ExternalEvents (it works with the built-in feed too, but
// then competes with it). Events of workers not in the catalog are refused
// (ErrNotFound); the index's own errors (kvindex.ErrUnknownParent, ...) are
// returned as they are. Without KV events it returns ErrBadRequest.
func (view EventPlane) Apply(w catalog.WorkerRank, ev kvindex.Event) error {
	s := view.s
	if !s.cfg.UseKVEvents {
		return fmt.Errorf("%w: KV events are off (approximate mode)", ErrBadRequest)
	}
	err := routingApplier{s}.Apply(w, ev)
	if errors.Is(err, errUnroutable) {
		return fmt.Errorf("%w: worker %q", ErrNotFound, w.WorkerID)
	}
	return err
}

func (r routingApplier) ClearRank(w catalog.WorkerRank) {
	r.s.mu.RLock()
	defer r.s.mu.RUnlock()
	if p := r.s.workerPart[w.WorkerID]; p != nil && p.index != nil {
		p.index.ClearRank(w)
		p.resetPressure(w)
	}
}

func modelOf(m string) string {
	if m == "" {
		return catalog.DefaultModel
	}
	return m
}

// partitionLocked returns the partition of model, creating it. s.mu is held.
func (s *SelectionService) partitionLocked(model string) *partition {
	if p := s.partitions[model]; p != nil {
		return p
	}
	p := &partition{
		model:   model,
		rng:     lockedRand{r: mrand.New(mrand.NewPCG(s.seeds.Uint64(), s.seeds.Uint64()))},
		changed: make(chan struct{}),
		epoch:   s.now(),
		ledger:  s.ledger,
	}
	if s.cfg.QueueThreshold == nil { // the sparse decision's order (sparse.go)
		p.newOrder = func() *costOrder { return newCostOrder(s.base, s.cfg.BlockSize) }
	}
	p.sessions = newSessionTable(s.cfg.Sessions, &s.st)
	if s.cfg.UseKVEvents {
		opts := kvindex.Options{BlockSize: s.cfg.BlockSize}
		if s.healthOn() {
			opts.OnStored = s.storedHook
		}
		p.index, _ = kvindex.New(opts)
		p.prefix = p.index
		if s.healthOn() {
			p.fallback, _ = kvindex.NewApprox(kvindex.ApproxOptions{TTL: s.cfg.RouterTTL, MaxBlocks: s.cfg.ApproxMaxBlocks, Now: s.now})
		}
	} else {
		p.approx, _ = kvindex.NewApprox(kvindex.ApproxOptions{TTL: s.cfg.RouterTTL, MaxBlocks: s.cfg.ApproxMaxBlocks, Now: s.now})
		p.prefix = p.approx
	}
	s.partitions[model] = p
	return p
}

// Upsert adds or replaces a worker. A nil error does not make it
// routable: the returned record says whether it is schedulable
// (Record.Lifecycle) and, if not, why (Record.Reasons: an event endpoint, a DP
// size, an endpoint the policy refuses...), and while a model has no
// schedulable worker its requests fail with an ErrNotReady that names the
// workers and their reasons. A BlockSize of 0 means the service's. With KV events on, it starts the event sources of
// the worker's ranks, and restarts (and clears) only those whose endpoints changed.
// A worker whose model changed moves to the new model's partition with a clean
// slate.
//
// Upsert costs O(1) amortised (plus the worker's ranks, and its event
// sources): it records the change, and the model's next decision rebuilds
// the model's candidates once for every change made since, so registering n
// workers one by one costs O(n) and one O(n log n) rebuild, not n of them. A
// change that takes ranks away (a worker no longer schedulable, or its
// endpoint, ranks or capacity changed) waits, before it returns, for the
// bookings in flight that may have read the old candidates: none lands on a
// rank it removed afterwards.
//
// Errors: ErrBadRequest (wrapping the catalog's validation error, or a block
// size that is not a multiple of the service's), ErrTooManyRanks (the worker
// would take the service past Config.MaxWorkerRanks data-parallel ranks; it
// wraps catalog.ErrTooManyRanks), ErrClosed. A refused worker changes
// nothing, and WorkerRefusals counts it.
func (view Workers) Upsert(w catalog.Worker) (catalog.Record, error) {
	s := view.s
	rec, err := s.upsertWorker(w)
	if err == nil && rec.Lifecycle == catalog.Incomplete {
		s.warnUnroutable(rec)
	}
	return rec, err
}

// warnUnroutable logs, at WARN, a worker registered without what it needs
// to be routed, once per reason code for the service's life: the first
// worker of a misconfigured fleet is named, the rest are in Workers and in
// the errors of the requests to their model.
func (s *SelectionService) warnUnroutable(rec catalog.Record) {
	for _, r := range rec.Reasons {
		code, _, _ := strings.Cut(string(r), ":")
		if _, seen := s.warnedReasons.LoadOrStore(code, struct{}{}); seen {
			continue
		}
		s.logger.Warn("worker registered but not routable (logged once per reason; Record.Reasons says it for each worker)",
			"worker", rec.Worker.ID, "model", rec.Worker.Model, "reason", code, "reasons", fmt.Sprint(rec.Reasons))
	}
}

func (s *SelectionService) upsertWorker(w catalog.Worker) (catalog.Record, error) {
	if s.closed.Load() {
		return catalog.Record{}, ErrClosed
	}
	w.Model = modelOf(w.Model)
	if w.BlockSize == 0 {
		w.BlockSize = s.cfg.BlockSize
	}
	if w.BlockSize > 0 && w.BlockSize%s.cfg.BlockSize != 0 {
		s.st.refusedInvalid.Add(1)
		return catalog.Record{}, fmt.Errorf("%w: worker %q block size %d is not a multiple of the router block size %d", ErrBadRequest, w.ID, w.BlockSize, s.cfg.BlockSize)
	}
	s.mu.Lock()
	prevRec, hadPrev := s.cat.Get(w.ID)
	rec, err := s.cat.Upsert(w)
	if err != nil {
		s.mu.Unlock()
		if errors.Is(err, catalog.ErrTooManyRanks) {
			s.st.refusedRanks.Add(1)
			return catalog.Record{}, fmt.Errorf("%w: %w", ErrTooManyRanks, err)
		}
		s.st.refusedInvalid.Add(1)
		return catalog.Record{}, fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	var oldP *partition
	if hadPrev {
		oldP = s.workerPart[w.ID]
	}
	p := s.partitionLocked(w.Model)
	var stale []catalog.WorkerRank // event sources to stop
	var clearRanks []catalog.WorkerRank
	if oldP != nil && oldP != p {
		// Model changed: drop everything the old partition knew.
		s.forgetWorkerLocked(oldP, w.ID)
		stale = append(stale, ranksOf(prevRec.Worker)...)
	} else if hadPrev {
		oldSrc := sourcesOf(prevRec.Worker)
		newSrc := sourcesOf(w)
		for wr, oc := range oldSrc {
			if nc, ok := newSrc[wr]; !ok || nc != oc {
				stale = append(stale, wr)
				clearRanks = append(clearRanks, wr)
			}
		}
		if s.bound != nil && prevRec.Worker.Endpoint != w.Endpoint {
			// Another address is another engine: what the old one published
			// (and the listener's attribution of its topic) is dropped.
			for _, wr := range ranksOf(prevRec.Worker) {
				if _, dialed := oldSrc[wr]; !dialed {
					stale = append(stale, wr)
					clearRanks = append(clearRanks, wr)
				}
			}
		}
	}
	for _, wr := range clearRanks {
		if p.index != nil {
			p.index.ClearRank(wr)
		}
	}
	s.workerPart[w.ID] = p
	s.partOf.Store(w.ID, p)
	s.rankRange[w.ID] = [2]int{w.DPStart, min(max(w.DPSize, 0), catalog.MaxDPSize)}
	if p.index != nil {
		p.index.SetRankLimit(w.ID, rankLimitFactor*w.TotalKVBlocks)
	}
	if s.bound != nil { // the bind listener attributes topics by host
		s.peers.Add(w.ID, w.Endpoint)
	}
	if hadPrev && oldP == p && s.healthOn() && !ranksWithin(prevRec.Worker, w) {
		// Feed states exist only for ranks the worker had (and only with
		// feed checks): forget those it no longer has.
		keep := map[catalog.WorkerRank]bool{}
		for _, wr := range ranksOf(w) {
			keep[wr] = true
		}
		s.dropHealthLocked(p, w.ID, keep)
	}
	if s.memberLocked(p, rec) {
		p.settle()
	}
	var add []kvevents.SourceConfig
	if s.feed != nil {
		for wr, c := range sourcesOf(w) {
			add = append(add, kvevents.SourceConfig{Worker: wr, Endpoint: c.endpoint, ReplayEndpoint: c.replay})
		}
	}
	s.mu.Unlock()

	// Outside s.mu: stopping a source waits for its handler calls, which take
	// s.mu for reading.
	if s.feed != nil {
		for _, wr := range stale {
			_ = s.feed.RemoveSource(wr)
			s.handler.Forget(wr)
		}
		for _, c := range add {
			if err := s.feed.AddSource(c); err != nil && !errors.Is(err, kvevents.ErrFeedStopped) {
				s.logger.Warn("kv event source not started", "worker", c.Worker.String(), "err", err)
			}
		}
	}
	// Only a queued request waits for a worker to join.
	p.signalIfWaiting()
	if oldP != nil && oldP != p {
		oldP.signalIfWaiting()
	}
	return rec, nil
}

// healthOn reports whether feeds are judged: the built-in event feed runs and
// FeedTrust is not Off.
func (s *SelectionService) healthOn() bool { return s.handler != nil && !s.trust.Off }

// memberLocked makes p's members agree with rec, the worker's record in the
// catalog: a member when it is Schedulable, none otherwise; the feed states
// of a member's ranks are resolved (created) here. It reports whether the
// change may take ranks away from p's snapshot, which the caller settles
// (partition.settle) before it reports the change done. s.mu is held for
// writing.
func (s *SelectionService) memberLocked(p *partition, rec catalog.Record) bool {
	w := rec.Worker
	if rec.Lifecycle != catalog.Schedulable {
		return p.dropMember(w.ID)
	}
	m := &member{id: w.ID, endpoint: w.Endpoint, blockSize: w.BlockSize, maxBatched: w.MaxNumBatchedTokens,
		dpStart: w.DPStart, ranks: len(w.Ranks()), labels: w.Labels}
	if s.healthOn() {
		m.health = make([]*rankHealth, m.ranks)
		for i := range m.health {
			m.health[i] = s.healthFor(catalog.WorkerRank{WorkerID: w.ID, Rank: w.DPStart + i})
		}
	}
	return p.setMember(m)
}

// The reasons Stats.WorkerRefusals counts, fit for a metric label.
const (
	// RefusedTooManyRanks: the worker would have taken the service past
	// Config.MaxWorkerRanks (ErrTooManyRanks).
	RefusedTooManyRanks = "too_many_ranks"
	// RefusedInvalid: the worker failed validation, or its block size is not
	// a multiple of the service's (ErrBadRequest).
	RefusedInvalid = "invalid"
)

// forgetWorkerLocked removes a worker's index state, bookings and candidacy from
// p. s.mu is held.
func (s *SelectionService) forgetWorkerLocked(p *partition, id string) {
	p.prefix.RemoveWorker(id)
	if p.fallback != nil {
		p.fallback.RemoveWorker(id)
	}
	s.dropHealthLocked(p, id, nil)
	p.unEject(id)
	p.pressure.Range(func(k, _ any) bool {
		if k.(catalog.WorkerRank).WorkerID == id {
			p.pressure.Delete(k)
		}
		return true
	})
	delete(s.workerPart, id)
	delete(s.rankRange, id)
	s.partOf.Delete(id)
	// Settle before clearing the ledger: settle waits for lock-free bookings
	// in flight, and none can pass its re-check afterwards, so no booking on
	// this worker outlives RemoveWorker. (A worker that was no member was
	// settled when it stopped being one.)
	if p.dropMember(id) {
		p.settle()
	}
	if s.ledger.RemoveWorker(id) > 0 {
		s.classes.prune(s.ledger)
	}
}

// Delete removes a worker: nothing routes to it any more, its event sources
// stop, and its index blocks and active load are dropped (its bookings are freed).
// The returned record is the final one (Unschedulable, deleted). Unknown id:
// ErrNotFound.
func (view Workers) Delete(id string) (catalog.Record, error) {
	s := view.s
	s.mu.Lock()
	rec, err := s.cat.Delete(id)
	if err != nil {
		s.mu.Unlock()
		return catalog.Record{}, fmt.Errorf("%w: worker %q: %w", ErrNotFound, id, err)
	}
	p := s.workerPart[id]
	if s.bound != nil {
		s.peers.Remove(rec.Worker.ID)
	}
	if p != nil {
		s.forgetWorkerLocked(p, id)
	}
	s.mu.Unlock()
	if s.feed != nil {
		for _, wr := range ranksOf(rec.Worker) {
			_ = s.feed.RemoveSource(wr)
			s.handler.Forget(wr)
		}
		// A batch applied between the catalog delete and the source stop was
		// refused by the routing applier, so nothing of the worker is left.
	}
	if p != nil {
		p.signalIfWaiting()
	}
	return rec, nil
}

// MarkFailed reports that a request to worker id failed in a way that says the
// worker is unwell: its connection was refused or reset, or it answered with a
// server error. The worker is taken out of the picks for
// Config.FailureEjection (unless every eligible worker of a request is
// ejected: then ejection yields, as an Envoy outlier detector does at its
// panic threshold), and the service forgets the prefixes it routed to it
// (approximate mode, and ranks routed on their own bookings), so that
// affinity does not pull requests back to it afterwards. Its bookings in
// flight stay until they are freed. Unknown id: ErrNotFound.
func (view Workers) MarkFailed(id string) error {
	s := view.s
	s.mu.RLock()
	p := s.workerPart[id]
	s.mu.RUnlock()
	if p == nil {
		return fmt.Errorf("%w: worker %q", ErrNotFound, id)
	}
	if p.approx != nil {
		p.approx.RemoveWorker(id)
	}
	if p.fallback != nil {
		p.fallback.RemoveWorker(id)
	}
	p.eject(id, s.now().Add(s.cfg.FailureEjection))
	s.st.failures.Add(1)
	return nil
}

// SetDraining takes worker id out of the picks (draining: true) or puts it
// back (false), as a gateway does before it stops a worker; its bookings in
// flight stay until they are freed, and a later Upsert keeps it
// draining. The returned record is the new one (Lifecycle Draining, or
// whatever the worker then is). Unknown id: ErrNotFound.
func (view Workers) SetDraining(id string, draining bool) (catalog.Record, error) {
	s := view.s
	s.mu.Lock()
	rec, err := s.cat.SetDraining(id, draining)
	if err != nil {
		s.mu.Unlock()
		return catalog.Record{}, fmt.Errorf("%w: worker %q: %w", ErrNotFound, id, err)
	}
	p := s.workerPart[id]
	if p != nil && s.memberLocked(p, rec) {
		p.settle()
	}
	s.mu.Unlock()
	if p != nil {
		p.signal()
	}
	return rec, nil
}

// List returns every worker record, sorted by id.
func (view Workers) List() []catalog.Record { return view.s.cat.List() }

type sourceCfg struct{ endpoint, replay string }

// ranksWithin reports whether every data-parallel rank of old is one of w's.
func ranksWithin(old, w catalog.Worker) bool {
	n, m := len(old.Ranks()), len(w.Ranks())
	return n == 0 || (m > 0 && old.DPStart >= w.DPStart && old.DPStart+n <= w.DPStart+m)
}

func ranksOf(w catalog.Worker) []catalog.WorkerRank {
	var out []catalog.WorkerRank
	for _, r := range w.Ranks() {
		out = append(out, catalog.WorkerRank{WorkerID: w.ID, Rank: r})
	}
	return out
}

// sourcesOf returns the event endpoints of each rank. A replay endpoint is given
// per worker; rank r uses its port plus the rank's offset from DPStart, as vLLM
// offsets every data-parallel rank's ports.
func sourcesOf(w catalog.Worker) map[catalog.WorkerRank]sourceCfg {
	out := map[catalog.WorkerRank]sourceCfg{}
	for _, r := range w.Ranks() {
		ep, ok := w.EventEndpoint(r)
		if !ok || ep == "" {
			continue
		}
		out[catalog.WorkerRank{WorkerID: w.ID, Rank: r}] = sourceCfg{endpoint: ep, replay: kvevents.OffsetPort(w.ReplayEndpoint, r-w.DPStart)}
	}
	return out
}

// NewReservationID returns a fresh random id (128 bits in hex), the kind
// SelectAndReserve mints when Request.ReservationID is empty. Callers that
// must know the id before booking (a plan naming its legs, a gateway logging
// it) mint it here.
func NewReservationID() reservation.ID {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return reservation.ID(hex.EncodeToString(b[:]))
}

// replayOf returns the replay endpoint of a worker rank attributed by the bind
// listener: the worker record's, offset by the rank like its event endpoints.
func (s *SelectionService) replayOf(wr catalog.WorkerRank) (string, bool) {
	rec, ok := s.cat.Get(wr.WorkerID)
	if !ok || rec.Worker.ReplayEndpoint == "" {
		return "", false
	}
	ep := kvevents.OffsetPort(rec.Worker.ReplayEndpoint, wr.Rank-rec.Worker.DPStart)
	return ep, ep != ""
}

// BindStats returns the counters of the bound event listener
// (BindEvents); nil without one.
func (view EventPlane) BindStats() []kvevents.BindStats {
	s := view.s
	if s.feed == nil || s.bound == nil {
		return nil
	}
	return s.feed.BindStats()
}

// BindAddr returns the address of the bound event listener (BindEvents), or
// nil.
func (view EventPlane) BindAddr() net.Addr { return view.s.bound }

// EventSourceStats is one KV-event source's transport and decoding counters.
type EventSourceStats struct {
	kvevents.SourceStats
	Handler kvevents.HandlerStats
}

// Sources returns the counters of every KV-event source, sorted by worker
// rank (nil without the built-in feed).
func (view EventPlane) Sources() []EventSourceStats {
	s := view.s
	if s.feed == nil {
		return nil
	}
	src := s.feed.Stats()
	out := make([]EventSourceStats, len(src))
	for i, st := range src {
		out[i] = EventSourceStats{SourceStats: st, Handler: s.handler.Stats(st.Worker)}
	}
	slices.SortFunc(out, func(a, b EventSourceStats) int { return a.Worker.Compare(b.Worker) })
	return out
}
