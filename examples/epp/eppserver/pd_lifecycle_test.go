package eppserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/roles"
)

// heldRequest is one request routed by the EPP whose upstream answer the test
// writes itself, byte by byte: the driver relays what the test writes, as
// Envoy relays an engine's stream.
type heldRequest struct {
	prefiller, destination string // what the EPP chose (the forwarded headers)
	w                      *io.PipeWriter
	cancel                 context.CancelFunc // the client goes away
	done                   chan error         // Roundtrip's result
}

// hold sends body through the driver and returns once the EPP's decision has
// been forwarded (the plan is booked, no response byte yet).
func hold(t *testing.T, client *extproctest.Client, body []byte) *heldRequest {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h := &heldRequest{cancel: cancel, done: make(chan error, 1)}
	forwarded := make(chan struct{})
	forward := func(dest string, req *http.Request) (*http.Response, error) {
		r, w := io.Pipe()
		// As a transport does, a request whose context ends closes its body.
		context.AfterFunc(req.Context(), func() { _ = w.CloseWithError(req.Context().Err()) })
		h.prefiller, h.destination, h.w = req.Header.Get(extproc.HeaderPrefiller), dest, w
		close(forwarded)
		return &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"text/event-stream"}},
			Body: r, ContentLength: -1, Request: req}, nil
	}
	go func() {
		_, err := client.Roundtrip(ctx, extproctest.HTTPRequest{Path: "/v1/chat/completions", Body: body,
			Headers: http.Header{"Content-Type": {"application/json"}}}, forward)
		h.done <- err
	}()
	select {
	case <-forwarded:
	case err := <-h.done:
		t.Fatalf("the request was not routed: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the request was never forwarded")
	}
	return h
}

func (h *heldRequest) write(t *testing.T, s string) {
	t.Helper()
	_, err := io.WriteString(h.w, s)
	require.NoError(t, err)
}

// wait waits for Roundtrip to return.
func (h *heldRequest) wait(t *testing.T) error {
	t.Helper()
	defer h.cancel()
	select {
	case err := <-h.done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("the exchange never ended")
		return nil
	}
}

// held returns, for each role, the worker holding a reservation and how many
// it holds (workers without any are left out).
func (r *pdRig) held() map[roles.Role]map[string]int {
	out := map[roles.Role]map[string]int{}
	for _, role := range []roles.Role{roles.Prefill, roles.Decode} {
		out[role] = map[string]int{}
		for _, l := range r.e.rs.Service(role).Loads(r.e.cfg.Model) {
			if l.ActiveRequests != 0 {
				out[role][l.WorkerID] = l.ActiveRequests
			}
		}
	}
	return out
}

// workerAt maps an endpoint of the rig's fleet to its worker id.
func (r *pdRig) workerAt(ep string) string {
	for _, w := range r.fleet.Workers() {
		if w.Endpoint == ep {
			return w.ID
		}
	}
	return ""
}

