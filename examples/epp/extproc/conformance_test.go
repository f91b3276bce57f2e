package extproc

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/gaie"
)

// GAIE's conformance suite steers requests with test-epp-endpoint-selection
// and reads where they went from x-conformance-test-served-endpoint, and
// probes the inference-extension health service. With the hooks on, the
// header is the subset hint (over the gateway's), hidden from the picker
// and removed upstream, and the gateway's served endpoint is echoed; off,
// the header is only removed and nothing is echoed.
func TestConformanceTestHooks(t *testing.T) {
	a, b := newBackend(t, "a"), newBackend(t, "b")
	for _, hooks := range []bool{true, false} {
		picker := routeTo(a.addr())
		h := newHarness(t, Options{Picker: picker, ConformanceTestHooks: hooks})
		client := forwardClient(t)
		hdr := http.Header{gaie.HeaderTestSelection: {b.addr() + ", 10.9.9.9"}}
		// The gateway serves where the suite asked (the fake picker routes
		// to a, so the served endpoint differs from the pick).
		toB := func(_ string, req *http.Request) (*http.Response, error) {
			req.URL.Host = b.addr()
			return client.Do(req)
		}
		res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Body: chatBody(), Headers: hdr}, toB)
		require.NoError(t, err)
		require.Equal(t, expectedBody("b"), string(res.Body))
		calls := picker.Calls()
		require.Len(t, calls, 1)
		require.NotContains(t, calls[0].Headers, gaie.HeaderTestSelection, "hidden from the picker")
		require.Empty(t, b.lastHeaders().Get(gaie.HeaderTestSelection), "removed upstream")
		if hooks {
			require.Equal(t, []string{b.addr(), "10.9.9.9"}, calls[0].Subset)
			require.Equal(t, []string{b.addr()}, res.Header[gaie.HeaderTestServed])
		} else {
			require.Nil(t, calls[0].Subset)
			require.Empty(t, res.Header[gaie.HeaderTestServed])
		}

		// An unusable selection leaves the gateway's subset (none here).
		_, err = h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: chatBody(), Headers: http.Header{gaie.HeaderTestSelection: {"not-an-address"}}})
		require.NoError(t, err)
		require.Nil(t, picker.Calls()[1].Subset)

		hc := healthpb.NewHealthClient(h.conn)
		status := func() healthpb.HealthCheckResponse_ServingStatus {
			r, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: HealthInferenceExtension})
			require.NoError(t, err)
			return r.GetStatus()
		}
		require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, status(), "until ready")
		h.srv.SetReady(true)
		require.Equal(t, healthpb.HealthCheckResponse_SERVING, status())
	}
}

// Options.Reason names a refusal's cause after the fixed phrase; a reason
// that is not a short safe token is left out, and errors without one keep
// the bare phrase.
func TestRefusalBodyNamesTheReason(t *testing.T) {
	for reason, want := range map[string]string{
		"unknown_model": "no endpoint available (unknown_model)\n",
		"no_schedulable_worker:kv_event_endpoint_missing": "no endpoint available (no_schedulable_worker:kv_event_endpoint_missing)\n",
		"":                        "no endpoint available\n",
		"Worker 10.0.0.1 is down": "no endpoint available\n",
		strings.Repeat("x", 65):   "no endpoint available\n",
		"with\nnewline":           "no endpoint available\n",
	} {
		h := newHarness(t, Options{Picker: failWith(errNoEndpoints), Reason: func(error) string { return reason }})
		res, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: chatBody()})
		require.NoError(t, err)
		require.Equal(t, http.StatusServiceUnavailable, res.Status)
		require.Equal(t, want, string(res.ImmediateBody), "reason %q", reason)
	}
}

// An overload (429, or 529 where Status maps to it) says when to retry, and
// any refusal with a reason names it in llm-d's drop-reason header.
func TestRefusalHeadersSayWhyAndWhen(t *testing.T) {
	for _, tc := range []struct {
		status     int
		reason     string
		retryAfter string
	}{
		{http.StatusTooManyRequests, "class_queue_full:batch", "1"},
		{gaie.StatusSiteOverloaded, "deadline:interactive", "1"},
		{http.StatusServiceUnavailable, "unknown_model", ""},
		{http.StatusTooManyRequests, "", "1"},
	} {
		h := newHarness(t, Options{
			Picker: failWith(errNoEndpoints),
			Status: func(error) int { return tc.status },
			Reason: func(error) string { return tc.reason },
		})
		res, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: chatBody()})
		require.NoError(t, err)
		require.Equal(t, tc.status, res.Status)
		require.Equal(t, tc.retryAfter, res.ImmediateHeaders["retry-after"], "%d %q", tc.status, tc.reason)
		require.Equal(t, tc.reason, res.ImmediateHeaders[gaie.HeaderDroppedReason], "%d %q", tc.status, tc.reason)
		if tc.status == gaie.StatusSiteOverloaded {
			require.Equal(t, "overloaded, retry later ("+tc.reason+")\n", string(res.ImmediateBody))
		}
	}
}
