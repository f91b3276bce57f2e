package catalog

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"time"
)

// Record is a worker as the catalog holds it: the worker, its lifecycle and why
// it is not Schedulable.
//
// Records the catalog returns are deep copies: a caller may keep and mutate
// them freely. A Record is a plain value with no internal locking.
type Record struct {
	// Worker is the worker as last upserted, with Model normalised (never "").
	Worker Worker
	// Lifecycle is Schedulable, Incomplete, Draining, or (only on the record
	// Delete returns) Unschedulable.
	Lifecycle Lifecycle
	// Reasons explain a lifecycle other than Schedulable: ReasonDraining
	// first when draining, ReasonDeleted when deleted, then the missing pieces
	// in the order Requirements lists them. Nil when Schedulable.
	Reasons []Reason
	// UpdatedAt is the catalog clock at the record's last change.
	UpdatedAt time.Time
}

// Clone returns a deep copy of r.
func (r Record) Clone() Record {
	c := r
	c.Worker = r.Worker.Clone()
	c.Reasons = slices.Clone(r.Reasons)
	return c
}

// Options configure a Catalog. The zero value is valid: no KV events, no
// queueing, the default EndpointPolicy, DefaultMaxRanks, time.Now.
type Options struct {
	// Requirements decide when a worker is Schedulable. Fixed for the
	// catalog's life.
	Requirements Requirements
	// MaxRanks bounds the data-parallel ranks of all the catalog's workers
	// together (the sum of their DPSize, whatever their lifecycle): an Upsert
	// that would pass it is refused with ErrTooManyRanks. 0 means
	// DefaultMaxRanks; a negative value means no bound.
	MaxRanks int
	// Now is the clock that stamps Record.UpdatedAt. Default time.Now.
	Now func() time.Time
}

// Catalog is the set of workers one SelectionService may route to, each with
// its lifecycle.
//
// A Catalog is safe for concurrent use: reads share a read lock, writes are
// serialised, and every method works on deep copies, so nothing a caller passes
// in or gets back aliases the catalog's state. The zero value is ready to use
// and behaves like New(Options{}).
type Catalog struct {
	req      Requirements
	now      func() time.Time
	maxRanks int // Options.MaxRanks as given: 0 is DefaultMaxRanks, negative none

	mu    sync.RWMutex
	recs  map[string]*Record // id -> record; a stored record is replaced, never mutated
	ranks int                // the stored workers' ranks together (Worker.rankCount)
}

// New returns an empty catalog. Every Options value is valid.
func New(opts Options) *Catalog {
	return &Catalog{req: opts.Requirements, now: opts.Now, maxRanks: opts.MaxRanks}
}

// rankBound is the most ranks the catalog holds; -1 for no bound.
func (c *Catalog) rankBound() int {
	switch {
	case c.maxRanks == 0:
		return DefaultMaxRanks
	case c.maxRanks < 0:
		return -1
	}
	return c.maxRanks
}

func (c *Catalog) clock() time.Time {
	if c.now == nil {
		return time.Now()
	}
	return c.now()
}

// lifecycle decides the lifecycle and reasons of a stored worker.
func (c *Catalog) lifecycle(w Worker, draining bool) (Lifecycle, []Reason) {
	life, reasons := evaluate(w, c.req)
	if draining {
		return Draining, append([]Reason{ReasonDraining}, reasons...)
	}
	return life, reasons
}

// store makes rec the record of its id. The caller holds the write lock.
func (c *Catalog) store(rec *Record) {
	if c.recs == nil {
		c.recs = make(map[string]*Record)
	}
	c.recs[rec.Worker.ID] = rec
}

