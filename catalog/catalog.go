package catalog

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
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
	// in Evaluate's order. Nil when Schedulable.
	Reasons []Reason
	// Version is the catalog-wide change counter at the record's last change.
	// It increases on every change to the record (and across a delete and a
	// re-add of the same id), and no two changes share a version.
	Version uint64
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

// ChangeKind says what a write did to a record.
type ChangeKind uint8

const (
	// Unchanged: the write matched the record; nothing was bumped or notified.
	Unchanged ChangeKind = iota
	// Added: the id was not in the catalog.
	Added
	// Updated: some part of the record changed; Change.Parts says which.
	Updated
	// Deleted: the record left the catalog.
	Deleted
)

// String returns "unchanged", "added", "updated" or "deleted".
func (k ChangeKind) String() string {
	switch k {
	case Unchanged:
		return "unchanged"
	case Added:
		return "added"
	case Updated:
		return "updated"
	case Deleted:
		return "deleted"
	default:
		return fmt.Sprintf("ChangeKind(%d)", uint8(k))
	}
}

// Parts is a set of the parts of a record an update touched.
type Parts uint8

const (
	// PartEndpoint: the serving Endpoint changed.
	PartEndpoint Parts = 1 << iota
	// PartEvents: something the KV-event feed depends on changed: the event
	// endpoints, the replay endpoint, the data-parallel ranks or the block
	// size. Event sources must restart and the index state may be stale.
	PartEvents
	// PartModel: the worker moved to another model partition.
	PartModel
	// PartCapacity: TotalKVBlocks or MaxNumBatchedTokens changed.
	PartCapacity
	// PartMetadata: Labels or Identity changed.
	PartMetadata
	// PartDraining: SetDraining switched draining on or off.
	PartDraining
)

var partNames = []string{"endpoint", "events", "model", "capacity", "metadata", "draining"}

// String lists the parts, "events|model"; "none" for the empty set.
func (p Parts) String() string {
	if p == 0 {
		return "none"
	}
	var names []string
	for i, name := range partNames {
		if p&(1<<i) != 0 {
			names = append(names, name)
		}
	}
	if rest := p &^ (1<<len(partNames) - 1); rest != 0 {
		names = append(names, fmt.Sprintf("0x%x", uint8(rest)))
	}
	return strings.Join(names, "|")
}

// diffParts compares two normalised workers with the same id.
func diffParts(a, b Worker) Parts {
	var p Parts
	if a.Endpoint != b.Endpoint {
		p |= PartEndpoint
	}
	if !maps.Equal(a.KVEventEndpoints, b.KVEventEndpoints) || a.ReplayEndpoint != b.ReplayEndpoint ||
		a.DPStart != b.DPStart || a.DPSize != b.DPSize || a.BlockSize != b.BlockSize {
		p |= PartEvents
	}
	if a.ModelName() != b.ModelName() {
		p |= PartModel
	}
	if a.TotalKVBlocks != b.TotalKVBlocks || a.MaxNumBatchedTokens != b.MaxNumBatchedTokens {
		p |= PartCapacity
	}
	if !maps.Equal(a.Labels, b.Labels) || a.Identity != b.Identity {
		p |= PartMetadata
	}
	return p
}

// Change describes what one write did.
type Change struct {
	Kind ChangeKind
	// Parts is the set of parts an Updated change touched; empty otherwise.
	Parts Parts
	// Before is the lifecycle before the write; zero for Added.
	Before Lifecycle
	// After is the lifecycle after the write: the returned record's.
	After Lifecycle
}

// EndpointsChanged reports an update of the serving endpoint.
func (c Change) EndpointsChanged() bool { return c.Parts&PartEndpoint != 0 }

// EventsChanged reports an update of what the KV-event feed depends on (see
// PartEvents).
func (c Change) EventsChanged() bool { return c.Parts&PartEvents != 0 }

// ModelChanged reports a move to another model partition.
func (c Change) ModelChanged() bool { return c.Parts&PartModel != 0 }

// MetadataOnly reports an update that touched only Labels or Identity, which
// routing never reads.
func (c Change) MetadataOnly() bool { return c.Kind == Updated && c.Parts == PartMetadata }

