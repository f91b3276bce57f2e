package selection

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvselect/kvselect/internal/clocktest"
	"github.com/kvselect/kvselect/reservation"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/kvindex"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
}

type fakeClock = clocktest.Clock

func newFakeClock() *fakeClock { return clocktest.New(time.Unix(1_000_000, 0)) }

// newTestService builds a service without KV events (no sockets), a fake clock, a
// fixed seed and no sweeper.
func newTestService(t testing.TB, mod func(*Config)) (*SelectionService, *fakeClock) {
	t.Helper()
	cfg := DefaultConfig(4)
	cfg.UseKVEvents = false
	if mod != nil {
		mod(&cfg)
	}
	clk := newFakeClock()
	s, err := NewSelectionServiceBuilder(cfg).Clock(clk.Now).Rand(rand.NewPCG(1, 2)).SweepInterval(-1).Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s, clk
}

func worker(id string, mod func(*catalog.Worker)) catalog.Worker {
	w := catalog.Worker{ID: id, Endpoint: "10.0.0.1:8000", DPSize: 1, BlockSize: 4, MaxNumBatchedTokens: 100}
	if mod != nil {
		mod(&w)
	}
	return w
}

func addWorkers(t testing.TB, s *SelectionService, ids ...string) {
	t.Helper()
	for _, id := range ids {
		rec, err := s.Workers().Upsert(worker(id, nil))
		require.NoError(t, err)
		require.Equal(t, catalog.Schedulable, rec.Lifecycle, rec.Reasons)
	}
}

// costsOf is each worker's cost for req (PotentialLoads), by worker id.
func costsOf(t testing.TB, s *SelectionService, req Request) map[string]float64 {
	t.Helper()
	scored, err := s.PotentialLoads(context.Background(), req)
	require.NoError(t, err)
	out := map[string]float64{}
	for _, sc := range scored {
		out[sc.WorkerID] = sc.Cost
	}
	return out
}

func toks(n, seed int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(seed*100000 + i)
	}
	return out
}

func requireIdle(t testing.TB, s *SelectionService) {
	t.Helper()
	for _, m := range []string{catalog.DefaultModel, "m1", "m2"} {
		for _, l := range s.Loads(m) {
			require.Zero(t, l.ActiveRequests, l)
			require.Zero(t, l.ActivePrefillTokens, l)
			require.Zero(t, l.ActiveBlocks, l)
		}
	}
	require.Zero(t, s.Stats().Ledger.Active)
}

func TestBuildReportsEveryProblem(t *testing.T) {
	cfg := DefaultConfig(0)
	cfg.Temperature = -1
	_, err := NewSelectionServiceBuilder(cfg).Build(context.Background())
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "BlockSize")
	require.ErrorContains(t, err, "Temperature")
	require.Equal(t, http.StatusBadRequest, HTTPStatus(err))

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = NewSelectionServiceBuilder(DefaultConfig(16)).Build(ctx)
	require.ErrorIs(t, err, context.Canceled)
}

