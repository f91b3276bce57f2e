package replica_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/selection"
)

// A replica alone is synced once its listening window has passed.
func TestSyncedAlone(t *testing.T) {
	h := newHub()
	a := newNode(t, h, "a", nil)
	require.False(t, a.r.Synced(), "synced before a heartbeat interval could pass")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, a.r.WaitSynced(ctx))
	st := a.r.Stats()
	require.True(t, st.Synced)
	require.Zero(t, st.SyncTimeouts)
}

// A replica that joins peers with live bookings reports itself synced only
// once it holds all of them.
func TestSyncedHoldsPeersBookings(t *testing.T) {
	h := newHub()
	a, b := newNode(t, h, "a", nil), newNode(t, h, "b", nil)
	rng := rand.New(rand.NewPCG(5, 5))
	for i := range 300 {
		n := a
		if i%2 == 0 {
			n = b
		}
		n.book(t, rng, 4)
	}
	requireConverged(t, a, b)
	c := newNode(t, h, "c", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, c.r.WaitSynced(ctx))
	st := c.r.Stats()
	require.Equal(t, 300, st.RemoteBookings, "synced before holding the peers' bookings")
	require.Equal(t, uint64(2), st.SnapshotsTaken)
	require.Zero(t, st.SyncTimeouts)
}

// noSnapshots is a Bus whose snapshot service never answers.
type noSnapshots struct{ *member }

func (noSnapshots) Respond(string, func([]byte) []byte) (func(), error) { return func() {}, nil }

// A peer whose snapshot never comes does not keep the joiner unready for
// longer than SyncTimeout.
func TestSyncedGivesUpAtTimeout(t *testing.T) {
	h := newHub()
	a := newNodeWith(t, h, "a", func(m *member) replica.Bus { return noSnapshots{m} }, nil)
	rng := rand.New(rand.NewPCG(6, 6))
	for range 10 {
		a.book(t, rng, 2)
	}
	require.NoError(t, a.r.Flush())
	const timeout = 400 * time.Millisecond
	c := newNode(t, h, "c", func(o *replica.Options) { o.SyncTimeout = timeout })
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, c.r.WaitSynced(ctx))
	require.GreaterOrEqual(t, time.Since(start), timeout-50*time.Millisecond, "synced without a's snapshot before the timeout")
	st := c.r.Stats()
	require.Equal(t, uint64(1), st.SyncTimeouts)
	require.True(t, st.Synced)
	require.Zero(t, st.SnapshotsTaken)
}

func TestWaitSyncedEnds(t *testing.T) {
	h := newHub()
	a := newNode(t, h, "a", func(o *replica.Options) { o.HeartbeatInterval = time.Second })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, a.r.WaitSynced(ctx), context.Canceled)
	require.NoError(t, a.r.Close())
	require.ErrorIs(t, a.r.WaitSynced(context.Background()), replica.ErrClosed)
	require.False(t, a.r.Synced())
}

// A session's requests, sent in turn through three replicas, all land on the
// worker its first request got: the pin travels with the booking.
func TestSessionsSharedAcrossReplicas(t *testing.T) {
	h := newHub()
	hard := func(c *selection.Config) { c.Sessions.Mode = selection.SessionHard }
	nodes := []*node{
		newNodeWith(t, h, "a", nil, nil, hard), newNodeWith(t, h, "b", nil, nil, hard), newNodeWith(t, h, "c", nil, nil, hard),
	}
	rng := rand.New(rand.NewPCG(8, 8))
	for s := range 5 {
		session := fmt.Sprintf("conv-%d", s)
		var pinned string
		for turn := range 9 {
			n := nodes[turn%3]
			toks := make([]uint32, 40)
			for i := range toks {
				toks[i] = rng.Uint32N(32000)
			}
			res, err := n.svc.SelectAndReserve(context.Background(), selection.Request{Tokens: toks, SessionID: session})
			require.NoError(t, err)
			if turn == 0 {
				pinned = res.WorkerID
			}
			require.Equal(t, pinned, res.WorkerID, "session %s turn %d through replica %s", session, turn, n.r.ID())
			require.NoError(t, n.r.Flush())
			requireConverged(t, nodes...) // the next replica has the pin
		}
	}
	for _, n := range nodes {
		require.Equal(t, 5, n.svc.Stats().Sessions, n.r.ID())
	}
}

// Output growth and a move reach the peers: their view of the booking grows
// and follows it to the rank that served it.
func TestGrowthAndMoveReplicated(t *testing.T) {
	h := newHub()
	a, b := newNode(t, h, "a", nil), newNode(t, h, "b", nil)
	bk, err := a.svc.Book(context.Background(), selection.Request{Tokens: make([]uint32, 64), Allowed: []string{"w1"}})
	require.NoError(t, err)
	require.NoError(t, bk.Generated(16*5))
	require.NoError(t, a.r.Flush())
	requireConverged(t, a, b)
	require.NoError(t, bk.Move(catalog.WorkerRank{WorkerID: "w2"}))
	require.NoError(t, a.r.Flush())
	requireConverged(t, a, b)
	for _, l := range b.svc.Loads("") {
		switch l.WorkerID {
		case "w2":
			require.Equal(t, 1, l.ActiveRequests)
			require.Equal(t, 4+5, l.ActiveBlocks, "4 prompt blocks and 5 output blocks")
		default:
			require.Zero(t, l.ActiveRequests, l.WorkerID)
		}
	}
	require.NoError(t, bk.Done())
	require.NoError(t, a.r.Flush())
	requireConverged(t, a, b)
	require.Zero(t, activeRequests(b))
}
