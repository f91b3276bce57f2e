package reservation

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

// modelBooking is the naive model's record of one live booking.
type modelBooking struct {
	worker   catalog.WorkerRank
	seqs     []uint64
	private  int
	prefill  int
	done     bool
	lease    time.Duration
	deadline time.Time
	order    int
}

// model is the obviously correct ledger: a map of live bookings, from which every
// load is recomputed from scratch.
type model struct {
	live  map[string]*modelBooking
	order int
	stats Stats
}

func (m *model) loads() map[catalog.WorkerRank]Load {
	out := map[catalog.WorkerRank]Load{}
	sets := map[catalog.WorkerRank]map[uint64]bool{}
	for _, b := range m.live {
		ld := out[b.worker]
		ld.ActiveRequests++
		ld.ActiveBlocks += b.private
		if !b.done {
			ld.ActivePrefillTokens += int64(b.prefill)
		}
		if sets[b.worker] == nil {
			sets[b.worker] = map[uint64]bool{}
		}
		for _, h := range b.seqs {
			sets[b.worker][h] = true
		}
		out[b.worker] = ld
	}
	for w, s := range sets {
		ld := out[w]
		ld.ActiveBlocks += len(s)
		out[w] = ld
	}
	return out
}

// newBlocks counts the distinct hashes of seqs not active on w; private blocks,
// which the ledger never names, play no part.
func (m *model) newBlocks(w catalog.WorkerRank, seqs []uint64) int {
	active := map[uint64]bool{}
	for _, b := range m.live {
		if b.worker == w {
			for _, h := range b.seqs {
				active[h] = true
			}
		}
	}
	seen := map[uint64]bool{}
	n := 0
	for _, h := range seqs {
		if !seen[h] && !active[h] {
			n++
		}
		seen[h] = true
	}
	return n
}

// expiring returns the ids the model expires at now, in settle order.
func (m *model) expiring(now time.Time) []string {
	var ids []string
	for id, b := range m.live {
		if !b.deadline.After(now) {
			ids = append(ids, id)
		}
	}
	slices.SortFunc(ids, func(a, b string) int {
		x, y := m.live[a], m.live[b]
		if c := x.deadline.Compare(y.deadline); c != 0 {
			return c
		}
		return x.order - y.order
	})
	return ids
}

// TestModel drives a Ledger and the naive model with the same random operations
// and compares them, and the ledger's internal structures, after every one.
func TestModel(t *testing.T) {
	for seed := range uint64(16) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			runModel(t, seed, 300)
		})
	}
}

// FuzzModel runs the model comparison from fuzzer-chosen seeds.
func FuzzModel(f *testing.F) {
	f.Add(uint64(0))
	f.Add(uint64(99))
	f.Fuzz(func(t *testing.T, seed uint64) {
		runModel(t, seed, 150)
	})
}

