package replay

import (
	"cmp"
	"container/heap"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"github.com/kvselect/kvselect/internal/enginemodel"
	"github.com/kvselect/kvselect/internal/trace"
	"github.com/kvselect/kvselect/kvindex"
)

// Result is what one policy achieved on one trace.
type Result struct {
	Policy   Policy
	Requests int
	// Blocks is the number of prompt blocks; HitBlocks those found in the
	// serving worker's cache when its prefill started.
	Blocks, HitBlocks int64
	// HitRate is HitBlocks / Blocks (block-weighted).
	HitRate float64
	// ReachableHitRate is the hit rate of one infinite cache shared by all
	// workers: the best any policy could do (trace.Summary.ReachableHitRate).
	ReachableHitRate float64
	// BelievedHitRate is the overlap the policy believed the chosen worker had
	// when it routed, over Blocks (for kvselect: the index's answer).
	BelievedHitRate float64
	// PerWorker counts the requests routed to each worker; Imbalance is their
	// max / mean.
	PerWorker []int
	Imbalance float64
	// TTFT is arrival to the end of prefill (queueing at the worker included).
	TTFTMean, TTFTP50, TTFTP90, TTFTP99 time.Duration
	// Makespan is the first arrival to the last completion, in simulated time.
	Makespan time.Duration
	// StoredBlocks and EvictedBlocks count cache changes over all workers;
	// Events the KV events the engines sent to the router (kvselect only; each
	// replica receives every one).
	StoredBlocks, EvictedBlocks, Events int64
	// Replicas is the number of router replicas (Options.Replicas for the
	// kvselect policies, 1 for the others); RemoteBookings counts the
	// bookings delivered from one replica to another (0 with NoSync).
	Replicas       int
	RemoteBookings int64
	// OutputBlocks counts the output blocks the bookings grew by
	// (Options.OutputGrowth).
	OutputBlocks int64
	// Wall is the real time the replay took (Options.Now).
	Wall time.Duration
	// Decision is the distribution of the real time (Options.Now) each
	// routing decision took: for kvselect, one SelectAndReserve (with
	// Options.Explain, the scoring it asks for besides).
	Decision DecisionTimes
	// Explain is set for the kvselect policies when Options.Explain is.
	Explain *Explanation
}

// DecisionTimes is a distribution of decision times (nearest-rank
// percentiles).
type DecisionTimes struct {
	P50, P90, P99, Max time.Duration
}

// Explanation breaks down the kvselect decisions that gave up cache hits: those
// whose chosen worker had a shorter cached prefix (device overlap, as the router
// saw it) than the best worker. For each, it compares the chosen worker with the
// cheapest of the workers that had the longest prefix, term by term of the cost
// (see package selection), each term weighted as in the cost and in blocks:
//
//	cost = scale*(active prefill + prompt - credit*overlap) + active blocks + new blocks
//	     + request weight*active requests
//
// The fields are means over the missed decisions of chosen minus best; their sum
// is <= 0 (the chosen worker was cheaper). The most negative term is the one that
// pulled requests away from their cached prefix; OverlapCredit is the price
// the chosen worker paid for its shorter prefix, net of the credit for the
// prefix blocks in-flight requests were computing on it
// (selection.Config.InFlightHitWeight), which can make it negative: the
// chosen worker was about to hold the prefix.
type Explanation struct {
	Decisions, Missed int
	// MissedBlocks sums best minus chosen overlap over the missed decisions.
	MissedBlocks int64
	// Term deltas, chosen minus best, averaged over the missed decisions.
	PrefillLoad, OverlapCredit, ActiveBlocks, NewBlocks, ActiveRequests float64
}

// simRequest is one request during the replay.
type simRequest struct {
	id       string
	idx      int // position in sim.reqs
	arrival  time.Duration
	in, out  int
	keys     []uint64 // dense prefix ids: cache keys and engine block hashes
	tokens   []uint32 // the same ids as router tokens (block size 1)
	worker   int
	replica  int // the router replica that booked it
	hit      int
	believed int
	ttft     time.Duration
	state    uint8
	grown    int // output blocks generated so far (DecodeHoldsKV, OutputGrowth)
}

const (
	stateNew uint8 = iota
	stateRouted
	statePrefilled
	stateDone
)

type simWorker struct {
	cache  *lruCache
	engine *enginemodel.Engine
	// wakeAt is when the worker's engine next changes, and wakeSeq the seq
	// of the queued event for it (0: none queued); older events are stale.
	wakeAt  time.Duration
	wakeSeq uint64
	active  int // routed and not finished
	routed  int
}

type evKind uint8