// LifecycleChanged reports a write that moved the record to another lifecycle
// (always true for Added and Deleted).
func (c Change) LifecycleChanged() bool { return c.Kind != Unchanged && c.Before != c.After }

// String renders the change for logs: "added schedulable",
// "updated(events) schedulable->incomplete", "deleted draining->unschedulable",
// "unchanged".
func (c Change) String() string {
	s := c.Kind.String()
	if c.Kind == Updated {
		s += "(" + c.Parts.String() + ")"
	}
	switch c.Kind {
	case Unchanged:
	case Added:
		s += " " + c.After.String()
	default:
		s += " " + c.Before.String() + "->" + c.After.String()
	}
	return s
}

// Options configure a Catalog. The zero value is valid: no KV events, no
// queueing, time.Now, no hook.
type Options struct {
	// Requirements decide when a worker is Schedulable (see Evaluate). Fixed for
	// the catalog's life.
	Requirements Requirements
	// Now is the clock that stamps Record.UpdatedAt. Default time.Now.
	Now func() time.Time
	// OnChange, if set, is called once for every change (never for Unchanged
	// writes), after the catalog's lock is released, with a private copy of the
	// record. Calls are serialised and arrive in Version order, also when
	// writers race. The hook may read the catalog but must not write to it
	// (the write would wait for the hook to return: a deadlock), and it delays
	// the writer that triggered it, so keep it short. Default none.
	OnChange func(Record, Change)
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
	onChange func(Record, Change)

	mu      sync.RWMutex
	recs    map[string]*Record    // id -> record; records are replaced, never mutated
	byModel map[string]*partition // model -> its records
	gen     uint64                // last Version handed out

	// Notification ordering (only with onChange): delivered is the Version of
	// the last change passed to the hook.
	nmu       sync.Mutex
	ncond     sync.Cond
	delivered uint64
}

// New returns an empty catalog. It fails with ErrInvalidOptions only for
// invalid options; none of the current fields can hold an invalid value, so
// today it always succeeds (the error keeps future fields compatible).
func New(opts Options) (*Catalog, error) {
	c := &Catalog{req: opts.Requirements, now: opts.Now, onChange: opts.OnChange}
	c.ncond.L = &c.nmu
	return c, nil
}

// Requirements returns the requirements the catalog evaluates workers against.
func (c *Catalog) Requirements() Requirements { return c.req }

func (c *Catalog) clock() time.Time {
	if c.now == nil {
		return time.Now()
	}
	return c.now()
}

func (c *Catalog) evaluate(w Worker, draining bool) (Lifecycle, []Reason) {
	life, reasons := Evaluate(w, c.req)
	if draining {
		return Draining, append([]Reason{ReasonDraining}, reasons...)
	}
	return life, reasons
}

// note is one pending OnChange call.
type note struct {
	rec Record
	ch  Change
}

// batch collects the results of writes made under one hold of the lock.
type batch struct {
	notes []note
}

func (c *Catalog) record(b *batch, rec *Record, ch Change) {
	if c.onChange != nil && ch.Kind != Unchanged {
		b.notes = append(b.notes, note{rec.Clone(), ch})
	}
}

// unlockAndNotify releases the write lock and delivers the batch's
// notifications in Version order.
func (c *Catalog) unlockAndNotify(b *batch) {
	c.mu.Unlock()
	if len(b.notes) == 0 {
		return
	}
	first, last := b.notes[0].rec.Version, b.notes[len(b.notes)-1].rec.Version
	c.nmu.Lock()
	for c.delivered != first-1 {
		c.ncond.Wait()
	}
	defer func() {
		c.delivered = last
		c.ncond.Broadcast()
		c.nmu.Unlock()
	}()
	for _, n := range b.notes {
		c.onChange(n.rec, n.ch)
	}
}