func TestRequestLifecycle(t *testing.T) {
	s, _ := newTestService(t, nil)
	addWorkers(t, s, "a", "b")
	require.True(t, s.Ready().Ready)
	ctx := context.Background()
	prompt := toks(40, 1) // 10 blocks of 4

	res, err := s.SelectAndReserve(ctx, Request{ReservationID: "r1", Tokens: prompt})
	require.NoError(t, err)
	require.Equal(t, reservation.ID("r1"), res.ReservationID)
	require.Equal(t, "10.0.0.1:8000", res.Endpoint)
	require.Equal(t, 10, res.RequestBlocks)
	require.Equal(t, 40, res.EffectivePrefillTokens)
	require.Equal(t, 10, res.PotentialDecodeBlocks)
	first := res.WorkerID

	loads := s.Loads("")
	require.Len(t, loads, 2)
	for _, l := range loads {
		if l.WorkerID == first {
			require.EqualValues(t, 40, l.ActivePrefillTokens)
			require.Equal(t, 10, l.ActiveBlocks)
			require.Equal(t, 1, l.ActiveRequests)
		} else {
			require.Zero(t, l.ActiveRequests)
		}
	}

	// Once its prefill is done, the same prompt again goes to the same worker:
	// the approximate index remembers where it went and the shared active blocks
	// cost nothing more. (While r1 still prefills, its prefill load cancels the
	// cache credit and the two workers tie.)
	require.NoError(t, s.Reservations().PrefillComplete("r1"))
	res2, err := s.SelectAndReserve(ctx, Request{ReservationID: "r2", Tokens: prompt})
	require.NoError(t, err)
	require.Equal(t, first, res2.WorkerID)
	require.Equal(t, 10, res2.Overlap.Device)
	require.Zero(t, res2.EffectivePrefillTokens)

	require.NoError(t, s.Reservations().PrefillComplete("r1")) // idempotent
	require.NoError(t, s.Reservations().Free("r1"))
	require.NoError(t, s.Reservations().Free("r2"))
	err = s.Reservations().Free("r2")
	require.ErrorIs(t, err, ErrUnknownReservation)
	require.Equal(t, http.StatusNotFound, HTTPStatus(err))
	require.ErrorIs(t, s.Reservations().PrefillComplete("nope"), ErrUnknownReservation)
	requireIdle(t, s)

	st := s.Stats()
	require.EqualValues(t, 2, st.Bookings)
	require.EqualValues(t, 2, st.Frees)
	require.EqualValues(t, 2, st.UnknownReservations)
	require.EqualValues(t, 20, st.RequestBlocks)
	require.EqualValues(t, 10, st.ChosenOverlapBlocks)
	require.EqualValues(t, 10, st.BestOverlapBlocks)
}

func TestSelectDoesNotBook(t *testing.T) {
	s, _ := newTestService(t, nil)
	addWorkers(t, s, "a")
	res, err := s.Select(context.Background(), Request{Tokens: toks(8, 1)})
	require.NoError(t, err)
	require.Equal(t, "a", res.WorkerID)
	require.Empty(t, res.ReservationID)
	requireIdle(t, s)
}

func TestBadRequestsAndPartitions(t *testing.T) {
	s, _ := newTestService(t, nil)
	ctx := context.Background()
	_, err := s.SelectAndReserve(ctx, Request{Tokens: toks(8, 1)})
	require.ErrorIs(t, err, ErrNotReady)
	require.Equal(t, http.StatusServiceUnavailable, HTTPStatus(err))

	_, err = s.Workers().Upsert(worker("m1-a", func(w *catalog.Worker) { w.Model = "m1" }))
	require.NoError(t, err)
	// Another model's worker is never used.
	_, err = s.SelectAndReserve(ctx, Request{Tokens: toks(8, 1)})
	require.ErrorIs(t, err, ErrNotReady)
	_, err = s.SelectAndReserve(ctx, Request{Model: "m2", Tokens: toks(8, 1)})
	require.ErrorIs(t, err, ErrNotReady)
	res, err := s.SelectAndReserve(ctx, Request{Model: "m1", Tokens: toks(8, 1)})
	require.NoError(t, err)
	require.Equal(t, "m1-a", res.WorkerID)
	require.NotEmpty(t, res.ReservationID)
	require.NoError(t, s.Reservations().Free(res.ReservationID))

	_, err = s.SelectAndReserve(ctx, Request{Model: "m1", Tokens: toks(8, 1), Allowed: []string{"elsewhere"}})
	require.ErrorIs(t, err, ErrNoEndpoints)

	neg := -2.0
	for name, req := range map[string]Request{
		"no tokens":       {Model: "m1"},
		"short ISL":       {Model: "m1", SeqHashes: []uint64{1, 2}, ISL: 5},
		"bad override":    {Model: "m1", Tokens: toks(8, 1), Override: &Override{OverlapScoreCredit: &neg}},
		"negative output": {Model: "m1", Tokens: toks(8, 1), ExpectedOutputTokens: -1},
		"negative jump":   {Model: "m1", Tokens: toks(8, 1), Priority: Priority{Jump: -1}},
	} {
		_, err := s.SelectAndReserve(ctx, req)
		require.ErrorIs(t, err, ErrBadRequest, name)
		require.Equal(t, http.StatusBadRequest, HTTPStatus(err), name)
	}

	// Precomputed hashes work like tokens.
	h, _ := kvindex.NewHasher(4, kvindex.HashOptions{})
	res, err = s.SelectAndReserve(ctx, Request{Model: "m1", SeqHashes: h.SeqHashes(toks(8, 1)), ISL: 9})
	require.NoError(t, err)
	require.Equal(t, 9, res.EffectivePrefillTokens+res.Overlap.Device*4)
	require.NoError(t, s.Reservations().Free(res.ReservationID))

	// Bad workers.
	_, err = s.Workers().Upsert(worker("", nil))
	require.ErrorIs(t, err, ErrBadRequest)
	_, err = s.Workers().Upsert(worker("odd", func(w *catalog.Worker) { w.BlockSize = 6 }))
	require.ErrorIs(t, err, ErrBadRequest)
	_, err = s.Workers().Delete("ghost")
	require.ErrorIs(t, err, ErrNotFound)
	require.Equal(t, http.StatusNotFound, HTTPStatus(err))
	requireIdle(t, s)
}

