package eppserver

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// TestDisaggregatedRouting runs the EPP in disaggregated mode over fake engines:
// the destination is always a decode worker, the prefill worker only ever the
// x-prefiller-host-port hint (a client cannot set either), and once the
// responses are done no load and no plan is left.
func TestDisaggregatedRouting(t *testing.T) {
	env := map[string]string{"DYN_EPP_TOPOLOGY_MODE": "disaggregated", "DYN_EPP_TOKENIZER_PROTOCOL": "vllm-render"}
	cfg, err := load(t, env)
	require.NoError(t, err)
	cfg.Model = demofleet.Model
	var workers []catalog.Worker
	role := map[string]string{}
	for i := range 4 {
		e, err := fakeengine.New(fakeengine.Options{BlockSize: 16, CapacityBlocks: 256, EnableHTTP: true, EnableReplay: true, Model: demofleet.Model})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		require.NoError(t, e.Start(ctx))
		cancel()
		t.Cleanup(func() { _ = e.Close() })
		r := "prefill"
		if i%2 == 1 {
			r = "decode"
		}
		role[e.HTTPEndpoint()] = r
		workers = append(workers, catalog.Worker{
			ID: fmt.Sprintf("w%d", i), Model: demofleet.Model, Endpoint: e.HTTPEndpoint(), DPSize: 1, BlockSize: 16,
			KVEventEndpoints: map[int]string{0: e.PubEndpoint()}, ReplayEndpoint: e.ReplayEndpoint(),
			Labels: map[string]string{roles.DefaultRoleLabel: r},
		})
		cfg.TokenizerURLs = []string{"http://" + e.HTTPEndpoint()}
	}
	workers = append(workers, catalog.Worker{ID: "unlabelled", Model: demofleet.Model, Endpoint: "127.0.0.9:1", DPSize: 1, BlockSize: 16})
	e, err := New(context.Background(), cfg, Options{Configure: func(b *selection.SelectionServiceBuilder) {
		b.EventFeed(selection.FeedOptions{ReconnectMin: time.Millisecond, ReconnectMax: 50 * time.Millisecond})
	}})
	require.NoError(t, err)
	defer e.Close()
	e.Apply(discovery.Snapshot{Workers: workers, Synced: true})
	require.True(t, e.server.Ready())
	census := e.rs.Census()
	for _, rc := range census.Roles {
		require.Equal(t, 2, rc.Schedulable, "%v", rc.Role)
	}
	require.Len(t, census.Excluded, 1, "the unlabelled worker")

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(e.server.GRPCServerOptions()...)
	e.server.Register(gs)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	client, err := extproctest.NewClient(conn, extproctest.Options{})
	require.NoError(t, err)
	httpc := &http.Client{Timeout: 10 * time.Second}
	defer httpc.CloseIdleConnections()

	for i := range 20 {
		body, _ := json.Marshal(map[string]any{"model": demofleet.Model, "max_tokens": 4,
			"messages": []map[string]string{{"role": "user", "content": fmt.Sprintf("hello number %d, tell me a story", i%3)}}})
		hdr := http.Header{"Content-Type": {"application/json"},
			// A client trying to steer routing is ignored.
			"X-Gateway-Destination-Endpoint": {"127.0.0.9:1"}, "X-Prefiller-Host-Port": {"127.0.0.9:1"}}
		resp, err := client.Roundtrip(context.Background(), extproctest.HTTPRequest{Path: "/v1/chat/completions", Headers: hdr, Body: body}, extproctest.HTTPForward(httpc))
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, string(resp.Body))
		d := resp.Decision
		require.Equal(t, "decode", role[d.Destination], "destination %s", d.Destination)
		require.Equal(t, "prefill", role[d.Prefiller], "prefiller %s", d.Prefiller)
		require.Equal(t, d.Destination, d.MetadataDestination)
	}
	require.Eventually(t, func() bool { return e.pairs.Stats().Plans.Active == 0 }, 5*time.Second, time.Millisecond)
	for _, r := range []roles.Role{roles.Prefill, roles.Decode} {
		for _, l := range e.rs.Service(r).Loads(demofleet.Model) {
			require.Zero(t, l.ActiveRequests, "%v %+v", r, l)
			require.Zero(t, l.ActiveBlocks, "%v %+v", r, l)
		}
	}
}