// upsertLocked stores w (valid and normalised, owned by the catalog from now
// on). The caller holds the write lock.
func (c *Catalog) upsertLocked(b *batch, w Worker) (*Record, Change) {
	if c.recs == nil {
		c.recs = make(map[string]*Record)
		c.byModel = make(map[string]*partition)
	}
	old, exists := c.recs[w.ID]
	ch := Change{Kind: Added}
	draining := false
	if exists {
		ch = Change{Kind: Updated, Parts: diffParts(old.Worker, w), Before: old.Lifecycle}
		if ch.Parts == 0 {
			return old, Change{Kind: Unchanged, Before: old.Lifecycle, After: old.Lifecycle}
		}
		draining = old.Lifecycle == Draining
		c.unindex(old)
	}
	life, reasons := c.evaluate(w, draining)
	c.gen++
	rec := &Record{Worker: w, Lifecycle: life, Reasons: reasons, Version: c.gen, UpdatedAt: c.clock()}
	ch.After = life
	c.index(rec)
	c.record(b, rec, ch)
	return rec, ch
}

// partition is one model's records, plus the Targets of its Schedulable ones
// kept sorted by ID so the hot read path copies them without sorting.
type partition struct {
	recs  map[string]*Record
	sched []Target
}

func (p *partition) setTarget(rec *Record) {
	id := rec.Worker.ID
	i, found := slices.BinarySearchFunc(p.sched, id, func(t Target, id string) int { return cmp.Compare(t.ID, id) })
	switch {
	case rec.Lifecycle == Schedulable && found:
		p.sched[i] = targetOf(rec)
	case rec.Lifecycle == Schedulable:
		p.sched = slices.Insert(p.sched, i, targetOf(rec))
	case found:
		p.sched = slices.Delete(p.sched, i, i+1)
	}
}

// index stores rec as the record of its id, replacing any earlier record of
// the same id and model. The caller holds the write lock and has unindexed an
// earlier record in another model.
func (c *Catalog) index(rec *Record) {
	c.recs[rec.Worker.ID] = rec
	p := c.byModel[rec.Worker.Model]
	if p == nil {
		p = &partition{recs: make(map[string]*Record)}
		c.byModel[rec.Worker.Model] = p
	}
	p.recs[rec.Worker.ID] = rec
	p.setTarget(rec)
}

// unindex removes rec from its model partition (not from recs).
func (c *Catalog) unindex(rec *Record) {
	p := c.byModel[rec.Worker.Model]
	delete(p.recs, rec.Worker.ID)
	if len(p.recs) == 0 {
		delete(c.byModel, rec.Worker.Model)
		return
	}
	p.setTarget(&Record{Worker: Worker{ID: rec.Worker.ID}}) // not Schedulable: removes the target
}

// deleteLocked removes id; the returned record is no longer referenced by the
// catalog. The caller holds the write lock.
func (c *Catalog) deleteLocked(b *batch, id string) (Record, Change, bool) {
	old, ok := c.recs[id]
	if !ok {
		return Record{}, Change{}, false
	}
	delete(c.recs, id)
	c.unindex(old)
	c.gen++
	rec := Record{
		Worker:    old.Worker,
		Lifecycle: Unschedulable,
		Reasons:   []Reason{ReasonDeleted},
		Version:   c.gen,
		UpdatedAt: c.clock(),
	}
	ch := Change{Kind: Deleted, Before: old.Lifecycle, After: Unschedulable}
	c.record(b, &rec, ch)
	return rec, ch, true
}

// Upsert adds w or replaces the record with the same ID, and returns the
// resulting record and what changed. An upsert equal to the stored worker (see
// Worker.Equal) is Unchanged: no version bump, no notification. A draining
// worker stays draining across upserts. An invalid w (see Worker.Validate) is
// rejected with ErrInvalidWorker and leaves the catalog untouched.
//
// Upsert does not keep w's maps: later changes to them do not affect the
// catalog.
func (c *Catalog) Upsert(w Worker) (Record, Change, error) {
	if err := w.Validate(); err != nil {
		return Record{}, Change{}, err
	}
	nw := w.normalized()
	var b batch
	c.mu.Lock()
	rec, ch := c.upsertLocked(&b, nw)
	out := rec.Clone()
	c.unlockAndNotify(&b)
	return out, ch, nil
}

