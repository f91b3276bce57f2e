package selection

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
)

// recorder is a BookingObserver that keeps what it hears.
type recorder struct {
	booked  []BookingEvent
	settled []Settlement
}

func (r *recorder) Booked(ev BookingEvent)                 { r.booked = append(r.booked, ev) }
func (r *recorder) Settled(_ reservation.ID, h Settlement) { r.settled = append(r.settled, h) }

func loadOf(t *testing.T, s *SelectionService, id string) WorkerLoad {
	t.Helper()
	for _, l := range s.Loads("") {
		if l.WorkerID == id {
			return l
		}
	}
	require.FailNow(t, "no worker", id)
	return WorkerLoad{}
}

// A generation that runs long raises its worker's active blocks, and so the
// decode cost a new request sees there, one block per BlockSize tokens.
func TestGeneratedGrowsTheBooking(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { c.Cost = CostDynamo }) // block size 4; costs in blocks
	addWorkers(t, s, "a", "b")
	b, err := s.Book(context.Background(), Request{Tokens: toks(8, 1), Allowed: []string{"a"}})
	require.NoError(t, err)
	start := loadOf(t, s, "a").ActiveBlocks
	before, err := s.PotentialLoads(context.Background(), Request{Tokens: toks(8, 2)})
	require.NoError(t, err)

	require.NoError(t, b.Generated(3)) // under one block
	require.Equal(t, start, loadOf(t, s, "a").ActiveBlocks)
	require.NoError(t, b.Generated(41)) // 10 blocks
	require.NoError(t, b.Generated(20)) // a smaller count changes nothing
	require.Equal(t, start+10, loadOf(t, s, "a").ActiveBlocks)
	after, err := s.PotentialLoads(context.Background(), Request{Tokens: toks(8, 2)})
	require.NoError(t, err)
	costOf := func(sc []Scored, w string) float64 {
		for _, x := range sc {
			if x.WorkerID == w {
				return x.Cost
			}
		}
		t.Fatalf("no %s", w)
		return 0
	}
	require.Greater(t, costOf(after, "a"), costOf(before, "a")+9, "the decode term follows the output")
	require.Equal(t, costOf(before, "b"), costOf(after, "b"))

	require.NoError(t, b.Done())
	require.Zero(t, loadOf(t, s, "a").ActiveBlocks)
	require.ErrorIs(t, b.Generated(100), ErrUnknownReservation)
	require.ErrorIs(t, s.Reservations().AddOutputBlocks("gone", 1), ErrUnknownReservation)
	require.ErrorIs(t, s.Reservations().AddOutputBlocks("gone", -1), ErrBadRequest)
}

// A request served by another worker than the one booked moves its whole
// load there, and its session's pin with it; peers hear a free and a booking.
func TestMoveToServedWorker(t *testing.T) {
	rec := &recorder{}
	cfg := DefaultConfig(4)
	cfg.UseKVEvents = false
	cfg.Sessions.Mode = SessionHard
	s, err := NewSelectionServiceBuilder(cfg).Clock(newFakeClock().Now).SweepInterval(-1).Observe(rec).Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	addWorkers(t, s, "a", "b")
	_, err = s.Workers().Upsert(worker("other-model", func(w *catalog.Worker) { w.Model = "m2" }))
	require.NoError(t, err)

	b, err := s.Book(context.Background(), Request{Tokens: toks(10, 1), SessionID: "conv", Allowed: []string{"a"}})
	require.NoError(t, err)
	require.NoError(t, b.Generated(8))
	picked := loadOf(t, s, "a")
	require.Equal(t, 1, picked.ActiveRequests)

	require.ErrorIs(t, b.Move(catalog.WorkerRank{WorkerID: "other-model"}), ErrNotFound)
	require.ErrorIs(t, b.Move(catalog.WorkerRank{WorkerID: "nope"}), ErrNotFound)
	require.ErrorIs(t, b.Move(catalog.WorkerRank{WorkerID: "b", Rank: 3}), ErrNotFound)
	require.NoError(t, b.Move(catalog.WorkerRank{WorkerID: "b"}))
	require.Equal(t, "b", b.WorkerID)
	require.Equal(t, "10.0.0.1:8000", b.Endpoint)
	served := loadOf(t, s, "b")
	require.Equal(t, picked.ActiveRequests, served.ActiveRequests)
	require.Equal(t, picked.ActiveBlocks, served.ActiveBlocks)
	require.Equal(t, picked.ActivePrefillTokens, served.ActivePrefillTokens)
	require.Zero(t, loadOf(t, s, "a").ActiveRequests)
	require.NoError(t, b.Move(catalog.WorkerRank{WorkerID: "b"}), "moving to the holder does nothing")

	// The session follows the served worker.
	next, err := s.Book(context.Background(), Request{Tokens: toks(4, 9), SessionID: "conv"})
	require.NoError(t, err)
	require.Equal(t, "b", next.WorkerID)

	require.Equal(t, []Settlement{SettleOutputBlock, SettleOutputBlock, SettleFree}, rec.settled)
	require.Len(t, rec.booked, 3)
	mv := rec.booked[1]
	require.Equal(t, "b", mv.Worker.WorkerID)
	require.Equal(t, b.ReservationID, mv.ID)
	require.Equal(t, "conv", mv.Session)
	require.Equal(t, picked.ActiveBlocks-len(mv.SeqHashes), mv.PrivateBlocks, "the output blocks travel as private ones")
	require.Equal(t, 5*time.Minute, mv.Lease)

	require.NoError(t, b.Done())
	require.NoError(t, next.Done())
	st := s.Stats()
	require.EqualValues(t, 1, st.Moves)
	require.EqualValues(t, 1, st.Ledger.Moved)
	require.ErrorIs(t, s.Reservations().Move(b.ReservationID, catalog.WorkerRank{WorkerID: "a"}, ""), ErrUnknownReservation)
	requireIdle(t, s)
}