func runModel(t *testing.T, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	clk := newFakeClock()
	var notified []catalog.WorkerRank
	l := newLedger(t, Options{Now: clk.Now, DefaultLease: 20 * time.Second, OnChange: func(w catalog.WorkerRank) { notified = append(notified, w) }})
	m := &model{live: map[string]*modelBooking{}}
	workers := []catalog.WorkerRank{wr("a", 0), wr("a", 1), wr("b", 0), wr("c", 0), wr("c", 2)}
	names := []string{"a", "b", "c", "zz"}
	handles := l.AppendRanks(nil, append(slices.Clone(workers), wr("idle", 0)))
	randID := func() string { return fmt.Sprint("id", rng.IntN(24)) }
	randSeqs := func() []uint64 {
		// A small alphabet so bookings overlap; sometimes a chained prefix of a
		// common root, sometimes arbitrary values with duplicates.
		n := rng.IntN(7)
		s := make([]uint64, n)
		if rng.IntN(2) == 0 {
			root := uint64(rng.IntN(3)) * 100
			for i := range s {
				s[i] = root + uint64(i)
			}
			return s
		}
		for i := range s {
			s[i] = uint64(rng.IntN(12))
		}
		return s
	}

	for step := range steps {
		notified = notified[:0]
		before := m.loads()
		var op string
		switch k := rng.IntN(100); {
		case k < 35:
			op = "book"
			b := Booking{
				ID: ID(randID()), Worker: workers[rng.IntN(len(workers))], SeqHashes: randSeqs(),
				PrefillTokens: rng.IntN(300), ExpectedOutputTokens: rng.IntN(50),
				Lease: time.Duration(rng.IntN(4)) * 5 * time.Second,
			}
			switch rng.IntN(3) { // shared hashes only, both, or private blocks only
			case 1:
				b.PrivateBlocks = rng.IntN(5)
			case 2:
				b.SeqHashes, b.PrivateBlocks = nil, 1+rng.IntN(8)
			}
			switch rng.IntN(25) {
			case 0:
				b.PrefillTokens = -1
			case 1:
				b.PrivateBlocks = -1
			}
			err := l.Book(b)
			switch {
			case b.PrefillTokens < 0 || b.PrivateBlocks < 0:
				require.ErrorIs(t, err, ErrInvalid)
				m.stats.Invalid++
			case m.live[string(b.ID)] != nil:
				require.ErrorIs(t, err, ErrConflict)
				m.stats.Conflicts++
			default:
				require.NoError(t, err)
				lease := b.Lease
				if lease == 0 {
					lease = 20 * time.Second
				}
				m.order++
				m.live[string(b.ID)] = &modelBooking{
					worker: b.Worker, seqs: slices.Clone(b.SeqHashes), private: b.PrivateBlocks, prefill: b.PrefillTokens,
					lease: lease, deadline: clk.Now().Add(lease), order: m.order,
				}
				m.stats.Booked++
			}
			require.Empty(t, notified)
		case k < 52:
			op = "prefill"
			id := randID()
			err := l.PrefillComplete(ID(id))
			b := m.live[id]
			switch {
			case b == nil:
				require.ErrorIs(t, err, ErrUnknownReservation)
				m.stats.UnknownIDs++
				require.Empty(t, notified)
			case b.done:
				require.NoError(t, err)
				require.Empty(t, notified)
			default:
				require.NoError(t, err)
				b.done = true
				m.stats.PrefillCompleted++
				if b.prefill > 0 {
					require.Equal(t, []catalog.WorkerRank{b.worker}, notified)
				} else {
					require.Empty(t, notified)
				}
			}
		case k < 72:
			op = "free"
			id := randID()
			err := l.Free(ID(id))
			if b := m.live[id]; b != nil {
				require.NoError(t, err)
				require.Equal(t, []catalog.WorkerRank{b.worker}, notified)
				delete(m.live, id)
				m.stats.Freed++
			} else {
				require.ErrorIs(t, err, ErrUnknownReservation)
				m.stats.UnknownIDs++
				require.Empty(t, notified)
			}
		case k < 82:
			op = "advance+expire"
			now := clk.Advance(time.Duration(rng.IntN(8)) * time.Second)
			ids := m.expiring(now)
			want := []catalog.WorkerRank{}
			for _, id := range ids {
				if w := m.live[id].worker; !slices.Contains(want, w) {
					want = append(want, w)
				}
			}
			require.Equal(t, len(ids), l.Expire(now))
			require.Equal(t, want, append([]catalog.WorkerRank{}, notified...), "one notification per worker rank, in deadline order")
			for _, id := range ids {
				delete(m.live, id)
			}
			m.stats.Expired += int64(len(ids))
		case k < 86:
			op = "remove worker"
			name := names[rng.IntN(len(names))]
			var want []catalog.WorkerRank
			n := 0
			for id, b := range m.live {
				if b.worker.WorkerID == name {
					if !slices.Contains(want, b.worker) {
						want = append(want, b.worker)
					}
					delete(m.live, id)
					n++
				}
			}
			require.Equal(t, n, l.RemoveWorker(name))
			require.ElementsMatch(t, want, notified)
			m.stats.Removed += int64(n)
		case k < 89:
			op = "touch"
			id := randID()
			now := clk.Advance(time.Duration(rng.IntN(3)) * time.Second)
			err := l.Touch(ID(id))
			if b := m.live[id]; b != nil {
				require.NoError(t, err)
				if d := now.Add(b.lease); d.After(b.deadline) {
					b.deadline = d
				}
			} else {
				require.ErrorIs(t, err, ErrUnknownReservation)
				m.stats.UnknownIDs++
			}
			require.Empty(t, notified)
		case k < 93:
			op = "output blocks"
			id, n := randID(), rng.IntN(4)
			err := l.AddOutputBlocks(ID(id), n)
			if b := m.live[id]; b != nil {
				require.NoError(t, err)
				b.private += n
				m.stats.OutputBlocks += int64(n)
			} else {
				require.ErrorIs(t, err, ErrUnknownReservation)
				m.stats.UnknownIDs++
			}
			require.Empty(t, notified)
		case k < 97:
			op = "move"
			id, to := randID(), workers[rng.IntN(len(workers))]
			moved, err := l.Move(ID(id), to)
			b := m.live[id]
			switch {
			case b == nil:
				require.ErrorIs(t, err, ErrUnknownReservation)
				m.stats.UnknownIDs++
				require.Empty(t, notified)
			case b.worker == to:
				require.NoError(t, err)
				require.Equal(t, to, moved.Worker)
				require.Empty(t, notified)
			default:
				require.NoError(t, err)
				require.Equal(t, []catalog.WorkerRank{b.worker}, notified)
				require.Equal(t, to, moved.Worker)
				b.worker = to
				if !b.deadline.After(clk.Now()) {
					b.deadline = clk.Now().Add(1)
				}
				m.order++
				b.order = m.order
				m.stats.Moved++
			}
		default:
			op = "read"
		}

		// Compare everything observable after every operation.
		want := m.loads()
		require.Equal(t, want, l.loads(), "step %d (%s)", step, op)
		for w, ld := range before {
			if after := want[w]; after.ActiveRequests < ld.ActiveRequests || after.ActivePrefillTokens < ld.ActivePrefillTokens {
				require.Contains(t, notified, w, "step %d (%s): load of %s went down unnoticed", step, op, w)
			}
		}
		probe := randSeqs()
		cands := append(slices.Clone(workers), wr("idle", 0))
		got := l.AppendLoads(nil, cands, probe)
		// Handles resolved before the run (some of whose workers were removed
		// and came back since) read the same.
		byHandle := l.AppendRankLoads(nil, handles, probe)
		for i := range got {
			require.Equal(t, got[i].Load, byHandle[i].Load, "step %d (%s): handle of %s", step, op, cands[i])
			require.Equal(t, got[i].NewBlocks, byHandle[i].NewBlocks, "step %d (%s): handle of %s", step, op, cands[i])
		}
		for i, w := range cands {
			require.Equal(t, want[w], l.Load(w))
			require.Equal(t, want[w], got[i].Load)
			nb := m.newBlocks(w, probe)
			require.Equal(t, nb, got[i].NewBlocks, "step %d (%s): new blocks of %v on %s", step, op, probe, w)
			require.Equal(t, nb, newBlocks(l, w, probe))
		}
		for id, b := range m.live {
			r, ok := l.get(id)
			require.True(t, ok)
			require.Equal(t, b.worker, r.Worker)
			require.Equal(t, b.done, r.PrefillDone)
			require.Equal(t, b.deadline, r.Deadline)
			require.Equal(t, len(b.seqs), r.Blocks)
			require.Equal(t, b.private, r.PrivateBlocks)
		}
		next, ok := l.nextExpiry()
		if ids := m.expiring(epoch.Add(100 * time.Hour)); len(ids) > 0 {
			require.True(t, ok)
			require.Equal(t, m.live[ids[0]].deadline, next)
		} else {
			require.False(t, ok)
		}
		m.stats.Active = int64(len(m.live))
		require.Equal(t, m.stats, l.Stats(), "step %d (%s)", step, op)
		checkInvariants(t, l)
	}
}