func TestDuplicateReservationIsConflict(t *testing.T) {
	s, _ := newTestService(t, nil)
	addWorkers(t, s, "a")
	ctx := context.Background()
	_, err := s.SelectAndReserve(ctx, Request{ReservationID: "x", Tokens: toks(8, 1)})
	require.NoError(t, err)
	_, err = s.SelectAndReserve(ctx, Request{ReservationID: "x", Tokens: toks(8, 2)})
	require.ErrorIs(t, err, ErrConflict)
	require.Equal(t, http.StatusConflict, HTTPStatus(err))
	require.NoError(t, s.Reservations().Free("x"))
	requireIdle(t, s)
}

func TestIncompleteWorkersAreNotRouted(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { th := 1.0; c.QueueThreshold = &th })
	rec, err := s.Workers().Upsert(worker("a", func(w *catalog.Worker) { w.MaxNumBatchedTokens = 0 }))
	require.NoError(t, err)
	require.Equal(t, catalog.Incomplete, rec.Lifecycle)
	require.False(t, s.Ready().Ready)
	_, err = s.SelectAndReserve(context.Background(), Request{Tokens: toks(8, 1)})
	require.ErrorIs(t, err, ErrNotReady)
	// Completing it makes it routable.
	rec, err = s.Workers().Upsert(worker("a", nil))
	require.NoError(t, err)
	require.Equal(t, catalog.Schedulable, rec.Lifecycle)
	res, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(8, 1)})
	require.NoError(t, err)
	require.NoError(t, s.Reservations().Free(res.ReservationID))
}

func TestLoadSpreadsAcrossWorkers(t *testing.T) {
	s, _ := newTestService(t, nil)
	addWorkers(t, s, "a", "b", "c", "d")
	count := map[string]int{}
	var ids []string
	for i := range 40 {
		res, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(64, i)})
		require.NoError(t, err)
		count[res.WorkerID]++
		ids = append(ids, string(res.ReservationID))
	}
	for _, w := range []string{"a", "b", "c", "d"} {
		require.Equal(t, 10, count[w], count)
	}
	for _, id := range ids {
		require.NoError(t, s.Reservations().Free(reservation.ID(id)))
	}
	requireIdle(t, s)
}

func TestDeleteWorkerDropsItsLoad(t *testing.T) {
	s, _ := newTestService(t, nil)
	addWorkers(t, s, "a", "b")
	ctx := context.Background()
	var onA []string
	for i := range 6 {
		res, err := s.SelectAndReserve(ctx, Request{Tokens: toks(16, i)})
		require.NoError(t, err)
		if res.WorkerID == "a" {
			onA = append(onA, string(res.ReservationID))
		}
	}
	require.NotEmpty(t, onA)
	rec, err := s.Workers().Delete("a")
	require.NoError(t, err)
	require.Equal(t, catalog.Unschedulable, rec.Lifecycle)
	for _, id := range onA {
		require.ErrorIs(t, s.Reservations().Free(reservation.ID(id)), ErrUnknownReservation)
	}
	for range 5 {
		res, err := s.SelectAndReserve(ctx, Request{Tokens: toks(16, 1)})
		require.NoError(t, err)
		require.Equal(t, "b", res.WorkerID)
	}
	require.Len(t, s.Loads(""), 1)
}

