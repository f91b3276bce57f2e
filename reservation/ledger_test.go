package reservation

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

func TestNewOptions(t *testing.T) {
	tests := []struct {
		name      string
		opts      Options
		wantErr   string
		wantLease time.Duration
	}{
		{name: "zero means defaults", opts: Options{}, wantLease: DefaultLease},
		{name: "explicit lease", opts: Options{DefaultLease: time.Minute}, wantLease: time.Minute},
		{name: "negative lease", opts: Options{DefaultLease: -time.Second}, wantErr: "DefaultLease -1s is negative"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l, err := New(tc.opts)
			if tc.wantErr != "" {
				require.ErrorIs(t, err, ErrInvalidOptions)
				require.ErrorContains(t, err, "reservation: invalid options")
				require.ErrorContains(t, err, tc.wantErr)
				require.Nil(t, l)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.wantLease, l.defaultLease)
			require.NotNil(t, l.now)
		})
	}
}

func TestDefaultClockAndLease(t *testing.T) {
	l := newLedger(t, Options{})
	before := time.Now()
	require.NoError(t, l.Book(Booking{ID: "a", Worker: wr("w", 0)}))
	after := time.Now()
	r, ok := l.get("a")
	require.True(t, ok)
	require.False(t, r.BookedAt.Before(before))
	require.False(t, r.BookedAt.After(after))
	require.Equal(t, DefaultLease, r.Lease)
	require.Equal(t, r.BookedAt.Add(DefaultLease), r.Deadline)
}

func TestBookValidation(t *testing.T) {
	good := Booking{ID: "r1", Worker: wr("w", 0), SeqHashes: []uint64{1}, PrefillTokens: 5}
	tests := []struct {
		name  string
		edit  func(*Booking)
		wants []string
	}{
		{name: "empty id", edit: func(b *Booking) { b.ID = "" }, wants: []string{"ID is empty"}},
		{name: "empty worker", edit: func(b *Booking) { b.Worker.WorkerID = "" }, wants: []string{"Worker.WorkerID is empty"}},
		{name: "negative rank", edit: func(b *Booking) { b.Worker.Rank = -1 }, wants: []string{"Worker.Rank -1 is negative"}},
		{name: "negative prefill", edit: func(b *Booking) { b.PrefillTokens = -3 }, wants: []string{"PrefillTokens -3 is negative"}},
		{name: "negative output", edit: func(b *Booking) { b.ExpectedOutputTokens = -1 }, wants: []string{"ExpectedOutputTokens -1 is negative"}},
		{name: "negative lease", edit: func(b *Booking) { b.Lease = -time.Second }, wants: []string{"Lease -1s is negative"}},
		{name: "negative private blocks", edit: func(b *Booking) { b.PrivateBlocks = -2 }, wants: []string{"PrivateBlocks -2 is negative"}},
		{
			name: "every problem reported",
			edit: func(b *Booking) {
				*b = Booking{Worker: wr("", -2), PrefillTokens: -1, ExpectedOutputTokens: -1, PrivateBlocks: -1, Lease: -1}
			},
			wants: []string{
				"ID is empty", "Worker.WorkerID is empty", "Worker.Rank -2 is negative", "PrefillTokens -1 is negative",
				"ExpectedOutputTokens -1 is negative", "PrivateBlocks -1 is negative", "Lease -1ns is negative",
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l := newLedger(t, Options{Now: newFakeClock().Now})
			b := good
			tc.edit(&b)
			err := l.Book(b)
			require.ErrorIs(t, err, ErrInvalid)
			require.ErrorContains(t, err, "reservation: invalid booking")
			for _, w := range tc.wants {
				require.ErrorContains(t, err, w)
			}
			require.Empty(t, l.loads())
			require.Equal(t, Stats{Invalid: 1}, l.Stats())
			checkInvariants(t, l)
		})
	}
	t.Run("valid edge values", func(t *testing.T) {
		l := newLedger(t, Options{Now: newFakeClock().Now})
		require.NoError(t, l.Book(Booking{ID: "x", Worker: wr("w", 0)}))
		require.Equal(t, Load{ActiveRequests: 1}, l.Load(wr("w", 0)))
		checkInvariants(t, l)
	})
}

