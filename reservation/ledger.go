package reservation

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/btree"

	"github.com/kvselect/kvselect/kvindex"
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

// Stamp marks the point in a ledger's history at which loads were read: every
// Book before it is visible in those loads, none after it is. BookAt compares a
// worker rank's latest booking with it.
type Stamp uint64

// Clock tells the ledger the time. Implementations must be safe for concurrent
// use. Tests inject a fake; the default is the system clock.
type Clock interface {
	Now() time.Time
}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

// Options configure a Ledger. The zero value means the defaults. New copies it.
type Options struct {
	// Clock gives the time bookings are made and touched at. Default: the system
	// clock.
	Clock Clock
	// DefaultLease is the lease of a booking whose Lease is zero. Default
	// DefaultLease (300 s); must not be negative.
	DefaultLease time.Duration
	// OnChange, when set, is called with a worker rank after a call lowered that
	// worker rank's load: PrefillComplete that removed prefill tokens, Free,
	// Expire and RemoveWorker (once per affected worker rank per call). It runs
	// after the ledger's lock is released, on the caller's goroutine, so it may
	// call the Ledger; it must not block (the selection service uses it to wake
	// its admission queue). Default: nil, nobody is told.
	OnChange func(w kvindex.WorkerRank)
}

// Booking is what Book records for one dispatched request.
type Booking struct {
	// ID names the reservation; it must not be empty and must not be booked
	// already.
	ID string
	// Worker is the worker rank the request was sent to: a non-empty worker and
	// a rank >= 0.
	Worker kvindex.WorkerRank
	// SeqHashes are the request's block sequence hashes; they become active
	// blocks of Worker, shared with every other live booking on Worker that
	// holds the same hash. Book copies them. May be empty.
	SeqHashes []uint64
	// PrivateBlocks is how many blocks the request holds that no other request
	// shares: its partial last block, or every block when the engine does not
	// reuse blocks across requests. >= 0. They count in Worker's active blocks
	// while the booking lives but never enter the shared block index, so they
	// cost Book and Free nothing per block. Being private, they are new on every
	// worker rank: NewBlocks and AppendLoads count SeqHashes only, and a caller
	// asking how many blocks a request would add adds its private blocks itself.
	PrivateBlocks int
	// PrefillTokens is how many prompt tokens the worker still has to prefill
	// (prompt length minus cached tokens); >= 0, and 0 when there is nothing to
	// prefill or prefill is not tracked.
	PrefillTokens int
	// ExpectedOutputTokens is the expected response length, >= 0; recorded for
	// Get only.
	ExpectedOutputTokens int
	// Lease is how long the booking may live without Touch; >= 0, 0 meaning the
	// ledger's default lease.
	Lease time.Duration
}

// Reservation is a snapshot of one live booking, as returned by Get.
type Reservation struct {
	ID                   string
	Worker               kvindex.WorkerRank
	PrefillTokens        int
	PrefillDone          bool
	ExpectedOutputTokens int
	Blocks               int // sequence hashes the booking holds (as given, duplicates included)
	PrivateBlocks        int // blocks it holds outside the shared block index (Booking.PrivateBlocks)
	Lease                time.Duration
	BookedAt             time.Time
	Deadline             time.Time // Expire frees the booking at or after this time
}

// Load is a worker rank's active load.
type Load struct {
	// ActivePrefillTokens is the sum of the prefill tokens of live bookings whose
	// prefill has not completed.
	ActivePrefillTokens int64
	// ActiveBlocks is the number of distinct sequence hashes over live bookings
	// plus the sum of their private blocks.
	ActiveBlocks int
	// ActiveRequests is the number of live bookings.
	ActiveRequests int
}

// CandidateLoad is a candidate worker rank's load and the number of the request's
// sequence hashes that would be new to it, as returned by AppendLoads (the
// request's private blocks, new everywhere, are the caller's to add).
type CandidateLoad struct {
	Worker    kvindex.WorkerRank
	Load      Load
	NewBlocks int
	// Stamp is the ledger's history point of the read (the same for every
	// candidate of one AppendLoads call), for BookAt.
	Stamp Stamp
}

