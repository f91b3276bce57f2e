package sidecar_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
)

// streamEngine answers every request with an event stream of chunks events,
// each after gap, then blocks until the request ends when stall is set; with
// stallHead it sends nothing at all until then.
func streamEngine(t *testing.T, chunks int, gap time.Duration, stall, stallHead bool) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if stallHead {
			<-r.Context().Done()
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		tick := time.NewTicker(gap)
		defer tick.Stop()
		for i := range chunks {
			if i > 0 {
				select {
				case <-tick.C:
				case <-r.Context().Done():
					return
				}
			}
			fmt.Fprintf(w, "data: %d\n\n", i)
			if rc.Flush() != nil {
				return
			}
		}
		if stall {
			<-r.Context().Done()
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// passthrough sends one request without a hint through a sidecar in front of
// decodeURL with the given read timeout and returns the status, the body
// read and the error that ended it.
func passthrough(t *testing.T, decodeURL string, readIdle time.Duration) (*sidecar.Sidecar, int, string, error) {
	t.Helper()
	sc, err := sidecar.New(sidecar.Options{DecodeURL: decodeURL, ReadIdleTimeout: readIdle})
	require.NoError(t, err)
	front := httptest.NewServer(sc)
	tr := &http.Transport{}
	t.Cleanup(func() {
		front.Close()
		sc.Close()
		tr.CloseIdleConnections()
	})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, front.URL+"/v1/completions", nil)
	require.NoError(t, err)
	resp, err := (&http.Client{Transport: tr}).Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return sc, resp.StatusCode, string(body), err
}

// ReadIdleTimeout (Dynamo's DYN_SIDECAR_READ_TIMEOUT_MS) cuts a leg whose
// engine goes silent, before its headers (504) or mid-stream (the client's
// connection aborted), and counts it as timed out; a stream whose events
// keep coming outlives it.
func TestReadIdleTimeout(t *testing.T) {
	timedOut := sidecar.LegKey{Leg: sidecar.LegPassthrough, Outcome: sidecar.OutcomeTimeout}

	sc, status, body, err := passthrough(t, streamEngine(t, 0, time.Millisecond, false, true), 100*time.Millisecond)
	require.NoError(t, err)
	require.Equal(t, http.StatusGatewayTimeout, status, body)
	require.Equal(t, "decode_upstream_timeout", errorCode(t, []byte(body)))
	require.Equal(t, uint64(1), sc.Stats().Legs[timedOut])

	sc, status, body, err = passthrough(t, streamEngine(t, 1, time.Millisecond, true, false), 100*time.Millisecond)
	require.Equal(t, http.StatusOK, status)
	require.Error(t, err, "an answer cut short must not look complete")
	require.Equal(t, "data: 0\n\n", body, "the first event was relayed before the engine stalled")
	require.Eventually(t, func() bool { return sc.Stats().Legs[timedOut] == 1 }, testTimeout, pollInterval)

	// 20 events 50 ms apart: a second in all, twice the read timeout.
	sc, status, body, err = passthrough(t, streamEngine(t, 20, 50*time.Millisecond, false, false), 500*time.Millisecond)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, body, "data: 19\n\n")
	require.Equal(t, uint64(1), sc.Stats().Legs[sidecar.LegKey{Leg: sidecar.LegPassthrough, Outcome: sidecar.OutcomeOK}])
}
