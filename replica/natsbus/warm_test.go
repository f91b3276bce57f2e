package natsbus_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/replica/natsbus"
	"github.com/kvselect/kvselect/selection"
)

// TestWarmStartOverNATS: over an embedded NATS server, a replica that joins
// after 5,000 requests routed through its peer (engines that replay only
// their last 64 batches) loads the peer's index, in chunks of the server's
// max_payload, and reports itself synced with an index equal to the peer's
// byte for byte.
func TestWarmStartOverNATS(t *testing.T) {
	srv := startServer(t)
	rng := rand.New(rand.NewPCG(4, 4))
	prompt := func() []uint32 {
		g := rng.IntN(8)
		p := make([]uint32, 0, 96)
		for i := range 8 + 4*g {
			p = append(p, uint32(g*1000+i))
		}
		for range rng.IntN(40) + 1 {
			p = append(p, uint32(rng.IntN(60)+10000))
		}
		return p
	}
	var engines []*fakeengine.Engine
	var workers []catalog.Worker
	for i := range 4 {
		e, err := fakeengine.New(fakeengine.Options{BlockSize: 4, CapacityBlocks: 128, EnableReplay: true, ReplayBuffer: 64})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		require.NoError(t, e.Start(ctx))
		cancel()
		t.Cleanup(func() { _ = e.Close() })
		engines = append(engines, e)
		workers = append(workers, catalog.Worker{
			ID: fmt.Sprintf("e%d", i), Endpoint: fmt.Sprintf("127.0.0.%d:8000", i+1), DPSize: 1, BlockSize: 4, TotalKVBlocks: 128,
			KVEventEndpoints: map[int]string{0: e.PubEndpoint()}, ReplayEndpoint: e.ReplayEndpoint(),
		})
	}
	// replica builds a service with KV events and a Replicator over NATS
	// (not started), and waits until the service hears every engine live.
	replica := func(id string) (*replica.Replicator, *selection.SelectionService) {
		nc := connect(t, srv.ClientURL(), id)
		nb, err := natsbus.New(nc)
		require.NoError(t, err)
		r, err := replicaNew(nb, id, int(nc.MaxPayload()))
		require.NoError(t, err)
		svc, err := selection.NewSelectionServiceBuilder(selection.DefaultConfig(4)).Observe(r).
			EventFeed(selection.FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond}).Build(context.Background())
		require.NoError(t, err)
		t.Cleanup(func() {
			_ = r.Close()
			_ = svc.Close()
		})
		for _, w := range workers {
			_, err := svc.Workers().Upsert(w)
			require.NoError(t, err)
		}
		require.Eventually(t, func() bool {
			st := svc.Events().Sources()
			heard := len(st) == len(engines)
			for i, e := range engines {
				if !heard || st[i].Received == 0 {
					heard = false
					_, err := e.Serve(fakeengine.Request{Tokens: prompt()})
					require.NoError(t, err)
				}
			}
			return heard
		}, 10*time.Second, 5*time.Millisecond)
		return r, svc
	}
	converge := func(svc *selection.SelectionService) {
		require.Eventually(t, func() bool {
			for i, st := range svc.Events().Sources() {
				if st.Applied == 0 || st.Watermark != engines[i].NextSeq()-1 || st.Queued > 0 {
					return false
				}
			}
			return true
		}, 20*time.Second, 2*time.Millisecond)
	}
	index := func(svc *selection.SelectionService) []byte {
		var buf bytes.Buffer
		require.NoError(t, svc.Events().WriteSnapshot(&buf))
		return buf.Bytes()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	ra, a := replica("a")
	require.NoError(t, ra.Start(a))
	require.NoError(t, ra.WaitSynced(ctx))
	for range 5000 {
		p := prompt()
		res, err := a.SelectAndReserve(context.Background(), selection.Request{Tokens: p})
		require.NoError(t, err)
		var i int
		_, err = fmt.Sscanf(res.WorkerID, "e%d", &i)
		require.NoError(t, err)
		_, err = engines[i].Serve(fakeengine.Request{Tokens: p})
		require.NoError(t, err)
		require.NoError(t, a.Reservations().Free(res.ReservationID))
	}
	converge(a)

	rb, b := replica("b")
	converge(b)
	require.NotEqual(t, index(a), index(b), "the joiner rebuilt its index cold: the test proves nothing")
	// Building b published on the engines until b heard them all: let a
	// apply those batches too, so that it holds what b replays after the cut.
	converge(a)
	require.NoError(t, rb.Start(b))
	require.NoError(t, rb.WaitSynced(ctx))
	require.Equal(t, index(a), index(b), "the joiner's index when it reports synced")
	w := rb.Stats().Warm
	require.True(t, w.Loaded)
	require.Equal(t, "a", w.From)
	require.Equal(t, 4, w.Resumed)
}

func replicaNew(bus replica.Bus, id string, maxMsg int) (*replica.Replicator, error) {
	return replica.New(replica.Options{Bus: bus, ID: id, HeartbeatInterval: 50 * time.Millisecond, MaxMessageBytes: maxMsg})
}
