package reservation

import (
	"fmt"
	"sync"
	"testing"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

func TestBookAtRejectsABookingSinceTheRead(t *testing.T) {
	l := newLedger(t, Options{})
	a, b := wr("a", 0), wr("b", 0)
	loads := l.AppendLoads(nil, []catalog.WorkerRank{a, b}, []uint64{1, 2})
	seen := loads[0].Stamp
	require.Equal(t, seen, loads[1].Stamp, "neither rank booked yet: both zero")

	// Another decision books a after the read: a decision on a made from that
	// read is stale, one on b is not.
	require.NoError(t, l.Book(Booking{ID: "other", Worker: a, SeqHashes: []uint64{1}}))
	err := l.BookAt(Booking{ID: "mine", Worker: a, SeqHashes: []uint64{1, 2}}, seen)
	require.ErrorIs(t, err, ErrStale)
	require.ErrorContains(t, err, `"mine"`)
	_, ok := l.get("mine")
	require.False(t, ok, "a stale BookAt books nothing")
	require.Equal(t, Load{ActiveBlocks: 1, ActiveRequests: 1}, l.Load(a))
	require.Equal(t, int64(1), l.Stats().Stale)

	require.NoError(t, l.BookAt(Booking{ID: "mine", Worker: b, SeqHashes: []uint64{1, 2}}, seen))
	require.Equal(t, Load{ActiveBlocks: 2, ActiveRequests: 1}, l.Load(b))

	// A fresh read sees both bookings and may book a again.
	fresh := l.AppendLoads(nil, []catalog.WorkerRank{a}, []uint64{1, 2})
	require.Equal(t, 1, fresh[0].NewBlocks)
	require.NoError(t, l.BookAt(Booking{ID: "third", Worker: a, SeqHashes: []uint64{1, 2}}, fresh[0].Stamp))
	checkInvariants(t, l)
}

func TestBookAtAcceptsSettlementsSinceTheRead(t *testing.T) {
	l := newLedger(t, Options{})
	a := wr("a", 0)
	require.NoError(t, l.Book(Booking{ID: "old", Worker: a, SeqHashes: []uint64{7}, PrefillTokens: 10}))
	seen := l.AppendLoads(nil, []catalog.WorkerRank{a}, nil)[0].Stamp
	// Lowering a load (prefill done, free) does not make a decision stale, and
	// neither does a worker rank's entry being dropped and made again.
	require.NoError(t, l.PrefillComplete("old"))
	require.NoError(t, l.Free("old"))
	require.NoError(t, l.BookAt(Booking{ID: "new", Worker: a, SeqHashes: []uint64{7}}, seen))
	// ...but the entry remembers the booking it was made by.
	require.ErrorIs(t, l.BookAt(Booking{ID: "late", Worker: a}, seen), ErrStale)
	checkInvariants(t, l)
}

func TestBookAtRejectsAReadOfARemovedRank(t *testing.T) {
	l := newLedger(t, Options{})
	a := wr("a", 0)
	require.NoError(t, l.Book(Booking{ID: "old", Worker: a, SeqHashes: []uint64{7}}))
	seen := l.AppendLoads(nil, []catalog.WorkerRank{a}, nil)[0].Stamp
	require.Equal(t, 1, l.RemoveWorker("a"))
	// The worker comes back and is booked from a fresh read: the old read
	// names the removed entry, so it is stale even though the new entry has
	// had as many bookings as the old one had.
	fresh := l.AppendLoads(nil, []catalog.WorkerRank{a}, nil)[0].Stamp
	require.Equal(t, Stamp{}, fresh)
	require.NoError(t, l.BookAt(Booking{ID: "new", Worker: a}, fresh))
	require.ErrorIs(t, l.BookAt(Booking{ID: "late", Worker: a}, seen), ErrStale)
	checkInvariants(t, l)
}

func TestBookAtRejectsAReadMidBooking(t *testing.T) {
	l := newLedger(t, Options{})
	a := wr("a", 0)
	require.NoError(t, l.Book(Booking{ID: "x", Worker: a}))
	seen := l.AppendLoads(nil, []catalog.WorkerRank{a}, nil)[0].Stamp
	// A read taken while a Book was changing the entry carries an odd version,
	// which no finished Book leaves behind.
	mid := Stamp{r: seen.r, v: seen.v - 1}
	require.ErrorIs(t, l.BookAt(Booking{ID: "y", Worker: a}, mid), ErrStale)
	require.NoError(t, l.BookAt(Booking{ID: "y", Worker: a}, seen))
	checkInvariants(t, l)
}

func TestBookAtValidatesAndConflictsLikeBook(t *testing.T) {
	l := newLedger(t, Options{})
	a := wr("a", 0)
	require.NoError(t, l.Book(Booking{ID: "x", Worker: a}))
	seen := l.AppendLoads(nil, []catalog.WorkerRank{a}, nil)[0].Stamp
	require.ErrorIs(t, l.BookAt(Booking{ID: "", Worker: a}, seen), ErrInvalid)
	require.ErrorIs(t, l.BookAt(Booking{ID: "x", Worker: wr("b", 0)}, seen), ErrConflict)
}

// TestBookAtSerialises has goroutines race read-decide-BookAt on the same two
// worker ranks, each always choosing the less loaded one. Whatever the
// interleaving, an accepted decision must have been right on the loads at the
// moment it was booked: the rank it chose had no more requests than the other.
func TestBookAtSerialises(t *testing.T) {
	l := newLedger(t, Options{})
	ranks := []catalog.WorkerRank{wr("a", 0), wr("b", 0)}
	const goroutines, perG = 8, 200
	var mu sync.Mutex // serialises the check below with the bookings it checks
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perG {
				id := fmt.Sprintf("g%d-%d", g, i)
				for {
					loads := l.AppendLoads(nil, ranks, nil)
					pick, other := 0, 1
					if loads[1].Load.ActiveRequests < loads[0].Load.ActiveRequests {
						pick, other = 1, 0
					}
					mu.Lock()
					err := l.BookAt(Booking{ID: ID(id), Worker: ranks[pick]}, loads[pick].Stamp)
					if err == nil {
						// Now: the chosen rank has at most one more than the
						// other (nothing is freed in this test).
						p, o := l.Load(ranks[pick]).ActiveRequests, l.Load(ranks[other]).ActiveRequests
						if p > o+1 {
							t.Errorf("%s booked %s at %d requests while %s had %d", id, ranks[pick], p, ranks[other], o)
						}
					}
					mu.Unlock()
					if err == nil {
						break
					}
					require.ErrorIs(t, err, ErrStale)
				}
			}
		}()
	}
	wg.Wait()
	na, nb := l.Load(ranks[0]).ActiveRequests, l.Load(ranks[1]).ActiveRequests
	require.Equal(t, goroutines*perG, na+nb)
	require.LessOrEqual(t, max(na-nb, nb-na), 1, "balanced: every booking went to the less loaded rank")
	checkInvariants(t, l)
}

