package roles

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
)

// RoleOptions configure RoleSelectors. The zero value is an aggregated
// topology whose Base is not valid yet: set Base (selection.DefaultConfig).
type RoleOptions struct {
	// Mode is the topology. Default ModeAggregated.
	Mode TopologyMode
	// LabelKey is the pod label carrying the worker's role in disaggregated
	// mode. "" means DefaultRoleLabel. A non-empty key must be a valid
	// Kubernetes label key in either mode.
	LabelKey string
	// Base is the configuration every role's service derives from (the
	// package documentation says how). Required; it must pass Validate.
	Base selection.Config
	// Profile holds the per-role settings outside selection.Config.
	Profile ProfileOptions
	// Configure, when set, is called with each role's builder before it is
	// built: set the clock, random source, logger, recorder, sweep interval,
	// event feed or ExternalEvents there. It must not call Build.
	Configure func(Role, *selection.SelectionServiceBuilder)
	// Logger receives role-level warnings (a role with no ready worker).
	// Default: discard.
	Logger *slog.Logger
}

// RoleSelectors owns one SelectionService per role of its topology (one in
// aggregated mode, a prefill and a decode one in disaggregated mode), each built
// from its role's share of the base Config, and keeps each service's catalog
// equal to its share of the desired worker set.
//
// A RoleSelectors is safe for concurrent use. Reconcile calls are serialised by
// a mutex; Census and Service read without it (each service has its own
// locks). The services' goroutines (KV-event feed, expiry sweeper) are owned by
// the RoleSelectors: Close stops them and waits.
type RoleSelectors struct {
	mode     TopologyMode
	labelKey string
	profiles [Decode + 1]profile
	services [Decode + 1]*selection.SelectionService // nil for roles outside the mode
	logger   *slog.Logger

	mu       sync.Mutex // serialises Reconcile; guards excluded and seen
	excluded []Excluded
	seen     [Decode + 1]roleState

	closed    atomic.Bool
	closeOnce sync.Once
}

type roleState uint8

const (
	stateUnknown roleState = iota
	stateEmpty
	stateReady
)

// New validates opts, reporting every problem (wrapped ErrInvalidOptions,
// ErrInvalidLabelKey or selection.ErrInvalidConfig), and builds the services
// of every role of the mode. They start empty: call Reconcile. ctx bounds only
// the start. On error nothing is left running.
func New(ctx context.Context, opts RoleOptions) (*RoleSelectors, error) {
	var errs []error
	if !opts.Mode.valid() {
		errs = append(errs, fmt.Errorf("%w: %w: %v", ErrInvalidOptions, ErrInvalidTopologyMode, opts.Mode))
	}
	key := opts.LabelKey
	if key == "" {
		key = DefaultRoleLabel
	}
	if err := validateLabelKey(key); err != nil {
		errs = append(errs, err)
	}
	profiles, err := deriveProfiles(opts.Base, opts.Profile)
	if err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	rs := &RoleSelectors{mode: opts.Mode, labelKey: key, logger: opts.Logger}
	if rs.logger == nil {
		rs.logger = slog.New(slog.DiscardHandler)
	}
	for r, p := range profiles {
		rs.profiles[r] = p
	}
	for _, r := range opts.Mode.Roles() {
		b := selection.NewSelectionServiceBuilder(rs.profiles[r].Config)
		if opts.Configure != nil {
			opts.Configure(r, b)
		}
		svc, err := b.Build(ctx)
		if err != nil {
			_ = rs.Close()
			return nil, fmt.Errorf("roles: building the %s selector: %w", r, err)
		}
		rs.services[r] = svc
	}
	return rs, nil
}

// Service returns the SelectionService of role r, or nil when the mode has no
// such role. Calls made on it directly skip the role's Override; book through
// a PairBooker.
func (rs *RoleSelectors) Service(r Role) *selection.SelectionService {
	if !r.valid() {
		return nil
	}
	return rs.services[r]
}

// ReconcileResult reports what a Reconcile did.
type ReconcileResult struct {
	// Plans holds the catalog plan applied to each role's service (the
	// upserts, deletes and invalid workers of that role), for every role of
	// the mode.
	Plans map[Role]catalog.Plan
	// NotSchedulable holds the records of the workers this call added or
	// changed that are not schedulable, with their reasons (a pod not ready
	// yet, a missing endpoint...), in role order.
	NotSchedulable []catalog.Record
	// Excluded are the workers the split left out, with reasons.
	Excluded []Excluded
}

