package extproc

import (
	"context"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/internal/extproctest"
)

// spoofed are routing headers a malicious client sends to pick the
// destination, the candidate set, the prefill target or fake a served report.
func spoofed(evil string) http.Header {
	return http.Header{
		"X-Gateway-Destination-Endpoint":        {evil, evil},
		"X-Gateway-Destination-Endpoint-Subset": {evil},
		"X-Gateway-Destination-Endpoint-Served": {evil},
		"X-Gateway-Destination-Endpoint-Scores": {evil},
		"X-Prefiller-Host-Port":                 {evil},
		"X-Kvselect-Prefiller-Signature":        {"v1.1.AAAAAAAAAAA.AAAA"},
		"Test-Epp-Endpoint-Selection":           {evil},
		"X-Dynamo-Worker-Instance-Id":           {"7"},
		"X-Gateway-Inference-Objective":         {"premium"},
		"Content-Type":                          {"application/json"},
	}
}

func TestSpoofedRoutingHeadersAreRemovedAndIgnored(t *testing.T) {
	for _, m := range modes {
		for _, disagg := range []bool{false, true} {
			name := m.name + "/aggregated"
			if disagg {
				name = m.name + "/disaggregated"
			}
			t.Run(name, func(t *testing.T) {
				good, evil := newBackend(t, "good"), newBackend(t, "evil")
				prefill := "10.1.2.3:8001"
				picker := &fakePicker{decide: func(context.Context, PickRequest) (Pick, error) {
					pk := Pick{Destination: good.addr()}
					if disagg {
						pk.Prefiller = prefill
					}
					return pk, nil
				}}
				h := newHarness(t, Options{Picker: picker})
				res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{
					Body: chatBody(), Mode: m.mode, Headers: spoofed(evil.addr()),
				}, extproctest.HTTPForward(forwardClient(t)))
				require.NoError(t, err)

				d := res.Decision
				require.Equal(t, good.addr(), d.Destination, "one value, the picked one")
				require.Equal(t, good.addr(), d.MetadataDestination)
				require.Equal(t, []string{good.addr()}, d.Headers[HeaderDestination])
				require.Equal(t, good.addr(), res.Served)
				require.Zero(t, evil.requests())
				require.Equal(t, expectedBody("good"), string(res.Body))

				// What the model server received.
				got := good.lastHeaders()
				if disagg {
					require.Equal(t, []string{prefill}, got.Values(HeaderPrefiller))
					require.Equal(t, prefill, d.Prefiller)
				} else {
					require.Empty(t, got.Values(HeaderPrefiller))
					require.Empty(t, d.Prefiller)
				}
				for _, hdr := range []string{SubsetKey, ServedKey, "x-gateway-destination-endpoint-scores", HeaderPrefillerSignature,
					"test-epp-endpoint-selection", "x-dynamo-worker-instance-id", "x-gateway-inference-objective"} {
					require.Empty(t, got.Values(hdr), hdr)
				}
				require.Equal(t, []string{good.addr()}, got.Values(HeaderDestination))
				require.Equal(t, "application/json", got.Get("Content-Type"))

				// What the picker saw: no routing header, no subset from headers;
				// input headers (objective) are for the picker.
				call := picker.Calls()[0]
				require.Nil(t, call.Subset)
				for _, hdr := range routingHeaders {
					require.NotContains(t, call.Headers, hdr)
				}
				require.Equal(t, "premium", call.Headers["x-gateway-inference-objective"])
				require.Equal(t, "application/json", call.Headers["content-type"])
			})
		}
	}
}

func TestSpoofedHeadersCannotSteerABodylessRequest(t *testing.T) {
	good := newBackend(t, "good")
	picker := routeTo(good.addr())
	h := newHarness(t, Options{Picker: picker})
	res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Headers: spoofed("10.66.66.66:1")},
		extproctest.HTTPForward(forwardClient(t)))
	require.NoError(t, err)
	require.Equal(t, good.addr(), res.Decision.Destination)
	require.Empty(t, good.lastHeaders().Values(HeaderPrefiller))
	require.Empty(t, good.lastHeaders().Values(SubsetKey))
}

func TestSubsetHeaderIsNotASubsetHint(t *testing.T) {
	// Only gateway metadata restricts the candidates; a client header with
	// an empty or foreign subset neither restricts nor fails the request.
	picker := routeTo("10.0.0.1:8000")
	h := newHarness(t, Options{Picker: picker})
	d, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{
		Body: chatBody(), Headers: http.Header{"X-Gateway-Destination-Endpoint-Subset": {""}},
	})
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, d.Status)
	require.Nil(t, picker.Calls()[0].Subset)
	require.Contains(t, d.RemovedHeaders, SubsetKey)
}

func TestReadRequestHeaders(t *testing.T) {
	rh := readRequestHeaders(headerMapOf(
		":method", "POST", ":path", "/v1/completions", ":authority", "gw",
		"X-Request-Id", "r1", "accept", "a", "accept", "b",
		"x-gateway-destination-endpoint", "1.2.3.4:5", "x-llm-d-inference-objective", "o",
	))
	require.Equal(t, "POST", rh.method)
	require.Equal(t, "/v1/completions", rh.path)
	require.Equal(t, "r1", rh.requestID)
	require.Equal(t, map[string]string{"x-request-id": "r1", "accept": "a,b", "x-llm-d-inference-objective": "o"}, rh.picker)
	require.Equal(t, []string{"x-gateway-destination-endpoint", "x-llm-d-inference-objective"}, rh.remove)
}