func TestIdleBlocksAreReusedThenSwept(t *testing.T) {
	l := newLedger(t, Options{})
	w := wr("w", 0)
	seqs := []uint64{11, 12, 13}
	require.NoError(t, l.Book(Booking{ID: "a", Worker: w, SeqHashes: seqs}))
	require.NoError(t, l.Free("a"))
	live, idle, _, slab := blockCounts(l)
	require.Zero(t, live)
	require.Equal(t, 3, idle, "freed blocks stay as idle entries")
	require.Equal(t, 3, newBlocks(l, w, seqs), "an idle block is not active anywhere")
	require.Equal(t, 3, l.AppendLoads(nil, []catalog.WorkerRank{w}, seqs)[0].NewBlocks)

	// Booking the prefix again re-activates the same entries.
	require.NoError(t, l.Book(Booking{ID: "b", Worker: w, SeqHashes: seqs}))
	_, idle, _, slabAgain := blockCounts(l)
	require.Equal(t, slab, slabAgain)
	require.Zero(t, idle)
	require.Equal(t, Load{ActiveBlocks: 3, ActiveRequests: 1}, l.Load(w))
	checkInvariants(t, l)

	// Many distinct freed blocks: each stripe sweeps its idle entries once
	// they outnumber maxIdle, keeping the live blocks.
	next := uint64(1000)
	for i := range 3 * blockStripes * maxIdle / 256 {
		hs := make([]uint64, 256)
		for j := range hs {
			hs[j] = next
			next++
		}
		id := fmt.Sprint("c", i)
		require.NoError(t, l.Book(Booking{ID: ID(id), Worker: w, SeqHashes: hs}))
		require.NoError(t, l.Free(ID(id)))
		_, idle, _, _ := blockCounts(l)
		require.LessOrEqual(t, idle, blockStripes*maxIdle)
	}
	live, idle, entries, _ := blockCounts(l)
	require.Positive(t, idle)
	require.LessOrEqual(t, entries, blockStripes*maxIdle+3)
	require.Equal(t, 3, live)
	checkInvariants(t, l)
	require.NoError(t, l.Free("b"))
	checkInvariants(t, l)
}

func TestRankHandles(t *testing.T) {
	l := newLedger(t, Options{})
	a, b := wr("a", 0), wr("b", 1)
	ranks := l.AppendRanks(nil, []catalog.WorkerRank{a, b})
	require.Equal(t, []catalog.WorkerRank{a, b}, []catalog.WorkerRank{ranks[0].key, ranks[1].key})
	require.Empty(t, l.loads(), "an entry made by AppendRanks has no load to report")
	require.NoError(t, l.Book(Booking{ID: "x", Worker: a, SeqHashes: []uint64{1, 2}, PrefillTokens: 5}))

	byHandle := l.AppendRankLoads(nil, ranks, []uint64{1, 2, 3})
	byName := l.AppendLoads(nil, []catalog.WorkerRank{a, b}, []uint64{1, 2, 3})
	require.Equal(t, byName, byHandle)
	require.Equal(t, 1, byHandle[0].NewBlocks)
	require.Equal(t, 3, byHandle[1].NewBlocks)
	require.NoError(t, l.BookAt(Booking{ID: "y", Worker: b}, byHandle[1].Stamp), "b was read through its handle and not booked since")

	// The worker goes and comes back: the old handle still reads the worker
	// rank's current entry, found again by name.
	require.Equal(t, 1, l.RemoveWorker("a"))
	require.NoError(t, l.Book(Booking{ID: "z", Worker: a, SeqHashes: []uint64{1}}))
	got := l.AppendRankLoads(nil, ranks[:1], []uint64{1, 2, 3})
	require.Equal(t, Load{ActiveBlocks: 1, ActiveRequests: 1}, got[0].Load)
	require.Equal(t, 2, got[0].NewBlocks)
	require.NoError(t, l.BookAt(Booking{ID: "w", Worker: a}, got[0].Stamp))
	require.ErrorIs(t, l.BookAt(Booking{ID: "v", Worker: a}, byHandle[0].Stamp), ErrStale, "a read of the removed entry")

	// Removed and not back: the handle reads nothing.
	require.Equal(t, 2, l.RemoveWorker("a"))
	got = l.AppendRankLoads(nil, ranks[:1], []uint64{1})
	require.Equal(t, []CandidateLoad{{Worker: a, NewBlocks: 1}}, got)
	checkInvariants(t, l)
}