func TestLifecycle(t *testing.T) {
	clk := newFakeClock()
	var changes []catalog.WorkerRank
	l := newLedger(t, Options{Now: clk.Now, OnChange: func(w catalog.WorkerRank) { changes = append(changes, w) }})
	w := wr("pod-a", 1)

	require.NoError(t, l.Book(Booking{ID: "req-1", Worker: w, SeqHashes: []uint64{11, 12, 13, 14}, PrefillTokens: 100, ExpectedOutputTokens: 20, Lease: time.Minute}))
	require.Equal(t, Load{ActivePrefillTokens: 100, ActiveBlocks: 4, ActiveRequests: 1}, l.Load(w))
	require.Equal(t, map[catalog.WorkerRank]Load{w: {100, 4, 1}}, l.loads())
	r, ok := l.get("req-1")
	require.True(t, ok)
	require.Equal(t, liveBooking{
		ID: "req-1", Worker: w, PrefillTokens: 100, ExpectedOutputTokens: 20, Blocks: 4,
		Lease: time.Minute, BookedAt: epoch, Deadline: epoch.Add(time.Minute),
	}, r)
	require.Empty(t, changes, "booking raises load and notifies nobody")
	checkInvariants(t, l)

	require.NoError(t, l.PrefillComplete("req-1"))
	require.Equal(t, Load{ActiveBlocks: 4, ActiveRequests: 1}, l.Load(w))
	r, _ = l.get("req-1")
	require.True(t, r.PrefillDone)
	require.Equal(t, []catalog.WorkerRank{w}, changes)

	require.NoError(t, l.PrefillComplete("req-1"), "second prefill complete is a no-op")
	require.Equal(t, Load{ActiveBlocks: 4, ActiveRequests: 1}, l.Load(w))
	require.Len(t, changes, 1)
	checkInvariants(t, l)

	require.NoError(t, l.Free("req-1"))
	require.Equal(t, Load{}, l.Load(w))
	require.Empty(t, l.loads())
	_, ok = l.get("req-1")
	require.False(t, ok)
	_, ok = l.nextExpiry()
	require.False(t, ok)
	require.Equal(t, []catalog.WorkerRank{w, w}, changes)
	require.Equal(t, Stats{Booked: 1, PrefillCompleted: 1, Freed: 1}, l.Stats())
	checkInvariants(t, l)

	// The id can be booked again once freed.
	require.NoError(t, l.Book(Booking{ID: "req-1", Worker: w, PrefillTokens: 7}))
	require.Equal(t, Load{ActivePrefillTokens: 7, ActiveRequests: 1}, l.Load(w))
}

func TestFreeWithoutPrefillComplete(t *testing.T) {
	l := newLedger(t, Options{Now: newFakeClock().Now})
	w := wr("w", 0)
	require.NoError(t, l.Book(Booking{ID: "a", Worker: w, SeqHashes: []uint64{1, 2}, PrefillTokens: 30}))
	require.NoError(t, l.Book(Booking{ID: "b", Worker: w, SeqHashes: []uint64{3}, PrefillTokens: 12}))
	require.Equal(t, Load{ActivePrefillTokens: 42, ActiveBlocks: 3, ActiveRequests: 2}, l.Load(w))
	require.NoError(t, l.Free("a"))
	require.Equal(t, Load{ActivePrefillTokens: 12, ActiveBlocks: 1, ActiveRequests: 1}, l.Load(w))
	checkInvariants(t, l)
}

func TestUnknownIDsChangeNothing(t *testing.T) {
	clk := newFakeClock()
	notified := 0
	l := newLedger(t, Options{Now: clk.Now, OnChange: func(catalog.WorkerRank) { notified++ }})
	require.NoError(t, l.Book(Booking{ID: "live", Worker: wr("w", 0), SeqHashes: []uint64{1, 2}, PrefillTokens: 9}))
	require.NoError(t, l.Book(Booking{ID: "freed", Worker: wr("w", 0), SeqHashes: []uint64{2, 3}, PrefillTokens: 4}))
	require.NoError(t, l.Free("freed"))
	require.NoError(t, l.Book(Booking{ID: "expired", Worker: wr("v", 0), SeqHashes: []uint64{5}, Lease: time.Second}))
	require.Equal(t, 1, l.Expire(clk.Advance(time.Second)))
	require.NoError(t, l.Book(Booking{ID: "removed", Worker: wr("gone", 0), SeqHashes: []uint64{5}}))
	require.Equal(t, 1, l.RemoveWorker("gone"))

	before := l.loads()
	beforeStats := l.Stats()
	beforeNotified := notified
	calls := []struct {
		name string
		call func(ID) error
		verb string
	}{
		{"Free", l.Free, "free"},
		{"PrefillComplete", l.PrefillComplete, "prefill complete for"},
		{"Touch", l.Touch, "touch"},
	}
	unknown := 0
	for _, c := range calls {
		for _, id := range []ID{"freed", "expired", "removed", "never", ""} {
			t.Run(c.name+"/"+string(id), func(t *testing.T) {
				err := c.call(id)
				unknown++
				require.ErrorIs(t, err, ErrUnknownReservation)
				require.ErrorContains(t, err, fmt.Sprintf("reservation: unknown reservation id: %s %q", c.verb, id))
				require.Equal(t, before, l.loads())
				checkInvariants(t, l)
			})
		}
	}
	want := beforeStats
	want.UnknownIDs += int64(unknown)
	require.Equal(t, want, l.Stats())
	require.Equal(t, beforeNotified, notified)
	r, ok := l.get("live")
	require.True(t, ok)
	require.False(t, r.PrefillDone)
}

