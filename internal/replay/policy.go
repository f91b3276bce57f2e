package replay

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

// router is one policy as the simulator drives it. Calls come from the
// simulation loop only, in simulated-time order.
type router interface {
	// route picks the worker for r and returns it with the overlap (in blocks)
	// the policy believed it had there.
	route(ctx context.Context, r *simRequest) (worker, believed int, err error)
	// prefillDone is r's first output token.
	prefillDone(r *simRequest) error
	// finished is r's last output token.
	finished(r *simRequest) error
	// grew is one more block of r's output (Options.OutputGrowth).
	grew(r *simRequest) error
	// apply receives a worker's KV event (stores and removals).
	apply(worker int, ev kvindex.Event) error
	// wantsEvents reports whether apply needs to be called.
	wantsEvents() bool
	// deliver runs a replica-sync event the router scheduled (evSync).
	deliver(slot int) error
	// hold picks r's router replica and returns how long r waits there
	// before route (selection.ReplicaPlane.Hold; 0 without Options.Hold).
	hold(r *simRequest) time.Duration
	close() error
}

// baseline implements the policies that need no SelectionService.
type baseline struct {
	policy Policy
	sim    *sim
	rng    *rand.Rand
	next   int
	ties   []int
}

func (b *baseline) wantsEvents() bool              { return false }
func (b *baseline) apply(int, kvindex.Event) error { return nil }
func (b *baseline) prefillDone(*simRequest) error  { return nil }
func (b *baseline) finished(*simRequest) error     { return nil }
func (b *baseline) grew(*simRequest) error         { return nil }
func (b *baseline) close() error                   { return nil }
func (b *baseline) deliver(int) error              { return nil }
func (b *baseline) hold(*simRequest) time.Duration { return 0 }

func (b *baseline) route(_ context.Context, r *simRequest) (int, int, error) {
	ws := b.sim.workers
	switch b.policy {
	case RoundRobin:
		w := b.next
		b.next = (b.next + 1) % len(ws)
		return w, ws[w].cache.Prefix(r.keys), nil
	case Random:
		w := b.rng.IntN(len(ws))
		return w, ws[w].cache.Prefix(r.keys), nil
	case LeastLoaded:
		b.ties = b.ties[:0]
		for i, w := range ws {
			switch {
			case len(b.ties) == 0 || w.active < ws[b.ties[0]].active:
				b.ties = append(b.ties[:0], i)
			case w.active == ws[b.ties[0]].active:
				b.ties = append(b.ties, i)
			}
		}
		w := b.ties[b.rng.IntN(len(b.ties))]
		return w, ws[w].cache.Prefix(r.keys), nil
	case MaxOverlap:
		b.ties = b.ties[:0]
		best, bestActive := -1, 0
		for i, w := range ws {
			o := w.cache.Prefix(r.keys)
			switch {
			case o > best || (o == best && w.active < bestActive):
				best, bestActive = o, w.active
				b.ties = append(b.ties[:0], i)
			case o == best && w.active == bestActive:
				b.ties = append(b.ties, i)
			}
		}
		return b.ties[b.rng.IntN(len(b.ties))], best, nil
	}
	return 0, 0, fmt.Errorf("%w: policy %q is not a baseline", ErrInvalidOptions, b.policy)
}

// simClock is the service's clock: the simulation's current time.
type simClock struct {
	base time.Time
	sim  *sim
}

func (c simClock) Now() time.Time { return c.base.Add(c.sim.now) }

// kvRouter drives the real SelectionService: one per router replica
// (Options.Replicas), each with its own ledger and every engine's events.
type kvRouter struct {
	sim    *sim
	svcs   []*selection.SelectionService // svcs[i] is replica i's
	events bool
	ids    []string
	byID   map[string]int
	ranks  []catalog.WorkerRank
	ev     int64
	next   int // the replica of the next arrival

	// Replica sync: ops waiting for their delivery event, by slot.
	ops    []syncOp
	free   []int
	remote int64 // bookings delivered to peers
	grown  int64 // output blocks added

	cfg     selection.Config
	explain *Explanation // sums until result() averages them
}

// syncOp is one booking (book) or settling call a replica made, on its way to
// the other replicas.
type syncOp struct {
	from int
	book bool
	ev   selection.BookingEvent // a settling call uses ev.ID only
	how  selection.Settlement
}

// replicaLink is the BookingObserver of replica from's service: it puts each
// booking and settling call in the simulator's event queue, to reach the other
// replicas SyncDelay later in simulated time (as package replica would ship
// it, without its batching).
type replicaLink struct {
	k    *kvRouter
	from int
}