func TestExpiryFreesOrphans(t *testing.T) {
	s, clk := newTestService(t, func(c *Config) { c.ActiveRequestExpiry = time.Minute })
	addWorkers(t, s, "a")
	_, err := s.SelectAndReserve(context.Background(), Request{ReservationID: "orphan", Tokens: toks(16, 1)})
	require.NoError(t, err)
	require.Zero(t, s.Reservations().Expire())
	clk.Advance(61 * time.Second)
	require.Equal(t, 1, s.Reservations().Expire())
	require.ErrorIs(t, s.Reservations().Free("orphan"), ErrUnknownReservation)
	require.EqualValues(t, 1, s.Stats().Expired)
	requireIdle(t, s)
}

// queued waits until n requests are in the default model's queue.
func queued(t *testing.T, s *SelectionService, model string, n int) {
	t.Helper()
	p := s.partition(model)
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.queue.Len() == n
	}, 5*time.Second, time.Millisecond)
}

// testContext is a context that ends with the test, and after 10 s at most, so
// that a request stuck in a queue fails the test instead of hanging it.
func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

type outcome struct {
	res Result
	err error
}

func TestAdmissionQueue(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) {
		th := 1.0
		c.QueueThreshold = &th
		c.QueueLimit = 2
	})
	addWorkers(t, s, "a") // busy above 100 active prefill tokens
	ctx := context.Background()
	big, err := s.SelectAndReserve(ctx, Request{ReservationID: "big", Tokens: toks(200, 1)})
	require.NoError(t, err)
	require.Equal(t, 200, big.EffectivePrefillTokens)

	// Select still answers, flagged busy.
	adv, err := s.Select(ctx, Request{Tokens: toks(8, 2)})
	require.NoError(t, err)
	require.True(t, adv.Busy)

	done := make(chan outcome, 3)
	go func() {
		r, err := s.SelectAndReserve(ctx, Request{ReservationID: "low", Tokens: toks(8, 3)})
		done <- outcome{r, err}
	}()
	queued(t, s, "", 1)
	go func() {
		r, err := s.SelectAndReserve(ctx, Request{ReservationID: "high", Tokens: toks(8, 4), Priority: Priority{Tier: 1}})
		done <- outcome{r, err}
	}()
	queued(t, s, "", 2)
	require.Equal(t, 2, s.Stats().Waiting)
	// The queue is full.
	_, err = s.SelectAndReserve(ctx, Request{ReservationID: "over", Tokens: toks(8, 5)})
	require.ErrorIs(t, err, ErrOverloaded)
	require.Equal(t, http.StatusTooManyRequests, HTTPStatus(err))

	// Prefill completes: capacity frees; the higher tier goes first. Each
	// admitted 8-token request keeps the worker below the busy line, so both go.
	require.NoError(t, s.Reservations().PrefillComplete("big"))
	// done gives the order in which the two goroutines got back, not the order
	// of admission (the first admitted wakes the next before it returns): each
	// request, evaluated under the partition lock, sees the active blocks of
	// every request admitted before it, so the first admitted saw fewer.
	got := map[string]Result{}
	for range 2 {
		o := <-done
		require.NoError(t, o.err)
		got[string(o.res.ReservationID)] = o.res
	}
	require.Len(t, got, 2)
	require.Contains(t, got, "high")
	require.Contains(t, got, "low")
	require.Less(t, got["high"].PotentialDecodeBlocks, got["low"].PotentialDecodeBlocks, "the higher tier was admitted first")
	st := s.Stats()
	require.EqualValues(t, 2, st.Queued)
	require.EqualValues(t, 1, st.QueueRejected)
	for _, id := range []string{"big", "high", "low"} {
		require.NoError(t, s.Reservations().Free(reservation.ID(id)))
	}
	requireIdle(t, s)
}

func TestQueuedRequestIsWithdrawnOnCancel(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { th := 0.5; c.QueueThreshold = &th })
	addWorkers(t, s, "a")
	_, err := s.SelectAndReserve(context.Background(), Request{ReservationID: "big", Tokens: toks(200, 1)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan outcome, 1)
	go func() {
		r, err := s.SelectAndReserve(ctx, Request{ReservationID: "w", Tokens: toks(8, 2)})
		done <- outcome{r, err}
	}()
	queued(t, s, "", 1)
	cancel()
	o := <-done
	require.ErrorIs(t, o.err, context.Canceled)
	queued(t, s, "", 0)
	require.ErrorIs(t, s.Reservations().Free("w"), ErrUnknownReservation)
	require.EqualValues(t, 1, s.Stats().QueueCanceled)

	// A deadline works the same way, and expiry of the blocker admits waiters.
	dctx, dcancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer dcancel()
	_, err = s.SelectAndReserve(dctx, Request{ReservationID: "d", Tokens: toks(8, 3)})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, http.StatusGatewayTimeout, HTTPStatus(err))
	require.NoError(t, s.Reservations().Free("big"))
	requireIdle(t, s)
}