func TestConflict(t *testing.T) {
	l := newLedger(t, Options{Now: newFakeClock().Now})
	a, b := wr("a", 0), wr("b", 2)
	require.NoError(t, l.Book(Booking{ID: "dup", Worker: a, SeqHashes: []uint64{1, 2}, PrefillTokens: 10}))
	before := l.loads()
	for _, w := range []catalog.WorkerRank{a, b} {
		err := l.Book(Booking{ID: "dup", Worker: w, SeqHashes: []uint64{7, 8, 9}, PrefillTokens: 99})
		require.ErrorIs(t, err, ErrConflict)
		require.ErrorContains(t, err, `reservation: id already booked: id "dup" is held on a/0 (asked for `+w.String()+")")
		require.Equal(t, before, l.loads())
		checkInvariants(t, l)
	}
	r, _ := l.get("dup")
	require.Equal(t, a, r.Worker)
	require.Equal(t, 10, r.PrefillTokens)
	st := l.Stats()
	require.Equal(t, int64(2), st.Conflicts)
	require.Equal(t, int64(1), st.Booked)
	require.Equal(t, int64(1), st.Active)
}

func TestSharedPrefixesAreRefCounted(t *testing.T) {
	l := newLedger(t, Options{Now: newFakeClock().Now})
	w, v := wr("w", 0), wr("v", 0)
	require.NoError(t, l.Book(Booking{ID: "a", Worker: w, SeqHashes: []uint64{1, 2, 3}}))
	require.NoError(t, l.Book(Booking{ID: "b", Worker: w, SeqHashes: []uint64{1, 2, 4}}))
	require.NoError(t, l.Book(Booking{ID: "c", Worker: v, SeqHashes: []uint64{1, 2, 3}}))
	require.Equal(t, 4, l.Load(w).ActiveBlocks, "1 and 2 are shared on w")
	require.Equal(t, 3, l.Load(v).ActiveBlocks, "other workers' blocks do not count")
	require.Equal(t, 1, newBlocks(l, w, []uint64{1, 2, 5}))
	require.Equal(t, 1, newBlocks(l, v, []uint64{1, 2, 4}))
	checkInvariants(t, l)

	require.NoError(t, l.Free("a"))
	require.Equal(t, 3, l.Load(w).ActiveBlocks, "1 and 2 still held by b")
	require.Equal(t, 1, newBlocks(l, w, []uint64{1, 2, 3}))
	require.Equal(t, 0, newBlocks(l, v, []uint64{1, 2, 3}))
	checkInvariants(t, l)

	require.NoError(t, l.Free("c"))
	require.NoError(t, l.Free("b"))
	require.Empty(t, l.loads())
	require.Zero(t, liveBlocks(l))
	checkInvariants(t, l)
}