// TestDisaggregatedReservationLifecycle follows one plan's reservations through
// the real EPP (ext_proc server, router, pair booker, both role services):
// routed, the prefill and the decode worker each hold one; the first response
// byte hands off (the prefill reservation is freed, the decode one stays);
// the end of the stream, a client cancel or an upstream error frees the decode
// one. A plan cancelled before its first byte frees both at once.
func TestDisaggregatedReservationLifecycle(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := load(t, nil)
	require.NoError(t, err)
	rig, err := newPDRig(ctx, cfg, demofleet.PDFleetOptions{Prefill: 2, Decode: 1, Model: demofleet.Model, PrefillBlocks: 64, DecodeBlocks: 64}, nil)
	require.NoError(t, err)
	defer rig.close()
	conn, client := rig.dial(t)
	defer conn.Close()
	workload := pdTestWorkload(t, 4)
	none := map[roles.Role]map[string]int{roles.Prefill: {}, roles.Decode: {}}

	for i, end := range []string{"end of stream", "client cancel", "upstream error", "cancel before the first byte"} {
		t.Run(end, func(t *testing.T) {
			before := rig.e.pairs.Stats().Plans
			h := hold(t, client, workload[i].Body)
			prefill, decode := rig.workerAt(h.prefiller), rig.workerAt(h.destination)
			require.NotEmpty(t, prefill, "prefiller %q", h.prefiller)
			require.NotEmpty(t, decode, "destination %q", h.destination)
			require.Equal(t, map[roles.Role]map[string]int{roles.Prefill: {prefill: 1}, roles.Decode: {decode: 1}}, rig.held(),
				"routed: both legs booked")
			require.Equal(t, before.Active+1, rig.e.pairs.Stats().Plans.Active)

			if end != "cancel before the first byte" {
				h.write(t, "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n")
				want := map[roles.Role]map[string]int{roles.Prefill: {}, roles.Decode: {decode: 1}}
				require.Eventually(t, func() bool { return fmt.Sprint(rig.held()) == fmt.Sprint(want) }, 5*time.Second, time.Millisecond,
					"the first byte frees the prefill reservation only: %v", rig.held())
				require.Equal(t, before.HandedOff+1, rig.e.pairs.Stats().Plans.HandedOff)
			}
			switch end {
			case "end of stream":
				h.write(t, "data: [DONE]\n\n")
				require.NoError(t, h.w.Close())
				require.NoError(t, h.wait(t))
			case "upstream error":
				require.NoError(t, h.w.CloseWithError(errors.New("the engine went away")))
				require.Error(t, h.wait(t))
			default: // the client goes away
				h.cancel()
				_ = h.wait(t)
			}
			require.Eventually(t, func() bool { return rig.unsettled() == nil }, 5*time.Second, time.Millisecond, "%v", rig.unsettled())
			require.Equal(t, none, rig.held())
			after := rig.e.pairs.Stats().Plans
			require.Equal(t, before.Completed+1, after.Completed, "settled by its request")
			require.Equal(t, before.Expired, after.Expired)
			if end == "cancel before the first byte" {
				require.Equal(t, before.HandedOff, after.HandedOff, "never handed off: both legs freed at completion")
			}
		})
	}
	for _, role := range []roles.Role{roles.Prefill, roles.Decode} {
		eventually(t, 10*time.Second, func() error { return uncounted(rig.e.rs.Service(role).Stats()) })
		st := rig.e.rs.Service(role).Stats()
		require.Equal(t, st.Bookings, st.Frees, "%v: %+v", role, st)
		require.Zero(t, st.Ledger.Expired, "%v: %+v", role, st)
		require.Zero(t, st.UnknownReservations, "%v: %+v", role, st)
	}
}

// TestDisaggregatedPlanExpiry: a plan whose stream never ends (an Envoy that
// died mid-request and never reset the stream) is settled by the pair
// booker's sweeper (every second) once its lease has passed, and its reservations freed; when the stream
// ends after all, nothing is freed twice.
func TestDisaggregatedPlanExpiry(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := load(t, nil)
	require.NoError(t, err)
	const lease = 300 * time.Millisecond
	cfg.Router.ActiveRequestExpiry = lease // the plans' lease too
	rig, err := newPDRig(ctx, cfg, demofleet.PDFleetOptions{Prefill: 2, Decode: 1, Model: demofleet.Model, PrefillBlocks: 64, DecodeBlocks: 64}, nil)
	require.NoError(t, err)
	defer rig.close()
	conn, client := rig.dial(t)
	defer conn.Close()
	workload := pdTestWorkload(t, 2)

	for i, handedOff := range []bool{false, true} {
		t.Run(fmt.Sprintf("handed off %v", handedOff), func(t *testing.T) {
			before := rig.e.pairs.Stats().Plans
			booked := time.Now()
			h := hold(t, client, workload[i].Body)
			require.Equal(t, before.Active+1, rig.e.pairs.Stats().Plans.Active)
			if handedOff {
				h.write(t, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n")
			}
			require.Eventually(t, func() bool { return rig.e.pairs.Stats().Plans.Expired == before.Expired+1 },
				10*time.Second, time.Millisecond, "the plan expires")
			require.GreaterOrEqual(t, time.Since(booked), lease, "not before its lease")
			require.Eventually(t, func() bool { return rig.unsettled() == nil }, 5*time.Second, time.Millisecond, "%v", rig.unsettled())

			// The stream ends after all: its Done finds no plan and frees nothing.
			require.NoError(t, h.w.Close())
			require.NoError(t, h.wait(t))
			after := rig.e.pairs.Stats().Plans
			require.Equal(t, before.Completed, after.Completed, "settled by expiry, not by its request")
			require.Zero(t, after.Active)
			require.NoError(t, rig.unsettled())
		})
	}
	for _, role := range []roles.Role{roles.Prefill, roles.Decode} {
		eventually(t, 10*time.Second, func() error { return uncounted(rig.e.rs.Service(role).Stats()) })
		st := rig.e.rs.Service(role).Stats()
		require.Equal(t, st.Bookings, st.Frees+uint64(st.Ledger.Expired), "%v: every booking settled once (%+v)", role, st)
	}
}
