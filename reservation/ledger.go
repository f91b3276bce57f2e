package reservation

import (
	"errors"
	"fmt"
	"hash/maphash"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/catalog"
)

// DefaultLease is the lease of a booking that names none and of a ledger whose
// Options leave DefaultLease zero: 300 s, the active-request expiry Dynamo's
// router uses. A request still running when its lease ends is freed as an orphan.
const DefaultLease = 300 * time.Second

var (
	// ErrConflict reports a Book whose id is already booked.
	ErrConflict = errors.New("reservation: id already booked")
	// ErrUnknownReservation reports an id that is not booked: never booked, or
	// already freed, expired or removed with its worker. The call changed nothing.
	ErrUnknownReservation = errors.New("reservation: unknown reservation id")
	// ErrInvalid reports a Booking with a bad field. Nothing was booked.
	ErrInvalid = errors.New("reservation: invalid booking")
	// ErrInvalidOptions reports Options that fail validation.
	ErrInvalidOptions = errors.New("reservation: invalid options")
	// ErrStale reports a BookAt whose worker rank was booked after the loads it
	// was decided on were read. Nothing was booked; read again and re-decide.
	ErrStale = errors.New("reservation: worker rank booked since the loads were read")
)

// Stamp records what AppendLoads saw of one worker rank: which incarnation of
// its load entry and how many bookings that entry had received. BookAt compares
// it with the worker rank's state at booking time. The zero Stamp means the
// worker rank had never been booked when it was read. Stamps are opaque and only
// meaningful to the Ledger that issued them.
type Stamp struct {
	r *rankState
	v uint64
}

// Options configure a Ledger. The zero value means the defaults. New copies it.
type Options struct {
	// Now gives the time bookings are made and touched at; it must be safe for
	// concurrent use. Default time.Now.
	Now func() time.Time
	// DefaultLease is the lease of a booking whose Lease is zero. Default
	// DefaultLease (300 s); must not be negative.
	DefaultLease time.Duration
	// ArrivalWindow is the time constant of PrefillClock.Arrivals. Default
	// DefaultArrivalWindow (5 minutes); must not be negative.
	ArrivalWindow time.Duration
	// OnChange, when set, is called with a worker rank after a call lowered that
	// worker rank's load: PrefillComplete that removed prefill tokens, Free,
	// Expire and RemoveWorker (once per affected worker rank per call). It runs
	// after the ledger's lock is released, on the caller's goroutine, so it may
	// call the Ledger; it must not block (the selection service uses it to wake
	// its admission queue). Default: nil, nobody is told.
	OnChange func(w catalog.WorkerRank)
	// OnRaise, when set, is called with a worker rank after a call raised that
	// worker rank's load: Book and BookAt, AddOutputBlocks, and Move on the
	// rank it moved to. It runs like OnChange: after the locks are released,
	// on the caller's goroutine; it must not block. The selection service
	// uses the two to keep its order of idle-candidate costs current.
	// Default: nil.
	OnRaise func(w catalog.WorkerRank)
	// PrefillRate is the calibration's prior: every rank prefills this many
	// tokens a second, queued or its own, until completions say otherwise.
	// Default DefaultPrefillRate; must not be negative.
	PrefillRate float64
}

// DefaultPrefillRate is Options.PrefillRate's default, tokens per second.
const DefaultPrefillRate = 10_000

// ID names a reservation. A caller chooses it (the request's id, or one the
// selection service mints); the ledger only requires that it is not empty and
// not booked already. A pair plan's legs are reservations with ids derived
// from the plan's.
type ID string

// Booking is what Book records for one dispatched request.
type Booking struct {
	// ID names the reservation; it must not be empty and must not be booked
	// already.
	ID ID
	// Worker is the worker rank the request was sent to: a non-empty worker and
	// a rank >= 0.
	Worker catalog.WorkerRank
	// SeqHashes are the request's block sequence hashes; they become active
	// blocks of Worker, shared with every other live booking on Worker that
	// holds the same hash. Book copies them. May be empty.
	SeqHashes []uint64
	// PrivateBlocks is how many blocks the request holds that no other request
	// shares: its partial last block, or every block when the engine does not
	// reuse blocks across requests. >= 0. They count in Worker's active blocks
	// while the booking lives but never enter the shared block index, so they
	// cost Book and Free nothing per block. Being private, they are new on every
	// worker rank: AppendLoads counts SeqHashes only, and a caller
	// asking how many blocks a request would add adds its private blocks itself.
	PrivateBlocks int
	// PrefillTokens is how many prompt tokens the worker still has to prefill
	// (prompt length minus cached tokens); >= 0, and 0 when there is nothing to
	// prefill or prefill is not tracked.
	PrefillTokens int
	// ExpectedOutputTokens is the expected response length, >= 0; kept with
	// the booking.
	ExpectedOutputTokens int
	// FirstLease, when > 0 and shorter than the lease, is how long the booking
	// lives before its first Touch: a copy of a booking made elsewhere that has
	// already run part of its lease. Touch always extends by the whole lease.
	// >= 0; 0 means the lease.
	FirstLease time.Duration
	// Lease is how long the booking may live without Touch; >= 0, 0 meaning the
	// ledger's default lease.
	Lease time.Duration
}