func TestPrivateBlocks(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	w, v := wr("w", 0), wr("v", 0)
	// A request with a shared prefix and a private tail, a request with nothing
	// but private blocks, and another shared prefix on the same worker.
	require.NoError(t, l.Book(Booking{ID: "tail", Worker: w, SeqHashes: []uint64{1, 2}, PrivateBlocks: 1}))
	require.NoError(t, l.Book(Booking{ID: "private", Worker: w, PrivateBlocks: 128}))
	require.NoError(t, l.Book(Booking{ID: "shared", Worker: w, SeqHashes: []uint64{1, 2}, PrivateBlocks: 1}))
	require.NoError(t, l.Book(Booking{ID: "other", Worker: v, PrivateBlocks: 7, Lease: time.Second}))
	require.Equal(t, 2+1+128+1, l.Load(w).ActiveBlocks, "hashes shared, private blocks never")
	require.Equal(t, 7, l.Load(v).ActiveBlocks)
	require.Equal(t, 2, liveBlocks(l), "private blocks never enter the shared index")
	r, ok := l.get("private")
	require.True(t, ok)
	require.Zero(t, r.Blocks)
	require.Equal(t, 128, r.PrivateBlocks)
	r, _ = l.get("tail")
	require.Equal(t, 2, r.Blocks)
	require.Equal(t, 1, r.PrivateBlocks)
	// New blocks count hashes only: another request's private blocks are not
	// shareable, and an empty hash list adds nothing the ledger can see.
	require.Equal(t, 0, newBlocks(l, w, nil))
	require.Equal(t, 1, newBlocks(l, w, []uint64{1, 2, 3}))
	got := l.AppendLoads(nil, []catalog.WorkerRank{w, v}, nil)
	require.Equal(t, []CandidateLoad{
		{Worker: w, Load: Load{ActiveBlocks: 132, ActiveRequests: 3}, Stamp: got[0].Stamp},
		{Worker: v, Load: Load{ActiveBlocks: 7, ActiveRequests: 1}, Stamp: got[1].Stamp},
	}, got)
	checkInvariants(t, l)

	// Each settling call removes a booking's private blocks exactly once.
	require.NoError(t, l.Free("private"))
	require.Equal(t, 4, l.Load(w).ActiveBlocks)
	require.ErrorIs(t, l.Free("private"), ErrUnknownReservation)
	require.Equal(t, 4, l.Load(w).ActiveBlocks, "a double free removes nothing")
	require.NoError(t, l.Free("tail"))
	require.Equal(t, 3, l.Load(w).ActiveBlocks, "the prefix stays with shared, its tail went with tail")
	require.Equal(t, 1, l.Expire(clk.Advance(time.Second)))
	require.Equal(t, Load{}, l.Load(v))
	require.ErrorIs(t, l.Free("other"), ErrUnknownReservation)
	checkInvariants(t, l)
	require.Equal(t, 1, l.RemoveWorker("w"))
	require.Empty(t, l.loads())
	require.Zero(t, liveBlocks(l))
	checkInvariants(t, l)

	// Worker entries are recycled: a fresh booking starts from zero.
	require.NoError(t, l.Book(Booking{ID: "again", Worker: w, PrivateBlocks: 2}))
	require.Equal(t, Load{ActiveBlocks: 2, ActiveRequests: 1}, l.Load(w))
	checkInvariants(t, l)
}

func TestDuplicateHashesInOneBooking(t *testing.T) {
	l := newLedger(t, Options{Now: newFakeClock().Now})
	w := wr("w", 0)
	require.NoError(t, l.Book(Booking{ID: "a", Worker: w, SeqHashes: []uint64{5, 5, 6}}))
	require.Equal(t, 2, l.Load(w).ActiveBlocks)
	r, _ := l.get("a")
	require.Equal(t, 3, r.Blocks)
	require.NoError(t, l.Book(Booking{ID: "b", Worker: w, SeqHashes: []uint64{5}}))
	require.NoError(t, l.Free("a"))
	require.Equal(t, 1, l.Load(w).ActiveBlocks, "b's reference on 5 survives a's two")
	require.NoError(t, l.Free("b"))
	require.Empty(t, l.loads())
	checkInvariants(t, l)
}

func TestNewBlocks(t *testing.T) {
	l := newLedger(t, Options{Now: newFakeClock().Now})
	w := wr("w", 0)
	require.NoError(t, l.Book(Booking{ID: "a", Worker: w, SeqHashes: []uint64{10, 20, 30}}))
	tests := []struct {
		name   string
		worker catalog.WorkerRank
		seqs   []uint64
		want   int
	}{
		{"nil request", w, nil, 0},
		{"all active", w, []uint64{10, 20, 30}, 0},
		{"some new", w, []uint64{10, 20, 40, 50}, 2},
		{"all new", w, []uint64{1, 2}, 2},
		{"duplicates count once", w, []uint64{40, 40, 10, 10, 50}, 2},
		{"zero hash", w, []uint64{0, 0, 10}, 1},
		{"idle worker", wr("idle", 0), []uint64{10, 10, 20}, 2},
		{"other rank of the same worker", wr("w", 1), []uint64{10, 20}, 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, newBlocks(l, tc.worker, tc.seqs))
			got := l.AppendLoads(nil, []catalog.WorkerRank{tc.worker}, tc.seqs)
			require.Len(t, got, 1)
			require.Equal(t, tc.want, got[0].NewBlocks)
		})
	}
}

