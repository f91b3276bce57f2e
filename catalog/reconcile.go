package catalog

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Plan is the set of writes that turns a catalog's current records into a
// desired set of workers. A Plan is a plain value; Reconcile fills every slice
// sorted by ID.
type Plan struct {
	// Upserts are the desired workers that are new or differ from their
	// current record (Worker.Equal). Deep copies, models normalised.
	Upserts []Worker
	// Deletes are the ids of current records no longer desired.
	Deletes []string
	// Invalid are the desired workers that failed Validate. They are neither
	// upserted nor deleted: a current record with the same id stays as it is
	// until a valid version arrives or the id leaves the desired set.
	Invalid []Invalid
}

// Invalid is a desired worker that Reconcile left out, and why.
type Invalid struct {
	ID  string // may be empty: an empty id is one of the problems
	Err error  // wraps ErrInvalidWorker
}

// Empty reports whether the plan writes nothing (Invalid entries aside).
func (p Plan) Empty() bool { return len(p.Upserts) == 0 && len(p.Deletes) == 0 }

// String summarises the plan for logs: "upserts=2 deletes=1 invalid=0".
func (p Plan) String() string {
	return fmt.Sprintf("upserts=%d deletes=%d invalid=%d", len(p.Upserts), len(p.Deletes), len(p.Invalid))
}

// prepared is a desired set checked for duplicates and validated.
type prepared struct {
	valid   []Worker // the caller's workers (maps shared), sorted by ID
	invalid []Invalid
	ids     map[string]struct{} // every non-empty desired id, valid or not
}

func prepare(desired []Worker) (prepared, error) {
	p := prepared{ids: make(map[string]struct{}, len(desired))}
	var dups []string
	for _, w := range desired {
		if w.ID == "" {
			continue
		}
		if _, seen := p.ids[w.ID]; seen {
			dups = append(dups, w.ID)
			continue
		}
		p.ids[w.ID] = struct{}{}
	}
	if len(dups) > 0 {
		slices.Sort(dups)
		dups = slices.Compact(dups)
		return prepared{}, fmt.Errorf("%w: %s", ErrDuplicateID, quoteAll(dups))
	}
	for _, w := range desired {
		if err := w.Validate(); err != nil {
			p.invalid = append(p.invalid, Invalid{ID: w.ID, Err: err})
			continue
		}
		p.valid = append(p.valid, w)
	}
	slices.SortFunc(p.valid, func(a, b Worker) int { return cmp.Compare(a.ID, b.ID) })
	slices.SortStableFunc(p.invalid, func(a, b Invalid) int { return cmp.Compare(a.ID, b.ID) })
	return p, nil
}

func quoteAll(ids []string) string {
	q := make([]string, len(ids))
	for i, id := range ids {
		q[i] = fmt.Sprintf("%q", id)
	}
	return strings.Join(q, ", ")
}

// diff plans the writes against the current workers (by id). The upserts are
// normalised deep copies.
func (p prepared) diff(current map[string]*Record) Plan {
	plan := Plan{Invalid: p.invalid}
	for _, w := range p.valid {
		if cur, ok := current[w.ID]; !ok || !cur.Worker.Equal(w) {
			plan.Upserts = append(plan.Upserts, w.normalized())
		}
	}
	for id := range current {
		if _, ok := p.ids[id]; !ok {
			plan.Deletes = append(plan.Deletes, id)
		}
	}
	slices.Sort(plan.Deletes)
	return plan
}

// Reconcile plans the writes that turn current into desired: upsert every
// desired worker that is new or differs from its current record, delete every
// current id that is not desired.
//
// A desired set that names an id twice is rejected up front with
// ErrDuplicateID listing the ids, and nothing is planned. A desired worker that
// fails Validate goes to Plan.Invalid instead of failing the whole set, so one
// malformed pod never stops the others from being served; its current record,
// if any, is neither updated nor deleted.
//
// current is normally Catalog.List(). Records with Lifecycle Unschedulable
// (the ones Delete returns) are ignored: they are no longer in a catalog. If
// an id appears twice in current, the later record counts. Reconcile copies
// what it keeps; it never mutates its arguments.
func Reconcile(current []Record, desired []Worker) (Plan, error) {
	p, err := prepare(desired)
	if err != nil {
		return Plan{}, err
	}
	cur := make(map[string]*Record, len(current))
	for i := range current {
		if current[i].Lifecycle != Unschedulable {
			cur[current[i].Worker.ID] = &current[i]
		}
	}
	return p.diff(cur), nil
}

// Apply carries out a plan: first its deletes, then its upserts, all under one
// hold of the lock, so readers see the catalog before or after the whole plan.
// Deleting an id that is already gone counts as done. Upserts that fail
// Validate are skipped and reported in the error (wrapping ErrInvalidWorker);
// the rest of the plan is still applied. Plan.Invalid is ignored.
//
// It returns the records the plan touched, in that order: the final record of
// each deleted worker (Lifecycle Unschedulable) and the record of each upsert,
// whether it changed or not. OnChange is called for every change.
func (c *Catalog) Apply(plan Plan) ([]Record, error) {
	ups := make([]Worker, 0, len(plan.Upserts))
	var errs []error
	for _, w := range plan.Upserts {
		if err := w.Validate(); err != nil {
			errs = append(errs, err)
			continue
		}
		ups = append(ups, w.normalized())
	}
	out := make([]Record, 0, len(plan.Deletes)+len(ups))
	var b batch
	c.mu.Lock()
	for _, id := range plan.Deletes {
		if rec, _, ok := c.deleteLocked(&b, id); ok {
			out = append(out, rec)
		}
	}
	for _, w := range ups {
		rec, _ := c.upsertLocked(&b, w)
		out = append(out, rec.Clone())
	}
	c.unlockAndNotify(&b)
	return out, errors.Join(errs...)
}

// Sync reconciles the catalog to desired and applies the plan, atomically: the
// plan is computed and carried out under one hold of the lock, so no
// concurrent write slips in between. It returns the plan it applied (see
// Reconcile for duplicate and invalid workers; on ErrDuplicateID nothing
// changes). This is the call a discovery loop makes on every change.
func (c *Catalog) Sync(desired []Worker) (Plan, error) {
	p, err := prepare(desired)
	if err != nil {
		return Plan{}, err
	}
	var b batch
	c.mu.Lock()
	plan := p.diff(c.recs)
	for _, id := range plan.Deletes {
		c.deleteLocked(&b, id)
	}
	for _, w := range plan.Upserts {
		c.upsertLocked(&b, w)
	}
	// Callers get their own copies: the catalog now owns the upserted workers.
	for i := range plan.Upserts {
		plan.Upserts[i] = plan.Upserts[i].Clone()
	}
	c.unlockAndNotify(&b)
	return plan, nil
}
