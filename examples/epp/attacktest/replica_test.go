package attacktest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/replica/natsbus"
	"github.com/kvselect/kvselect/selection"
)

// The replica plane's flood: a rogue NATS server the EPP routes to (a peer
// address in DYN_EPP_PEERS, no DYN_EPP_REPLICA_SYNC_SECRET) carries a
// "replica" that books as fast as it can, valid bookings on the EPP's own
// workers, 20 MiB of them. The EPP holds at most its per-peer bound of them
// (replica.DefaultMaxPeerBlocks), refuses the rest by name and stays
// small.
const (
	floodBytes    = 20 << 20
	floodBlocks   = 70 // blocks a booking: about 600 bytes on the wire
	floodRSSLimit = 300 << 20
	// floodRaceRSSLimit is the bound for a binary built with -race, whose
	// shadow memory multiplies the heap's footprint: there the bounded flood
	// peaked at 480 MiB, the unbounded one at 1,480 MiB.
	floodRaceRSSLimit = 900 << 20
)

func TestReplicaBookingFlood(t *testing.T) {
	rogue, err := natsbus.StartServer(natsbus.ServerOptions{Name: "rogue", ClusterAddr: "127.0.0.1:0"})
	require.NoError(t, err)
	t.Cleanup(rogue.Close)

	engines := []*fakeengine.Engine{boundEngine(t, true), boundEngine(t, true)}
	var ws []worker
	for i, e := range engines {
		ws = append(ws, worker{ID: fmt.Sprintf("engine-%d", i), Endpoint: e.HTTPEndpoint(), KVEvents: e.PubEndpoint()})
	}
	p := startEPP(t, eppConfig{workers: ws, tokenizer: "http://127.0.0.1:1", extra: map[string]string{
		"DYN_EPP_PEERS":             rogue.ClusterAddr().String(),
		"DYN_EPP_REPLICA_SYNC_PORT": "0",
		"POD_IP":                    "127.0.0.1",
		"DYN_EPP_REPLICA_ID":        "epp-0",
	}})
	started, ok := p.WaitLog(startTimeout, eppproc.MsgIs("replica started"))
	require.True(t, ok, "the EPP's replica never started")
	_, ok = p.WaitLog(startTimeout, eppproc.MsgIs("replica sync without DYN_EPP_REPLICA_SYNC_SECRET: any host that reaches the sync port can join the mesh and publish bookings; set a secret, or keep the port behind a NetworkPolicy"))
	require.True(t, ok, "no WARN for a mesh without a secret")
	p.eventually("the rogue server routed", startTimeout, func() bool { return len(rogue.Peers()) > 0 })
	base := p.rss()

	// The forger: a real Replicator over the rogue server, its service
	// knowing the EPP's workers, booking what it likes.
	cl, err := rogue.Dial(natsbus.DialOptions{Name: "forger"})
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	rep, err := replica.New(replica.Options{Bus: cl.Bus(), ID: "forger", Subject: started.Str("subject")})
	require.NoError(t, err)
	cfg := selection.DefaultConfig(blockSize)
	cfg.UseKVEvents = false
	svc, err := selection.NewSelectionServiceBuilder(cfg).Observe(rep).Build(context.Background())
	require.NoError(t, err)
	for _, w := range ws {
		_, err := svc.Workers().Upsert(catalog.Worker{ID: w.ID, Endpoint: w.Endpoint, Model: model, DPSize: 1})
		require.NoError(t, err)
	}
	require.NoError(t, rep.Start(svc))
	t.Cleanup(func() { _ = rep.Close(); _ = svc.Close() })

	rng := rand.New(rand.NewPCG(27, 2))
	toks := make([]uint32, floodBlocks*blockSize)
	bookings := 0
	for rep.Stats().PublishedOps == 0 || bytesOf(rep) < floodBytes {
		for i := range toks {
			toks[i] = rng.Uint32N(1 << 20)
		}
		_, err := svc.SelectAndReserve(context.Background(), selection.Request{Model: model, Tokens: toks})
		require.NoError(t, err)
		bookings++
		if bookings%1024 == 0 {
			require.NoError(t, rep.Flush())
		}
	}
	require.NoError(t, rep.Flush())
	t.Logf("forged %d bookings of %d blocks", bookings, floodBlocks)

	refusedFull := func() float64 {
		return p.count("kvselect_replica_refused_total", labels{"role": role, "reason": "peer_full"})
	}
	peak := base
	p.eventually("the flood is refused past the per-peer bound", 60*time.Second, func() bool {
		peak = max(peak, p.rss())
		return refusedFull() > 0 && p.count("kvselect_replica_remote_bookings", labels{"role": role}) > 0
	})
	// The flood has arrived once the EPP has heard every booking (applied or
	// refused) or repaired its view by a snapshot of the forger.
	p.eventually("every forged booking heard", 60*time.Second, func() bool {
		peak = max(peak, p.rss())
		heard := p.count("kvselect_replica_applied_total", labels{"role": role})
		return heard >= float64(bookings) || p.count("kvselect_replica_snapshots_taken_total", labels{"role": role}) > 0
	})
	peak = max(peak, p.rss())
	held := p.count("kvselect_replica_remote_bookings", labels{"role": role})
	t.Logf("RSS %d MiB before, peak %d MiB; %v bookings held, %v refused peer_full", base>>20, peak>>20, held, refusedFull())
	require.LessOrEqual(t, held*floodBlocks, float64(replica.DefaultMaxPeerBlocks))
	limit := int64(floodRSSLimit)
	if raceBuild {
		limit = floodRaceRSSLimit
	}
	require.Less(t, peak, limit, "the EPP's RSS under the flood")
	p.alive()
}

// bytesOf is what rep has published so far, in bytes, estimated from its
// ops: a booked op of floodBlocks hashes is about 8 bytes a hash plus 40.
func bytesOf(rep *replica.Replicator) int {
	return int(rep.Stats().PublishedOps) * (8*floodBlocks + 40)
}