// Reconcile makes the role catalogs match desired: it splits desired by role
// (Split), prepares each worker for its role (a decode worker loses its KV-event
// and replay endpoints) and, for every role's service, deletes the workers no
// longer desired there and upserts the new or changed ones. All deletes, of
// every role, run before any upsert, so a worker whose label flipped leaves its
// old catalog before it joins the new one: it is never in both, and is in
// neither only for that instant. Excluded workers are in no catalog (a worker
// that becomes excluded is deleted). Deleting a worker frees its bookings on
// that service.
//
// A desired set naming one id twice is refused before anything changes
// (ErrDuplicateID). Workers that fail catalog validation are reported in their
// role's Plan.Invalid and left as they were, as catalog.Reconcile does. Upserts
// the service refuses are reported in the joined error, the rest still applied.
// After Close: ErrClosed.
func (rs *RoleSelectors) Reconcile(desired []catalog.Worker) (ReconcileResult, error) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.closed.Load() {
		return ReconcileResult{}, ErrClosed
	}
	if err := checkDuplicates(desired); err != nil {
		return ReconcileResult{}, err
	}
	split, err := Split(desired, rs.mode, rs.labelKey)
	if err != nil {
		return ReconcileResult{}, err
	}
	res := ReconcileResult{Plans: make(map[Role]catalog.Plan, 2), Excluded: split.Excluded}
	roles := rs.mode.Roles()
	for _, r := range roles {
		ws := split.ByRole[r]
		prepared := make([]catalog.Worker, len(ws))
		for i, w := range ws {
			prepared[i] = rs.profiles[r].worker(w)
		}
		plan, err := catalog.Reconcile(rs.services[r].Workers().List(), prepared)
		if err != nil { // duplicates were refused above
			return ReconcileResult{}, fmt.Errorf("roles: planning the %s catalog: %w", r, err)
		}
		res.Plans[r] = plan
	}
	var errs []error
	for _, r := range roles {
		for _, id := range res.Plans[r].Deletes {
			if _, err := rs.services[r].Workers().Delete(id); err != nil && !errors.Is(err, selection.ErrNotFound) {
				errs = append(errs, fmt.Errorf("roles: deleting %s worker %q: %w", r, id, err))
			}
		}
	}
	for _, r := range roles {
		for _, w := range res.Plans[r].Upserts {
			rec, err := rs.services[r].Workers().Upsert(w)
			if err != nil {
				errs = append(errs, fmt.Errorf("roles: upserting %s worker %q: %w", r, w.ID, err))
				continue
			}
			if rec.Lifecycle != catalog.Schedulable {
				res.NotSchedulable = append(res.NotSchedulable, rec)
			}
		}
	}
	rs.excluded = slices.Clone(split.Excluded)
	rs.logEmptyRolesLocked()
	return res, errors.Join(errs...)
}

func checkDuplicates(desired []catalog.Worker) error {
	seen := make(map[string]struct{}, len(desired))
	var dups []string
	for _, w := range desired {
		if w.ID == "" {
			continue
		}
		if _, ok := seen[w.ID]; ok {
			dups = append(dups, w.ID)
		}
		seen[w.ID] = struct{}{}
	}
	if len(dups) == 0 {
		return nil
	}
	slices.Sort(dups)
	return fmt.Errorf("%w: %q: %w", ErrDuplicateID, slices.Compact(dups), catalog.ErrDuplicateID)
}

// logEmptyRolesLocked logs a role that has no ready worker, once per change of
// state (the first Reconcile reports a role empty from the start). rs.mu is
// held.
func (rs *RoleSelectors) logEmptyRolesLocked() {
	for _, r := range rs.mode.Roles() {
		st := stateReady
		if !rs.services[r].Ready().Ready {
			st = stateEmpty
		}
		if st == rs.seen[r] {
			continue
		}
		if st == stateEmpty {
			rs.logger.Warn("role has no ready workers", "role", r.String())
		} else if rs.seen[r] == stateEmpty {
			rs.logger.Info("role has ready workers again", "role", r.String())
		}
		rs.seen[r] = st
	}
}

// RoleCensus counts one role's catalog.
type RoleCensus struct {
	Role Role
	// Workers is the number of workers in the role's catalog; Schedulable how
	// many of them may receive requests.
	Workers, Schedulable int
}

// Census is a snapshot of every role's catalog.
type Census struct {
	Mode TopologyMode
	// Roles has one entry per role of the mode, in role order, empty roles
	// included.
	Roles []RoleCensus
	// Excluded are the workers the last Reconcile left out.
	Excluded []Excluded
}

// Census counts every role's catalog. A role that has been empty from the
// start is listed like any other, with zero counts.
func (rs *RoleSelectors) Census() Census {
	c := Census{Mode: rs.mode}
	for _, r := range rs.mode.Roles() {
		st := rs.services[r].Ready()
		c.Roles = append(c.Roles, RoleCensus{Role: r, Workers: st.Workers, Schedulable: st.Schedulable})
	}
	rs.mu.Lock()
	c.Excluded = slices.Clone(rs.excluded)
	rs.mu.Unlock()
	return c
}

func (rs *RoleSelectors) roleReady(r Role) bool {
	svc := rs.Service(r)
	return svc != nil && svc.Ready().Ready
}

// roleError names the role in a selection error, and marks a role without a
// ready worker for the model as ErrRoleCatalogEmpty.
func roleError(r Role, err error) error {
	if errors.Is(err, selection.ErrNotReady) {
		return fmt.Errorf("%w: role %s: %w", ErrRoleCatalogEmpty, r, err)
	}
	return fmt.Errorf("roles: %s: %w", r, err)
}

// Close closes every service, stopping their goroutines and waiting for them;
// requests waiting in their admission queues return selection.ErrClosed. It is
// idempotent and safe to call concurrently; later Reconciles return ErrClosed.
func (rs *RoleSelectors) Close() error {
	rs.closeOnce.Do(func() {
		rs.closed.Store(true)
		for _, svc := range rs.services {
			if svc != nil {
				_ = svc.Close()
			}
		}
	})
	return nil
}
