package eppserver

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/roles"
)

// The disaggregated end-to-end run: prefill engines that publish KV events,
// decode engines each behind a real decode sidecar, the EPP in disaggregated
// mode, requests through the Envoy-like driver, which forwards each to the
// destination the EPP chose with the headers it set.
const (
	pdRequests      = 1000
	pdInflight      = 8
	pdPrefills      = 4
	pdDecodes       = 2
	pdGroups        = 8  // shared system prompts, two per prefill engine
	pdPrefillBlocks = 64 // per prefill engine: about two and a half prompts
)

func pdTestFleet() demofleet.PDFleetOptions {
	return demofleet.PDFleetOptions{Prefill: pdPrefills, Decode: pdDecodes, PrefillBlocks: pdPrefillBlocks, DecodeBlocks: 4096}
}

func pdTestWorkload(t *testing.T, requests int) []demofleet.Request {
	t.Helper()
	// Two output tokens: the prefill legs are what is measured, and short
	// streams keep 1,000 requests quick under the race detector.
	w, err := demofleet.Workload(demofleet.WorkloadOptions{Requests: requests, Groups: pdGroups, MaxTokens: 2, Seed: 18}, 0)
	require.NoError(t, err)
	return w
}

// TestDisaggregatedEndToEnd is the acceptance of disaggregated serving: 1,000
// streamed requests of a shared-prefix workload, 8 in flight. Every request
// succeeds; every prefill leg lands on the prefill worker the EPP named in
// x-prefiller-host-port (each engine served exactly the legs the EPP sent it)
// and every decode leg on the decode worker it chose; kvselect's prefill
// placement at least doubles the prefill prefix-cache hit rate of round-robin
// placement on the same workload; afterwards every reservation is settled by
// its request: no load on either role, every plan booked was handed off at the
// first byte and completed, none expired, no fallback.
func TestDisaggregatedEndToEnd(t *testing.T) {
	started := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cfg, err := load(t, nil)
	require.NoError(t, err)
	fo := pdTestFleet()
	fo.Model = demofleet.Model
	rig, err := newPDRig(ctx, cfg, fo, nil)
	require.NoError(t, err)
	defer rig.close()

	workload := pdTestWorkload(t, pdRequests)
	res, err := rig.drive(ctx, pdInflight, workload)
	require.NoError(t, err)
	require.Zero(t, res.Failed, res.FirstFailure)
	require.Equal(t, pdRequests, res.Requests)
	require.NoError(t, rig.waitSettled(ctx))
	// No load is left once the last free took its booking off the ledger;
	// the free counts it just after.
	eventually(t, 10*time.Second, func() error {
		for _, role := range []roles.Role{roles.Prefill, roles.Decode} {
			if err := uncounted(rig.e.rs.Service(role).Stats()); err != nil {
				return fmt.Errorf("%v: %w", role, err)
			}
		}
		return nil
	})
	driven := time.Since(started)

	// Prefill legs: where the EPP sent them is where they ran.
	view := rig.fleet.View()
	prefill := rig.fleet.PrefillStats()
	named := 0
	for i, st := range prefill {
		ep := view.PrefillEndpoints[i]
		require.EqualValues(t, res.PerPrefiller[ep], st.PrefillLegs, "prefill engine %s: legs the EPP named it for", ep)
		require.Equal(t, st.PrefillLegs, st.Pulls, "%s: every prefill leg's KV was taken by its decode", ep)
		require.Zero(t, st.HoldsExpired, ep)
		require.Positive(t, st.PrefillLegs, "%s: no prefill leg at all", ep)
		named += res.PerPrefiller[ep]
	}
	require.Equal(t, pdRequests, named, "every request named one prefill engine (%v)", res.PerPrefiller)
	// Decode legs: each decode worker (its sidecar) served what the EPP sent it.
	decode := rig.fleet.DecodeStats()
	for i, st := range decode {
		ep := view.DecodeEndpoints[i]
		sc := rig.fleet.Sidecars()[i].Stats()
		require.EqualValues(t, res.PerEndpoint[ep], st.DecodeLegs, "decode engine behind %s", ep)
		require.EqualValues(t, res.PerEndpoint[ep], sc.Disaggregated, "sidecar %s", ep)
		require.EqualValues(t, sc.Disaggregated, sc.Legs[sidecar.LegKey{Leg: sidecar.LegPrefill, Outcome: sidecar.OutcomeOK}], ep)
		require.EqualValues(t, sc.Disaggregated, sc.Legs[sidecar.LegKey{Leg: sidecar.LegDecode, Outcome: sidecar.OutcomeOK}], ep)
		require.Zero(t, sc.Passthrough+sc.Fallbacks, ep)
		for reason, n := range sc.BadHints {
			require.Zero(t, n, "%s: hints refused as %s", ep, reason)
		}
		require.Positive(t, st.TransferredTokens, "%s: the decode engine took its KV from the prefill engines", ep)
	}

	// Prefill placement versus round-robin, on the engines' own counters.
	rr, err := demofleet.RoundRobinPrefillHitRate(rig.prefillOptions(fo), workload)
	require.NoError(t, err)
	hit := demofleet.HitRate(prefill)
	require.GreaterOrEqual(t, hit, 2*rr, "prefill prefix-cache hit rate: kvselect %.3f, round-robin %.3f", hit, rr)

	// Every reservation settled by its request.
	st := rig.e.pairs.Stats()
	require.EqualValues(t, pdRequests, st.Booked)
	require.Equal(t, st.Booked, st.Plans.Completed, "%+v", st)
	require.Equal(t, st.Booked, st.Plans.HandedOff, "every plan handed off at its first byte (%+v)", st)
	require.Zero(t, st.Plans.Expired+st.Plans.Active, "%+v", st)
	require.Zero(t, st.LocalPrefill+st.Fallbacks+st.Failed+st.Compensated, "%+v", st)
	for _, role := range []roles.Role{roles.Prefill, roles.Decode} {
		svc := rig.e.rs.Service(role)
		for _, l := range svc.Loads(demofleet.Model) {
			require.True(t, l.ActiveRequests == 0 && l.ActiveBlocks == 0 && l.ActivePrefillTokens == 0, "%v: %+v", role, l)
		}
		ss := svc.Stats()
		require.EqualValues(t, pdRequests, ss.Bookings, "%v", role)
		require.Equal(t, ss.Bookings, ss.Frees, "%v: %+v", role, ss)
		require.Zero(t, ss.Ledger.Expired+ss.Ledger.Removed, "%v: bookings settled by their lease or a removal (%+v)", role, ss)
		require.Zero(t, ss.UnknownReservations, "%v: settling calls for unknown bookings", role)
	}
	t.Logf("%d requests, %d in flight, in %v: prefill legs per engine %v, decode legs per sidecar %v; "+
		"prefill prefix-cache hit rate %.1f%% (round-robin %.1f%%, %.1fx); TTFT p50 %.1f ms, p90 %.1f ms (client, race detector %v)",
		pdRequests, pdInflight, driven.Round(time.Millisecond), legsOf(prefill, true), legsOf(decode, false),
		100*hit, 100*rr, hit/rr, demofleet.Percentile(res.TTFTs, 0.5), demofleet.Percentile(res.TTFTs, 0.9), raceBuild())
}