// Stats are the ledger's counters since New. Each is read atomically, but the set
// is not one snapshot while calls are in flight.
type Stats struct {
	Booked           int64 // successful Book calls
	PrefillCompleted int64 // bookings whose prefill was marked complete (first call only)
	Freed            int64 // bookings settled by Free
	Expired          int64 // bookings settled by Expire
	Removed          int64 // bookings settled by RemoveWorker
	Conflicts        int64 // Book calls rejected with ErrConflict
	Stale            int64 // BookAt calls rejected with ErrStale
	Invalid          int64 // Book calls rejected with ErrInvalid
	UnknownIDs       int64 // PrefillComplete, Free and Touch calls with an unknown id
	Active           int64 // live bookings
}

// booking is the ledger's record of one live reservation.
type booking struct {
	id          string
	worker      kvindex.WorkerRank
	wl          *workerLoad
	seqs        []uint64 // the ledger's own copy
	idx         []int32  // idx[i] is the active-block entry of seqs[i]
	private     int      // blocks outside the shared index
	prefill     int
	expected    int
	prefillDone bool
	lease       time.Duration
	bookedAt    time.Time
	deadline    time.Time
	order       uint64 // booking order; breaks deadline ties in the lease tree
	prev, next  *booking
}

// workerLoad is the load of one worker rank with at least one live booking.
type workerLoad struct {
	key      kvindex.WorkerRank
	slot     int32
	prefill  int64
	requests int
	blocks   int         // distinct active hashes
	private  int         // sum of the private blocks of the live bookings
	head     *booking    // the worker rank's live bookings, doubly linked
	nextRank *workerLoad // the next loaded rank of the same worker
	lastBook Stamp       // the stamp of the worker rank's latest live Book
}

func (w *workerLoad) load() Load {
	return Load{ActivePrefillTokens: w.prefill, ActiveBlocks: w.blocks + w.private, ActiveRequests: w.requests}
}

// maxPooledHashes bounds the hash buffer a recycled booking keeps.
const maxPooledHashes = 4096

var bookingPool = sync.Pool{New: func() any { return new(booking) }}

func recycle(b *booking) {
	seqs, idx := b.seqs[:0], b.idx[:0]
	if cap(seqs) > maxPooledHashes || cap(idx) > maxPooledHashes {
		seqs, idx = nil, nil
	}
	*b = booking{seqs: seqs, idx: idx}
	bookingPool.Put(b)
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
	clock        Clock
	defaultLease time.Duration
	onChange     func(kvindex.WorkerRank)

	// mu is held for writing by every call that changes state and for reading
	// by the reads (AppendLoads, NewBlocks, Load, Loads, Get, NextExpiry), so
	// candidate evaluations of concurrent requests do not exclude each other.
	mu        sync.RWMutex
	bookings  map[string]*booking
	workers   map[string]*workerLoad // by worker: the first of its loaded ranks, chained by nextRank
	spare     []*workerLoad          // recycled worker loads, at most maxSpareLoads
	leases    *btree.BTreeG[*booking]
	blocks    activeBlocks
	stamp     Stamp // Book calls so far: the current history point
	nextSlot  int32
	freeSlots []int32
	order     uint64

	booked, prefillDone, freed, expired, removed atomic.Int64
	conflicts, invalid, unknown, active, stale   atomic.Int64
}

// New returns an empty Ledger. It reports every invalid option, wrapped in
// ErrInvalidOptions.
func New(opts Options) (*Ledger, error) {
	var errs []error
	if opts.DefaultLease < 0 {
		errs = append(errs, fmt.Errorf("DefaultLease %v is negative", opts.DefaultLease))
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, errors.Join(errs...))
	}
	if opts.Clock == nil {
		opts.Clock = systemClock{}
	}
	if opts.DefaultLease == 0 {
		opts.DefaultLease = DefaultLease
	}
	return &Ledger{
		clock:        opts.Clock,
		defaultLease: opts.DefaultLease,
		onChange:     opts.OnChange,
		bookings:     make(map[string]*booking),
		workers:      make(map[string]*workerLoad),
		leases:       btree.NewG(16, leaseLess),
		blocks:       newActiveBlocks(),
	}, nil
}