func TestCloseReleasesWaiters(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { th := 0.5; c.QueueThreshold = &th })
	addWorkers(t, s, "a")
	_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(200, 1)})
	require.NoError(t, err)
	done := make(chan outcome, 1)
	go func() {
		r, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(8, 2)})
		done <- outcome{r, err}
	}()
	queued(t, s, "", 1)
	require.NoError(t, s.Close())
	require.ErrorIs(t, (<-done).err, ErrClosed)
	require.NoError(t, s.Close())
	_, err = s.SelectAndReserve(context.Background(), Request{Tokens: toks(8, 2)})
	require.ErrorIs(t, err, ErrClosed)
	_, err = s.Workers().Upsert(worker("b", nil))
	require.ErrorIs(t, err, ErrClosed)
}

func TestNewWorkerAdmitsWaiters(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { th := 0.5; c.QueueThreshold = &th })
	addWorkers(t, s, "a")
	_, err := s.SelectAndReserve(context.Background(), Request{ReservationID: "big", Tokens: toks(200, 1)})
	require.NoError(t, err)
	done := make(chan outcome, 1)
	go func() {
		r, err := s.SelectAndReserve(context.Background(), Request{ReservationID: "w", Tokens: toks(8, 2)})
		done <- outcome{r, err}
	}()
	queued(t, s, "", 1)
	addWorkers(t, s, "b")
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, "b", o.res.WorkerID)
}

// TestConcurrentChurn runs bookings, prefill completions, frees and worker
// upserts and deletes from many goroutines; at the end every load is zero and
// no reservation is left.
func TestConcurrentChurn(t *testing.T) {
	t.Run("queueing", func(t *testing.T) {
		concurrentChurn(t, func(c *Config) { th := 4.0; c.QueueThreshold = &th })
	})
	t.Run("lock-free", func(t *testing.T) { concurrentChurn(t, nil) })
}

// concurrentChurn has goroutines book, complete and free while workers are
// deleted and re-added; at the end nothing may be left booked.
func concurrentChurn(t *testing.T, mod func(*Config)) {
	s, _ := newTestService(t, mod)
	addWorkers(t, s, "w0", "w1", "w2", "w3")
	var wg sync.WaitGroup
	ctx := context.Background()
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 9))
			for i := range 300 {
				id := fmt.Sprintf("g%d-%d", g, i)
				c, cancel := context.WithTimeout(ctx, time.Second)
				_, err := s.SelectAndReserve(c, Request{ReservationID: reservation.ID(id), Tokens: toks(8+r.IntN(64), r.IntN(5)), Priority: Priority{Tier: r.IntN(2)}})
				cancel()
				if err != nil {
					if errors.Is(err, context.DeadlineExceeded) {
						t.Logf("deadline: %v", err)
					}
					if !errors.Is(err, ErrNotReady) && !errors.Is(err, ErrOverloaded) && !errors.Is(err, context.DeadlineExceeded) {
						t.Errorf("unexpected %v", err)
					}
					continue
				}
				if r.IntN(2) == 0 {
					_ = s.Reservations().PrefillComplete(reservation.ID(id))
				}
				_ = s.Reservations().Free(reservation.ID(id)) // may be gone with a deleted worker
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range 100 {
			id := fmt.Sprintf("w%d", i%4)
			if i%3 == 0 {
				_, _ = s.Workers().Delete(id)
			}
			_, err := s.Workers().Upsert(worker(id, nil))
			if err != nil {
				t.Error(err)
			}
		}
	}()
	wg.Wait()
	requireIdle(t, s)
}

