package extproc

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/examples/internal/pdhint"
)

// A signed prefiller goes out as two headers, in both body modes; a pick
// without a signature sends exactly the headers it did before signing existed
// (the aggregated wire: the destination only), and a client's own signature
// never reaches the model server or the Picker.
func TestPrefillerSignatureHeader(t *testing.T) {
	const prefill, sig = "10.1.2.3:8001", "v1.1700000030.AAAAAAAAAAAAAAAAAAAAAA.BBBB"
	cases := []struct {
		name string
		pick func(dest string) Pick
		want map[string]string // what the server sets, but the destination
	}{
		{"aggregated", func(dest string) Pick { return Pick{Destination: dest} }, map[string]string{}},
		{"disaggregated, unsigned", func(dest string) Pick { return Pick{Destination: dest, Prefiller: prefill} },
			map[string]string{HeaderPrefiller: prefill}},
		{"disaggregated, signed", func(dest string) Pick {
			return Pick{Destination: dest, Prefiller: prefill, PrefillerSignature: sig}
		}, map[string]string{HeaderPrefiller: prefill, HeaderPrefillerSignature: sig}},
	}
	for _, m := range modes {
		for _, tc := range cases {
			t.Run(m.name+"/"+tc.name, func(t *testing.T) {
				be := newBackend(t, "w1")
				picker := &fakePicker{decide: func(context.Context, PickRequest) (Pick, error) { return tc.pick(be.addr()), nil }}
				h := newHarness(t, Options{Picker: picker})
				res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{
					Body: chatBody(), Mode: m.mode,
					Headers: http.Header{"Content-Type": {"application/json"}, "X-Kvselect-Prefiller-Signature": {"forged"}},
				}, extproctest.HTTPForward(forwardClient(t)))
				require.NoError(t, err)
				require.Equal(t, http.StatusOK, res.StatusCode)

				want := map[string]string{HeaderDestination: be.addr()}
				for k, v := range tc.want {
					want[k] = v
				}
				require.Equal(t, want, res.Decision.SetHeaders)
				got := be.lastHeaders()
				require.Equal(t, []string{be.addr()}, got.Values(HeaderDestination))
				if s, ok := tc.want[HeaderPrefillerSignature]; ok {
					require.Equal(t, []string{s}, got.Values(HeaderPrefillerSignature), "one value, the Picker's")
				} else {
					require.Empty(t, got.Values(HeaderPrefillerSignature), "the client's value is removed")
					require.Contains(t, res.Decision.RemovedHeaders, HeaderPrefillerSignature)
				}
				require.NotContains(t, picker.Calls()[0].Headers, HeaderPrefillerSignature)
			})
		}
	}
}

func TestInvalidPrefillerSignatureIs500(t *testing.T) {
	require.Equal(t, pdhint.Header, HeaderPrefillerSignature)
	for name, pk := range map[string]Pick{
		"no prefiller":        {Destination: "10.0.0.1:8000", PrefillerSignature: "v1.x"},
		"not as signed":       {Destination: "10.0.0.1:8000", Prefiller: "[FD00::2]:8001", PrefillerSignature: "v1.x"},
		"line break":          {Destination: "10.0.0.1:8000", Prefiller: "10.0.0.2:8001", PrefillerSignature: "v1.x\r\nx-evil: 1"},
		"space":               {Destination: "10.0.0.1:8000", Prefiller: "10.0.0.2:8001", PrefillerSignature: "v1 x"},
		"non-ASCII":           {Destination: "10.0.0.1:8000", Prefiller: "10.0.0.2:8001", PrefillerSignature: "v1.é"},
		"longer than the max": {Destination: "10.0.0.1:8000", Prefiller: "10.0.0.2:8001", PrefillerSignature: strings.Repeat("a", MaxSignatureLen+1)},
	} {
		t.Run(name, func(t *testing.T) {
			picker := &fakePicker{decide: func(context.Context, PickRequest) (Pick, error) { return pk, nil }}
			h := newHarness(t, Options{Picker: picker})
			d, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: chatBody()})
			require.NoError(t, err)
			require.Equal(t, http.StatusInternalServerError, d.Status)
			require.Empty(t, d.SetHeaders)
			s := picker.Settlers()[0]
			require.EqualValues(t, 1, s.done.Load(), "the booking is released")
		})
	}
	require.NoError(t, checkSignature(strings.Repeat("~", MaxSignatureLen), "10.0.0.2:8001", "10.0.0.2:8001"))
}