func validate(b *Booking) error {
	var errs []error
	if b.ID == "" {
		errs = append(errs, errors.New("ID is empty"))
	}
	if b.Worker.Worker == "" {
		errs = append(errs, errors.New("Worker.Worker is empty"))
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
func (l *Ledger) Book(b Booking) error { return l.book(&b, 0, false) }

// BookAt is Book for a decision made on loads read at seen (CandidateLoad.Stamp):
// it books only if no Book reached b.Worker after that read, and otherwise
// returns ErrStale and changes nothing. Loads only rise through Book, so a
// worker rank chosen as the cheapest on those loads is still no dearer than it
// looked, and every other candidate is at least as dear as it looked or became
// cheaper only through settlements the decision may be ordered before: a
// decision BookAt accepts is one some serial order of the calls would have made.
// This lets callers decide concurrently without a lock around read-decide-book.
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
	bk := bookingPool.Get().(*booking)
	bk.id = b.ID
	bk.worker = b.Worker
	bk.seqs = append(bk.seqs[:0], b.SeqHashes...)
	bk.idx = slices.Grow(bk.idx[:0], len(bk.seqs))
	bk.private = b.PrivateBlocks
	bk.prefill = b.PrefillTokens
	bk.expected = b.ExpectedOutputTokens
	bk.lease = lease
	bk.bookedAt = l.clock.Now()
	bk.deadline = bk.bookedAt.Add(lease)

	l.mu.Lock()
	if old, ok := l.bookings[b.ID]; ok {
		held := old.worker
		l.mu.Unlock()
		l.conflicts.Add(1)
		recycle(bk)
		return fmt.Errorf("%w: id %q is held on %s (asked for %s)", ErrConflict, b.ID, held, b.Worker)
	}
	wl := l.lookup(b.Worker)
	if check && wl != nil && wl.lastBook > seen {
		l.mu.Unlock()
		l.stale.Add(1)
		recycle(bk)
		return fmt.Errorf("%w: %s (id %q)", ErrStale, b.Worker, b.ID)
	}
	if wl == nil {
		wl = l.addWorkerLoad(b.Worker)
	}
	l.stamp++
	wl.lastBook = l.stamp
	bk.wl = wl
	for _, h := range bk.seqs {
		i, added := l.blocks.inc(h, wl.slot)
		bk.idx = append(bk.idx, i)
		if added {
			wl.blocks++
		}
	}
	wl.private += bk.private
	wl.prefill += int64(bk.prefill)
	wl.requests++
	bk.next = wl.head
	if wl.head != nil {
		wl.head.prev = bk
	}
	wl.head = bk
	l.order++
	bk.order = l.order
	l.bookings[bk.id] = bk
	l.leases.ReplaceOrInsert(bk)
	l.booked.Add(1)
	l.active.Add(1)
	l.mu.Unlock()
	return nil
}

// PrefillComplete removes the booking's prefill tokens from its worker's active
// prefill; its request and blocks stay until it is freed. A second call for the
// same booking is a no-op that returns nil. An unknown id returns a wrapped
// ErrUnknownReservation and changes nothing.
func (l *Ledger) PrefillComplete(id string) error {
	l.mu.Lock()
	bk := l.bookings[id]
	if bk == nil {
		l.mu.Unlock()
		l.unknown.Add(1)
		return fmt.Errorf("%w: prefill complete for %q", ErrUnknownReservation, id)
	}
	if bk.prefillDone {
		l.mu.Unlock()
		return nil
	}
	bk.prefillDone = true
	bk.wl.prefill -= int64(bk.prefill)
	lowered := bk.prefill > 0
	w := bk.worker
	l.prefillDone.Add(1)
	l.mu.Unlock()
	if lowered && l.onChange != nil {
		l.onChange(w)
	}
	return nil
}

// Free settles the booking: everything Book added (and PrefillComplete did not
// already remove) is removed. An unknown id, including one already freed, expired
// or removed, returns a wrapped ErrUnknownReservation and changes nothing.
func (l *Ledger) Free(id string) error {
	l.mu.Lock()
	bk := l.bookings[id]
	if bk == nil {
		l.mu.Unlock()
		l.unknown.Add(1)
		return fmt.Errorf("%w: free %q", ErrUnknownReservation, id)
	}
	w := bk.worker
	l.leases.Delete(bk)
	l.settle(bk)
	l.freed.Add(1)
	l.mu.Unlock()
	recycle(bk)
	if l.onChange != nil {
		l.onChange(w)
	}
	return nil
}

// Touch extends the booking's lease to the clock's now plus its lease (a request
// making progress is not an orphan). It never shortens a lease. An unknown id
// returns a wrapped ErrUnknownReservation and changes nothing.
func (l *Ledger) Touch(id string) error {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	bk := l.bookings[id]
	if bk == nil {
		l.unknown.Add(1)
		return fmt.Errorf("%w: touch %q", ErrUnknownReservation, id)
	}
	deadline := now.Add(bk.lease)
	if deadline.Compare(bk.deadline) <= 0 {
		return nil
	}
	l.leases.Delete(bk)
	bk.deadline = deadline
	l.leases.ReplaceOrInsert(bk)
	return nil
}

// Expire frees every booking whose deadline is at or before now, earliest
// deadline first, and returns how many it freed. Its cost is the number it frees
// times log of the number of live bookings.
func (l *Ledger) Expire(now time.Time) int {
	var changed affected
	var done []*booking
	n := 0
	l.mu.Lock()
	for {
		bk, ok := l.leases.Min()
		if !ok || bk.deadline.After(now) {
			break
		}
		l.leases.DeleteMin()
		if l.onChange != nil {
			changed.add(bk.worker)
		}
		l.settle(bk)
		done = append(done, bk)
		n++
	}
	l.expired.Add(int64(n))
	l.mu.Unlock()
	for _, bk := range done {
		recycle(bk)
	}
	changed.notify(l.onChange)
	return n
}

// NextExpiry returns the earliest lease deadline among the live bookings, and
// false when there are none. An owner's sweeper sleeps until then and calls
// Expire.
func (l *Ledger) NextExpiry() (time.Time, bool) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	bk, ok := l.leases.Min()
	if !ok {
		return time.Time{}, false
	}
	return bk.deadline, true
}