// TestConcurrentDecisionsSeeEachOther races SelectAndReserve calls without
// queueing (lock-free booking) on two workers and an empty cache: equal prompts
// cost only their worker's active blocks, so if any two calls both decided on
// the loads from before the other's booking, they could both land on the same
// worker and leave the two unbalanced by more than one request.
func TestConcurrentDecisionsSeeEachOther(t *testing.T) {
	s, _ := newTestService(t, nil)
	addWorkers(t, s, "a", "b")
	const goroutines, perG = 8, 100
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perG {
				if _, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(64, g*perG+i+1)}); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	loads := s.Loads(catalog.DefaultModel)
	require.Len(t, loads, 2)
	na, nb := loads[0].ActiveRequests, loads[1].ActiveRequests
	require.Equal(t, goroutines*perG, na+nb)
	require.LessOrEqual(t, max(na-nb, nb-na), 1, "every booking went to the less loaded worker")
	st := s.Stats()
	require.Equal(t, uint64(goroutines*perG), st.Bookings)
	require.Equal(t, uint64(goroutines*perG), st.Selections, "a retried decision counts once")
	t.Logf("retries after a concurrent booking: %d", st.Retries)
}

// TestStaleDecisionIsMadeAgain holds one decision between its evaluation and
// its booking while another decides and books the same worker: the first must
// see that booking and go elsewhere.
func TestStaleDecisionIsMadeAgain(t *testing.T) {
	s, _ := newTestService(t, nil)
	addWorkers(t, s, "a", "b")
	ctx := context.Background()
	// b is a little loaded, so a is every fresh decision's choice.
	_, err := s.SelectAndReserve(ctx, Request{ReservationID: "pre", Tokens: toks(8, 1), Allowed: []string{"b"}})
	require.NoError(t, err)

	first, release, _ := holdFirstBooking(s)

	held := make(chan Result, 1)
	go func() {
		res, err := s.SelectAndReserve(ctx, Request{ReservationID: "held", Tokens: toks(64, 2)})
		if err != nil {
			t.Error(err)
		}
		held <- res
	}()
	<-first // "held" chose a and waits to book it
	other, err := s.SelectAndReserve(ctx, Request{ReservationID: "other", Tokens: toks(64, 3)})
	require.NoError(t, err)
	require.Equal(t, "a", other.WorkerID)
	close(release)
	res := <-held
	require.Equal(t, "b", res.WorkerID, "the held decision saw the booking on a")
	require.Equal(t, uint64(1), s.Stats().Retries)
	require.Equal(t, int64(1), s.Stats().Ledger.Stale)
}

func TestTemperaturePicksByCost(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { c.Temperature = 0.5 })
	addWorkers(t, s, "a", "b")
	ctx := context.Background()
	// Load a heavily: the softmax should still mostly pick b.
	for i := range 5 {
		_, err := s.SelectAndReserve(ctx, Request{Tokens: toks(400, 100+i), Allowed: []string{"a"}})
		require.NoError(t, err)
	}
	b := 0
	for i := range 200 {
		res, err := s.Select(ctx, Request{Tokens: toks(8, i)})
		require.NoError(t, err)
		if res.WorkerID == "b" {
			b++
		}
	}
	require.Greater(t, b, 150)
	require.Less(t, b, 200, "temperature > 0 must still sample the worse worker sometimes")
}

func TestPotentialLoadsAndOverlap(t *testing.T) {
	s, _ := newTestService(t, nil)
	addWorkers(t, s, "a", "b")
	ctx := context.Background()
	prompt := toks(20, 7)
	res, err := s.SelectAndReserve(ctx, Request{ReservationID: "r", Tokens: prompt})
	require.NoError(t, err)
	sc, err := s.PotentialLoads(ctx, Request{Tokens: prompt})
	require.NoError(t, err)
	require.Len(t, sc, 2)
	for _, x := range sc {
		if x.WorkerID == res.WorkerID {
			require.Equal(t, 5, x.Overlap.Device)
			require.Zero(t, x.EffectivePrefillTokens)
			require.Equal(t, 5, x.PotentialDecodeBlock)
			require.EqualValues(t, 20, x.PotentialPrefill) // its own booking's prefill
		} else {
			require.Zero(t, x.Overlap.Device)
			require.EqualValues(t, 20, x.PotentialPrefill)
			require.Equal(t, 5, x.PotentialDecodeBlock)
		}
	}
	ov, err := overlapScores(s, ctx, Request{Tokens: prompt})
	require.NoError(t, err)
	require.Equal(t, 5, ov[catalog.WorkerRank{WorkerID: res.WorkerID}].Device)
	require.NoError(t, s.Reservations().Free("r"))
}

