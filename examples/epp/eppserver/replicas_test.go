package eppserver

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/replica/natsbus"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

func TestConfigReplicas(t *testing.T) {
	c, err := load(t, nil)
	require.NoError(t, err)
	require.False(t, c.replicated())
	require.Equal(t, natsbus.DefaultClusterPort, c.SyncPort)
	require.True(t, c.HoldBursts, "replicas hold bursts by default")

	c, err = load(t, map[string]string{"DYN_EPP_PEERS": " 10.0.0.2:9092, [fd00::3]:9092,,", "DYN_EPP_REPLICA_SYNC_PORT": "0"})
	require.NoError(t, err)
	require.Equal(t, []string{"10.0.0.2:9092", "[fd00::3]:9092"}, c.Peers)
	require.True(t, c.embedsNATS())
	require.Zero(t, c.SyncPort)
	require.Empty(t, c.SyncSecret)

	c, err = load(t, map[string]string{"DYN_EPP_PEERS": "10.0.0.2:9092", "DYN_EPP_REPLICA_SYNC_SECRET": " s3cret-s3cret-s3cret "})
	require.NoError(t, err)
	require.Equal(t, "s3cret-s3cret-s3cret", c.SyncSecret)

	c, err = load(t, map[string]string{"DYN_EPP_PEER_SERVICE": "epp-peers", "POD_IP": "10.0.0.1", "DYN_EPP_WORKERS_FILE": "w.json",
		"DYN_EPP_TOKENIZER_SERVICE_URL": "http://tok:8000"})
	require.NoError(t, err)
	require.Equal(t, "epp-peers", c.PeerService)
	require.ErrorContains(t, c.requireForServing(), "POD_NAMESPACE: required with DYN_EPP_PEER_SERVICE")

	c, err = load(t, map[string]string{"DYN_EPP_NATS_URL": "nats://u:p@nats-0:4222,tls://nats-1:4222", "DYN_EPP_REPLICA_ID": "epp_0-a"})
	require.NoError(t, err)
	require.True(t, c.replicated())
	require.False(t, c.embedsNATS())
	require.Equal(t, "epp_0-a", c.ReplicaID)

	c, err = load(t, map[string]string{"DYN_EPP_NATS_URL": "nats://n:4222", "DYN_EPP_REPLICA_HOLD_BURSTS": "false"})
	require.NoError(t, err)
	require.False(t, c.HoldBursts)

	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"DYN_EPP_NATS_URL": "nats://n:4222", "DYN_EPP_PEERS": "10.0.0.2:9092"}, "not both"},
		{map[string]string{"DYN_EPP_NATS_URL": "nats://n:4222", "DYN_EPP_PEER_SERVICE": "p", "POD_IP": "10.0.0.1"}, "not both"},
		{map[string]string{"DYN_EPP_PEER_SERVICE": "p", "DYN_EPP_PEERS": "10.0.0.2:9092", "POD_IP": "10.0.0.1"}, "DYN_EPP_PEERS: set either"},
		{map[string]string{"DYN_EPP_PEER_SERVICE": "p"}, "POD_IP"},
		{map[string]string{"DYN_EPP_PEER_SERVICE": "p", "POD_IP": "pod-0"}, "POD_IP"},
		{map[string]string{"DYN_EPP_PEER_SERVICE": "Peers.svc"}, "not a Service name"},
		{map[string]string{"DYN_EPP_PEERS": "10.0.0.2"}, "not host:port"},
		{map[string]string{"DYN_EPP_PEERS": "10.0.0.2:0"}, "not host:port"},
		{map[string]string{"DYN_EPP_PEERS": ":9092"}, "not host:port"},
		{map[string]string{"DYN_EPP_PEERS": ",,,"}, "names no peer"},
		{map[string]string{"DYN_EPP_NATS_URL": "http://n:4222"}, "not a NATS URL"},
		{map[string]string{"DYN_EPP_NATS_URL": "nats-0:4222"}, "not a NATS URL"},
		{map[string]string{"DYN_EPP_REPLICA_ID": "epp.0"}, "DYN_EPP_REPLICA_ID"},
		{map[string]string{"DYN_EPP_REPLICA_ID": strings.Repeat("a", 65)}, "DYN_EPP_REPLICA_ID"},
		{map[string]string{"DYN_EPP_REPLICA_SYNC_PORT": "65536"}, "DYN_EPP_REPLICA_SYNC_PORT"},
		{map[string]string{"POD_IP": "10.0.0"}, "POD_IP"},
		{map[string]string{"DYN_EPP_PEERS": "10.0.0.2:9092", "DYN_EPP_REPLICA_SYNC_SECRET": "short"}, "DYN_EPP_REPLICA_SYNC_SECRET"},
		{map[string]string{"DYN_EPP_PEERS": "10.0.0.2:9092", "DYN_EPP_REPLICA_SYNC_SECRET": "has spaces in it, see"}, "DYN_EPP_REPLICA_SYNC_SECRET"},
		{map[string]string{"DYN_EPP_NATS_URL": "nats://n:4222", "DYN_EPP_REPLICA_SYNC_SECRET": "s3cret-s3cret-s3cret"}, "applies to the embedded"},
	} {
		_, err := load(t, tc.env)
		require.ErrorIs(t, err, ErrConfig, "%v", tc.env)
		require.ErrorContains(t, err, tc.want, "%v", tc.env)
	}
	many := make([]string, maxPeers+1)
	for i := range many {
		many[i] = fmt.Sprintf("10.0.%d.%d:9092", i/250, i%250+1)
	}
	_, err = load(t, map[string]string{"DYN_EPP_PEERS": strings.Join(many, ",")})
	require.ErrorContains(t, err, "at most")
}

