package natsbus_test

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/replica"
)

// heartbeat encodes a batch without ops, written from the wire grammar of
// package replica (wire.go) rather than with its encoder: magic "KVSR",
// version, type 1, flags, origin, epoch (u64 little-endian), seq (uvarint),
// op count 0.
func heartbeat(origin string, epoch, seq uint64) []byte {
	b := append([]byte("KVSR"), replica.WireVersion, 1, 0)
	b = binary.AppendUvarint(b, uint64(len(origin)))
	b = append(b, origin...)
	b = binary.LittleEndian.AppendUint64(b, epoch)
	b = binary.AppendUvarint(b, seq)
	return binary.AppendUvarint(b, 0)
}

// A heartbeat forged under a real replica's ID and epoch, claiming sequence
// number 2^62, published on a real NATS server by a client that is no
// replica: the others refuse it and make at most a few repairs, where they
// used to take snapshots in a loop until the replica restarted.
func TestForgedHeartbeatOverNATS(t *testing.T) {
	srv := startServer(t)
	a := newNode(t, srv.ClientURL(), "a", nil, nil)
	b := newNode(t, srv.ClientURL(), "b", nil, nil)
	c := newNode(t, srv.ClientURL(), "c", nil, nil)
	rng := rand.New(rand.NewPCG(27, 9))
	for range 4 {
		a.book(t, rng, 3)
	}
	requireConverged(t, 5*time.Second, a, b, c)
	repairs := func(n *node) uint64 { st := n.r.Stats(); return st.Gaps + st.Resyncs }
	before := []uint64{repairs(b), repairs(c)}

	forger := connect(t, srv.ClientURL(), "forger")
	st := a.r.Stats()
	require.NoError(t, forger.Publish(replica.DefaultSubject+".ops.a", heartbeat(st.ID, st.Epoch, 1<<62)))
	require.NoError(t, forger.Flush())
	require.Eventually(t, func() bool {
		return b.r.Stats().Refused["implausible_seq"] > 0 && c.r.Stats().Refused["implausible_seq"] > 0
	}, 5*time.Second, time.Millisecond, "the forged heartbeat refused")
	hb := a.r.Stats().Heartbeats
	require.Eventually(t, func() bool { return a.r.Stats().Heartbeats >= hb+10 }, 10*time.Second, time.Millisecond)
	a.book(t, rng, 2)
	requireConverged(t, 5*time.Second, a, b, c)
	for i, n := range []*node{b, c} {
		require.LessOrEqual(t, repairs(n)-before[i], uint64(3), "repairs after one forged heartbeat at %s", n.r.ID())
	}
}