// booking is the ledger's record of one live reservation. id, worker, rank and
// the booking's own figures never change after Book publishes it; settled,
// prefillDone, the lease fields and the list links are guarded by rank.mu.
type booking struct {
	id          ID
	worker      catalog.WorkerRank
	rank        *rankState
	buf         *hashBuf // seqs (in stripe order) and idx; nil once settled
	private     int      // blocks outside the shared index
	prefill     int
	expected    int
	prefillDone bool
	settled     bool
	lease       time.Duration
	bookedAt    time.Time
	// ahead and aheadReqs are the prefill tokens and requests active on the
	// rank when it was booked, what its time to first token is calibrated
	// against; ahead is -1 for a booking that moved, which teaches nothing.
	ahead, aheadReqs int64
	deadline         time.Time
	order            uint64 // booking order; breaks deadline ties
	prev, next       *booking
}

func leaseLess(a, b *booking) bool {
	if c := a.deadline.Compare(b.deadline); c != 0 {
		return c < 0
	}
	return a.order < b.order
}

// Ledger records the reservations of dispatched requests and the active load they
// put on each worker rank. Create one with New; the zero value is not usable. A
// Ledger is safe for concurrent use (see the package documentation).
type Ledger struct {
	now           func() time.Time
	defaultLease  time.Duration
	arrivalWindow float64 // Options.ArrivalWindow in nanoseconds
	onChange      func(catalog.WorkerRank)
	onRaise       func(catalog.WorkerRank)
	stripeSeed    uint64
	idSeed        maphash.Seed

	// regMu guards the registry of worker ranks: held for writing to add or
	// remove an entry or a slot, for reading to look entries up.
	regMu     sync.RWMutex
	ranks     map[catalog.WorkerRank]*rankState
	byWorker  map[string][]*rankState
	nextSlot  atomic.Int32 // slots ever handed out; written under regMu, read without it
	freeSlots []int32
	// bySlot names the entry that holds each slot: grown (copied) and
	// published under regMu, its elements written under regMu before the
	// slot is first booked. A reader that finds a slot among a block's
	// holders, under the block's stripe lock, may read its element: the slot
	// cannot be released while it holds a reference.
	bySlot atomic.Pointer[[]*rankState]

	ids    [idStripes]idStripe
	blocks [blockStripes]blockStripe
	order  atomic.Uint64 // bookings so far, for booking.order
	cal    *calibrator

	booked, prefillDone, freed, expired, removed atomic.Int64
	conflicts, invalid, unknown, active, stale   atomic.Int64
	moved, outputBlocks                          atomic.Int64
}

// New returns an empty Ledger. It reports every invalid option, wrapped in
// ErrInvalidOptions.
func New(opts Options) (*Ledger, error) {
	var errs []error
	if opts.DefaultLease < 0 {
		errs = append(errs, fmt.Errorf("DefaultLease %v is negative", opts.DefaultLease))
	}
	if opts.ArrivalWindow < 0 {
		errs = append(errs, fmt.Errorf("ArrivalWindow %v is negative", opts.ArrivalWindow))
	}
	if !(opts.PrefillRate >= 0) || math.IsInf(opts.PrefillRate, 0) {
		errs = append(errs, fmt.Errorf("PrefillRate %v is not a finite number >= 0", opts.PrefillRate))
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, errors.Join(errs...))
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.DefaultLease == 0 {
		opts.DefaultLease = DefaultLease
	}
	if opts.ArrivalWindow == 0 {
		opts.ArrivalWindow = DefaultArrivalWindow
	}
	if opts.PrefillRate == 0 {
		opts.PrefillRate = DefaultPrefillRate
	}
	l := &Ledger{
		now:           opts.Now,
		defaultLease:  opts.DefaultLease,
		arrivalWindow: float64(opts.ArrivalWindow),
		onChange:      opts.OnChange,
		onRaise:       opts.OnRaise,
		stripeSeed:    rand.Uint64(),
		idSeed:        maphash.MakeSeed(),
		ranks:         make(map[catalog.WorkerRank]*rankState),
		byWorker:      make(map[string][]*rankState),
		cal:           newCalibrator(opts.PrefillRate),
	}
	for i := range l.ids {
		l.ids[i].m = make(map[ID]*booking)
	}
	for i := range l.blocks {
		l.blocks[i].a = newActiveBlocks()
	}
	return l, nil
}