func TestReplicaID(t *testing.T) {
	for in, want := range map[string]string{
		"epp-7d9f8-x2k": "epp-7d9f8-x2k",
		"epp.pool.0":    "epp-pool-0",
		"Host_1":        "Host_1",
		"a b/c":         "a-b-c",
	} {
		require.Equal(t, want, sanitizeReplicaID(in), in)
	}
	long1, long2 := strings.Repeat("x", 80)+"-aaaaa", strings.Repeat("x", 80)+"-bbbbb"
	id1, id2 := sanitizeReplicaID(long1), sanitizeReplicaID(long2)
	require.Len(t, id1, replica.MaxIDLen)
	require.NotEqual(t, id1, id2, "long names that differ at their end keep distinct IDs")
	require.Equal(t, id1, sanitizeReplicaID(long1))

	host := func(name string, err error) func() (string, error) {
		return func() (string, error) { return name, err }
	}
	id, err := (&Config{ReplicaID: "set"}).replicaID(host("h", nil))
	require.NoError(t, err)
	require.Equal(t, "set", id)
	id, err = (&Config{PodName: "epp-0.x"}).replicaID(host("h", nil))
	require.NoError(t, err)
	require.Equal(t, "epp-0-x", id, "POD_NAME before the host name")
	id, err = (&Config{}).replicaID(host("node.local", nil))
	require.NoError(t, err)
	require.Equal(t, "node-local", id)
	_, err = (&Config{}).replicaID(host("", errors.New("no name")))
	require.ErrorContains(t, err, "DYN_EPP_REPLICA_ID")
}

func TestReplicaSubject(t *testing.T) {
	c := &Config{Namespace: "serving", PoolName: "qwen.v2"}
	require.Equal(t, "kvselect.replica.serving.qwen_v2.prefill", replicaSubject(c, roles.Prefill))
	require.Equal(t, "kvselect.replica._._.aggregated", replicaSubject(&Config{}, roles.Aggregated))
	require.Equal(t, "nats://***@n:4222,nats://m:4222", redactURL("nats://u:p@n:4222, nats://m:4222"))
}

// replicaEPP is one EPP in process with its replicas over url.
type replicaEPP struct {
	e  *EPP
	rp *replication
}

func newReplicaEPP(t *testing.T, env map[string]string, workers []catalog.Worker) *replicaEPP {
	t.Helper()
	cfg, err := load(t, env)
	require.NoError(t, err)
	rp, err := openReplication(cfg, nil)
	require.NoError(t, err)
	require.NotNil(t, rp)
	e, err := build(context.Background(), cfg, Options{}, extras{rep: rp})
	if err != nil {
		rp.closeLink()
	}
	require.NoError(t, err)
	t.Cleanup(func() { e.Close(); rp.closeLink() })
	e.Apply(discovery.Snapshot{Workers: workers, Synced: true})
	require.False(t, e.server.Ready(), "not ready before the replicas' initial sync")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, e.readyWhenSynced(ctx))
	require.True(t, e.server.Ready())
	return &replicaEPP{e: e, rp: rp}
}

