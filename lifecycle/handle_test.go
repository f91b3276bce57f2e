package lifecycle_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/lifecycle"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

var (
	_ lifecycle.Handle = (*selection.Booking)(nil)
	_ lifecycle.Handle = roles.Plan{}
)

// handles are the two implementations, each booked on a fresh two-worker
// fleet: book returns a new handle on worker a, loads the fleet's active
// requests, pick the worker a request for a or b goes to, gone the
// implementation's unknown-booking error.
type handles struct {
	book  func(t *testing.T) lifecycle.Handle
	loads func() int
	pick  func(t *testing.T) string
	gone  error
}

// picksB reports whether a request for a or b goes to b while a carries
// two more requests than b: unless b is out of the picks.
func (hs handles) picksB(t *testing.T) bool {
	x, y := hs.book(t), hs.book(t)
	defer func() { _, _ = x.Done(), y.Done() }()
	return hs.pick(t) == "b"
}

func pod(id, ip, role string) catalog.Worker {
	return catalog.Worker{ID: id, Endpoint: ip + ":8000", DPSize: 1, BlockSize: 4,
		Labels: map[string]string{roles.DefaultRoleLabel: role}}
}

// only is a request that may go to worker id alone.
func only(id string) selection.Request {
	return selection.Request{Tokens: make([]uint32, 16), Allowed: []string{id}}
}

func bookings(t *testing.T) handles {
	svc, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).ExternalEvents().Build(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	for _, w := range []catalog.Worker{pod("a", "10.0.0.1", ""), pod("b", "10.0.0.2", "")} {
		_, err := svc.Workers().Upsert(w)
		require.NoError(t, err)
	}
	return handles{
		book: func(t *testing.T) lifecycle.Handle {
			b, err := svc.Book(context.Background(), only("a"))
			require.NoError(t, err)
			return b
		},
		loads: func() int { return activeRequests(svc.Loads("")) },
		pick: func(t *testing.T) string {
			res, err := svc.Select(context.Background(), selection.Request{Tokens: make([]uint32, 16), Allowed: []string{"a", "b"}})
			require.NoError(t, err)
			return res.WorkerID
		},
		gone: selection.ErrUnknownReservation,
	}
}

func plans(t *testing.T) handles {
	rs, err := roles.New(context.Background(), roles.RoleOptions{
		Mode: roles.ModeDisaggregated, Base: selection.DefaultConfig(4),
		Configure: func(_ roles.Role, b *selection.SelectionServiceBuilder) { b.ExternalEvents() },
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = rs.Close() })
	_, err = rs.Reconcile([]catalog.Worker{pod("p", "10.0.0.9", "prefill"), pod("a", "10.0.0.1", "decode"), pod("b", "10.0.0.2", "decode")})
	require.NoError(t, err)
	pb, err := roles.NewPairBooker(rs, roles.BookerOptions{})
	require.NoError(t, err)
	t.Cleanup(pb.Close)
	dec := rs.Service(roles.Decode)
	return handles{
		book: func(t *testing.T) lifecycle.Handle {
			p, err := pb.Book(context.Background(), selection.Request{Tokens: make([]uint32, 16), Allowed: []string{"p", "a"}})
			require.NoError(t, err)
			return p
		},
		loads: func() int { return activeRequests(dec.Loads("")) + activeRequests(rs.Service(roles.Prefill).Loads("")) },
		pick: func(t *testing.T) string {
			res, err := dec.Select(context.Background(), selection.Request{Tokens: make([]uint32, 16), Allowed: []string{"a", "b"}})
			require.NoError(t, err)
			return res.WorkerID
		},
		gone: roles.ErrUnknownPlan,
	}
}

func activeRequests(ls []selection.WorkerLoad) int {
	n := 0
	for _, l := range ls {
		n += l.ActiveRequests
	}
	return n
}

// TestHandleContract: a booking and a plan keep the same repeat-call
// contract, on real services.
func TestHandleContract(t *testing.T) {
	for name, mk := range map[string]func(*testing.T) handles{"booking": bookings, "plan": plans} {
		t.Run(name, func(t *testing.T) {
			hs := mk(t)
			h := hs.book(t)
			require.Positive(t, hs.loads())
			require.NoError(t, h.PrefillComplete())
			require.NoError(t, h.PrefillComplete(), "a repeat changes nothing")
			require.NoError(t, h.Renew())
			require.NoError(t, h.Generated(64))
			require.NoError(t, h.Move(catalog.WorkerRank{WorkerID: "b"}))
			require.True(t, hs.picksB(t))
			require.NoError(t, h.MarkFailed())
			require.False(t, hs.picksB(t), "the worker moved to is marked failed")
			require.NoError(t, h.MarkFailed(), "a repeat changes nothing")

			require.NoError(t, h.Done())
			require.Zero(t, hs.loads(), "Done freed everything")
			require.NoError(t, h.Done(), "a repeat changes nothing")
			require.NoError(t, h.PrefillComplete(), "nor does a first output after Done")
			require.ErrorIs(t, h.Renew(), hs.gone)
			require.ErrorIs(t, h.Generated(128), hs.gone)
			require.ErrorIs(t, h.Move(catalog.WorkerRank{WorkerID: "a"}), hs.gone)
		})
	}
}

// The follower drives either handle through a response to the same end.
func TestFollowerOnEitherHandle(t *testing.T) {
	for name, mk := range map[string]func(*testing.T) handles{"booking": bookings, "plan": plans} {
		t.Run(name, func(t *testing.T) {
			hs := mk(t)
			f, err := lifecycle.NewFollower(hs.book(t), lifecycle.Options{OutputGrowth: true})
			require.NoError(t, err)
			f.Response(200, "text/event-stream")
			require.True(t, f.Body([]byte("data: one\n\n")))
			renewed, _ := f.Renew()
			require.True(t, renewed)
			require.NoError(t, f.Done())
			require.Zero(t, hs.loads())
			require.NoError(t, f.Done())
		})
	}
}