func TestNewBlocksLargeRequest(t *testing.T) {
	// Larger than any earlier request: the scratch set must grow.
	l := newLedger(t, Options{Now: newFakeClock().Now})
	w := wr("w", 0)
	require.Equal(t, 0, newBlocks(l, w, nil))
	seqs := make([]uint64, 5000)
	for i := range seqs {
		seqs[i] = uint64(i / 2) // every hash twice
	}
	require.NoError(t, l.Book(Booking{ID: "a", Worker: w, SeqHashes: seqs[:1000]}))
	require.Equal(t, 2500-500, newBlocks(l, w, seqs))
}

func TestAppendLoads(t *testing.T) {
	l := newLedger(t, Options{Now: newFakeClock().Now})
	a, b, c := wr("a", 0), wr("b", 0), wr("c", 3)
	require.NoError(t, l.Book(Booking{ID: "1", Worker: a, SeqHashes: []uint64{1, 2, 3}, PrefillTokens: 50}))
	require.NoError(t, l.Book(Booking{ID: "2", Worker: b, SeqHashes: []uint64{1, 9}, PrefillTokens: 8}))
	require.NoError(t, l.Book(Booking{ID: "3", Worker: b, SeqHashes: []uint64{1, 2}}))
	require.NoError(t, l.PrefillComplete("2"))

	prefix := []CandidateLoad{{Worker: wr("keep", 0)}}
	got := l.AppendLoads(prefix, []catalog.WorkerRank{a, b, c, a}, []uint64{1, 2, 3, 4})
	require.Len(t, got, 5)
	stamps := []Stamp{got[1].Stamp, got[2].Stamp, got[3].Stamp, got[4].Stamp}
	require.Equal(t, []CandidateLoad{
		{Worker: wr("keep", 0)},
		{Worker: a, Load: Load{ActivePrefillTokens: 50, ActiveBlocks: 3, ActiveRequests: 1}, NewBlocks: 1, Stamp: stamps[0]},
		{Worker: b, Load: Load{ActivePrefillTokens: 0, ActiveBlocks: 3, ActiveRequests: 2}, NewBlocks: 2, Stamp: stamps[1]},
		{Worker: c, NewBlocks: 4},
		{Worker: a, Load: Load{ActivePrefillTokens: 50, ActiveBlocks: 3, ActiveRequests: 1}, NewBlocks: 1, Stamp: stamps[0]},
	}, got)
	require.Equal(t, Stamp{}, stamps[2], "never booked: the zero stamp")
	require.NotEqual(t, stamps[0], stamps[1], "each rank has its own stamp")
	for _, cl := range got[1:] {
		require.Equal(t, l.Load(cl.Worker), cl.Load)
		require.Equal(t, newBlocks(l, cl.Worker, []uint64{1, 2, 3, 4}), cl.NewBlocks)
	}
	require.Equal(t, prefix, l.AppendLoads(prefix, nil, []uint64{1}))
	require.Equal(t, []CandidateLoad{{Worker: a, Load: l.Load(a), Stamp: stamps[0]}}, l.AppendLoads(nil, []catalog.WorkerRank{a}, nil))
	require.NoError(t, l.Book(Booking{ID: "4", Worker: a}))
	require.NotEqual(t, stamps[0], l.AppendLoads(nil, []catalog.WorkerRank{a}, nil)[0].Stamp, "a Book moves its rank's stamp")
	require.Equal(t, stamps[1], l.AppendLoads(nil, []catalog.WorkerRank{b}, nil)[0].Stamp, "and no other's")
}

