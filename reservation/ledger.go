package reservation

import (
	"errors"
	"fmt"
	"hash/maphash"
	"math/rand/v2"
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

// Stamp records what AppendLoads saw of one worker rank: which incarnation of
// its load entry and how many bookings that entry had received. BookAt compares
// it with the worker rank's state at booking time. The zero Stamp means the
// worker rank had never been booked when it was read. Stamps are opaque and only
// meaningful to the Ledger that issued them.
type Stamp struct {
	r *rankState
	v uint64
}

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
	// Stamp is what the read saw of Worker, for BookAt.
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

// booking is the ledger's record of one live reservation. id, worker, rank and
// the booking's own figures never change after Book publishes it; settled,
// prefillDone, the lease fields and the list links are guarded by rank.mu.
type booking struct {
	id          string
	worker      kvindex.WorkerRank
	rank        *rankState
	buf         *hashBuf // seqs (in stripe order) and idx; nil once settled
	private     int      // blocks outside the shared index
	prefill     int
	expected    int
	prefillDone bool
	settled     bool
	lease       time.Duration
	bookedAt    time.Time
	deadline    time.Time
	order       uint64 // booking order; breaks deadline ties
	prev, next  *booking
}

// hashBuf holds a booking's sequence hashes, ordered by block stripe, and
// idx[i], the stripe entry of seqs[i]. Recycled through hashBufPool.
type hashBuf struct {
	seqs []uint64
	idx  []int32
	runs stripeRuns
}

// maxPooledHashes bounds the hash buffer a recycled booking keeps.
const maxPooledHashes = 4096

var hashBufPool = sync.Pool{New: func() any { return new(hashBuf) }}

func putHashBuf(b *hashBuf) {
	if cap(b.seqs) > maxPooledHashes || cap(b.idx) > maxPooledHashes {
		return
	}
	b.seqs, b.idx = b.seqs[:0], b.idx[:0]
	hashBufPool.Put(b)
}

func leaseLess(a, b *booking) bool {
	if c := a.deadline.Compare(b.deadline); c != 0 {
		return c < 0
	}
	return a.order < b.order
}

// rankState is one worker rank's load entry. It is created by the first Book on
// the worker rank or by AppendRanks and lives until RemoveWorker, so concurrent
// calls can hold it without the registry lock.
//
// The load counters are atomics: Book, settlements and PrefillComplete change
// them under mu, and AppendRankLoads reads them without it. version is a sequence
// counter: odd while a Book is changing the entry, advanced by two per Book.
type rankState struct {
	// What AppendRankLoads reads, together in one cache line.
	version  atomic.Uint64
	prefill  atomic.Int64
	blocks   atomic.Int64 // distinct active hashes
	private  atomic.Int64 // sum of the private blocks of the live bookings
	requests atomic.Int64
	dead     atomic.Bool // removed from the registry by RemoveWorker; set under mu
	slot     int32       // dense number naming the worker rank in the block index

	key kvindex.WorkerRank

	mu       sync.Mutex
	head     *booking // live bookings, doubly linked
	leases   *btree.BTreeG[*booking]
	released bool // its slot has been given back
}

func (r *rankState) load() Load {
	return Load{
		ActivePrefillTokens: r.prefill.Load(),
		ActiveBlocks:        int(r.blocks.Load() + r.private.Load()),
		ActiveRequests:      int(r.requests.Load()),
	}
}

// current reports whether a decision made on what s saw of a worker rank still
// holds for r, its entry now: r is the entry s saw (or s saw none and r has
// never been booked) and no Book has reached r since. r.mu must be held.
func (s Stamp) current(r *rankState) bool {
	v := r.version.Load()
	if s.r == nil {
		return v == 0
	}
	return s.r == r && s.v == v
}

const (
	// blockStripes is the number of independently locked parts of the block
	// index; a hash's part is chosen by its bits.
	blockStripes = 8
	stripeShift  = 61 // 64 - log2(blockStripes)
	// idStripes is the number of independently locked parts of the id map.
	idStripes = 32
)

// blockStripe is one part of the inverted block index with its lock, padded so
// that neighbouring stripes do not share a cache line.
type blockStripe struct {
	mu sync.Mutex
	a  activeBlocks
	_  [64]byte
}

// idStripe is one part of the map from reservation id to live booking.
type idStripe struct {
	mu sync.Mutex
	m  map[string]*booking
	_  [48]byte
}

// Ledger records the reservations of dispatched requests and the active load they
// put on each worker rank. Create one with New; the zero value is not usable. A
// Ledger is safe for concurrent use (see the package documentation).
type Ledger struct {
	clock        Clock
	defaultLease time.Duration
	onChange     func(kvindex.WorkerRank)
	stripeSeed   uint64
	idSeed       maphash.Seed

	// regMu guards the registry of worker ranks: held for writing to add or
	// remove an entry or a slot, for reading to look entries up.
	regMu     sync.RWMutex
	ranks     map[kvindex.WorkerRank]*rankState
	byWorker  map[string][]*rankState
	nextSlot  atomic.Int32 // slots ever handed out; written under regMu, read without it
	freeSlots []int32

	ids    [idStripes]idStripe
	blocks [blockStripes]blockStripe
	order  atomic.Uint64 // bookings so far, for booking.order

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
	l := &Ledger{
		clock:        opts.Clock,
		defaultLease: opts.DefaultLease,
		onChange:     opts.OnChange,
		stripeSeed:   rand.Uint64(),
		idSeed:       maphash.MakeSeed(),
		ranks:        make(map[kvindex.WorkerRank]*rankState),
		byWorker:     make(map[string][]*rankState),
	}
	for i := range l.ids {
		l.ids[i].m = make(map[string]*booking)
	}
	for i := range l.blocks {
		l.blocks[i].a = newActiveBlocks()
	}
	return l, nil
}

// stripeOf returns the block stripe of sequence hash h for a ledger's seed.
func stripeOf(h, seed uint64) int {
	return int(((h ^ seed) * 0xD6E8FEB86659FD93) >> stripeShift)
}

// idStripe returns the id-map stripe of id.
func (l *Ledger) idStripe(id string) *idStripe {
	return &l.ids[maphash.String(l.idSeed, id)%idStripes]
}

// stripeRuns marks where each block stripe's hashes end in a slice grouped by
// stripe: stripe s holds [runs[s-1], runs[s]) (from 0 for stripe 0).
type stripeRuns [blockStripes]int32

// span returns the bounds of stripe s.
func (r *stripeRuns) span(s int) (int, int) {
	if s == 0 {
		return 0, int(r[0])
	}
	return int(r[s-1]), int(r[s])
}

// byStripe writes src to dst grouped by block stripe (a counting sort), records
// the runs and returns dst resized to len(src).
func (l *Ledger) byStripe(dst, src []uint64, runs *stripeRuns) []uint64 {
	var start [blockStripes]int32
	seed := l.stripeSeed
	for _, h := range src {
		start[stripeOf(h, seed)]++
	}
	at := int32(0)
	for i, n := range start {
		start[i] = at
		at += n
		runs[i] = at
	}
	dst = slices.Grow(dst[:0], len(src))[:len(src)]
	for _, h := range src {
		s := stripeOf(h, seed)
		dst[start[s]] = h
		start[s]++
	}
	return dst
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
func (l *Ledger) Book(b Booking) error { return l.book(&b, Stamp{}, false) }

// BookAt is Book for a decision made on loads read by AppendRankLoads or
// AppendLoads: seen is the chosen candidate's CandidateLoad.Stamp. It books only
// if no Book reached b.Worker, and RemoveWorker did not drop its entry, since
// that read; otherwise it returns ErrStale and changes nothing.
// Loads only rise through Book, so a worker rank chosen as the cheapest on those
// loads is still no dearer than it looked, and every other candidate is at least
// as dear as it looked or became cheaper only through settlements the decision
// may be ordered before: a decision BookAt accepts is one some serial order of
// the calls would have made. This lets callers decide concurrently without a
// lock around read-decide-book.
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
	now := l.clock.Now()
	bk := &booking{
		id: b.ID, worker: b.Worker, buf: buf,
		private: b.PrivateBlocks, prefill: b.PrefillTokens, expected: b.ExpectedOutputTokens,
		lease: lease, bookedAt: now, deadline: now.Add(lease),
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

	r.version.Add(1) // odd: readers that see it cannot book on what they read
	r.blocks.Add(int64(l.addRefs(bk)))
	r.private.Add(int64(bk.private))
	r.prefill.Add(int64(bk.prefill))
	r.requests.Add(1)
	bk.next = r.head
	if r.head != nil {
		r.head.prev = bk
	}
	r.head = bk
	bk.order = l.order.Add(1)
	r.leases.ReplaceOrInsert(bk)
	r.version.Add(1)
	r.mu.Unlock()
	l.booked.Add(1)
	l.active.Add(1)
	return nil
}

// rankFor returns the load entry of w, creating it if there is none.
func (l *Ledger) rankFor(w kvindex.WorkerRank) *rankState {
	if r := l.lookup(w); r != nil {
		return r
	}
	l.regMu.Lock()
	defer l.regMu.Unlock()
	if r := l.ranks[w]; r != nil {
		return r
	}
	r := &rankState{key: w, leases: btree.NewG(16, leaseLess)}
	if n := len(l.freeSlots); n > 0 {
		r.slot = l.freeSlots[n-1]
		l.freeSlots = l.freeSlots[:n-1]
	} else {
		r.slot = l.nextSlot.Add(1) - 1
	}
	l.ranks[w] = r
	l.byWorker[w.Worker] = append(l.byWorker[w.Worker], r)
	return r
}

// lookup returns the load entry of w, or nil when w has none.
func (l *Ledger) lookup(w kvindex.WorkerRank) *rankState {
	l.regMu.RLock()
	r := l.ranks[w]
	l.regMu.RUnlock()
	return r
}

// addRefs adds bk's references to the block index, one stripe at a time, records
// the entry of each hash in bk.buf.idx and returns how many hashes were new to
// bk's worker rank. bk.rank.mu must be held.
func (l *Ledger) addRefs(bk *booking) int {
	buf, slot := bk.buf, bk.rank.slot
	seqs, idx := buf.seqs, buf.idx[:len(buf.seqs)]
	added := 0
	for s := range l.blocks {
		from, to := buf.runs.span(s)
		if from == to {
			continue
		}
		st := &l.blocks[s]
		st.mu.Lock()
		for i := from; i < to; i++ {
			j, isNew := st.a.inc(seqs[i], slot)
			idx[i] = j
			if isNew {
				added++
			}
		}
		st.mu.Unlock()
	}
	buf.idx = idx
	return added
}

// dropRefs removes bk's references from the block index, sweeping each stripe it
// touched, and returns how many hashes bk's worker rank no longer holds.
// bk.rank.mu must be held.
func (l *Ledger) dropRefs(bk *booking) int {
	buf, slot := bk.buf, bk.rank.slot
	seqs, idx := buf.seqs, buf.idx
	gone := 0
	for s := range l.blocks {
		from, to := buf.runs.span(s)
		if from == to {
			continue
		}
		st := &l.blocks[s]
		st.mu.Lock()
		for i := from; i < to; i++ {
			if st.a.dec(idx[i], seqs[i], slot) {
				gone++
			}
		}
		st.a.sweep()
		st.mu.Unlock()
	}
	return gone
}

// find returns the live booking id, or nil.
func (l *Ledger) find(id string) *booking {
	ids := l.idStripe(id)
	ids.mu.Lock()
	bk := ids.m[id]
	ids.mu.Unlock()
	return bk
}

// take removes id from the id map and returns its booking: nil when id is not
// booked, or when want is set and id's booking is not want (a Free has taken
// want and will settle it). Whoever takes a booking settles it.
func (l *Ledger) take(id string, want *booking) *booking {
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
func (l *Ledger) PrefillComplete(id string) error {
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
	lowered := bk.prefill > 0
	r.mu.Unlock()
	l.prefillDone.Add(1)
	if lowered && l.onChange != nil {
		l.onChange(bk.worker)
	}
	return nil
}

// Free settles the booking: everything Book added (and PrefillComplete did not
// already remove) is removed. An unknown id, including one already freed, expired
// or removed, returns a wrapped ErrUnknownReservation and changes nothing.
func (l *Ledger) Free(id string) error {
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
func (l *Ledger) Touch(id string) error {
	now := l.clock.Now()
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

// rankList returns the registered worker ranks.
func (l *Ledger) rankList() []*rankState {
	l.regMu.RLock()
	defer l.regMu.RUnlock()
	out := make([]*rankState, 0, len(l.ranks))
	for _, r := range l.ranks {
		out = append(out, r)
	}
	return out
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
		for {
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

// NextExpiry returns the earliest lease deadline among the live bookings, and
// false when there are none. An owner's sweeper sleeps until then and calls
// Expire.
func (l *Ledger) NextExpiry() (time.Time, bool) {
	var next time.Time
	found := false
	for _, r := range l.rankList() {
		r.mu.Lock()
		if bk, ok := r.leases.Min(); ok && (!found || bk.deadline.Before(next)) {
			next, found = bk.deadline, true
		}
		r.mu.Unlock()
	}
	return next, found
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

// release gives a removed worker rank's slot back, once. r.mu must be held and
// r must have no booking left.
func (l *Ledger) release(r *rankState) {
	if r.released {
		return
	}
	r.released = true
	l.regMu.Lock()
	l.freeSlots = append(l.freeSlots, r.slot)
	l.regMu.Unlock()
}

// settle removes a booking the caller has taken from the id map and everything
// it added. bk.rank.mu must be held.
func (l *Ledger) settle(bk *booking) {
	r := bk.rank
	r.blocks.Add(-int64(l.dropRefs(bk)))
	r.private.Add(-int64(bk.private))
	if !bk.prefillDone {
		r.prefill.Add(-int64(bk.prefill))
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

// Load returns the active load of worker rank w; the zero Load when it has none.
func (l *Ledger) Load(w kvindex.WorkerRank) Load {
	r := l.lookup(w)
	if r == nil {
		return Load{}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.load()
}

// NewBlocks returns how many of seqs are not active on worker rank w: the shared
// blocks a request with these sequence hashes would add to w's active blocks. A
// hash listed twice counts once. A request's private blocks (Booking.PrivateBlocks)
// are not counted: they are new everywhere, so the caller adds them.
func (l *Ledger) NewBlocks(w kvindex.WorkerRank, seqs []uint64) int {
	return l.AppendLoads(make([]CandidateLoad, 0, 1), []kvindex.WorkerRank{w}, seqs)[0].NewBlocks
}

// Rank is a resolved handle on one worker rank's load entry, from AppendRanks.
// It spares AppendRankLoads a lookup by name per candidate. A handle whose
// worker was removed since it was made still works: AppendRankLoads looks it up
// again by name.
type Rank struct {
	key kvindex.WorkerRank
	r   *rankState
}

// Worker returns the worker rank the handle names.
func (k Rank) Worker() kvindex.WorkerRank { return k.key }

// AppendRanks appends a handle for each of workers to dst, making an empty load
// entry for each worker rank that has none, and returns the extended slice. An
// entry lives until RemoveWorker of its worker; callers resolve a worker's
// ranks when they start considering it and again after removing it.
func (l *Ledger) AppendRanks(dst []Rank, workers []kvindex.WorkerRank) []Rank {
	for _, w := range workers {
		dst = append(dst, Rank{key: w, r: l.rankFor(w)})
	}
	return dst
}

// AppendLoads appends to dst, for each of workers in order, its load, the
// number of seqs it does not have active (as NewBlocks) and a Stamp of what was
// read, and returns the extended slice. It is AppendRankLoads with one lookup
// by name per candidate (unresolved handles).
func (l *Ledger) AppendLoads(dst []CandidateLoad, workers []kvindex.WorkerRank, seqs []uint64) []CandidateLoad {
	refs := make([]Rank, len(workers))
	for i, w := range workers {
		refs[i].key = w
	}
	return l.AppendRankLoads(dst, refs, seqs)
}

// AppendRankLoads appends to dst, for each of ranks in order, its load, the
// number of seqs it does not have active (as NewBlocks) and a Stamp of what was
// read, and returns the extended slice. Its cost is one pass over seqs, one
// index lookup per distinct hash when any candidate has active blocks, one
// increment per worker rank holding each of them, and a few atomic reads per
// candidate; never one lookup per (candidate, hash). It takes no lock a Book or
// Free holds for long: candidates' loads are read without their locks, the
// block index a stripe at a time. The selection service calls it on its hot
// path.
//
// Each candidate's load is read at one point; different candidates' at nearby
// points, and a candidate being booked concurrently may be read mid-change
// (BookAt then refuses a booking on it).
func (l *Ledger) AppendRankLoads(dst []CandidateLoad, ranks []Rank, seqs []uint64) []CandidateLoad {
	if len(ranks) == 0 {
		return dst
	}
	base := len(dst)
	dst = slices.Grow(dst, len(ranks))[:base+len(ranks)]
	sc := scratchPool.Get().(*requestScratch)
	slots := slices.Grow(sc.slots[:0], len(ranks))[:len(ranks)]
	anyBlocks := false
	for i, k := range ranks {
		c := &dst[base+i]
		c.Worker = k.key
		slots[i] = -1
		r := k.r
		if r == nil || r.dead.Load() { // no entry when resolved, or removed since: by name
			r = l.lookup(k.key)
		}
		if r == nil {
			c.Load, c.Stamp = Load{}, Stamp{}
			continue
		}
		// The version first: a Book that starts after it changes it.
		c.Stamp = Stamp{r: r, v: r.version.Load()}
		shared := r.blocks.Load()
		c.Load = Load{
			ActivePrefillTokens: r.prefill.Load(),
			ActiveBlocks:        int(shared + r.private.Load()),
			ActiveRequests:      int(r.requests.Load()),
		}
		slots[i] = r.slot
		anyBlocks = anyBlocks || shared > 0
	}
	// Read after the candidates: every slot they hold is below it.
	nslots := l.nextSlot.Load()
	distinct := l.scanRequest(sc, seqs, nslots, anyBlocks)
	for i, slot := range slots {
		c := &dst[base+i]
		c.NewBlocks = distinct
		if slot >= 0 {
			c.NewBlocks -= min(sc.shared(slot), distinct)
		}
	}
	sc.slots = slots
	scratchPool.Put(sc)
	return dst
}

// scratchPool recycles the per-call scratch of scanRequest.
var scratchPool = sync.Pool{New: func() any { return new(requestScratch) }}

// scanRequest deduplicates seqs into sc and, when lookup is set, counts per slot
// (below slots) how many of the distinct hashes it has active, locking one
// block stripe at a time. It returns the number of distinct hashes; the counts
// are valid until sc's next use.
func (l *Ledger) scanRequest(sc *requestScratch, seqs []uint64, slots int32, lookup bool) int {
	sc.begin(len(seqs), slots)
	uniq := sc.uniq[:0]
	for _, h := range seqs {
		if sc.add(h) {
			uniq = append(uniq, h)
		}
	}
	sc.uniq = uniq
	if !lookup || len(uniq) == 0 {
		return len(uniq)
	}
	sorted := l.byStripe(sc.sorted, uniq, &sc.runs)
	sc.sorted = sorted
	for s := range l.blocks {
		from, to := sc.runs.span(s)
		if from == to {
			continue
		}
		st := &l.blocks[s]
		st.mu.Lock()
		if st.a.live() > 0 {
			for _, h := range sorted[from:to] {
				if e := st.a.holders(h); e != nil {
					sc.credit(e)
				}
			}
		}
		st.mu.Unlock()
	}
	return len(uniq)
}

// Get returns a snapshot of the live booking id, and false when there is none.
func (l *Ledger) Get(id string) (Reservation, bool) {
	bk := l.find(id)
	if bk == nil {
		return Reservation{}, false
	}
	r := bk.rank
	r.mu.Lock()
	defer r.mu.Unlock()
	if bk.settled {
		return Reservation{}, false
	}
	return Reservation{
		ID:                   bk.id,
		Worker:               bk.worker,
		PrefillTokens:        bk.prefill,
		PrefillDone:          bk.prefillDone,
		ExpectedOutputTokens: bk.expected,
		Blocks:               len(bk.buf.seqs),
		PrivateBlocks:        bk.private,
		Lease:                bk.lease,
		BookedAt:             bk.bookedAt,
		Deadline:             bk.deadline,
	}, true
}

// Loads returns a snapshot of the load of every worker rank that has any (each
// worker rank's read at one point); worker ranks without live bookings are
// absent.
func (l *Ledger) Loads() map[kvindex.WorkerRank]Load {
	out := make(map[kvindex.WorkerRank]Load)
	for _, r := range l.rankList() {
		r.mu.Lock()
		if r.head != nil && !r.dead.Load() {
			out[r.key] = r.load()
		}
		r.mu.Unlock()
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
