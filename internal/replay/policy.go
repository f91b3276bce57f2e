package replay

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
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
	// apply receives a worker's KV event (stores and removals).
	apply(worker int, ev kvindex.Event) error
	// wantsEvents reports whether apply needs to be called.
	wantsEvents() bool
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
func (b *baseline) close() error                   { return nil }

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

// kvRouter drives the real SelectionService.
type kvRouter struct {
	svc    *selection.SelectionService
	events bool
	ids    []string
	byID   map[string]int
	ranks  []catalog.WorkerRank
	ev     int64

	cfg     selection.Config
	explain *Explanation // sums until result() averages them
}

func newKVRouter(ctx context.Context, s *sim, events bool) (*kvRouter, error) {
	cfg := s.opts.selectionConfig(events)
	b := selection.NewSelectionServiceBuilder(cfg).
		Clock(simClock{base: time.Unix(1_700_000_000, 0), sim: s}.Now).
		Rand(rand.NewPCG(s.opts.Seed, s.opts.Seed^0x5851f42d4c957f2d)).
		SweepInterval(-1)
	if events {
		b = b.ExternalEvents()
	}
	svc, err := b.Build(ctx)
	if err != nil {
		return nil, fmt.Errorf("replay: building the selection service: %w", err)
	}
	k := &kvRouter{svc: svc, events: events, byID: make(map[string]int, len(s.workers)), cfg: cfg}
	if s.opts.Explain {
		k.explain = &Explanation{}
	}
	for i := range s.workers {
		id := "worker-" + strconv.Itoa(i)
		rec, err := svc.UpsertWorker(catalog.Worker{
			ID: id, Endpoint: id + ":8000", DPSize: 1, BlockSize: 1, TotalKVBlocks: s.opts.CapacityBlocks,
		})
		if err == nil && rec.Lifecycle != catalog.Schedulable {
			err = fmt.Errorf("worker %s is %v", id, rec.Lifecycle)
		}
		if err != nil {
			return nil, errors.Join(fmt.Errorf("replay: adding a worker: %w", err), svc.Close())
		}
		k.ids = append(k.ids, id)
		k.byID[id] = i
		k.ranks = append(k.ranks, catalog.WorkerRank{Worker: id})
	}
	return k, nil
}

func (k *kvRouter) wantsEvents() bool { return k.events }

func (k *kvRouter) route(ctx context.Context, r *simRequest) (int, int, error) {
	req := selection.Request{ReservationID: r.id, Tokens: r.tokens, ExpectedOutputTokens: r.out}
	var scored []selection.Scored
	if k.explain != nil {
		var err error
		if scored, err = k.svc.PotentialLoads(ctx, req); err != nil {
			return 0, 0, fmt.Errorf("replay: scoring request %s: %w", r.id, err)
		}
	}
	res, err := k.svc.SelectAndReserve(ctx, req)
	if err != nil {
		return 0, 0, fmt.Errorf("replay: routing request %s: %w", r.id, err)
	}
	w, ok := k.byID[res.Worker]
	if !ok {
		return 0, 0, fmt.Errorf("replay: the service picked unknown worker %q", res.Worker)
	}
	if k.explain != nil {
		k.explainDecision(scored, res.Worker)
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
		if c.Worker == chosenID {
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

func (k *kvRouter) prefillDone(r *simRequest) error { return k.svc.PrefillComplete(r.id) }
func (k *kvRouter) finished(r *simRequest) error    { return k.svc.FreeReservation(r.id) }

func (k *kvRouter) apply(worker int, ev kvindex.Event) error {
	k.ev++
	if err := k.svc.ApplyEvent(k.ranks[worker], ev); err != nil {
		return fmt.Errorf("replay: applying a %v event of %s: %w", ev.Kind, k.ids[worker], err)
	}
	return nil
}

func (k *kvRouter) close() error { return k.svc.Close() }