func TestExpire(t *testing.T) {
	clk := newFakeClock()
	var order []catalog.WorkerRank
	l := newLedger(t, Options{Now: clk.Now, DefaultLease: 30 * time.Second, OnChange: func(w catalog.WorkerRank) { order = append(order, w) }})
	// Booked out of deadline order; each on its own worker so OnChange shows the
	// order in which Expire settles them.
	require.NoError(t, l.Book(Booking{ID: "late", Worker: wr("late", 0), SeqHashes: []uint64{1}, PrefillTokens: 3, Lease: 50 * time.Second}))
	require.NoError(t, l.Book(Booking{ID: "default", Worker: wr("default", 0), SeqHashes: []uint64{1}}))
	require.NoError(t, l.Book(Booking{ID: "early", Worker: wr("early", 0), SeqHashes: []uint64{2}, Lease: 10 * time.Second}))
	clk.Advance(5 * time.Second)
	require.NoError(t, l.Book(Booking{ID: "mid", Worker: wr("mid", 0), Lease: 5 * time.Second})) // deadline epoch+10s, ties with early
	require.NoError(t, l.Book(Booking{ID: "keep", Worker: wr("keep", 0), Lease: time.Hour}))

	next, ok := l.nextExpiry()
	require.True(t, ok)
	require.Equal(t, epoch.Add(10*time.Second), next)

	require.Equal(t, 0, l.Expire(epoch.Add(10*time.Second-time.Nanosecond)), "nothing before its deadline")
	require.Len(t, l.loads(), 5)
	require.Equal(t, 2, l.Expire(epoch.Add(10*time.Second)), "a deadline equal to now expires")
	require.Equal(t, []catalog.WorkerRank{wr("early", 0), wr("mid", 0)}, order, "ties settle in booking order")
	next, _ = l.nextExpiry()
	require.Equal(t, epoch.Add(30*time.Second), next, "the default lease applies")
	checkInvariants(t, l)

	require.Equal(t, 2, l.Expire(epoch.Add(time.Minute)))
	require.Equal(t, []catalog.WorkerRank{wr("early", 0), wr("mid", 0), wr("default", 0), wr("late", 0)}, order)
	require.Equal(t, map[catalog.WorkerRank]Load{wr("keep", 0): {ActiveRequests: 1}}, l.loads())
	require.Equal(t, int64(4), l.Stats().Expired)
	checkInvariants(t, l)

	for _, id := range []string{"early", "mid", "default", "late"} {
		require.ErrorIs(t, l.Free(ID(id)), ErrUnknownReservation, "free after expiry is harmless")
	}
	require.Equal(t, 0, l.Expire(epoch.Add(time.Minute)), "expiry is not repeated")
	require.Equal(t, Stats{Booked: 5, Expired: 4, UnknownIDs: 4, Active: 1}, l.Stats())
	checkInvariants(t, l)
}

func TestExpireNotifiesEachWorkerOnce(t *testing.T) {
	clk := newFakeClock()
	counts := map[catalog.WorkerRank]int{}
	l := newLedger(t, Options{Now: clk.Now, OnChange: func(w catalog.WorkerRank) { counts[w]++ }})
	for i := range 100 {
		require.NoError(t, l.Book(Booking{ID: ID(fmt.Sprint(i)), Worker: wr(fmt.Sprint("w", i%20), i%3), Lease: time.Second}))
	}
	require.Equal(t, 100, l.Expire(clk.Advance(time.Second)))
	require.Len(t, counts, 60) // (i%20, i%3) repeats every 60 ids, so all 60 pairs occur
	for w, n := range counts {
		require.Equal(t, 1, n, "%s notified %d times", w, n)
	}
	require.Empty(t, l.loads())
	checkInvariants(t, l)
}

func TestTouch(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	require.NoError(t, l.Book(Booking{ID: "a", Worker: wr("w", 0), Lease: 10 * time.Second}))
	require.NoError(t, l.Book(Booking{ID: "b", Worker: wr("w", 0), Lease: 15 * time.Second}))

	clk.Advance(8 * time.Second)
	require.NoError(t, l.Touch("a"))
	r, _ := l.get("a")
	require.Equal(t, epoch.Add(18*time.Second), r.Deadline)
	require.Equal(t, epoch, r.BookedAt)
	next, _ := l.nextExpiry()
	require.Equal(t, epoch.Add(15*time.Second), next, "b is now first")
	checkInvariants(t, l)

	require.Equal(t, 0, l.Expire(epoch.Add(10*time.Second)), "a's old deadline no longer applies")
	require.Equal(t, 1, l.Expire(epoch.Add(17*time.Second)))
	_, ok := l.get("b")
	require.False(t, ok)
	require.Equal(t, 1, l.Expire(epoch.Add(18*time.Second)))
	require.Empty(t, l.loads())
	checkInvariants(t, l)
}