// RemoveWorker frees every booking on any rank of worker (the worker was deleted)
// and returns how many it freed. Its cost is the worker's bookings and their
// blocks.
func (l *Ledger) RemoveWorker(worker string) int {
	var changed affected
	var done []*booking
	l.mu.Lock()
	for wl := l.workers[worker]; wl != nil; wl = l.workers[worker] {
		if l.onChange != nil {
			changed.add(wl.key)
		}
		for wl.head != nil {
			bk := wl.head
			l.leases.Delete(bk)
			l.settle(bk) // unlinks bk from wl, and wl from l.workers with its last booking
			done = append(done, bk)
		}
	}
	l.removed.Add(int64(len(done)))
	l.mu.Unlock()
	for _, bk := range done {
		recycle(bk)
	}
	changed.notify(l.onChange)
	return len(done)
}

// settle removes a live booking and everything it added, except its lease-tree
// entry, which the caller removes. l.mu must be held.
func (l *Ledger) settle(bk *booking) {
	wl := bk.wl
	for i, h := range bk.seqs {
		if l.blocks.dec(bk.idx[i], h, wl.slot) {
			wl.blocks--
		}
	}
	l.blocks.sweep()
	wl.private -= bk.private
	if !bk.prefillDone {
		wl.prefill -= int64(bk.prefill)
	}
	wl.requests--
	if bk.prev != nil {
		bk.prev.next = bk.next
	} else {
		wl.head = bk.next
	}
	if bk.next != nil {
		bk.next.prev = bk.prev
	}
	bk.prev, bk.next, bk.wl = nil, nil, nil
	delete(l.bookings, bk.id)
	l.active.Add(-1)
	if wl.requests == 0 {
		if wl.blocks != 0 || wl.private != 0 || wl.prefill != 0 || wl.head != nil {
			panic("reservation: internal error: load left on a worker rank without bookings")
		}
		l.dropWorkerLoad(wl)
	}
}

