package catalog

import (
	"cmp"
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

// Reconcile plans the writes that turn current into desired: upsert every
// desired worker that is new or differs from its current record, delete every
// current id that is not desired. The caller applies the plan, deletes first
// (Catalog.Delete and Upsert, or the selection service's Workers().Delete and
// Workers().Upsert, which also stop and start the workers' event feeds).
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
	ids := make(map[string]struct{}, len(desired)) // every non-empty desired id, valid or not
	var dups []string
	for _, w := range desired {
		if w.ID == "" {
			continue
		}
		if _, seen := ids[w.ID]; seen {
			dups = append(dups, w.ID)
			continue
		}
		ids[w.ID] = struct{}{}
	}
	if len(dups) > 0 {
		slices.Sort(dups)
		return Plan{}, fmt.Errorf("%w: %s", ErrDuplicateID, quoteAll(slices.Compact(dups)))
	}
	cur := make(map[string]*Worker, len(current))
	for i := range current {
		if current[i].Lifecycle != Unschedulable {
			cur[current[i].Worker.ID] = &current[i].Worker
		}
	}
	var plan Plan
	for _, w := range desired {
		if err := w.Validate(); err != nil {
			plan.Invalid = append(plan.Invalid, Invalid{ID: w.ID, Err: err})
			continue
		}
		if c, ok := cur[w.ID]; !ok || !c.Equal(w) {
			plan.Upserts = append(plan.Upserts, w.normalized())
		}
	}
	for id := range cur {
		if _, ok := ids[id]; !ok {
			plan.Deletes = append(plan.Deletes, id)
		}
	}
	slices.SortFunc(plan.Upserts, func(a, b Worker) int { return cmp.Compare(a.ID, b.ID) })
	slices.Sort(plan.Deletes)
	slices.SortStableFunc(plan.Invalid, func(a, b Invalid) int { return cmp.Compare(a.ID, b.ID) })
	return plan, nil
}

func quoteAll(ids []string) string {
	q := make([]string, len(ids))
	for i, id := range ids {
		q[i] = fmt.Sprintf("%q", id)
	}
	return strings.Join(q, ", ")
}