func TestTouchNeverShortens(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	require.NoError(t, l.Book(Booking{ID: "a", Worker: wr("w", 0), Lease: 10 * time.Second}))
	clk.Advance(5 * time.Second)
	require.NoError(t, l.Touch("a")) // epoch+15s
	clk.Advance(-4 * time.Second)    // a clock that stepped back
	require.NoError(t, l.Touch("a"))
	r, _ := l.get("a")
	require.Equal(t, epoch.Add(15*time.Second), r.Deadline)
	checkInvariants(t, l)
}

func TestRemoveWorker(t *testing.T) {
	clk := newFakeClock()
	var changed []catalog.WorkerRank
	l := newLedger(t, Options{Now: clk.Now, OnChange: func(w catalog.WorkerRank) { changed = append(changed, w) }})
	require.NoError(t, l.Book(Booking{ID: "1", Worker: wr("gone", 0), SeqHashes: []uint64{1, 2}, PrefillTokens: 5}))
	require.NoError(t, l.Book(Booking{ID: "2", Worker: wr("gone", 0), SeqHashes: []uint64{1, 3}}))
	require.NoError(t, l.Book(Booking{ID: "3", Worker: wr("gone", 1), SeqHashes: []uint64{1}}))
	require.NoError(t, l.Book(Booking{ID: "4", Worker: wr("stay", 0), SeqHashes: []uint64{1, 2}, PrefillTokens: 6}))
	require.NoError(t, l.Book(Booking{ID: "5", Worker: wr("gone-too", 0), SeqHashes: []uint64{1}}))

	require.Equal(t, 0, l.RemoveWorker("unknown"))
	require.Empty(t, changed)
	require.Equal(t, 3, l.RemoveWorker("gone"))
	require.ElementsMatch(t, []catalog.WorkerRank{wr("gone", 0), wr("gone", 1)}, changed)
	require.Equal(t, map[catalog.WorkerRank]Load{
		wr("stay", 0):     {ActivePrefillTokens: 6, ActiveBlocks: 2, ActiveRequests: 1},
		wr("gone-too", 0): {ActiveBlocks: 1, ActiveRequests: 1},
	}, l.loads())
	for _, id := range []string{"1", "2", "3"} {
		require.ErrorIs(t, l.Free(ID(id)), ErrUnknownReservation)
		_, ok := l.get(id)
		require.False(t, ok)
	}
	next, _ := l.nextExpiry()
	require.Equal(t, epoch.Add(DefaultLease), next)
	require.Equal(t, 2, l.Expire(epoch.Add(DefaultLease)), "removed bookings left the lease tree")
	st := l.Stats()
	require.Equal(t, int64(3), st.Removed)
	require.Equal(t, int64(2), st.Expired)
	require.Equal(t, st.Booked, st.Active+st.Freed+st.Expired+st.Removed)
	checkInvariants(t, l)
}

func TestOnChange(t *testing.T) {
	clk := newFakeClock()
	var l *Ledger
	var seen []Load
	l = newLedger(t, Options{Now: clk.Now, OnChange: func(w catalog.WorkerRank) {
		// Runs after the lock is released: calling back must not deadlock, and
		// it sees the lowered load.
		seen = append(seen, l.Load(w))
	}})
	w := wr("w", 0)
	require.NoError(t, l.Book(Booking{ID: "a", Worker: w, SeqHashes: []uint64{1}, PrefillTokens: 10}))
	require.NoError(t, l.Book(Booking{ID: "zero", Worker: w}))
	require.Empty(t, seen)
	require.NoError(t, l.PrefillComplete("zero"))
	require.Empty(t, seen, "no prefill tokens, no lower load")
	require.NoError(t, l.PrefillComplete("a"))
	require.NoError(t, l.PrefillComplete("a"))
	require.Equal(t, []Load{{ActiveBlocks: 1, ActiveRequests: 2}}, seen)
	require.ErrorIs(t, l.Free("nope"), ErrUnknownReservation)
	require.NoError(t, l.Free("a"))
	require.NoError(t, l.Free("zero"))
	require.Equal(t, []Load{{ActiveBlocks: 1, ActiveRequests: 2}, {ActiveRequests: 1}, {}}, seen)
}