const (
	evArrive evKind = iota
	evEngine        // req is the worker
	evSync          // req is the router's op slot, not a request
	evRoute         // a request held (router.hold) is routed
)

type simEvent struct {
	at   time.Duration
	seq  uint64
	kind evKind
	req  int
}

type eventHeap []simEvent

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(simEvent)) }
func (h *eventHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// sim is one replay. Not safe for concurrent use; the SelectionService it drives
// is called from the replay's goroutine only.
type sim struct {
	opts      Options
	decisions []time.Duration // wall time of each route call
	policy    Policy
	reqs      []simRequest
	workers   []*simWorker
	router    router
	now       time.Duration
	events    eventHeap
	seq       uint64
	reachable float64
	evicted   []uint64
	evBuf     kvindex.Event
	engineEvs []enginemodel.Event
	stored    int64
	evictedN  int64
	lastDone  time.Duration // the last completion (replica sync may run later)
}

// Run replays reqs (in arrival order; ties keep slice order) against policy and
// returns what it achieved. ctx bounds the replay. Errors: ErrInvalidOptions,
// ErrInvalidTrace, ctx's error, and any error of the SelectionService (wrapped).
func Run(ctx context.Context, reqs []trace.Request, policy Policy, opts Options) (Result, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return Result{}, err
	}
	if _, err := ParsePolicy(string(policy)); err != nil {
		return Result{}, err
	}
	if o.Replicas > 1 && policy != KVSelect && policy != KVSelectApprox {
		return Result{}, fmt.Errorf("%w: Replicas %d: policy %q is one router (replicas apply to %s and %s)",
			ErrInvalidOptions, o.Replicas, policy, KVSelect, KVSelectApprox)
	}
	start := o.Now()
	s, err := prepare(ctx, reqs, policy, o)
	if err != nil {
		return Result{}, err
	}
	err = s.run(ctx)
	err = errors.Join(err, s.router.close())
	if err != nil {
		return Result{}, err
	}
	res := s.result()
	res.Wall = o.Now().Sub(start)
	return res, nil
}

// prepare builds the simulation and its router; the caller must close the
// router.
func prepare(ctx context.Context, reqs []trace.Request, policy Policy, o Options) (*sim, error) {
	s, err := newSim(reqs, policy, o)
	if err != nil {
		return nil, err
	}
	switch policy {
	case KVSelect, KVSelectApprox:
		s.router, err = newKVRouter(ctx, s, policy == KVSelect)
		if err != nil {
			return nil, err
		}
	default:
		s.router = &baseline{policy: policy, sim: s, rng: rand.New(rand.NewPCG(o.Seed+o.RouterSeed*0xbf58476d1ce4e5b9, o.Seed^0x2545f4914f6cdd1d))}
	}
	return s, nil
}

func newSim(reqs []trace.Request, policy Policy, o Options) (*sim, error) {
	order := make([]int, len(reqs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(reqs[a].Arrival, reqs[b].Arrival) })
	s := &sim{opts: o, policy: policy, reqs: make([]simRequest, len(reqs))}
	var tree trace.PrefixTree
	var ids []int32
	total, seen := 0, 0
	for pos, i := range order {
		r := &reqs[i]
		if err := r.Validate(o.BlockSize); err != nil {
			return nil, fmt.Errorf("%w: request %d: %w", ErrInvalidTrace, i, err)
		}
		if len(r.Blocks) == 0 {
			return nil, fmt.Errorf("%w: request %d has no prompt blocks", ErrInvalidTrace, i)
		}
		before := tree.Len()
		ids = tree.Append(ids[:0], r.Blocks)
		if tree.Len() > math.MaxUint32 {
			return nil, fmt.Errorf("%w: more than 2^32 distinct prefix blocks", ErrInvalidTrace)
		}
		total += len(r.Blocks)
		seen += len(r.Blocks) - (tree.Len() - before)
		sr := &s.reqs[pos]
		*sr = simRequest{
			id: strconv.Itoa(i), idx: pos, arrival: time.Duration(float64(r.Arrival) / o.Speedup),
			in: r.InputTokens, out: r.OutputTokens,
			keys: make([]uint64, len(ids)), tokens: make([]uint32, len(ids)),
		}
		for j, id := range ids {
			sr.keys[j], sr.tokens[j] = uint64(id), uint32(id)
		}
	}
	if total > 0 {
		s.reachable = float64(seen) / float64(total)
	}
	s.workers = make([]*simWorker, o.Workers)
	for i := range s.workers {
		wk := &simWorker{cache: newLRUCache(o.CapacityBlocks)}
		// The engine reads the worker's cache when it first schedules a
		// request, as vLLM does.
		eng, err := enginemodel.New(o.engineParams(i, func(id uint64) int {
			r := &s.reqs[id]
			r.hit = wk.cache.Prefix(r.keys)
			wk.cache.Touch(r.keys[:r.hit])
			return r.hit * o.BlockSize
		}))
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, err)
		}
		wk.engine = eng
		s.workers[i] = wk
	}
	s.events = make(eventHeap, 0, len(reqs))
	for i := range s.reqs {
		s.push(s.reqs[i].arrival, evArrive, i)
	}
	return s, nil
}