func legsOf(sts []fakeengine.HTTPStats, prefill bool) []uint64 {
	out := make([]uint64, len(sts))
	for i, s := range sts {
		out[i] = s.DecodeLegs
		if prefill {
			out[i] = s.PrefillLegs
		}
	}
	return out
}

// prefillOptions are the options round-robin's replay needs: the fleet's, with
// the values newPDRig filled in from the configuration.
func (r *pdRig) prefillOptions(fo demofleet.PDFleetOptions) demofleet.PDFleetOptions {
	fo.Model, fo.BlockSize = r.e.cfg.Model, r.e.cfg.BlockSize
	return fo
}

// TestDisaggregatedSignedHints runs the same path with hint signing on: the
// EPP (DYN_EPP_PD_HINT_KEY) signs every hint, the sidecars (HintKey) accept
// every request. A signed request captured on its way and sent again straight
// to its sidecar is refused as a replay, and a forged, re-targeted, unsigned or
// expired one as well, and so is the captured request sent to the other decode
// sidecar, which holds the same key: 502 invalid_epp_metadata, before any
// engine is called.
func TestDisaggregatedSignedHints(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	key := bytes.Repeat([]byte("k"), pdhint.MinKeyLen)
	cfg, err := load(t, map[string]string{"DYN_EPP_PD_HINT_KEY": string(key), "DYN_EPP_PD_HINT_TTL_MS": "20000"})
	require.NoError(t, err)
	require.Equal(t, key, cfg.PDHintKey)
	require.Equal(t, 20*time.Second, cfg.PDHintTTL)
	fo := pdTestFleet()
	fo.Model = demofleet.Model
	rig, err := newPDRig(ctx, cfg, fo, nil)
	require.NoError(t, err)
	defer rig.close()

	const n = 200
	workload := pdTestWorkload(t, n)
	res, err := rig.drive(ctx, pdInflight, workload)
	require.NoError(t, err)
	require.Zero(t, res.Failed, res.FirstFailure)
	var accepted uint64
	for _, sc := range rig.fleet.Sidecars() {
		st := sc.Stats()
		accepted += st.Disaggregated
		for reason, c := range st.BadHints {
			require.Zero(t, c, "hints refused as %s", reason)
		}
	}
	require.EqualValues(t, n, accepted, "every signed hint accepted")

	// One more request, captured as the driver forwards it.
	conn, client := rig.dial(t)
	defer conn.Close()
	var sent *http.Request
	var sentBody []byte
	httpc := &http.Client{Timeout: 10 * time.Second}
	defer httpc.CloseIdleConnections()
	before := time.Now()
	resp, err := client.Roundtrip(ctx, extproctest.HTTPRequest{Path: "/v1/chat/completions", Body: workload[0].Body,
		Headers: http.Header{"Content-Type": {"application/json"}}},
		func(_ string, req *http.Request) (*http.Response, error) {
			sent = req.Clone(context.Background())
			sentBody, _ = io.ReadAll(req.Body)
			req.Body = io.NopCloser(bytes.NewReader(sentBody))
			return httpc.Do(req)
		})
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	hint, sig := sent.Header.Get(extproc.HeaderPrefiller), sent.Header.Get(extproc.HeaderPrefillerSignature)
	require.NotEmpty(t, hint)
	parsed, err := pdhint.Parse(sig)
	require.NoError(t, err)
	require.WithinDuration(t, before.Add(20*time.Second), parsed.Expiry, 2*time.Second, "expiry: now + DYN_EPP_PD_HINT_TTL_MS")
	require.Equal(t, workload[0].Body, sentBody, "the body signed is the body sent")
	require.NoError(t, rig.waitSettled(ctx))

	sidecarAt := map[string]*sidecar.Sidecar{}
	sidecars := rig.fleet.Sidecars()
	for i, ep := range rig.fleet.View().DecodeEndpoints {
		sidecarAt[ep] = sidecars[i]
	}
	target := sidecarAt[resp.Served]
	require.NotNil(t, target, "served by %s", resp.Served)
	require.Equal(t, resp.Served, sent.Header.Get(sidecar.HeaderDestination), "the destination the hint is signed for")
	var otherSidecar *sidecar.Sidecar
	var otherFront string
	for ep, sc := range sidecarAt {
		if ep != resp.Served {
			otherSidecar, otherFront = sc, ep
		}
	}
	other := rig.fleet.View().PrefillEndpoints[0]
	if other == hint {
		other = rig.fleet.View().PrefillEndpoints[1]
	}
	claim := pdhint.Claim{Prefiller: hint, Destinations: []string{resp.Served}, Path: sent.URL.Path, Body: sentBody}
	expired, err := pdhint.Sign(key, claim, time.Now().Add(-time.Minute), time.Now().Add(-2*time.Second), pdhint.NewNonce())
	require.NoError(t, err)
	wrongKey, err := pdhint.Sign(bytes.Repeat([]byte("x"), pdhint.MinKeyLen), claim, time.Now(), time.Now().Add(10*time.Second), pdhint.NewNonce())
	require.NoError(t, err)
	legsBefore := legsOf(rig.fleet.PrefillStats(), true)
	for _, tc := range []struct {
		name, hint, sig, reason string
		body                    []byte
		elsewhere, dropDest     bool // sent to the other decode sidecar; without the destination header
	}{
		{"replayed as captured", hint, sig, sidecar.HintReplayed, sentBody, false, false},
		{"re-targeted to another prefill engine", other, sig, sidecar.HintForged, sentBody, false, false},
		{"another body", hint, sig, sidecar.HintForged, workload[1].Body, false, false},
		{"signed with another key", hint, wrongKey, sidecar.HintForged, sentBody, false, false},
		{"expired", hint, expired, sidecar.HintExpired, sentBody, false, false},
		{"unsigned", hint, "", sidecar.HintUnsigned, sentBody, false, false},
		{"sent to the other decode sidecar", hint, sig, sidecar.HintWrongDestination, sentBody, true, false},
		{"sent to the other decode sidecar, destination header dropped", hint, sig, sidecar.HintForged, sentBody, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u, at := *sent.URL, target
			if tc.elsewhere {
				u.Host, at = otherFront, otherSidecar
			}
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), bytes.NewReader(tc.body))
			require.NoError(t, err)
			req.Header = sent.Header.Clone()
			if tc.dropDest {
				req.Header.Del(sidecar.HeaderDestination)
			}
			req.Header.Set(extproc.HeaderPrefiller, tc.hint)
			if tc.sig == "" {
				req.Header.Del(extproc.HeaderPrefillerSignature)
			} else {
				req.Header.Set(extproc.HeaderPrefillerSignature, tc.sig)
			}
			before := at.Stats().BadHints[tc.reason]
			got, err := httpc.Do(req)
			require.NoError(t, err)
			defer got.Body.Close()
			var answer struct {
				Error struct {
					Code string `json:"code"`
				} `json:"error"`
			}
			require.Equal(t, http.StatusBadGateway, got.StatusCode)
			require.NoError(t, json.NewDecoder(got.Body).Decode(&answer))
			require.Equal(t, "invalid_epp_metadata", answer.Error.Code)
			require.Equal(t, before+1, at.Stats().BadHints[tc.reason], "refused as %s", tc.reason)
		})
	}
	require.Equal(t, legsBefore, legsOf(rig.fleet.PrefillStats(), true), "no refused request reached a prefill engine")
}

// dial serves the rig's ext_proc server on loopback (h2c) until the test ends
// and returns a driver connected to it.
func (r *pdRig) dial(t *testing.T) (*grpc.ClientConn, *extproctest.Client) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(r.e.server.GRPCServerOptions()...)
	r.e.server.Register(gs)
	served := make(chan struct{})
	go func() { defer close(served); _ = gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-served })
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	client, err := extproctest.NewClient(conn, extproctest.Options{})
	require.NoError(t, err)
	return conn, client
}