// activeOn sums the active requests of role's service.
func (r *replicaEPP) activeOn(role roles.Role) int {
	n := 0
	for _, l := range r.e.rs.Service(role).Loads(r.e.cfg.Model) {
		n += l.ActiveRequests
	}
	return n
}

// Two disaggregated EPPs over one NATS server (DYN_EPP_NATS_URL): each role
// has its own Replicator and subject on the one connection, so a plan booked
// through one EPP is in the other's prefill and decode loads, and its end
// leaves both empty; the replica metrics are exported per role.
func TestReplicasDisaggregated(t *testing.T) {
	srv, err := natsbus.StartServer(natsbus.ServerOptions{ClusterAddr: "127.0.0.1:0"})
	require.NoError(t, err)
	defer srv.Close()
	var workers []catalog.Worker
	for i, role := range []string{"prefill", "prefill", "decode", "decode"} {
		workers = append(workers, catalog.Worker{ID: fmt.Sprintf("w%d", i), Model: "m", Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1),
			DPSize: 1, Labels: map[string]string{roles.DefaultRoleLabel: role}})
	}
	env := func(id string) map[string]string {
		return map[string]string{"DYN_EPP_TOPOLOGY_MODE": "disaggregated", "DYN_EPP_NATS_URL": srv.ClientURL(), "DYN_EPP_REPLICA_ID": id,
			"DYN_MODEL_NAME": "m", "DYN_EPP_KV_EVENT_PORT": "0", "DYN_EPP_INFERENCE_POOL_NAME": "pool", "POD_NAMESPACE": "ns",
			"DYN_EPP_TOKENIZER_SERVICE_URL": "http://127.0.0.1:1"}
	}
	a := newReplicaEPP(t, env("a"), workers)
	b := newReplicaEPP(t, env("b"), workers)
	for _, r := range []*replicaEPP{a, b} {
		require.Len(t, r.rp.reps, 2)
		require.NotNil(t, r.rp.reps[roles.Prefill])
		require.NotNil(t, r.rp.reps[roles.Decode])
	}

	rng := rand.New(rand.NewPCG(1, 2))
	var plans []roles.Plan
	for range 8 {
		toks := make([]uint32, 16*12)
		for i := range toks {
			toks[i] = rng.Uint32N(32000)
		}
		p, err := a.e.pairs.Book(context.Background(), selection.Request{Model: "m", Tokens: toks})
		require.NoError(t, err)
		require.False(t, p.LocalPrefill)
		plans = append(plans, p)
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Equal(c, 8, b.activeOn(roles.Prefill), "prefill legs seen by b")
		assert.Equal(c, 8, b.activeOn(roles.Decode), "decode legs seen by b")
	}, 10*time.Second, 5*time.Millisecond)
	for _, p := range plans {
		require.NoError(t, p.PrefillComplete())
		require.NoError(t, p.Done())
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Zero(c, b.activeOn(roles.Prefill))
		assert.Zero(c, b.activeOn(roles.Decode))
	}, 10*time.Second, 5*time.Millisecond)

	families, err := b.e.reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			role := ""
			for _, l := range m.GetLabel() {
				if l.GetName() == "role" {
					role = l.GetValue()
				}
			}
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			got[f.GetName()+"/"+role] += v
		}
	}
	for _, role := range []string{"prefill", "decode"} {
		require.Equal(t, 1.0, got["kvselect_replica_peers/"+role], role)
		require.Equal(t, 1.0, got["kvselect_replica_synced/"+role], role)
		require.Zero(t, got["kvselect_replica_degraded/"+role], role)
		require.Zero(t, got["kvselect_replica_remote_bookings/"+role], role)
		require.Positive(t, got["kvselect_replica_applied_total/"+role], role)
		require.Contains(t, got, "kvselect_replica_refused_total/"+role)
		require.Zero(t, got["kvselect_worker_active_requests/"+role], role)
	}
}