func (s *sim) push(at time.Duration, kind evKind, req int) {
	s.seq++
	heap.Push(&s.events, simEvent{at: at, seq: s.seq, kind: kind, req: req})
}

func (s *sim) run(ctx context.Context) error {
	for n := 0; s.events.Len() > 0; n++ {
		if n%1024 == 0 {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("replay: %w", err)
			}
		}
		if err := s.step(ctx); err != nil {
			return err
		}
	}
	for i := range s.reqs {
		if s.reqs[i].state != stateDone {
			return fmt.Errorf("replay: internal error: request %s never finished", s.reqs[i].id)
		}
	}
	return nil
}

// step runs the next event; the queue is not empty.
func (s *sim) step(ctx context.Context) error {
	e := heap.Pop(&s.events).(simEvent)
	s.now = e.at
	switch e.kind {
	case evArrive:
		if d := s.router.hold(&s.reqs[e.req]); d > 0 {
			s.push(s.now+d, evRoute, e.req)
			return nil
		}
		return s.arrive(ctx, e.req, &s.reqs[e.req])
	case evRoute:
		return s.arrive(ctx, e.req, &s.reqs[e.req])
	case evEngine:
		if s.workers[e.req].wakeSeq != e.seq {
			return nil // stale: the engine's next change moved
		}
		return s.advance(e.req)
	case evSync:
		return s.router.deliver(e.req)
	}
	return fmt.Errorf("replay: internal error: event kind %d", e.kind)
}

func (s *sim) arrive(ctx context.Context, idx int, r *simRequest) error {
	start := s.opts.Now()
	w, believed, err := s.router.route(ctx, r)
	s.decisions = append(s.decisions, s.opts.Now().Sub(start))
	if err != nil {
		return err
	}
	r.worker, r.believed, r.state = w, believed, stateRouted
	wk := s.workers[w]
	wk.routed++
	wk.active++
	if err := wk.engine.Add(uint64(idx), r.in, r.out, s.now); err != nil {
		return fmt.Errorf("replay: internal error: %w", err)
	}
	s.wake(w)
	return nil
}

// wake queues an event for worker w's engine's next change, unless one is
// queued for that time already.
func (s *sim) wake(w int) {
	wk := s.workers[w]
	t, ok := wk.engine.Next()
	switch {
	case !ok:
		wk.wakeSeq = 0
	case wk.wakeSeq == 0 || t != wk.wakeAt:
		s.push(t, evEngine, w)
		wk.wakeAt, wk.wakeSeq = t, s.seq
	}
}

// advance runs worker w's engine to now and acts on what it did: a request's
// first token (its blocks stored, the router told), its output blocks, its
// finish.
func (s *sim) advance(w int) error {
	wk := s.workers[w]
	wk.wakeSeq = 0
	s.engineEvs = wk.engine.Advance(s.now, s.engineEvs[:0])
	for _, ev := range s.engineEvs {
		r := &s.reqs[ev.ID]
		var err error
		switch ev.Kind {
		case enginemodel.EventFirstToken:
			err = s.prefillDone(r)
		case enginemodel.EventFinished:
			err = s.finish(r)
		}
		if err == nil && ev.Kind != enginemodel.EventFinished && (s.opts.OutputGrowth || s.opts.DecodeHoldsKV) &&
			ev.Tokens%s.opts.BlockSize == 0 && ev.Tokens < r.out {
			// One block per BlockSize tokens generated, when its last token is out.
			err = s.outputBlock(r)
		}
		if err != nil {
			return err
		}
	}
	s.wake(w)
	return nil
}

