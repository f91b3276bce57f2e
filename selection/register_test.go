package selection

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
)

// TestMaxWorkerRanks: past Config.MaxWorkerRanks an upsert is refused by
// name, counted, and changes nothing; a delete gives its ranks back.
func TestMaxWorkerRanks(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { c.MaxWorkerRanks = 8 })
	wide := func(id string, n int) catalog.Worker {
		return worker(id, func(w *catalog.Worker) { w.DPSize = n })
	}
	for _, id := range []string{"a", "b"} {
		_, err := s.Workers().Upsert(wide(id, 4))
		require.NoError(t, err)
	}
	_, err := s.Workers().Upsert(wide("c", 1))
	require.ErrorIs(t, err, ErrTooManyRanks)
	require.ErrorIs(t, err, catalog.ErrTooManyRanks)
	require.ErrorContains(t, err, "above its bound of 8")
	require.Equal(t, http.StatusBadRequest, HTTPStatus(err))
	_, err = s.Workers().Upsert(wide("b", 5)) // growing a worker counts too
	require.ErrorIs(t, err, ErrTooManyRanks)
	require.Equal(t, map[string]uint64{RefusedTooManyRanks: 2, RefusedInvalid: 0}, s.Stats().WorkerRefusals)
	require.Len(t, s.Workers().List(), 2)
	require.Len(t, s.Loads(""), 8, "b keeps its 4 ranks")

	_, err = s.Workers().Delete("a")
	require.NoError(t, err)
	_, err = s.Workers().Upsert(wide("c", 4))
	require.NoError(t, err)
	require.Len(t, s.Loads(""), 8)

	_, err = s.Workers().Upsert(worker("bad", func(w *catalog.Worker) { w.DPSize = -1 }))
	require.ErrorIs(t, err, ErrBadRequest)
	require.Equal(t, uint64(1), s.Stats().WorkerRefusals[RefusedInvalid])
}

// TestMaxWorkerRanksDefault: without the knob a service holds
// DefaultMaxWorkerRanks ranks (16 workers of catalog.MaxDPSize) and refuses
// one more; issue 27's 500 workers of 4,096 ranks stop at the 17th.
func TestMaxWorkerRanksDefault(t *testing.T) {
	s, _ := newTestService(t, nil)
	var refused []string
	for i := range 500 {
		w := worker(fmt.Sprintf("w%03d", i), func(w *catalog.Worker) { w.DPSize = catalog.MaxDPSize })
		if _, err := s.Workers().Upsert(w); err != nil {
			require.ErrorIs(t, err, ErrTooManyRanks)
			refused = append(refused, w.ID)
		}
	}
	require.Len(t, refused, 500-DefaultMaxWorkerRanks/catalog.MaxDPSize)
	require.Equal(t, "w016", refused[0])
	require.Len(t, s.Loads(""), DefaultMaxWorkerRanks)
}

func TestMaxWorkerRanksValidated(t *testing.T) {
	cfg := DefaultConfig(16)
	cfg.MaxWorkerRanks = -1
	err := cfg.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "MaxWorkerRanks is -1, want >= 0")
}

// TestRegisterBuildsOnce: upserting workers one by one builds no candidate
// snapshot; the first decision builds one, with every worker in it, and the
// next decision builds none.
func TestRegisterBuildsOnce(t *testing.T) {
	s, _ := newTestService(t, nil)
	for i := range 100 {
		_, err := s.Workers().Upsert(worker(fmt.Sprintf("w%03d", i), nil))
		require.NoError(t, err)
	}
	p := s.partition("")
	require.Nil(t, p.set.Load(), "no snapshot built while registering")
	require.Equal(t, uint64(100), p.ver.Load())
	_, err := s.SelectAndReserve(context.Background(), Request{Tokens: toks(8, 1)})
	require.NoError(t, err)
	rs := p.set.Load()
	require.NotNil(t, rs)
	require.Len(t, rs.ranks, 100)
	require.Equal(t, "w000", rs.ranks[0].key.WorkerID, "sorted by worker id")
	require.Equal(t, "w099", rs.ranks[99].key.WorkerID)
	_, err = s.SelectAndReserve(context.Background(), Request{Tokens: toks(8, 2)})
	require.NoError(t, err)
	require.Same(t, rs, p.set.Load(), "nothing changed: no build")

	// An upsert equal to the worker changes nothing either.
	_, err = s.Workers().Upsert(worker("w007", nil))
	require.NoError(t, err)
	require.Same(t, rs, p.ranksOf())
}

// TestChangeHeldDecision holds a decision between its evaluation and its
// booking while the worker it chose is deleted, or moved to another
// endpoint: the decision is made again, and books what is true once the
// change has returned.
func TestChangeHeldDecision(t *testing.T) {
	for _, c := range []struct {
		name   string
		change func(*SelectionService) error
		want   Result
	}{
		{"delete", func(s *SelectionService) error { _, err := s.Workers().Delete("a"); return err },
			Result{WorkerRank: catalog.WorkerRank{WorkerID: "b"}, Endpoint: "10.0.0.2:8000"}},
		{"endpoint", func(s *SelectionService) error {
			_, err := s.Workers().Upsert(worker("a", func(w *catalog.Worker) { w.Endpoint = "10.0.0.9:8000" }))
			return err
		}, Result{WorkerRank: catalog.WorkerRank{WorkerID: "a"}, Endpoint: "10.0.0.9:8000"}},
		{"draining", func(s *SelectionService) error { _, err := s.Workers().SetDraining("a", true); return err },
			Result{WorkerRank: catalog.WorkerRank{WorkerID: "b"}, Endpoint: "10.0.0.2:8000"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, _ := newTestService(t, nil)
			_, err := s.Workers().Upsert(worker("a", nil))
			require.NoError(t, err)
			_, err = s.Workers().Upsert(worker("b", func(w *catalog.Worker) { w.Endpoint = "10.0.0.2:8000" }))
			require.NoError(t, err)
			ctx := context.Background()
			// b is a little loaded, so a is every fresh decision's choice.
			_, err = s.SelectAndReserve(ctx, Request{ReservationID: "pre", Tokens: toks(8, 1), Allowed: []string{"b"}})
			require.NoError(t, err)

			first, release, calls := holdFirstBooking(s)
			held := make(chan Result, 1)
			go func() {
				res, err := s.SelectAndReserve(ctx, Request{ReservationID: "held", Tokens: toks(64, 2)})
				assert.NoError(t, err)
				held <- res
			}()
			<-first // "held" chose a and waits to book it
			require.NoError(t, c.change(s))
			close(release)
			res := <-held
			require.Equal(t, c.want.WorkerRank, res.WorkerRank)
			require.Equal(t, c.want.Endpoint, res.Endpoint)
			require.GreaterOrEqual(t, calls.Load(), int32(2), "the held decision was made again")
		})
	}
}