func validate(b *Booking) error {
	var errs []error
	if b.ID == "" {
		errs = append(errs, errors.New("ID is empty"))
	}
	if b.Worker.WorkerID == "" {
		errs = append(errs, errors.New("Worker.WorkerID is empty"))
	}
	if b.Worker.Rank < 0 {
		errs = append(errs, fmt.Errorf("Worker.Rank %d is negative", b.Worker.Rank))
	}
	if b.PrefillTokens < 0 {
		errs = append(errs, fmt.Errorf("PrefillTokens %d is negative", b.PrefillTokens))
	}
	if b.ExpectedOutputTokens < 0 {
		errs = append(errs, fmt.Errorf("ExpectedOutputTokens %d is negative", b.ExpectedOutputTokens))
	}
	if b.PrivateBlocks < 0 {
		errs = append(errs, fmt.Errorf("PrivateBlocks %d is negative", b.PrivateBlocks))
	}
	if b.Lease < 0 {
		errs = append(errs, fmt.Errorf("Lease %v is negative", b.Lease))
	}
	if b.FirstLease < 0 {
		errs = append(errs, fmt.Errorf("FirstLease %v is negative", b.FirstLease))
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: id %q on %s: %w", ErrInvalid, b.ID, b.Worker, errors.Join(errs...))
}

// Book records a reservation: one more active request on b.Worker, b.PrefillTokens
// more active prefill tokens, a reference on each of b.SeqHashes and
// b.PrivateBlocks more active blocks, with a lease ending at the clock's now plus
// the lease. It returns a wrapped ErrInvalid for a
// bad field or ErrConflict when b.ID is already booked; either way nothing
// changed.
func (l *Ledger) Book(b Booking) error { return l.book(&b, Stamp{}, false) }

// BookAt is Book for a decision made on loads read by AppendRankLoads or
// AppendLoads: seen is the chosen candidate's CandidateLoad.Stamp. It books only
// if no Book reached b.Worker, and RemoveWorker did not drop its entry, since
// that read; otherwise it returns ErrStale and changes nothing. The package doc
// ("Read, decide, book") says why a decision it accepts is a serial one.
func (l *Ledger) BookAt(b Booking, seen Stamp) error { return l.book(&b, seen, true) }

func (l *Ledger) book(b *Booking, seen Stamp, check bool) error {
	if err := validate(b); err != nil {
		l.invalid.Add(1)
		return err
	}
	lease := b.Lease
	if lease == 0 {
		lease = l.defaultLease
	}
	buf := hashBufPool.Get().(*hashBuf)
	buf.seqs = l.byStripe(buf.seqs, b.SeqHashes, &buf.runs)
	buf.idx = slices.Grow(buf.idx[:0], len(buf.seqs))
	now := l.now()
	first := lease
	if b.FirstLease > 0 && b.FirstLease < lease {
		first = b.FirstLease
	}
	bk := &booking{
		id: b.ID, worker: b.Worker, buf: buf,
		private: b.PrivateBlocks, prefill: b.PrefillTokens, expected: b.ExpectedOutputTokens,
		lease: lease, bookedAt: now, deadline: now.Add(first),
	}
	var r *rankState
	for {
		r = seen.r
		if !check || r == nil || r.key != b.Worker {
			r = l.rankFor(b.Worker)
		}
		r.mu.Lock()
		if !r.dead.Load() {
			break
		}
		r.mu.Unlock()
		if check && r == seen.r { // the entry read was removed since
			l.stale.Add(1)
			putHashBuf(buf)
			return fmt.Errorf("%w: %s (id %q)", ErrStale, b.Worker, b.ID)
		}
		// Removed meanwhile: the next lookup makes a new entry.
	}
	ids := l.idStripe(b.ID)
	ids.mu.Lock()
	if old := ids.m[b.ID]; old != nil {
		ids.mu.Unlock()
		r.mu.Unlock()
		l.conflicts.Add(1)
		putHashBuf(buf)
		return fmt.Errorf("%w: id %q is held on %s (asked for %s)", ErrConflict, b.ID, old.worker, b.Worker)
	}
	if check && !seen.current(r) {
		ids.mu.Unlock()
		r.mu.Unlock()
		l.stale.Add(1)
		putHashBuf(buf)
		return fmt.Errorf("%w: %s (id %q)", ErrStale, b.Worker, b.ID)
	}
	bk.rank = r
	ids.m[b.ID] = bk
	ids.mu.Unlock()

	bk.ahead, bk.aheadReqs = r.prefill.Load(), r.requests.Load()
	r.version.Add(1) // odd: readers that see it cannot book on what they read
	r.blocks.Add(int64(l.addRefs(bk)))
	r.private.Add(int64(bk.private))
	r.prefill.Add(int64(bk.prefill))
	r.queued(bk.prefill, now)
	l.arrive(r, 1, now)
	r.requests.Add(1)
	bk.next = r.head
	if r.head != nil {
		r.head.prev = bk
	}
	r.head = bk
	bk.order = l.order.Add(1)
	r.leaseTree().ReplaceOrInsert(bk)
	r.version.Add(1)
	r.mu.Unlock()
	l.booked.Add(1)
	l.active.Add(1)
	if l.onRaise != nil {
		l.onRaise(b.Worker)
	}
	return nil
}

// find returns the live booking id, or nil.
func (l *Ledger) find(id ID) *booking {
	ids := l.idStripe(id)
	ids.mu.Lock()
	bk := ids.m[id]
	ids.mu.Unlock()
	return bk
}

// take removes id from the id map and returns its booking: nil when id is not
// booked, or when want is set and id's booking is not want (a Free has taken
// want and will settle it). Whoever takes a booking settles it.
func (l *Ledger) take(id ID, want *booking) *booking {
	ids := l.idStripe(id)
	ids.mu.Lock()
	bk := ids.m[id]
	if bk != nil && (want == nil || bk == want) {
		delete(ids.m, id)
	} else {
		bk = nil
	}
	ids.mu.Unlock()
	return bk
}

// PrefillComplete removes the booking's prefill tokens from its worker's active
// prefill; its request and blocks stay until it is freed. A second call for the
// same booking is a no-op that returns nil. An unknown id returns a wrapped
// ErrUnknownReservation and changes nothing.
func (l *Ledger) PrefillComplete(id ID) error {
	bk := l.find(id)
	if bk == nil {
		l.unknown.Add(1)
		return fmt.Errorf("%w: prefill complete for %q", ErrUnknownReservation, id)
	}
	r := bk.rank
	r.mu.Lock()
	if bk.settled {
		r.mu.Unlock()
		l.unknown.Add(1)
		return fmt.Errorf("%w: prefill complete for %q", ErrUnknownReservation, id)
	}
	if bk.prefillDone {
		r.mu.Unlock()
		return nil
	}
	bk.prefillDone = true
	r.prefill.Add(-int64(bk.prefill))
	now := stamp(l.now())
	if bk.prefill > 0 {
		r.served(now)
	}
	smp, learn := l.observe(bk, r, now)
	lowered := bk.prefill > 0
	r.mu.Unlock()
	if learn {
		l.cal.add(smp)
	}
	l.prefillDone.Add(1)
	if lowered && l.onChange != nil {
		l.onChange(bk.worker)
	}
	return nil
}

// Free settles the booking: everything Book added (and PrefillComplete did not
// already remove) is removed. An unknown id, including one already freed, expired
// or removed, returns a wrapped ErrUnknownReservation and changes nothing.
func (l *Ledger) Free(id ID) error {
	bk := l.take(id, nil)
	if bk == nil {
		l.unknown.Add(1)
		return fmt.Errorf("%w: free %q", ErrUnknownReservation, id)
	}
	r := bk.rank
	r.mu.Lock()
	l.settle(bk)
	r.mu.Unlock()
	l.freed.Add(1)
	if l.onChange != nil {
		l.onChange(bk.worker)
	}
	return nil
}

// Touch extends the booking's lease to the clock's now plus its lease (a request
// making progress is not an orphan). It never shortens a lease. An unknown id
// returns a wrapped ErrUnknownReservation and changes nothing.
func (l *Ledger) Touch(id ID) error {
	now := l.now()
	bk := l.find(id)
	if bk != nil {
		r := bk.rank
		r.mu.Lock()
		defer r.mu.Unlock()
	}
	if bk == nil || bk.settled {
		l.unknown.Add(1)
		return fmt.Errorf("%w: touch %q", ErrUnknownReservation, id)
	}
	deadline := now.Add(bk.lease)
	if deadline.Compare(bk.deadline) <= 0 {
		return nil
	}
	r := bk.rank
	r.leases.Delete(bk)
	bk.deadline = deadline
	r.leases.ReplaceOrInsert(bk)
	return nil
}

// Expire frees every booking whose deadline is at or before now and returns how
// many it freed; OnChange hears of the affected worker ranks in the order of
// their earliest expired deadline (ties in booking order). Its cost is one look
// per worker rank plus the number it frees times log of the number of live
// bookings.
func (l *Ledger) Expire(now time.Time) int {
	var done []*booking
	for _, r := range l.rankList() {
		r.mu.Lock()
		for r.leases != nil {
			bk, ok := r.leases.Min()
			if !ok || bk.deadline.After(now) {
				break
			}
			r.leases.DeleteMin()
			if l.take(bk.id, bk) == nil {
				continue // a Free in flight owns it
			}
			l.settle(bk)
			done = append(done, bk)
		}
		r.mu.Unlock()
	}
	l.expired.Add(int64(len(done)))
	if l.onChange != nil {
		// Settled bookings are never written again: their deadlines are safe
		// to read without their locks.
		slices.SortFunc(done, func(a, b *booking) int {
			if leaseLess(a, b) {
				return -1
			}
			return 1
		})
		var changed affected
		for _, bk := range done {
			changed.add(bk.worker)
		}
		changed.notify(l.onChange)
	}
	return len(done)
}

// RemoveWorker frees every booking on any rank of worker (the worker was deleted)
// and forgets its ranks' entries; it returns how many bookings it freed. Its cost
// is the worker's bookings and their blocks.
func (l *Ledger) RemoveWorker(worker string) int {
	l.regMu.Lock()
	rs := l.byWorker[worker]
	delete(l.byWorker, worker)
	for _, r := range rs {
		delete(l.ranks, r.key)
	}
	l.regMu.Unlock()

	var changed affected
	n := 0
	for _, r := range rs {
		r.mu.Lock()
		r.dead.Store(true)
		if r.head != nil && l.onChange != nil {
			changed.add(r.key)
		}
		for bk := r.head; bk != nil; {
			next := bk.next
			if l.take(bk.id, bk) != nil { // otherwise a Free in flight settles it
				l.settle(bk)
				n++
			}
			bk = next
		}
		if r.head == nil {
			l.release(r)
		}
		r.mu.Unlock()
	}
	l.removed.Add(int64(n))
	changed.notify(l.onChange)
	return n
}

// settle removes a booking the caller has taken from the id map and everything
// it added. bk.rank.mu must be held.
func (l *Ledger) settle(bk *booking) {
	r := bk.rank
	r.blocks.Add(-int64(l.dropRefs(bk)))
	r.private.Add(-int64(bk.private))
	if !bk.prefillDone && bk.prefill > 0 {
		r.prefill.Add(-int64(bk.prefill))
		r.dropped()
	}
	r.requests.Add(-1)
	r.leases.Delete(bk)
	if bk.prev != nil {
		bk.prev.next = bk.next
	} else {
		r.head = bk.next
	}
	if bk.next != nil {
		bk.next.prev = bk.prev
	}
	bk.prev, bk.next = nil, nil
	bk.settled = true
	putHashBuf(bk.buf)
	bk.buf = nil
	l.active.Add(-1)
	if r.head == nil {
		if r.blocks.Load() != 0 || r.private.Load() != 0 || r.prefill.Load() != 0 || r.requests.Load() != 0 {
			panic("reservation: internal error: load left on a worker rank without bookings")
		}
		if r.dead.Load() {
			l.release(r)
		}
	}
}

// affected collects the distinct worker ranks whose load a call lowered, in the
// order first seen, to notify once each after the lock is released.
type affected struct {
	list []catalog.WorkerRank
	seen map[catalog.WorkerRank]struct{}
}

func (a *affected) add(w catalog.WorkerRank) {
	if a.seen != nil {
		if _, ok := a.seen[w]; ok {
			return
		}
		a.seen[w] = struct{}{}
		a.list = append(a.list, w)
		return
	}
	if slices.Contains(a.list, w) {
		return
	}
	a.list = append(a.list, w)
	if len(a.list) == 16 { // switch to a set before linear scans get long
		a.seen = make(map[catalog.WorkerRank]struct{}, 32)
		for _, x := range a.list {
			a.seen[x] = struct{}{}
		}
	}
}

func (a *affected) notify(f func(catalog.WorkerRank)) {
	if f == nil {
		return
	}
	for _, w := range a.list {
		f(w)
	}
}