func (s *sim) prefillDone(r *simRequest) error {
	wk := s.workers[r.worker]
	r.ttft = s.now - r.arrival
	r.state = statePrefilled
	cached, added, evicted := wk.cache.Store(r.keys, s.evicted[:0])
	s.stored += int64(added)
	if err := s.evict(r.worker, evicted); err != nil {
		return err
	}
	if s.router.wantsEvents() && added > 0 {
		ev := kvindex.Event{
			Kind: kvindex.EventStored, BlockSize: 1,
			BlockHashes: r.keys[cached : cached+added], Tokens: r.tokens[cached : cached+added],
		}
		if cached > 0 {
			ev.HasParent, ev.ParentHash = true, r.keys[cached-1]
		}
		if err := s.router.apply(r.worker, ev); err != nil {
			return err
		}
	}
	if err := s.router.prefillDone(r); err != nil {
		return fmt.Errorf("replay: prefill of request %s: %w", r.id, err)
	}
	return nil
}

// outputBlock is one more block of r's output: it takes cache space
// (DecodeHoldsKV) and grows r's booking (OutputGrowth).
func (s *sim) outputBlock(r *simRequest) error {
	r.grown++
	if s.opts.DecodeHoldsKV {
		if err := s.evict(r.worker, s.workers[r.worker].cache.Reserve(1, s.evicted[:0])); err != nil {
			return err
		}
	}
	if s.opts.OutputGrowth {
		return s.router.grew(r)
	}
	return nil
}

// evict counts blocks a worker evicted and tells the router.
func (s *sim) evict(worker int, evicted []uint64) error {
	s.evicted = evicted
	s.evictedN += int64(len(evicted))
	if len(evicted) == 0 || !s.router.wantsEvents() {
		return nil
	}
	s.evBuf = kvindex.Event{Kind: kvindex.EventRemoved, BlockHashes: evicted}
	return s.router.apply(worker, s.evBuf)
}

func (s *sim) finish(r *simRequest) error {
	wk := s.workers[r.worker]
	if s.opts.DecodeHoldsKV {
		wk.cache.Reserve(-r.grown, nil) // the output is never asked for again: freed
	}
	wk.active--
	r.state = stateDone
	s.lastDone = s.now
	if err := s.router.finished(r); err != nil {
		return fmt.Errorf("replay: completion of request %s: %w", r.id, err)
	}
	return nil
}

func (s *sim) result() Result {
	res := Result{Policy: s.policy, Requests: len(s.reqs), ReachableHitRate: s.reachable,
		StoredBlocks: s.stored, EvictedBlocks: s.evictedN, Replicas: 1}
	if k, ok := s.router.(*kvRouter); ok {
		res.Events, res.Replicas, res.RemoteBookings, res.OutputBlocks = k.ev, len(k.svcs), k.remote, k.grown
		if k.explain != nil {
			e := *k.explain
			if e.Missed > 0 {
				n := float64(e.Missed)
				e.PrefillLoad, e.OverlapCredit, e.ActiveBlocks, e.NewBlocks, e.ActiveRequests =
					e.PrefillLoad/n, e.OverlapCredit/n, e.ActiveBlocks/n, e.NewBlocks/n, e.ActiveRequests/n
			}
			res.Explain = &e
		}
	}
	var believed int64
	ttfts := make([]time.Duration, 0, len(s.reqs))
	var sum time.Duration
	for i := range s.reqs {
		r := &s.reqs[i]
		res.Blocks += int64(len(r.keys))
		res.HitBlocks += int64(r.hit)
		believed += int64(r.believed)
		ttfts = append(ttfts, r.ttft)
		sum += r.ttft
	}
	if res.Blocks > 0 {
		res.HitRate = float64(res.HitBlocks) / float64(res.Blocks)
		res.BelievedHitRate = float64(believed) / float64(res.Blocks)
	}
	res.PerWorker = make([]int, len(s.workers))
	maxN := 0
	for i, w := range s.workers {
		res.PerWorker[i] = w.routed
		maxN = max(maxN, w.routed)
	}
	if len(s.reqs) > 0 {
		res.Imbalance = float64(maxN) / (float64(len(s.reqs)) / float64(len(s.workers)))
		slices.Sort(ttfts)
		res.TTFTMean = sum / time.Duration(len(ttfts))
		res.TTFTP50, res.TTFTP90, res.TTFTP99 = percentile(ttfts, 0.50), percentile(ttfts, 0.90), percentile(ttfts, 0.99)
		res.Makespan = s.lastDone - s.reqs[0].arrival
	}
	if len(s.decisions) > 0 {
		d := slices.Clone(s.decisions)
		slices.Sort(d)
		res.Decision = DecisionTimes{P50: percentile(d, 0.50), P90: percentile(d, 0.90), P99: percentile(d, 0.99), Max: d[len(d)-1]}
	}
	return res
}

// percentile is the nearest-rank percentile of sorted values.
func percentile(sorted []time.Duration, p float64) time.Duration {
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}