var _ selection.BookingObserver = replicaLink{}

func (l replicaLink) Booked(ev selection.BookingEvent) {
	ev.SeqHashes = slices.Clone(ev.SeqHashes) // the service's buffer
	l.k.send(syncOp{from: l.from, book: true, ev: ev})
}

func (l replicaLink) Settled(id reservation.ID, how selection.Settlement) {
	l.k.send(syncOp{from: l.from, ev: selection.BookingEvent{ID: reservation.ID(id)}, how: how})
}

func (k *kvRouter) send(op syncOp) {
	var slot int
	if n := len(k.free); n > 0 {
		slot, k.free = k.free[n-1], k.free[:n-1]
		k.ops[slot] = op
	} else {
		slot = len(k.ops)
		k.ops = append(k.ops, op)
	}
	k.sim.push(k.sim.now+k.sim.opts.SyncDelay, evSync, slot)
}

// deliver applies op slot to every replica but its origin.
func (k *kvRouter) deliver(slot int) error {
	op := k.ops[slot]
	k.ops[slot] = syncOp{}
	k.free = append(k.free, slot)
	origin := replicaName(op.from)
	for i, svc := range k.svcs {
		if i == op.from {
			continue
		}
		var err error
		if op.book {
			if err = svc.Replicas().Book(origin, op.ev); err == nil {
				k.remote++
			}
		} else {
			err = svc.Replicas().Settle(origin, op.ev.ID, op.how)
		}
		if err != nil {
			return fmt.Errorf("replay: delivering %s's booking %s to %s: %w", origin, op.ev.ID, replicaName(i), err)
		}
	}
	return nil
}

func replicaName(i int) string { return "replica-" + strconv.Itoa(i) }

func newKVRouter(ctx context.Context, s *sim, events bool) (*kvRouter, error) {
	cfg := s.opts.selectionConfig(events)
	k := &kvRouter{sim: s, events: events, byID: make(map[string]int, len(s.workers)), cfg: cfg}
	if s.opts.Explain {
		k.explain = &Explanation{}
	}
	for i := range s.workers {
		id := "worker-" + strconv.Itoa(i)
		k.ids = append(k.ids, id)
		k.byID[id] = i
		k.ranks = append(k.ranks, catalog.WorkerRank{WorkerID: id})
	}
	for r := range s.opts.Replicas {
		svc, err := k.newService(ctx, r)
		if err != nil {
			return nil, errors.Join(err, k.close())
		}
		k.svcs = append(k.svcs, svc)
	}
	return k, nil
}

// newService builds replica r's service and registers every worker.
func (k *kvRouter) newService(ctx context.Context, r int) (*selection.SelectionService, error) {
	s := k.sim
	// Replica 0 draws the stream a single router always has; each other
	// replica its own, as separate processes would.
	seed := s.opts.Seed + uint64(r)*0x9e3779b97f4a7c15 + s.opts.RouterSeed*0xbf58476d1ce4e5b9
	b := selection.NewSelectionServiceBuilder(k.cfg).
		Clock(simClock{base: time.Unix(1_700_000_000, 0), sim: s}.Now).
		Rand(rand.NewPCG(seed, s.opts.Seed^0x5851f42d4c957f2d)).
		SweepInterval(-1)
	if k.events {
		b = b.ExternalEvents()
	}
	if s.opts.Replicas > 1 && !s.opts.NoSync {
		b = b.Observe(replicaLink{k: k, from: r})
	}
	svc, err := b.Build(ctx)
	if err != nil {
		return nil, fmt.Errorf("replay: building the selection service: %w", err)
	}
	if s.opts.Replicas > 1 && !s.opts.NoSync && !s.opts.NoSpread {
		// A booking made at an instant reaches the peers SyncDelay later, in
		// an event after every arrival of that instant: the window is the
		// delay and the instant itself.
		err = svc.Replicas().SetPeers(selection.Peers{Count: s.opts.Replicas - 1, Position: r, Window: s.opts.SyncDelay + time.Nanosecond, Hold: s.opts.Hold})
		if err != nil {
			return nil, errors.Join(fmt.Errorf("replay: %w", err), svc.Close())
		}
	}
	for _, id := range k.ids {
		rec, err := svc.Workers().Upsert(catalog.Worker{
			ID: id, Endpoint: id + ":8000", DPSize: 1, BlockSize: 1, TotalKVBlocks: s.opts.CapacityBlocks,
		})
		if err == nil && rec.Lifecycle != catalog.Schedulable {
			err = fmt.Errorf("worker %s is %v", id, rec.Lifecycle)
		}
		if err != nil {
			return nil, errors.Join(fmt.Errorf("replay: adding a worker: %w", err), svc.Close())
		}
	}
	return svc, nil
}