func TestLoadsIsASnapshot(t *testing.T) {
	l := newLedger(t, Options{Now: newFakeClock().Now})
	require.NoError(t, l.Book(Booking{ID: "a", Worker: wr("w", 0), PrefillTokens: 1}))
	snap := l.loads()
	require.NoError(t, l.Free("a"))
	require.Equal(t, map[catalog.WorkerRank]Load{wr("w", 0): {ActivePrefillTokens: 1, ActiveRequests: 1}}, snap)
	snap[wr("x", 0)] = Load{ActiveRequests: 5}
	require.Empty(t, l.loads())
}

func TestSeqHashesAreCopied(t *testing.T) {
	l := newLedger(t, Options{Now: newFakeClock().Now})
	seqs := []uint64{1, 2, 3}
	require.NoError(t, l.Book(Booking{ID: "a", Worker: wr("w", 0), SeqHashes: seqs}))
	seqs[0], seqs[1], seqs[2] = 7, 8, 9
	require.Equal(t, 3, newBlocks(l, wr("w", 0), seqs))
	require.NoError(t, l.Free("a"))
	checkInvariants(t, l)
}

// TestChurnDoesNotGrow books and frees many requests with fresh ids and hashes and
// checks that the ledger's structures return to empty and stay bounded by the
// peak number of live bookings (plus the idle blocks kept for reuse), not the
// number ever made.
func TestChurnDoesNotGrow(t *testing.T) {
	l := newLedger(t, Options{Now: newFakeClock().Now})
	const live, hashes = 8, 32
	next := uint64(1)
	for round := range 8000 {
		id := fmt.Sprint("r", round)
		seqs := make([]uint64, hashes)
		for i := range seqs {
			seqs[i] = next
			next++
		}
		require.NoError(t, l.Book(Booking{ID: ID(id), Worker: wr(fmt.Sprint("w", round%5), round%2), SeqHashes: seqs, PrefillTokens: 3}))
		if round >= live {
			require.NoError(t, l.Free(ID(fmt.Sprint("r", round-live))))
		}
	}
	_, _, _, slab := blockCounts(l)
	bound := 2*(live+1)*hashes + blockStripes*(maxIdle+hashes) // per stripe: its peak of live blocks plus idle ones
	require.LessOrEqual(t, slab, bound)
	require.Less(t, bound, 8000*hashes/4, "the bound is meaningful")
	require.LessOrEqual(t, int(l.nextSlot.Load()), 10, "one slot per worker rank used (5 workers x 2 ranks)")
	checkInvariants(t, l)
	for round := 8000 - live; round < 8000; round++ {
		require.NoError(t, l.Free(ID(fmt.Sprint("r", round))))
	}
	require.Empty(t, l.loads())
	require.Zero(t, l.Stats().Active)
	require.Zero(t, liveBlocks(l))
	for _, r := range l.rankList() {
		require.True(t, r.leases == nil || r.leases.Len() == 0)
	}
	checkInvariants(t, l)
}

// A copy of a booking made elsewhere lives what is left of the original's
// lease, and each Touch then extends it by the whole lease.
func TestFirstLease(t *testing.T) {
	clk := newFakeClock()
	l := newLedger(t, Options{Now: clk.Now})
	w := catalog.WorkerRank{WorkerID: "a"}
	require.NoError(t, l.Book(Booking{ID: "copy", Worker: w, Lease: time.Minute, FirstLease: 10 * time.Second}))
	require.NoError(t, l.Book(Booking{ID: "renewed", Worker: w, Lease: time.Minute, FirstLease: 10 * time.Second}))
	require.NoError(t, l.Book(Booking{ID: "longer", Worker: w, Lease: time.Minute, FirstLease: time.Hour}))
	clk.Advance(5 * time.Second)
	require.NoError(t, l.Touch("renewed"))
	clk.Advance(5 * time.Second)
	require.Equal(t, 1, l.Expire(clk.Now()), "the copy expires at its first lease")
	_, ok := l.get("renewed")
	require.True(t, ok, "a touch extends by the whole lease")
	clk.Advance(50 * time.Second)
	require.Equal(t, 1, l.Expire(clk.Now()), "a first lease longer than the lease is the lease")
	clk.Advance(5 * time.Second)
	require.Equal(t, 1, l.Expire(clk.Now()))
	require.ErrorIs(t, l.Book(Booking{ID: "bad", Worker: w, FirstLease: -1}), ErrInvalid)
}