// maxSpareLoads bounds the worker loads kept for reuse.
const maxSpareLoads = 64

// lookup returns the load entry of w, or nil when w has no live booking. l.mu
// must be held.
func (l *Ledger) lookup(w kvindex.WorkerRank) *workerLoad {
	for wl := l.workers[w.Worker]; wl != nil; wl = wl.nextRank {
		if wl.key.Rank == w.Rank {
			return wl
		}
	}
	return nil
}

// addWorkerLoad creates the empty load entry of w, which has none. l.mu must be
// held.
func (l *Ledger) addWorkerLoad(w kvindex.WorkerRank) *workerLoad {
	var wl *workerLoad
	if n := len(l.spare); n > 0 {
		wl = l.spare[n-1]
		l.spare[n-1] = nil
		l.spare = l.spare[:n-1]
	} else {
		wl = new(workerLoad)
	}
	*wl = workerLoad{key: w, slot: l.takeSlot(), nextRank: l.workers[w.Worker]}
	l.workers[w.Worker] = wl
	return wl
}

// dropWorkerLoad removes wl, which has no bookings left, and recycles it and its
// slot. l.mu must be held.
func (l *Ledger) dropWorkerLoad(wl *workerLoad) {
	name := wl.key.Worker
	if head := l.workers[name]; head == wl {
		if wl.nextRank == nil {
			delete(l.workers, name)
		} else {
			l.workers[name] = wl.nextRank
		}
	} else {
		prev := head
		for prev.nextRank != wl {
			prev = prev.nextRank
		}
		prev.nextRank = wl.nextRank
	}
	l.freeSlots = append(l.freeSlots, wl.slot)
	*wl = workerLoad{}
	if len(l.spare) < maxSpareLoads {
		l.spare = append(l.spare, wl)
	}
}

func (l *Ledger) takeSlot() int32 {
	if n := len(l.freeSlots); n > 0 {
		s := l.freeSlots[n-1]
		l.freeSlots = l.freeSlots[:n-1]
		return s
	}
	s := l.nextSlot
	l.nextSlot++
	return s
}

// Load returns the active load of worker rank w; the zero Load when it has none.
func (l *Ledger) Load(w kvindex.WorkerRank) Load {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if wl := l.lookup(w); wl != nil {
		return wl.load()
	}
	return Load{}
}

// NewBlocks returns how many of seqs are not active on worker rank w: the shared
// blocks a request with these sequence hashes would add to w's active blocks. A
// hash listed twice counts once. A request's private blocks (Booking.PrivateBlocks)
// are not counted: they are new everywhere, so the caller adds them.
func (l *Ledger) NewBlocks(w kvindex.WorkerRank, seqs []uint64) int {
	sc := scratchPool.Get().(*requestScratch)
	defer scratchPool.Put(sc)
	l.mu.RLock()
	defer l.mu.RUnlock()
	distinct := l.scanRequest(sc, seqs)
	if wl := l.lookup(w); wl != nil {
		return distinct - sc.shared(wl.slot)
	}
	return distinct
}

