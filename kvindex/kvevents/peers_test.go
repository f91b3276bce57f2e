package kvevents_test

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex/kvevents"
)

// Peers attributes a topic to the one worker its host names, admits only
// workers' addresses, takes a topic only from its worker's address, and
// follows the catalog's changes.
func TestPeers(t *testing.T) {
	var p kvevents.Peers
	a, b := net.ParseIP("10.0.0.1"), net.ParseIP("10.0.0.2")
	require.ErrorIs(t, p.Admit(a), kvevents.ErrNotWorker, "the zero value knows nobody")
	p.Add("w1", "10.0.0.1:8000")
	p.Add("w2", "10.0.0.2:8000")
	p.Add("w3", "10.0.0.2:9000")

	wr, ok := p.Attribute("kv@10.0.0.1@m")
	require.True(t, ok)
	require.Equal(t, catalog.WorkerRank{WorkerID: "w1"}, wr)
	wr, ok = p.Attribute("kv@10.0.0.2:9000@m")
	require.True(t, ok, "host:port tells two workers on one host apart")
	require.Equal(t, "w3", wr.WorkerID)
	_, ok = p.Attribute("kv@10.0.0.2@m")
	require.False(t, ok, "a host two workers share is ambiguous")
	_, ok = p.Attribute("kv@10.0.0.9@m")
	require.False(t, ok)
	_, ok = p.Attribute("not a topic")
	require.False(t, ok)

	require.NoError(t, p.Admit(a))
	require.ErrorIs(t, p.Admit(net.ParseIP("10.0.0.9")), kvevents.ErrNotWorker)
	require.ErrorIs(t, p.Admit(nil), kvevents.ErrNotWorker)
	require.NoError(t, p.Peer(a, "kv@10.0.0.1@m"))
	require.NoError(t, p.Peer(net.ParseIP("::ffff:10.0.0.1"), "kv@10.0.0.1@m"), "a v4-mapped address is the same host")
	require.ErrorIs(t, p.Peer(b, "kv@10.0.0.1@m"), kvevents.ErrTopicNotPeer, "w2 may not publish as w1")
	require.ErrorIs(t, p.Peer(b, "kv@10.0.0.2@m"), kvevents.ErrTopicAmbiguous)
	require.ErrorIs(t, p.Peer(b, "kv@10.0.0.7@m"), kvevents.ErrTopicUnknown)

	p.Add("w1", "10.0.0.5:8000") // moved
	require.ErrorIs(t, p.Admit(a), kvevents.ErrNotWorker, "its old address is forgotten")
	wr, ok = p.Attribute("kv@10.0.0.5@m")
	require.True(t, ok)
	require.Equal(t, "w1", wr.WorkerID)
	p.Remove("w3")
	p.Remove("w3")
	wr, ok = p.Attribute("kv@10.0.0.2@m")
	require.True(t, ok, "no longer shared")
	require.Equal(t, "w2", wr.WorkerID)
	p.Remove("w2")
	require.ErrorIs(t, p.Admit(b), kvevents.ErrNotWorker)
}

func TestOffsetPort(t *testing.T) {
	for _, c := range []struct {
		ep   string
		off  int
		want string
	}{
		{"tcp://10.0.0.1:5557", 0, "tcp://10.0.0.1:5557"},
		{"tcp://10.0.0.1:5557", 2, "tcp://10.0.0.1:5559"},
		{"tcp://[fd00::1]:5557", 1, "tcp://[fd00::1]:5558"},
		{"tcp://10.0.0.1:65535", 1, ""},
		{"ipc:///tmp/x", 0, "ipc:///tmp/x"},
		{"ipc:///tmp/x", 1, ""},
		{"tcp://10.0.0.1", 1, ""},
		{"tcp://10.0.0.1:port", 1, ""},
		{"", 3, ""},
	} {
		require.Equal(t, c.want, kvevents.OffsetPort(c.ep, c.off), "%s + %d", c.ep, c.off)
	}
}
