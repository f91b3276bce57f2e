package reservation

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

// TestConcurrentBookAndFree has many goroutines book, complete prefill, touch and
// free requests with overlapping prefixes on shared workers, some with private
// blocks and some with nothing but private blocks, while others read loads,
// expire leases and remove a worker. At the end every load must be exactly zero
// (private blocks included: each is removed exactly once whichever call settles
// its booking) and every booking settled exactly once.
func TestConcurrentBookAndFree(t *testing.T) {
	const (
		goroutines = 16
		perG       = 300
	)
	clk := newFakeClock()
	var lowered atomic.Int64
	l := newLedger(t, Options{Now: clk.Now, DefaultLease: time.Minute, OnChange: func(catalog.WorkerRank) { lowered.Add(1) }})
	workers := make([]catalog.WorkerRank, 8)
	for i := range workers {
		workers[i] = wr(fmt.Sprint("w", i%4), i/4)
	}
	prefix := make([]uint64, 64)
	for i := range prefix {
		prefix[i] = uint64(1000 + i)
	}

	ranks := l.AppendRanks(nil, workers) // handles, some of which RemoveWorker kills
	var bookers, others sync.WaitGroup
	stop := make(chan struct{})
	var freedByMe, lostToExpiry, lostToRemoval atomic.Int64
	halfway := make(chan struct{}) // booker 0 closes it half way through

	for g := range goroutines {
		bookers.Add(1)
		go func() {
			defer bookers.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			for i := range perG {
				if g == 0 && i == perG/2 {
					close(halfway)
				}
				id := fmt.Sprintf("g%d-%d", g, i)
				seqs := append([]uint64(nil), prefix[:rng.IntN(len(prefix))]...)
				for range rng.IntN(8) {
					seqs = append(seqs, rng.Uint64())
				}
				private := 0
				switch rng.IntN(3) {
				case 1: // a partial last block or a few
					private = rng.IntN(4)
				case 2: // a request whose blocks are never shared: no hashes at all
					seqs, private = nil, 1+rng.IntN(128)
				}
				lease := time.Duration(0)
				if rng.IntN(10) == 0 {
					lease = time.Second // some bookings will be expired by the sweeper
				}
				b := Booking{ID: ID(id), SeqHashes: seqs, PrivateBlocks: private, PrefillTokens: 1 + rng.IntN(500), Lease: lease}
				if rng.IntN(2) == 0 {
					b.Worker = workers[rng.IntN(len(workers))]
					if err := l.Book(b); err != nil {
						t.Errorf("book %s: %v", id, err)
						return
					}
				} else if !decideAndBook(t, l, ranks, b, rng) {
					return
				}
				_ = l.AppendLoads(nil, workers, seqs)
				if rng.IntN(2) == 0 {
					_ = l.PrefillComplete(ID(id)) // may already be expired or removed
				}
				if rng.IntN(4) == 0 {
					_ = l.Touch(ID(id))
				}
				if rng.IntN(4) == 0 {
					_ = l.AddOutputBlocks(ID(id), 1+rng.IntN(3))
				}
				if rng.IntN(4) == 0 { // served elsewhere; may already be expired or removed
					if _, err := l.Move(ID(id), workers[rng.IntN(len(workers))]); err != nil && !errors.Is(err, ErrUnknownReservation) {
						t.Errorf("move %s: %v", id, err)
					}
				}
				switch err := l.Free(ID(id)); {
				case err == nil:
					freedByMe.Add(1)
				case errors.Is(err, ErrUnknownReservation):
					// Settled by the sweeper or the worker removal first.
				default:
					t.Errorf("free %s: %v", id, err)
				}
			}
		}()
	}

	// The sweeper: moves the fake clock and expires, as a selection service's
	// sweeper goroutine would.
	others.Add(1)
	go func() {
		defer others.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			lostToExpiry.Add(int64(l.Expire(clk.Advance(100 * time.Millisecond))))
			for w, ld := range l.loads() {
				if ld.ActiveRequests <= 0 || ld.ActiveBlocks < 0 || ld.ActivePrefillTokens < 0 {
					t.Errorf("load of %s mid-run: %+v", w, ld)
				}
			}
			_ = l.Stats()
		}
	}()
	// A worker deleted mid-run.
	others.Add(1)
	go func() {
		defer others.Done()
		<-halfway
		for range 3 {
			lostToRemoval.Add(int64(l.RemoveWorker("w3")))
		}
	}()

	// Wait for the bookers, then stop the sweeper and wait for it too.
	bookers.Wait()
	close(stop)
	others.Wait()

	// Every booker freed its own booking unless the sweeper or the removal
	// settled it first, so nothing should be live; a final sweep far in the
	// future must find nothing either.
	require.Equal(t, 0, l.Expire(clk.Advance(time.Hour)))
	require.Empty(t, l.loads())
	for _, w := range workers {
		require.Equal(t, Load{}, l.Load(w))
	}
	st := l.Stats()
	require.Equal(t, int64(goroutines*perG), st.Booked)
	require.Equal(t, int64(0), st.Active)
	require.Equal(t, freedByMe.Load(), st.Freed)
	require.Equal(t, lostToExpiry.Load(), st.Expired)
	require.Equal(t, lostToRemoval.Load(), st.Removed)
	require.Equal(t, st.Booked, st.Freed+st.Expired+st.Removed, "every booking settled exactly once")
	require.Positive(t, lowered.Load())
	checkInvariants(t, l)
	require.Zero(t, liveBlocks(l))
	t.Logf("freed %d, expired %d, removed %d, conflicts %d", st.Freed, st.Expired, st.Removed, st.Conflicts)
}

// decideAndBook books b the way the selection service does: it reads the
// candidates through their handles, checks what it read, picks one and books it
// with BookAt, reading again whenever the pick was booked since. It reports
// false after a t.Errorf.
func decideAndBook(t *testing.T, l *Ledger, ranks []Rank, b Booking, rng *rand.Rand) bool {
	distinct := map[uint64]bool{}
	for _, h := range b.SeqHashes {
		distinct[h] = true
	}
	for {
		loads := l.AppendRankLoads(nil, ranks, b.SeqHashes)
		for _, c := range loads {
			if c.NewBlocks < 0 || c.NewBlocks > len(distinct) || c.Load.ActiveBlocks < 0 || c.Load.ActiveRequests < 0 || c.Load.ActivePrefillTokens < 0 {
				t.Errorf("read of %s mid-run: %+v (%d distinct hashes)", c.Worker, c, len(distinct))
				return false
			}
		}
		pick := loads[rng.IntN(len(loads))]
		b.Worker = pick.Worker
		switch err := l.BookAt(b, pick.Stamp); {
		case err == nil:
			return true
		case errors.Is(err, ErrStale):
			continue
		default:
			t.Errorf("book %s: %v", b.ID, err)
			return false
		}
	}
}