func TestActiveBlockTracking(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name string
		mod  func(*Config)
		want int // active blocks after two bookings of the same 10-token prompt
	}{
		{"reuse shares blocks, tail private", nil, 2 + 1 + 1},
		{"no reuse: every block private", func(c *Config) { c.AssumeKVReuse = false }, 3 + 3},
		{"not tracked", func(c *Config) { c.TrackActiveBlocks = false }, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, _ := newTestService(t, c.mod)
			addWorkers(t, s, "a")
			for _, id := range []string{"x", "y"} {
				_, err := s.SelectAndReserve(ctx, Request{ReservationID: reservation.ID(id), Tokens: toks(10, 1)})
				require.NoError(t, err)
			}
			require.Equal(t, c.want, s.Loads("")[0].ActiveBlocks)
			require.NoError(t, s.Reservations().Free("x"))
			require.NoError(t, s.Reservations().Free("y"))
			requireIdle(t, s)
		})
	}
	// Prefill tracking off: bookings add no prefill load.
	s, _ := newTestService(t, func(c *Config) { c.TrackPrefillTokens = false })
	addWorkers(t, s, "a")
	off := false
	_, err := s.SelectAndReserve(ctx, Request{ReservationID: "p", Tokens: toks(40, 1)})
	require.NoError(t, err)
	require.Zero(t, s.Loads("")[0].ActivePrefillTokens)
	on := true
	_, err = s.SelectAndReserve(ctx, Request{ReservationID: "q", Tokens: toks(40, 2), Override: &Override{TrackPrefillTokens: &on, AssumeKVReuse: &off}})
	require.NoError(t, err)
	require.EqualValues(t, 40, s.Loads("")[0].ActivePrefillTokens)
}

// TestPrivateBlocksAreCounted checks how a booking's blocks reach the ledger:
// shared prefix blocks as sequence hashes, blocks no other request can share (the
// partial last block, or every block without assumed reuse) as a private count
// and never as hashes, and that the potential decode blocks of the result count
// both.
func TestPrivateBlocksAreCounted(t *testing.T) {
	ctx := context.Background()
	off := false
	cases := []struct {
		name          string
		mod           func(*Config)
		override      *Override
		tokens        int
		hashes        int // sequence hashes booked
		private       int // private blocks booked
		first, second int // PotentialDecodeBlocks of two bookings of the same prompt
	}{
		{"reuse, partial tail", nil, nil, 10, 2, 1, 3, 2 + 1 + 1},
		{"reuse, whole blocks", nil, nil, 12, 3, 0, 3, 3},
		{"no reuse", func(c *Config) { c.AssumeKVReuse = false }, nil, 10, 0, 3, 3, 6},
		{"no reuse by override", nil, &Override{AssumeKVReuse: &off}, 12, 0, 3, 3, 6},
		{"not tracked", func(c *Config) { c.TrackActiveBlocks = false }, nil, 10, 0, 0, 0, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, _ := newTestService(t, c.mod)
			obs := &recordingObserver{}
			s.obs = obs // the booking as the ledger took it
			addWorkers(t, s, "a")
			for i, id := range []reservation.ID{"x", "y"} {
				res, err := s.SelectAndReserve(ctx, Request{ReservationID: id, Tokens: toks(c.tokens, 1), Override: c.override})
				require.NoError(t, err)
				ev := obs.booked[len(obs.booked)-1]
				require.Equal(t, id, ev.ID)
				require.Len(t, ev.SeqHashes, c.hashes, "sequence hashes booked")
				require.Equal(t, c.private, ev.PrivateBlocks)
				want := []int{c.first, c.second}[i]
				require.Equal(t, want, res.PotentialDecodeBlocks)
				require.Equal(t, want, s.Loads("")[0].ActiveBlocks, "the potential became the load")
				require.Equal(t, want, s.ledger.Load(catalog.WorkerRank{WorkerID: "a"}).ActiveBlocks)
			}
			require.NoError(t, s.Reservations().Free("x"))
			require.NoError(t, s.Reservations().Free("y"))
			requireIdle(t, s)
			require.Zero(t, s.ledger.Load(catalog.WorkerRank{WorkerID: "a"}), "nothing left on the rank")
		})
	}
}