// AppendLoads appends to dst, for each of workers in order, its load and the
// number of seqs it does not have active (as NewBlocks), all read at one point
// of the ledger's history (each CandidateLoad carries its Stamp), and returns
// the extended slice. Its cost is one index lookup per distinct hash of seqs,
// one increment per worker rank holding each of them active, and one lookup per
// candidate; never one lookup per (candidate, hash). Concurrent AppendLoads
// calls do not exclude each other. The selection service calls it on its hot
// path.
func (l *Ledger) AppendLoads(dst []CandidateLoad, workers []kvindex.WorkerRank, seqs []uint64) []CandidateLoad {
	if len(workers) == 0 {
		return dst
	}
	dst = slices.Grow(dst, len(workers))
	sc := scratchPool.Get().(*requestScratch)
	l.mu.RLock()
	distinct := l.scanRequest(sc, seqs)
	for _, w := range workers {
		c := CandidateLoad{Worker: w, NewBlocks: distinct, Stamp: l.stamp}
		if wl := l.lookup(w); wl != nil {
			c.Load = wl.load()
			c.NewBlocks -= sc.shared(wl.slot)
		}
		dst = append(dst, c)
	}
	l.mu.RUnlock()
	scratchPool.Put(sc)
	return dst
}

// scratchPool recycles the per-call scratch of scanRequest.
var scratchPool = sync.Pool{New: func() any { return new(requestScratch) }}

// scanRequest deduplicates seqs into sc and counts, per slot, how many of the
// distinct hashes it has active. It returns the number of distinct hashes. l.mu
// must be held (for reading at least); the counts are valid until sc's next use.
func (l *Ledger) scanRequest(sc *requestScratch, seqs []uint64) int {
	sc.begin(len(seqs), l.nextSlot)
	anyActive := l.blocks.live() > 0
	distinct := 0
	for _, h := range seqs {
		if !sc.add(h) {
			continue
		}
		distinct++
		if !anyActive {
			continue
		}
		if e := l.blocks.holders(h); e != nil {
			sc.credit(e)
		}
	}
	return distinct
}

// Get returns a snapshot of the live booking id, and false when there is none.
func (l *Ledger) Get(id string) (Reservation, bool) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	bk := l.bookings[id]
	if bk == nil {
		return Reservation{}, false
	}
	return Reservation{
		ID:                   bk.id,
		Worker:               bk.worker,
		PrefillTokens:        bk.prefill,
		PrefillDone:          bk.prefillDone,
		ExpectedOutputTokens: bk.expected,
		Blocks:               len(bk.seqs),
		PrivateBlocks:        bk.private,
		Lease:                bk.lease,
		BookedAt:             bk.bookedAt,
		Deadline:             bk.deadline,
	}, true
}

// Loads returns a snapshot of the load of every worker rank that has any; worker
// ranks without live bookings are absent.
func (l *Ledger) Loads() map[kvindex.WorkerRank]Load {
	l.mu.RLock()
	defer l.mu.RUnlock()
	out := make(map[kvindex.WorkerRank]Load, len(l.workers))
	for _, head := range l.workers {
		for wl := head; wl != nil; wl = wl.nextRank {
			out[wl.key] = wl.load()
		}
	}
	return out
}

// Stats returns the ledger's counters. It does not take the lock.
func (l *Ledger) Stats() Stats {
	return Stats{
		Booked:           l.booked.Load(),
		PrefillCompleted: l.prefillDone.Load(),
		Freed:            l.freed.Load(),
		Expired:          l.expired.Load(),
		Removed:          l.removed.Load(),
		Conflicts:        l.conflicts.Load(),
		Stale:            l.stale.Load(),
		Invalid:          l.invalid.Load(),
		UnknownIDs:       l.unknown.Load(),
		Active:           l.active.Load(),
	}
}

// affected collects the distinct worker ranks whose load a call lowered, in the
// order first seen, to notify once each after the lock is released.
type affected struct {
	list []kvindex.WorkerRank
	seen map[kvindex.WorkerRank]struct{}
}

func (a *affected) add(w kvindex.WorkerRank) {
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
		a.seen = make(map[kvindex.WorkerRank]struct{}, 32)
		for _, x := range a.list {
			a.seen[x] = struct{}{}
		}
	}
}

func (a *affected) notify(f func(kvindex.WorkerRank)) {
	if f == nil {
		return
	}
	for _, w := range a.list {
		f(w)
	}
}