// Upsert adds w or replaces the record with the same ID, and returns the
// resulting record. An upsert equal to the stored worker (see Worker.Equal)
// changes nothing, not even UpdatedAt. A draining worker stays draining across
// upserts. An invalid w (see Worker.Validate) is rejected with ErrInvalidWorker,
// and one that would take the catalog's workers past Options.MaxRanks
// data-parallel ranks with ErrTooManyRanks; either leaves the catalog
// untouched. Upsert costs O(1) plus copying w.
//
// Upsert does not keep w's maps: later changes to them do not affect the
// catalog.
func (c *Catalog) Upsert(w Worker) (Record, error) {
	if err := w.Validate(); err != nil {
		return Record{}, err
	}
	nw := w.normalized()
	c.mu.Lock()
	defer c.mu.Unlock()
	old, exists := c.recs[nw.ID]
	if exists && old.Worker.Equal(nw) {
		return old.Clone(), nil
	}
	ranks := c.ranks + nw.rankCount()
	if exists {
		ranks -= old.Worker.rankCount()
	}
	if bound := c.rankBound(); bound >= 0 && ranks > bound && ranks > c.ranks {
		return Record{}, fmt.Errorf("%w: worker %q has %d ranks, and the catalog's workers would have %d, above its bound of %d",
			ErrTooManyRanks, nw.ID, nw.rankCount(), ranks, bound)
	}
	life, reasons := c.lifecycle(nw, exists && old.Lifecycle == Draining)
	rec := &Record{Worker: nw, Lifecycle: life, Reasons: reasons, UpdatedAt: c.clock()}
	c.store(rec)
	c.ranks = ranks
	return rec.Clone(), nil
}

// Delete removes the worker id. It returns the worker's final record, with
// Lifecycle Unschedulable and Reasons [ReasonDeleted]; afterwards the id is
// in no list and Get does not find it. An unknown id gives ErrNotFound.
func (c *Catalog) Delete(id string) (Record, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	old, ok := c.recs[id]
	if !ok {
		return Record{}, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	delete(c.recs, id)
	c.ranks -= old.Worker.rankCount()
	// No record left in the catalog refers to old.Worker, so the caller may
	// have it.
	return Record{Worker: old.Worker, Lifecycle: Unschedulable, Reasons: []Reason{ReasonDeleted}, UpdatedAt: c.clock()}, nil
}

// SetDraining takes the worker id out of rotation (Lifecycle Draining, with
// ReasonDraining first among its reasons) or puts it back (its lifecycle is
// evaluated afresh). Setting the state it already has changes nothing. An
// unknown id gives ErrNotFound.
func (c *Catalog) SetDraining(id string, draining bool) (Record, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	old, ok := c.recs[id]
	if !ok {
		return Record{}, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	if (old.Lifecycle == Draining) == draining {
		return old.Clone(), nil
	}
	life, reasons := c.lifecycle(old.Worker, draining)
	// A stored worker is never mutated, so the new record may share it.
	rec := &Record{Worker: old.Worker, Lifecycle: life, Reasons: reasons, UpdatedAt: c.clock()}
	c.store(rec)
	return rec.Clone(), nil
}

// Get returns a copy of the record of id.
func (c *Catalog) Get(id string) (Record, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	rec, ok := c.recs[id]
	if !ok {
		return Record{}, false
	}
	return rec.Clone(), true
}

// Ranks returns the data-parallel ranks of all the catalog's workers
// together, what Options.MaxRanks bounds.
func (c *Catalog) Ranks() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.ranks
}

// List returns copies of all records, sorted by ID.
func (c *Catalog) List() []Record {
	c.mu.RLock()
	defer c.mu.RUnlock()
	out := make([]Record, 0, len(c.recs))
	for _, r := range c.recs {
		out = append(out, r.Clone())
	}
	return sortByID(out)
}

// Schedulable returns copies of the Schedulable records of one model ("" means
// DefaultModel), sorted by ID. It walks every record and deep-copies the ones
// it returns: a call for when the set of workers changes, not for every
// request.
func (c *Catalog) Schedulable(model string) []Record {
	model = modelName(model)
	c.mu.RLock()
	defer c.mu.RUnlock()
	out := []Record{}
	for _, r := range c.recs {
		if r.Lifecycle == Schedulable && r.Worker.Model == model {
			out = append(out, r.Clone())
		}
	}
	return sortByID(out)
}

func sortByID(recs []Record) []Record {
	slices.SortFunc(recs, func(a, b Record) int { return cmp.Compare(a.Worker.ID, b.Worker.ID) })
	return recs
}