// TestChurnWhileDeciding books and frees from several goroutines while
// workers are added, moved to new endpoints and deleted: a decision never
// books an endpoint that a change had taken away before the decision began.
func TestChurnWhileDeciding(t *testing.T) {
	for _, queued := range []bool{false, true} {
		t.Run(fmt.Sprintf("queued=%v", queued), func(t *testing.T) {
			s, _ := newTestService(t, func(c *Config) {
				if queued {
					c.QueueThreshold = new(float64)
					*c.QueueThreshold = 1e9
				}
			})
			const workers, changes = 16, 600
			// Every endpoint is used once. An endpoint is allowed from just
			// before the upsert that brings it until the change that takes it
			// away has returned; added is when it was allowed (a change
			// count).
			var mu sync.Mutex
			allowed := map[string]bool{}
			added := map[string]int{}
			gen := 0
			cur := make([]string, workers) // each worker's endpoint, "" when deleted
			allow := func(ep string) {
				mu.Lock()
				gen++
				allowed[ep], added[ep] = true, gen
				mu.Unlock()
			}
			revoke := func(ep string) {
				mu.Lock()
				delete(allowed, ep)
				mu.Unlock()
			}
			upsert := func(i, g int) {
				ep := fmt.Sprintf("10.%d.%d.%d:8000", i, g/200, g%200+1)
				allow(ep)
				_, err := s.Workers().Upsert(worker(fmt.Sprintf("w%02d", i), func(w *catalog.Worker) { w.Endpoint = ep }))
				require.NoError(t, err)
				if cur[i] != "" {
					revoke(cur[i])
				}
				cur[i] = ep
			}
			for i := range workers {
				upsert(i, 0)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var wg sync.WaitGroup
			var bookings atomic.Int64
			// booked paces the changes: each waits for a booking made since
			// the one before (or at most a second, when every worker is
			// gone), so decisions run between every two changes.
			booked := make(chan struct{}, 1)
			for g := range 3 {
				wg.Go(func() {
					r := rand.New(rand.NewPCG(uint64(g), 9))
					for ctx.Err() == nil {
						mu.Lock()
						before, g0 := maps.Clone(allowed), gen
						mu.Unlock()
						res, err := s.SelectAndReserve(ctx, Request{Tokens: toks(16, r.IntN(50))})
						if errors.Is(err, ErrNotReady) || errors.Is(err, context.Canceled) {
							continue
						}
						if !assert.NoError(t, err) {
							return
						}
						bookings.Add(1)
						select {
						case booked <- struct{}{}:
						default:
						}
						mu.Lock()
						ok := before[res.Endpoint] || added[res.Endpoint] > g0
						mu.Unlock()
						assert.True(t, ok, "booked %s at %s, taken away before the decision began", res.WorkerID, res.Endpoint)
						// Deleting the worker may have dropped it already.
						if err := s.Reservations().Free(res.ReservationID); !errors.Is(err, ErrUnknownReservation) {
							assert.NoError(t, err)
						}
					}
				})
			}
			r := rand.New(rand.NewPCG(7, 7))
			for g := 1; g <= changes; g++ {
				select {
				case <-booked:
				case <-time.After(time.Second):
				}
				i := r.IntN(workers)
				if cur[i] != "" && r.IntN(2) == 0 {
					_, err := s.Workers().Delete(fmt.Sprintf("w%02d", i))
					require.NoError(t, err)
					revoke(cur[i])
					cur[i] = ""
					continue
				}
				upsert(i, g)
			}
			cancel()
			wg.Wait()
			require.Zero(t, s.Stats().Ledger.Active, "every booking freed or dropped")
			t.Logf("%d bookings during %d changes", bookings.Load(), changes)
		})
	}
}

// TestCloseStopsRegistration: a registration loop running when the service
// closes ends at its next upsert, with ErrClosed.
func TestCloseStopsRegistration(t *testing.T) {
	s, _ := newTestService(t, func(c *Config) { c.MaxWorkerRanks = 1 << 30 }) // only Close ends the loop
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		for i := 0; ; i++ {
			if i == 100 {
				close(started)
			}
			if _, err := s.Workers().Upsert(worker(fmt.Sprintf("w%06d", i), nil)); err != nil {
				done <- err
				return
			}
		}
	}()
	<-started
	require.NoError(t, s.Close())
	select {
	case err := <-done:
		require.ErrorIs(t, err, ErrClosed)
	case <-time.After(10 * time.Second):
		t.Fatal("the registration loop did not stop after Close")
	}
}