func (k *kvRouter) wantsEvents() bool { return k.events }

func (k *kvRouter) hold(r *simRequest) time.Duration {
	// Round-robin over the replicas, as Envoy's default load balancer spreads
	// requests over the Endpoint Pickers behind it.
	r.replica, k.next = k.next, (k.next+1)%len(k.svcs)
	return k.svcs[r.replica].Replicas().Hold("")
}

func (k *kvRouter) route(ctx context.Context, r *simRequest) (int, int, error) {
	svc := k.svcs[r.replica]
	req := selection.Request{ReservationID: reservation.ID(r.id), Tokens: r.tokens, ExpectedOutputTokens: r.out}
	var scored []selection.Scored
	if k.explain != nil {
		var err error
		if scored, err = svc.PotentialLoads(ctx, req); err != nil {
			return 0, 0, fmt.Errorf("replay: scoring request %s: %w", r.id, err)
		}
	}
	res, err := svc.SelectAndReserve(ctx, req)
	if err != nil {
		return 0, 0, fmt.Errorf("replay: routing request %s: %w", r.id, err)
	}
	w, ok := k.byID[res.WorkerID]
	if !ok {
		return 0, 0, fmt.Errorf("replay: the service picked unknown worker %q", res.WorkerID)
	}
	if k.explain != nil {
		k.explainDecision(scored, res.WorkerID)
	}
	return w, res.Overlap.Device, nil
}

// explainDecision adds one decision to the explanation's sums.
func (k *kvRouter) explainDecision(scored []selection.Scored, chosenID string) {
	e := k.explain
	e.Decisions++
	var chosen, best *selection.Scored
	for i := range scored {
		c := &scored[i]
		if c.WorkerID == chosenID {
			chosen = c
		}
		if best == nil || c.Overlap.Device > best.Overlap.Device ||
			(c.Overlap.Device == best.Overlap.Device && c.Cost < best.Cost) {
			best = c
		}
	}
	if chosen == nil || best == nil || chosen.Overlap.Device >= best.Overlap.Device {
		return
	}
	e.Missed++
	e.MissedBlocks += int64(best.Overlap.Device - chosen.Overlap.Device)
	scale, reqW := k.cfg.PrefillLoadScale, k.cfg.DecodeActiveRequestWeight
	newBlocks := func(s *selection.Scored) int { return s.PotentialDecodeBlock - s.ActiveBlocks }
	active := float64(chosen.ActiveBlocks - best.ActiveBlocks)
	fresh := float64(newBlocks(chosen) - newBlocks(best))
	reqs := reqW * float64(chosen.ActiveRequests-best.ActiveRequests)
	// The prefill term is scale * max(0, prefill/bs - credit): split its
	// difference into the part the active prefill load explains and the rest,
	// what the overlap credit (clamped at zero, as in the cost) was worth.
	prefillTerm := chosen.Cost - best.Cost - active - fresh - reqs
	load := 0.0
	if k.cfg.TrackPrefillTokens {
		load = scale * float64(chosen.ActivePrefillTokens-best.ActivePrefillTokens) / float64(k.cfg.BlockSize)
	}
	e.PrefillLoad += load
	e.OverlapCredit += prefillTerm - load
	e.ActiveBlocks += active
	e.NewBlocks += fresh
	e.ActiveRequests += reqs
}

func (k *kvRouter) prefillDone(r *simRequest) error {
	return k.svcs[r.replica].Reservations().PrefillComplete(reservation.ID(r.id))
}
func (k *kvRouter) finished(r *simRequest) error {
	return k.svcs[r.replica].Reservations().Free(reservation.ID(r.id))
}
func (k *kvRouter) grew(r *simRequest) error {
	k.grown++
	return k.svcs[r.replica].Reservations().AddOutputBlocks(reservation.ID(r.id), 1)
}

// apply gives a worker's event to every replica: each subscribes to every
// engine.
func (k *kvRouter) apply(worker int, ev kvindex.Event) error {
	k.ev++
	for _, svc := range k.svcs {
		if err := svc.Events().Apply(k.ranks[worker], ev); err != nil {
			return fmt.Errorf("replay: applying a %v event of %s: %w", ev.Kind, k.ids[worker], err)
		}
	}
	return nil
}

func (k *kvRouter) close() error {
	var errs []error
	for _, svc := range k.svcs {
		errs = append(errs, svc.Close())
	}
	return errors.Join(errs...)
}
