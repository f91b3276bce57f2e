package replica_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/replica"
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
