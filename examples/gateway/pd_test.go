package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/tokenize"
)

// The prefill/decode pool of TestGatewayPrefillDecode.
const (
	pdPrefill  = 2
	pdDecode   = 2
	pdRequests = 48
	pdInflight = 4
)

// writeWorkersFile writes ws as a workers file (docs/WORKERS_FILE.md) and
// returns its path.
func writeWorkersFile(t *testing.T, ws []catalog.Worker) string {
	t.Helper()
	type fileWorker struct {
		ID        string            `json:"id"`
		Identity  string            `json:"identity"`
		Endpoint  string            `json:"endpoint"`
		Model     string            `json:"model"`
		Events    string            `json:"kv_events_endpoint,omitempty"`
		Replay    string            `json:"replay_endpoint,omitempty"`
		BlockSize int               `json:"block_size"`
		Labels    map[string]string `json:"labels"`
	}
	out := make([]fileWorker, len(ws))
	for i, w := range ws {
		out[i] = fileWorker{ID: w.ID, Identity: w.Identity, Endpoint: w.Endpoint, Model: w.Model, Events: w.KVEventEndpoints[0],
			Replay: w.ReplayEndpoint, BlockSize: w.BlockSize, Labels: w.Labels}
	}
	file, err := json.Marshal(map[string]any{"workers": out})
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "workers.json")
	require.NoError(t, os.WriteFile(path, file, 0o600))
	return path
}