// Delete removes the worker id. It returns the worker's final record, with
// Lifecycle Unschedulable and Reasons [ReasonDeleted]; afterwards the id is
// in no list and Get does not find it. An unknown id gives ErrNotFound.
func (c *Catalog) Delete(id string) (Record, error) {
	var b batch
	c.mu.Lock()
	rec, _, ok := c.deleteLocked(&b, id)
	c.unlockAndNotify(&b)
	if !ok {
		return Record{}, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	return rec, nil
}

// SetDraining takes the worker id out of rotation (Lifecycle Draining, with
// ReasonDraining first among its reasons) or puts it back (its lifecycle is
// evaluated afresh). Setting the state it already has changes nothing. An
// unknown id gives ErrNotFound.
func (c *Catalog) SetDraining(id string, draining bool) (Record, error) {
	var b batch
	c.mu.Lock()
	old, ok := c.recs[id]
	if !ok {
		c.mu.Unlock()
		return Record{}, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	if (old.Lifecycle == Draining) == draining {
		out := old.Clone()
		c.mu.Unlock()
		return out, nil
	}
	life, reasons := c.evaluate(old.Worker, draining)
	c.gen++
	// The worker is immutable once stored, so the new record may share it.
	rec := &Record{Worker: old.Worker, Lifecycle: life, Reasons: reasons, Version: c.gen, UpdatedAt: c.clock()}
	c.index(rec)
	c.record(&b, rec, Change{Kind: Updated, Parts: PartDraining, Before: old.Lifecycle, After: life})
	out := rec.Clone()
	c.unlockAndNotify(&b)
	return out, nil
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

// List returns copies of all records, sorted by ID.
func (c *Catalog) List() []Record {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return cloneSorted(c.recs)
}

// ListModel returns copies of the records of one model partition ("" means
// DefaultModel), sorted by ID.
func (c *Catalog) ListModel(model string) []Record {
	c.mu.RLock()
	defer c.mu.RUnlock()
	p := c.byModel[Worker{Model: model}.ModelName()]
	if p == nil {
		return []Record{}
	}
	return cloneSorted(p.recs)
}

// Schedulable returns copies of the Schedulable records of one model partition
// ("" means DefaultModel), sorted by ID. Deep copies cost about a microsecond
// per record; the request path should use AppendTargets instead.
func (c *Catalog) Schedulable(model string) []Record {
	c.mu.RLock()
	defer c.mu.RUnlock()
	p := c.byModel[Worker{Model: model}.ModelName()]
	if p == nil {
		return []Record{}
	}
	out := make([]Record, len(p.sched))
	for i, t := range p.sched {
		out[i] = p.recs[t.ID].Clone()
	}
	return out
}

// Target is what the request path needs of a Schedulable worker, without the
// maps: a flat value, cheap to copy.
type Target struct {
	ID                  string
	Endpoint            string
	DPStart             int
	DPSize              int
	BlockSize           int
	TotalKVBlocks       int
	MaxNumBatchedTokens int
	// Version is the record's Version.
	Version uint64
}

func targetOf(r *Record) Target {
	w := &r.Worker
	return Target{
		ID: w.ID, Endpoint: w.Endpoint, DPStart: w.DPStart, DPSize: w.DPSize, BlockSize: w.BlockSize,
		TotalKVBlocks: w.TotalKVBlocks, MaxNumBatchedTokens: w.MaxNumBatchedTokens, Version: r.Version,
	}
}

// AppendTargets appends the Targets of the Schedulable workers of one model
// partition ("" means DefaultModel), sorted by ID, to dst and returns the
// extended slice. It is the allocation-free alternative to Schedulable for the
// request path: the catalog keeps the list sorted as it changes, so the call
// only copies it.
func (c *Catalog) AppendTargets(dst []Target, model string) []Target {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if p := c.byModel[Worker{Model: model}.ModelName()]; p != nil {
		dst = append(dst, p.sched...)
	}
	return dst
}

func cloneSorted(m map[string]*Record) []Record {
	out := make([]Record, 0, len(m))
	for _, r := range m {
		out = append(out, r.Clone())
	}
	slices.SortFunc(out, func(a, b Record) int { return cmp.Compare(a.Worker.ID, b.Worker.ID) })
	return out
}

// Models returns the model partitions that hold at least one record, sorted.
func (c *Catalog) Models() []string {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return slices.Sorted(maps.Keys(c.byModel))
}

// Len returns the number of records.
func (c *Catalog) Len() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.recs)
}

// Version returns the catalog-wide change counter: the Version of the latest
// change (0 for a catalog never changed). It grows with every change, so a
// caller can cache a List and refresh it only when Version moves.
func (c *Catalog) Version() uint64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.gen
}
