package reservation

import (
	"math"
	"slices"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/clocktest"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeClock is a Clock the test moves by hand.
type fakeClock = clocktest.Clock

var epoch = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func newFakeClock() *fakeClock { return clocktest.New(epoch) }

func wr(worker string, rank int) catalog.WorkerRank {
	return catalog.WorkerRank{WorkerID: worker, Rank: rank}
}

func newLedger(t testing.TB, opts Options) *Ledger {
	t.Helper()
	l, err := New(opts)
	require.NoError(t, err)
	return l
}

type ref struct {
	h    uint64
	slot int32
}

// lockAll takes every lock of l (registry, worker ranks, id stripes, block
// stripes) and returns the function that releases them. Only for a quiescent
// ledger: the order differs from the calls'.
func lockAll(l *Ledger) func() {
	l.regMu.Lock()
	var ranks []*rankState
	for _, r := range l.ranks {
		r.mu.Lock()
		ranks = append(ranks, r)
	}
	for i := range l.ids {
		l.ids[i].mu.Lock()
	}
	for i := range l.blocks {
		l.blocks[i].mu.Lock()
	}
	return func() {
		for i := range l.blocks {
			l.blocks[i].mu.Unlock()
		}
		for i := range l.ids {
			l.ids[i].mu.Unlock()
		}
		for _, r := range ranks {
			r.mu.Unlock()
		}
		l.regMu.Unlock()
	}
}

// blockCounts sums the block index over its stripes: live and idle entries,
// all entries, and slab entries (in use or free).
func blockCounts(l *Ledger) (live, idle, entries, slab int) {
	for i := range l.blocks {
		st := &l.blocks[i]
		st.mu.Lock()
		live += st.a.live()
		idle += st.a.idle
		entries += st.a.index.len()
		slab += len(st.a.slab)
		st.mu.Unlock()
	}
	return live, idle, entries, slab
}

func liveBlocks(l *Ledger) int { live, _, _, _ := blockCounts(l); return live }

// checkInvariants recomputes every derived quantity of l from its live bookings
// and compares it with what l maintains: per worker rank loads, booking lists
// and lease trees, the inverted block index with its reference counts (which
// must hold no private block) and its stripes, the slots and the Active
// counter. The ledger must be quiescent.
func checkInvariants(t testing.TB, l *Ledger) {
	t.Helper()
	unlock := lockAll(l)
	defer unlock()

	wantRefs := map[ref]int32{}
	wantLoads := map[*rankState]Load{}
	distinct := map[*rankState]map[uint64]struct{}{}
	nbookings := 0
	for i := range l.ids {
		for id, bk := range l.ids[i].m {
			nbookings++
			require.Same(t, &l.ids[i], l.idStripe(id), "booking %q in the wrong id stripe", id)
			require.Equal(t, id, bk.id)
			require.False(t, bk.settled, "booking %q settled but listed", id)
			require.NotNil(t, bk.buf, "booking %q has no hashes", id)
			r := bk.rank
			require.Same(t, r, l.ranks[bk.worker], "booking %q on an unregistered rank", id)
			require.Equal(t, bk.worker, r.key)
			seqs, idx := bk.buf.seqs, bk.buf.idx
			require.Len(t, idx, len(seqs))
			require.True(t, slices.IsSortedFunc(seqs, func(a, b uint64) int { return stripeOf(a, l.stripeSeed) - stripeOf(b, l.stripeSeed) }), "booking %q: hashes not grouped by stripe", id)
			require.GreaterOrEqual(t, bk.private, 0, "booking %q", id)
			ld := wantLoads[r]
			ld.ActiveRequests++
			ld.ActiveBlocks += bk.private // the distinct shared hashes are added below
			if !bk.prefillDone {
				ld.ActivePrefillTokens += int64(bk.prefill)
			}
			if distinct[r] == nil {
				distinct[r] = map[uint64]struct{}{}
			}
			for j, h := range seqs {
				distinct[r][h] = struct{}{}
				wantRefs[ref{h, r.slot}]++
				e, ok := l.blocks[stripeOf(h, l.stripeSeed)].a.index.get(h)
				require.True(t, ok, "booking %q: hash %d not active", id, h)
				require.Equal(t, e, idx[j], "booking %q: stale entry index", id)
			}
			wantLoads[r] = ld
			require.LessOrEqual(t, bk.bookedAt.Add(bk.lease).Compare(bk.deadline), 0, "deadline before booked-at + lease")
		}
	}
	for r, set := range distinct {
		ld := wantLoads[r]
		ld.ActiveBlocks += len(set)
		wantLoads[r] = ld
	}

	slots := map[int32]bool{}
	byWorker := 0
	for name, rs := range l.byWorker {
		require.NotEmpty(t, rs, "empty rank list of %s kept", name)
		for _, r := range rs {
			require.Same(t, r, l.ranks[r.key], "rank %s listed under %s", r.key, name)
			byWorker++
		}
	}
	require.Equal(t, len(l.ranks), byWorker)
	for k, r := range l.ranks {
		require.Equal(t, k, r.key)
		require.False(t, r.dead.Load())
		require.False(t, slots[r.slot], "slot %d used twice", r.slot)
		slots[r.slot] = true
		require.Equal(t, wantLoads[r], r.load(), "load of %s", k)
		require.Zero(t, r.version.Load()%2, "%s left mid-booking", k)
		checkRank(t, l, r)
	}
	checkBlocks(t, l, wantRefs)

	for _, s := range l.freeSlots {
		require.False(t, slots[s], "free slot %d in use", s)
		slots[s] = true
	}
	require.Len(t, slots, int(l.nextSlot.Load()))
	require.Equal(t, int64(nbookings), l.active.Load())
}

func checkRank(t testing.TB, l *Ledger, r *rankState) {
	t.Helper()
	n, private := 0, 0
	var prev *booking
	for bk := r.head; bk != nil; bk = bk.next {
		require.Same(t, prev, bk.prev)
		require.Same(t, r, bk.rank)
		require.Same(t, bk, l.idStripe(bk.id).m[bk.id], "listed booking %q not live", bk.id)
		prev = bk
		n++
		private += bk.private
	}
	require.Equal(t, int(r.requests.Load()), n, "list length of %s", r.key)
	require.Equal(t, int64(private), r.private.Load(), "private blocks of %s", r.key)
	require.GreaterOrEqual(t, r.prefill.Load(), int64(0))
	require.Equal(t, r.prefill.Load() > 0, r.clock.since.Load() != 0, "prefill clock of %s runs exactly while prefill is queued", r.key)
	require.GreaterOrEqual(t, math.Float64frombits(r.clock.slow.Load()), 0.0)
	require.GreaterOrEqual(t, r.blocks.Load(), int64(0))
	if r.leases == nil {
		require.Zero(t, n, "bookings of %s without a lease tree", r.key)
		return
	}
	require.Equal(t, n, r.leases.Len())
	var last *booking
	r.leases.Ascend(func(bk *booking) bool {
		require.Same(t, r, bk.rank)
		if last != nil {
			require.True(t, leaseLess(last, bk))
		}
		last = bk
		return true
	})
}

func checkBlocks(t testing.TB, l *Ledger, wantRefs map[ref]int32) {
	t.Helper()
	gotRefs := map[ref]int32{}
	for s := range l.blocks {
		a := &l.blocks[s].a
		n, idle := 0, 0
		a.index.all(func(h uint64, i int32) {
			n++
			require.Equal(t, s, stripeOf(h, l.stripeSeed), "hash %d in the wrong stripe", h)
			e := a.slab[i]
			require.Equal(t, h, e.hash)
			if e.first.refs == 0 { // idle: no holder at all
				require.Empty(t, e.more, "idle block %d has holders", h)
				require.True(t, e.listed, "idle block %d not listed for the sweep", h)
				idle++
				return
			}
			require.Positive(t, e.first.refs)
			gotRefs[ref{h, e.first.slot}] = e.first.refs
			require.True(t, slices.IsSortedFunc(e.more, func(a, b holder) int { return int(a.slot - b.slot) }), "holders of %d not sorted", h)
			for _, o := range e.more {
				require.Positive(t, o.refs)
				_, dup := gotRefs[ref{h, o.slot}]
				require.False(t, dup, "slot %d listed twice for %d", o.slot, h)
				gotRefs[ref{h, o.slot}] = o.refs
			}
		})
		require.Equal(t, a.index.len(), n)
		require.Equal(t, a.idle, idle)
		require.LessOrEqual(t, idle, maxIdle, "stripe %d: idle entries were not swept", s)
		require.Equal(t, len(a.slab), n+len(a.free))
		listed := map[int32]bool{}
		for _, i := range a.idleList {
			require.False(t, listed[i], "slab entry %d listed twice", i)
			listed[i] = true
			require.True(t, a.slab[i].listed)
		}
		for i := range a.slab {
			require.Equal(t, listed[int32(i)], a.slab[i].listed, "slab entry %d", i)
		}
	}
	require.Equal(t, wantRefs, gotRefs)
}

// newBlocks is AppendLoads for one worker rank: how many of seqs are not
// active on w.
func newBlocks(l *Ledger, w catalog.WorkerRank, seqs []uint64) int {
	return l.AppendLoads(make([]CandidateLoad, 0, 1), []catalog.WorkerRank{w}, seqs)[0].NewBlocks
}

// nextExpiry returns the earliest lease deadline among the live bookings, and
// false when there are none.
func (l *Ledger) nextExpiry() (time.Time, bool) {
	var next time.Time
	found := false
	for _, r := range l.rankList() {
		r.mu.Lock()
		if r.leases == nil {
			r.mu.Unlock()
			continue
		}
		if bk, ok := r.leases.Min(); ok && (!found || bk.deadline.Before(next)) {
			next, found = bk.deadline, true
		}
		r.mu.Unlock()
	}
	return next, found
}

// liveBooking is a snapshot of one live booking, as returned by get.
type liveBooking struct {
	ID                   string
	Worker               catalog.WorkerRank
	PrefillTokens        int
	PrefillDone          bool
	ExpectedOutputTokens int
	Blocks               int // sequence hashes the booking holds (as given, duplicates included)
	PrivateBlocks        int // blocks it holds outside the shared block index (Booking.PrivateBlocks)
	Lease                time.Duration
	BookedAt             time.Time
	Deadline             time.Time // Expire frees the booking at or after this time
}

// get returns a snapshot of the live booking id, and false when there is none.
func (l *Ledger) get(id string) (liveBooking, bool) {
	bk := l.find(ID(id))
	if bk == nil {
		return liveBooking{}, false
	}
	r := bk.rank
	r.mu.Lock()
	defer r.mu.Unlock()
	if bk.settled {
		return liveBooking{}, false
	}
	return liveBooking{
		ID:                   string(bk.id),
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

// loads returns a snapshot of the load of every worker rank that has any (each
// worker rank's read at one point); worker ranks without live bookings are
// absent.
func (l *Ledger) loads() map[catalog.WorkerRank]Load {
	out := make(map[catalog.WorkerRank]Load)
	for _, r := range l.rankList() {
		r.mu.Lock()
		if r.head != nil && !r.dead.Load() {
			out[r.key] = r.load()
		}
		r.mu.Unlock()
	}
	return out
}