// TestQueuedRequestThatFailsLeavesTheQueue: a waiting request whose booking
// fails when it is admitted (its id was booked meanwhile through another
// model's partition) must leave the queue and let the next request through,
// not stay at its head.
func TestQueuedRequestThatFailsLeavesTheQueue(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { th := 1.0; c.QueueThreshold = &th })
	for _, w := range []catalog.Worker{
		worker("a", func(w *catalog.Worker) { w.Model = "m1" }),
		worker("b", func(w *catalog.Worker) { w.Model = "m2" }),
	} {
		_, err := s.Workers().Upsert(w)
		require.NoError(t, err)
	}
	ctx := testContext(t)
	_, err := s.SelectAndReserve(ctx, Request{Model: "m1", ReservationID: "big", Tokens: toks(200, 1)})
	require.NoError(t, err)

	failed := make(chan error, 1)
	go func() {
		_, err := s.SelectAndReserve(ctx, Request{Model: "m1", ReservationID: "dup", Tokens: toks(8, 2)})
		failed <- err
	}()
	queued(t, s, "m1", 1)
	// The same id is booked on the other model while "dup" waits.
	_, err = s.SelectAndReserve(ctx, Request{Model: "m2", ReservationID: "dup", Tokens: toks(8, 3)})
	require.NoError(t, err)

	require.NoError(t, s.Reservations().PrefillComplete("big"))
	require.ErrorIs(t, <-failed, ErrConflict)
	require.Zero(t, s.Stats().Waiting, "the failed request left the queue")
	next, err := s.SelectAndReserve(ctx, Request{Model: "m1", ReservationID: "next", Tokens: toks(8, 4)})
	require.NoError(t, err, "capacity is free and nobody waits ahead")
	require.Equal(t, "a", next.WorkerID)
}

// TestQueuedHeadThatFailsWakesTheNext: when the head of the queue fails on
// admission (every worker it may use is gone), the request behind it must be
// woken to look again, and get through.
func TestQueuedHeadThatFailsWakesTheNext(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { th := 1.0; c.QueueThreshold = &th })
	addWorkers(t, s, "a", "b")
	ctx := testContext(t)
	for _, w := range []string{"a", "b"} {
		_, err := s.SelectAndReserve(ctx, Request{ReservationID: reservation.ID("big-" + w), Tokens: toks(200, 1), Allowed: []string{w}})
		require.NoError(t, err)
	}
	headErr := make(chan error, 1)
	go func() {
		_, err := s.SelectAndReserve(ctx, Request{ReservationID: "head", Tokens: toks(8, 2), Allowed: []string{"b"}})
		headErr <- err
	}()
	queued(t, s, "", 1)
	nextRes := make(chan outcome, 1)
	go func() {
		r, err := s.SelectAndReserve(ctx, Request{ReservationID: "next", Tokens: toks(8, 3)})
		nextRes <- outcome{r, err}
	}()
	queued(t, s, "", 2)
	// a frees up, but the queue is strict: "next" stays behind the head, which
	// may only use b. Then b goes away: the head fails, and nothing else will
	// signal the partition.
	require.NoError(t, s.Reservations().PrefillComplete("big-a"))
	_, err := s.Workers().Delete("b")
	require.NoError(t, err)
	require.ErrorIs(t, <-headErr, ErrNoEndpoints)
	got := <-nextRes
	require.NoError(t, got.err)
	require.Equal(t, "a", got.res.WorkerID)
}

// holdFirstBooking makes s's first decision that reaches its booking wait
// there: first is closed when it arrives, and it books once the test closes
// release. Later decisions pass; calls counts every decision that reached
// its booking.
func holdFirstBooking(s *SelectionService) (first, release chan struct{}, calls *atomic.Int32) {
	calls = new(atomic.Int32)
	first, release = make(chan struct{}), make(chan struct{})
	s.beforeBook = func() {
		if calls.Add(1) == 1 {
			close(first)
			<-release
		}
	}
	return first, release, calls
}
