package reservation

import (
	"github.com/kvselect/kvselect/internal/clocktest"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/kvindex"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeClock is a Clock the test moves by hand.
type fakeClock = clocktest.Clock

var epoch = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func newFakeClock() *fakeClock { return clocktest.New(epoch) }

func wr(worker string, rank int) kvindex.WorkerRank {
	return kvindex.WorkerRank{Worker: worker, Rank: rank}
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

// checkInvariants recomputes every derived quantity of l from its live bookings
// and compares it with what l maintains: per worker rank loads, the inverted block
// index with its reference counts (which must hold no private block), the lease
// tree, the slots and the Active counter.
func checkInvariants(t testing.TB, l *Ledger) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()

	wantRefs := map[ref]int32{}
	wantLoads := map[kvindex.WorkerRank]Load{}
	distinct := map[kvindex.WorkerRank]map[uint64]struct{}{}
	for id, bk := range l.bookings {
		require.Equal(t, id, bk.id)
		require.NotNil(t, bk.wl, "booking %q has no worker load", id)
		require.Equal(t, bk.worker, bk.wl.key)
		require.Same(t, bk.wl, l.lookup(bk.worker))
		require.Len(t, bk.idx, len(bk.seqs))
		require.GreaterOrEqual(t, bk.private, 0, "booking %q", id)
		ld := wantLoads[bk.worker]
		ld.ActiveRequests++
		ld.ActiveBlocks += bk.private // the distinct shared hashes are added below
		if !bk.prefillDone {
			ld.ActivePrefillTokens += int64(bk.prefill)
		}
		if distinct[bk.worker] == nil {
			distinct[bk.worker] = map[uint64]struct{}{}
		}
		for _, h := range bk.seqs {
			distinct[bk.worker][h] = struct{}{}
			wantRefs[ref{h, bk.wl.slot}]++
		}
		wantLoads[bk.worker] = ld
		require.LessOrEqual(t, bk.bookedAt.Add(bk.lease).Compare(bk.deadline), 0, "deadline before booked-at + lease")
	}
	for w, set := range distinct {
		ld := wantLoads[w]
		ld.ActiveBlocks += len(set)
		wantLoads[w] = ld
	}

	gotLoads := map[kvindex.WorkerRank]Load{}
	slots := map[int32]bool{}
	for name, head := range l.workers {
		require.NotNil(t, head, "empty rank list of %s kept", name)
		for wl := head; wl != nil; wl = wl.nextRank {
			require.Equal(t, name, wl.key.Worker)
			require.Same(t, wl, l.lookup(wl.key), "rank %d of %s listed twice", wl.key.Rank, name)
			checkWorkerLoad(t, wl, slots)
			gotLoads[wl.key] = wl.load()
		}
	}
	require.Equal(t, wantLoads, gotLoads)
	for id, bk := range l.bookings {
		for i, h := range bk.seqs {
			j, ok := l.blocks.index.get(h)
			require.True(t, ok, "booking %q: hash %d not active", id, h)
			require.Equal(t, j, bk.idx[i], "booking %q: stale entry index", id)
		}
	}
	checkBlocks(t, l, wantRefs, slots)
}

func checkWorkerLoad(t testing.TB, wl *workerLoad, slots map[int32]bool) {
	t.Helper()
	require.False(t, slots[wl.slot], "slot %d used twice", wl.slot)
	slots[wl.slot] = true
	n, private := 0, 0
	var prev *booking
	for bk := wl.head; bk != nil; bk = bk.next {
		require.Same(t, prev, bk.prev)
		require.Same(t, wl, bk.wl)
		prev = bk
		n++
		private += bk.private
	}
	require.Equal(t, wl.requests, n, "list length of %s", wl.key)
	require.Equal(t, private, wl.private, "private blocks of %s", wl.key)
	require.Positive(t, wl.requests)
	require.GreaterOrEqual(t, wl.prefill, int64(0))
	require.GreaterOrEqual(t, wl.blocks, 0)
}

func checkBlocks(t testing.TB, l *Ledger, wantRefs map[ref]int32, slots map[int32]bool) {
	t.Helper()

	gotRefs := map[ref]int32{}
	n, idle := 0, 0
	l.blocks.index.all(func(h uint64, i int32) {
		n++
		e := l.blocks.slab[i]
		if e.first.refs == 0 { // idle: no holder at all
			require.Empty(t, e.more, "idle block %d has holders", h)
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
	require.Equal(t, wantRefs, gotRefs)
	require.Equal(t, l.blocks.index.len(), n)
	require.Equal(t, l.blocks.idle, idle)
	require.True(t, idle <= maxIdle || idle <= n-idle, "%d idle entries for %d live ones were not swept", idle, n-idle)
	require.Equal(t, len(l.blocks.slab), n+len(l.blocks.free))

	for _, s := range l.freeSlots {
		require.False(t, slots[s], "free slot %d in use", s)
		slots[s] = true
	}
	require.Len(t, slots, int(l.nextSlot))

	require.Equal(t, len(l.bookings), l.leases.Len())
	var last *booking
	l.leases.Ascend(func(bk *booking) bool {
		require.Same(t, bk, l.bookings[bk.id])
		if last != nil {
			require.True(t, leaseLess(last, bk))
		}
		last = bk
		return true
	})
	require.Equal(t, int64(len(l.bookings)), l.active.Load())
}