// TestGatewayPrefillDecode runs streamed chat requests through the gateway in
// the disaggregated topology, end to end over loopback: fake prefill engines
// that publish KV events, fake decode engines each behind a real decode
// sidecar (examples/pdsidecar/sidecar, vLLM NIXL), all named in a workers
// file by their role label. Each request is booked on a prefill worker and a
// decode worker and sent to the decode worker's sidecar with the prefill
// worker in x-prefiller-host-port; the sidecar runs the prefill leg on that
// engine, and the decode engine pulls the prompt's KV from it. Every request
// is answered whole; each prefill engine counts the prefill legs and each
// decode engine the decode legs, one of each per request; every plan is
// handed off at the first byte and completed at the end, none left active,
// and both roles' loads are back to zero.
func TestGatewayPrefillDecode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	fleet, err := demofleet.StartPDFleet(ctx, demofleet.PDFleetOptions{
		Prefill: pdPrefill, Decode: pdDecode, BlockSize: e2eBlock, RoleLabel: roles.DefaultRoleLabel,
		PrefillBlocks: 512, DecodeBlocks: 512, TokenInterval: time.Millisecond, Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil)),
	})
	require.NoError(t, err)
	t.Cleanup(fleet.Close)

	cfg := config{Addr: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0", WorkersFile: writeWorkersFile(t, fleet.Workers()),
		Model: demofleet.Model, Topology: roles.ModeDisaggregated, RoleLabel: roles.DefaultRoleLabel,
		TokenizerURLs: []string{fleet.TokenizerURL()}, TokenizerProtocol: tokenize.ProtocolVLLMRender, TokenizerTimeout: 5 * time.Second,
		BlockSize: e2eBlock, UseKVEvents: true, MaxBodyBytes: 8 << 20, FailureEjection: time.Second}
	g, api, metrics := startGateway(ctx, t, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), t.Cleanup)
	require.NoError(t, fleet.WaitSubscribed(ctx))
	for r, n := range map[roles.Role]int{roles.Prefill: pdPrefill, roles.Decode: pdDecode} {
		require.Len(t, g.rs.Service(r).Workers().List(), n, "%s workers", r)
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: pdInflight}}
	t.Cleanup(client.CloseIdleConnections)
	health, err := client.Get(api + "/health")
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, health.Body)
	require.NoError(t, health.Body.Close())
	require.Equal(t, http.StatusOK, health.StatusCode, "a prefill and a decode worker are schedulable")

	workload, err := demofleet.Workload(demofleet.WorkloadOptions{Requests: pdRequests, Groups: 4, Seed: 28}, 0)
	require.NoError(t, err)
	bodies := make(chan []byte, len(workload))
	for _, r := range workload {
		bodies <- r.Body
	}
	close(bodies)
	errs := make(chan error, len(workload))
	var wg sync.WaitGroup
	for range pdInflight {
		wg.Go(func() {
			for body := range bodies {
				errs <- pdRequest(ctx, client, api, body)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}

	// A settle follows the last byte the Router read, which the client may
	// have before it: wait for every plan to be settled.
	require.NoError(t, demofleet.WaitFor(ctx, 10*time.Second, func() error {
		if rs := g.router.Stats(); rs.Done != pdRequests {
			return fmt.Errorf("router: %d of %d settled (%+v)", rs.Done, pdRequests, rs)
		}
		if st := g.pairs.Stats().Plans; st.Active != 0 {
			return fmt.Errorf("%d plans active", st.Active)
		}
		return nil
	}))
	var prefillLegs, decodeLegs, transferred uint64
	for _, s := range fleet.PrefillStats() {
		prefillLegs += s.PrefillLegs
		require.Zero(t, s.DecodeLegs)
	}
	for _, s := range fleet.DecodeStats() {
		decodeLegs += s.DecodeLegs
		transferred += s.TransferredTokens
		require.Zero(t, s.PrefillLegs)
	}
	require.EqualValues(t, pdRequests, prefillLegs, "one prefill leg per request, on a prefill engine")
	require.EqualValues(t, pdRequests, decodeLegs, "one decode leg per request, on a decode engine")
	require.Positive(t, transferred, "the decode engines took the prompts' KV from the prefill engines")
	for i, sc := range fleet.Sidecars() {
		st := sc.Stats()
		require.Zero(t, st.Passthrough, "sidecar %d: every request came with a prefill worker", i)
		require.Empty(t, nonZero(st.BadHints), "sidecar %d", i)
		require.Equal(t, st.Disaggregated, st.Legs[sidecar.LegKey{Leg: sidecar.LegPrefill, Outcome: sidecar.OutcomeOK}], "sidecar %d", i)
	}

	bs := g.pairs.Stats()
	require.EqualValues(t, pdRequests, bs.Booked)
	require.Zero(t, bs.LocalPrefill, "every request was paired")
	require.EqualValues(t, pdRequests, bs.Plans.HandedOff, "the prefill leg freed at the first byte")
	require.EqualValues(t, pdRequests, bs.Plans.Completed)
	require.Zero(t, bs.Plans.Expired)
	require.Zero(t, bs.Plans.Active)
	rs := g.router.Stats()
	require.EqualValues(t, pdRequests, rs.Booked)
	require.EqualValues(t, pdRequests, rs.Ended, "%+v", rs)
	require.EqualValues(t, pdRequests, rs.FirstBytes)
	require.Zero(t, rs.MarkedFailed)
	for _, r := range []roles.Role{roles.Prefill, roles.Decode} {
		svc := g.rs.Service(r)
		for _, l := range svc.Loads(demofleet.Model) {
			require.Zero(t, l.ActiveRequests, "%s: %+v", r, l)
			require.Zero(t, l.ActiveBlocks, "%s: %+v", r, l)
			require.Zero(t, l.ActivePrefillTokens, "%s: %+v", r, l)
		}
		st := svc.Stats()
		require.EqualValues(t, pdRequests, st.Bookings, "%s: one booking per request", r)
		require.Zero(t, st.Ledger.Active, "%s", r)
		require.Zero(t, st.Expired, "%s", r)
	}
	// The prefill engines' events feed the prefill service's index; the
	// decode workers have no feed.
	sources := g.rs.Service(roles.Prefill).Events().Sources()
	require.Len(t, sources, pdPrefill)
	for _, s := range sources {
		require.Positive(t, s.Handler.EventsApplied, "%v", s.Worker)
	}
	require.Empty(t, g.rs.Service(roles.Decode).Events().Sources())
	t.Logf("prefill/decode: %d requests, prefill-cache hit rate %.3f, %d tokens transferred", pdRequests,
		demofleet.HitRate(fleet.PrefillStats()), transferred)

	m := scrape(t, metrics)
	for r, n := range map[string]int{"prefill": pdPrefill, "decode": pdDecode} {
		require.EqualValues(t, pdRequests, mustValue(t, m, "kvselect_bookings_total", map[string]string{"role": r}), r)
		require.Zero(t, mustValue(t, m, "kvselect_reservations_active", map[string]string{"role": r}), r)
		require.EqualValues(t, n, mustValue(t, m, "kvselect_workers", map[string]string{"role": r, "lifecycle": "schedulable"}), r)
	}
	require.EqualValues(t, pdRequests, mustValue(t, m, "kvselect_httproute_done_total", map[string]string{"outcome": "ended"}))
}

// pdRequest sends one streamed chat request and reads its answer to the end.
func pdRequest(ctx context.Context, client *http.Client, api string, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, api+"/v1/chat/completions", strings.NewReader(string(body)))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || !strings.HasSuffix(strings.TrimSpace(string(answer)), "data: [DONE]") {
		return fmt.Errorf("status %d: %.300s", resp.StatusCode, answer)
	}
	return nil
}

// nonZero returns the entries of m that are not zero.
func nonZero(m map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range m {
		if v != 0 {
			out[k] = v
		}
	}
	return out
}
