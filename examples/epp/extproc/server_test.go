package extproc

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/internal/extproctest"
)

var modes = []struct {
	name string
	mode extproctest.Mode
}{{"full-duplex", extproctest.FullDuplex}, {"buffered", extproctest.Buffered}}

func chatBody() []byte {
	return []byte(`{"model":"m","messages":[{"role":"user","content":"hello"}],"stream":true}`)
}

func TestRoutesWithHeaderEqualToMetadata(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			be := newBackend(t, "w1")
			picker := routeTo(be.addr())
			rec := newFakeRecorder()
			h := newHarness(t, Options{Picker: picker, Metrics: rec})
			res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{
				Path: "/v1/chat/completions", Body: chatBody(), Mode: m.mode,
				Headers: http.Header{"Content-Type": {"application/json"}},
			}, extproctest.HTTPForward(forwardClient(t)))
			require.NoError(t, err)

			d := res.Decision
			require.Equal(t, http.StatusOK, d.Status)
			require.Equal(t, be.addr(), d.Destination)
			require.Equal(t, d.Destination, d.MetadataDestination)
			require.True(t, d.ClearRouteCache)
			require.Empty(t, d.Prefiller)
			require.Equal(t, chatBody(), d.Body)
			require.Equal(t, http.StatusOK, res.StatusCode)
			require.Equal(t, expectedBody("w1"), string(res.Body))
			require.Equal(t, be.addr(), res.Served)
			require.Equal(t, 1, be.requests())
			require.Equal(t, string(chatBody()), string(be.bodies[0]))

			calls := picker.Calls()
			require.Len(t, calls, 1)
			require.Equal(t, "/v1/chat/completions", calls[0].Path)
			require.Equal(t, http.MethodPost, calls[0].Method)
			require.Equal(t, chatBody(), calls[0].Body)
			require.Equal(t, "application/json", calls[0].Headers["content-type"])
			require.Nil(t, calls[0].Subset)

			s := picker.Settlers()[0]
			require.EqualValues(t, 1, s.first.Load())
			require.EqualValues(t, 1, s.done.Load())
			st := rec.snapshot()
			require.Equal(t, map[int]int{200: 1}, st.outcomes)
			require.Equal(t, 1, st.picks)
			require.Zero(t, st.mismatches)
			require.Zero(t, st.inflight)
			require.Zero(t, h.srv.Inflight())
		})
	}
}

func TestBodylessRequestPicksWithNilBody(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			be := newBackend(t, "w1")
			picker := routeTo(be.addr())
			h := newHarness(t, Options{Picker: picker})
			res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Path: "/v1/models", Mode: m.mode},
				extproctest.HTTPForward(forwardClient(t)))
			require.NoError(t, err)
			require.Equal(t, be.addr(), res.Decision.Destination)
			require.Equal(t, be.addr(), res.Decision.MetadataDestination)
			require.Equal(t, expectedBody("w1"), string(res.Body))
			calls := picker.Calls()
			require.Len(t, calls, 1)
			require.Nil(t, calls[0].Body)
			require.Equal(t, http.MethodGet, calls[0].Method)
			require.EqualValues(t, 1, picker.Settlers()[0].done.Load())
		})
	}
}

func TestSubsetHint(t *testing.T) {
	cases := []struct {
		name string
		hint any
		want []string
	}{
		{"list", []string{"10.0.0.1:8000", "[fd00::1]:8000"}, []string{"10.0.0.1:8000", "[fd00::1]:8000"}},
		{"string", "10.0.0.1:8000, [fd00::1]:8000", []string{"10.0.0.1:8000", "[fd00::1]:8000"}},
		{"list with comma items", []string{"10.0.0.1:8000,10.0.0.2:8000", "10.0.0.3:8000"},
			[]string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}},
		{"bare IPs", []string{"10.0.0.1", "[fd00::2]", "fd00::3"}, []string{"10.0.0.1", "fd00::2", "fd00::3"}},
		{"canonicalised and deduplicated", "10.0.0.1:08000,10.0.0.1:8000,[FD00::1]:8000",
			[]string{"10.0.0.1:8000", "[fd00::1]:8000"}},
		{"invalid entries dropped", []string{"evil.example:80", "10.0.0.1:8000", "10.0.0.2:0", "x y"},
			[]string{"10.0.0.1:8000"}},
		{"absent", nil, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			picker := routeTo("10.0.0.1:8000")
			h := newHarness(t, Options{Picker: picker})
			d, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: chatBody(), SubsetHint: tc.hint})
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, d.Status)
			calls := picker.Calls()
			require.Len(t, calls, 1)
			require.Equal(t, tc.want, calls[0].Subset)
			require.EqualValues(t, 1, picker.Settlers()[0].done.Load(), "Do ends the stream: Done")
		})
	}
}

func TestEmptySubsetIs503WithoutPicking(t *testing.T) {
	for name, hint := range map[string]any{
		"empty list": []string{}, "empty string": "", "only invalid": []string{"dns.name:80", "1.2.3.4:70000"},
		"commas only": " , ,",
	} {
		t.Run(name, func(t *testing.T) {
			picker := routeTo("10.0.0.1:8000")
			rec := newFakeRecorder()
			h := newHarness(t, Options{Picker: picker, Metrics: rec})
			for _, m := range modes {
				d, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: chatBody(), SubsetHint: hint, Mode: m.mode})
				require.NoError(t, err)
				require.Equal(t, http.StatusServiceUnavailable, d.Status)
				require.Empty(t, d.Destination)
				require.Empty(t, d.MetadataDestination)
			}
			d, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{SubsetHint: hint})
			require.NoError(t, err)
			require.Equal(t, http.StatusServiceUnavailable, d.Status, "body-less too")
			require.Empty(t, picker.Calls())
			require.Equal(t, map[int]int{503: 3}, rec.snapshot().outcomes)
		})
	}
}

func TestPickerErrorsBecomeImmediateResponses(t *testing.T) {
	cases := []struct {
		name   string
		err    error
		status int
	}{
		{"no endpoints", errNoEndpoints, 503},
		{"non-matching subset", errNoMatch, 503},
		{"overloaded", errOverloaded, 429},
		{"malformed body", errBadBody, 400},
		{"tokenizer 5xx", errTokenizerFailed, 502},
		{"tokenizer timeout", errTokenizerTimeout, 504},
		{"unmapped", context.Canceled, 500},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			picker := failWith(tc.err)
			rec := newFakeRecorder()
			h := newHarness(t, Options{Picker: picker, Metrics: rec})
			be := newBackend(t, "w1")
			for _, m := range modes {
				res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{
					Body: chatBody(), Mode: m.mode, SubsetHint: []string{"10.9.9.9:8000"},
				}, extproctest.HTTPForward(forwardClient(t)))
				require.NoError(t, err)
				require.Equal(t, tc.status, res.StatusCode)
				require.Equal(t, tc.status, res.Decision.Status)
				require.Equal(t, clientBody(tc.status), res.Body)
				require.NotContains(t, string(res.Body), "fake", "no error details for the client")
				require.Empty(t, res.Decision.Destination)
			}
			require.Zero(t, be.requests())
			require.Len(t, picker.Calls(), 2)
			require.Equal(t, map[int]int{tc.status: 2}, rec.snapshot().outcomes)
		})
	}
}

func TestStatusOutsideErrorRangeIs500(t *testing.T) {
	h := newHarness(t, Options{Picker: failWith(errBadBody), Status: func(error) int { return 200 }})
	d, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: chatBody()})
	require.NoError(t, err)
	require.Equal(t, http.StatusInternalServerError, d.Status)
}

func TestInflightLimitIs503(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	picker := &fakePicker{decide: func(ctx context.Context, req PickRequest) (Pick, error) {
		if req.Path == "/slow" {
			close(entered)
			<-release
		}
		return Pick{Destination: "10.0.0.1:8000"}, nil
	}}
	rec := newFakeRecorder()
	h := newHarness(t, Options{Picker: picker, MaxInflight: 1, Metrics: rec})
	ctx := testCtx(t)
	first := make(chan extproctest.Decision, 1)
	go func() {
		d, err := h.client.Do(ctx, extproctest.HTTPRequest{Path: "/slow", Body: chatBody()})
		if err != nil {
			d.Status = -1
		}
		first <- d
	}()
	<-entered
	require.Equal(t, 1, h.srv.Inflight())
	d, err := h.client.Do(ctx, extproctest.HTTPRequest{Path: "/fast", Body: chatBody()})
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, d.Status)
	close(release)
	require.Equal(t, http.StatusOK, (<-first).Status)

	d, err = h.client.Do(ctx, extproctest.HTTPRequest{Path: "/fast", Body: chatBody()})
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, d.Status, "the permit was released")
	require.Len(t, picker.Calls(), 2)
	st := rec.snapshot()
	require.Equal(t, 1, st.maxInflight)
	require.Zero(t, st.inflight)
	require.Equal(t, map[int]int{200: 2, 503: 1}, st.outcomes)
}

func TestBodyOverLimitIs413(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			picker := routeTo("10.0.0.1:8000")
			h := newHarness(t, Options{Picker: picker, MaxBodyBytes: 1000})
			d, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{
				Body: bytes.Repeat([]byte("a"), 5000), ChunkSize: 400, Mode: m.mode,
			})
			require.NoError(t, err)
			require.Equal(t, http.StatusRequestEntityTooLarge, d.Status)
			require.Equal(t, clientBody(413), d.ImmediateBody)
			d, err = h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: bytes.Repeat([]byte("a"), 1000), Mode: m.mode})
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, d.Status, "exactly the limit is fine")
			require.Len(t, picker.Calls(), 1)
		})
	}
}

func TestBodyResentInChunks(t *testing.T) {
	body := make([]byte, 200_000)
	for i := range body {
		body[i] = byte('a' + i%26)
	}
	be := newBackend(t, "w1")
	picker := routeTo(be.addr())
	h := newHarness(t, Options{Picker: picker})
	res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Body: body, ChunkSize: 16 << 10},
		extproctest.HTTPForward(forwardClient(t)))
	require.NoError(t, err)
	d := res.Decision
	require.Equal(t, []int{62000, 62000, 62000, 14000}, d.BodyChunks)
	require.Equal(t, body, d.Body)
	require.Equal(t, body, picker.Calls()[0].Body, "the picker saw the whole body")
	require.Equal(t, body, be.bodies[0], "the backend got the body unchanged")

	h2 := newHarness(t, Options{Picker: routeTo(be.addr()), ChunkSize: 1000})
	d2, err := h2.client.Do(testCtx(t), extproctest.HTTPRequest{Body: body[:2500]})
	require.NoError(t, err)
	require.Equal(t, []int{1000, 1000, 500}, d2.BodyChunks)
}

func TestServedEndpointMismatchIsCounted(t *testing.T) {
	picked, other := newBackend(t, "picked"), newBackend(t, "other")
	rec := newFakeRecorder()
	h := newHarness(t, Options{Picker: routeTo(picked.addr()), Metrics: rec})
	client := forwardClient(t)

	res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Body: chatBody()}, extproctest.HTTPForward(client))
	require.NoError(t, err)
	require.Equal(t, picked.addr(), res.Served)
	require.Zero(t, rec.snapshot().mismatches)

	// A gateway that sends the request elsewhere (a retry to another
	// endpoint) reports that endpoint as served.
	redirect := func(_ string, req *http.Request) (*http.Response, error) {
		req.URL.Host = other.addr()
		return client.Do(req)
	}
	res, err = h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Body: chatBody()}, redirect)
	require.NoError(t, err)
	require.Equal(t, other.addr(), res.Served)
	require.Equal(t, expectedBody("other"), string(res.Body))
	require.Equal(t, 1, rec.snapshot().mismatches)
}

func TestInvalidPickedEndpointIs500(t *testing.T) {
	for _, pk := range []Pick{
		{Destination: ""},
		{Destination: "backend.example:8000"},
		{Destination: "10.0.0.1:0"},
		{Destination: "10.0.0.1:65536"},
		{Destination: "10.0.0.1"},
		{Destination: "[fe80::1%eth0]:8000"},
		{Destination: "10.0.0.1:8000\r\nx-evil: 1"},
		{Destination: "10.0.0.1:8000,10.0.0.2:8000"},
		{Destination: "10.0.0.1:8000", Prefiller: "prefill.example:8000"},
		{Destination: "10.0.0.1:8000", Prefiller: "10.0.0.2:-1"},
	} {
		t.Run(pk.Destination+"|"+pk.Prefiller, func(t *testing.T) {
			picker := &fakePicker{decide: func(context.Context, PickRequest) (Pick, error) { return pk, nil }}
			h := newHarness(t, Options{Picker: picker})
			d, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: chatBody()})
			require.NoError(t, err)
			require.Equal(t, http.StatusInternalServerError, d.Status)
			require.Empty(t, d.SetHeaders)
			s := picker.Settlers()[0]
			require.EqualValues(t, 1, s.done.Load(), "the booking is released")
			require.Zero(t, s.first.Load())
		})
	}
}

func TestIPv6DestinationIsBracketed(t *testing.T) {
	picker := &fakePicker{decide: func(context.Context, PickRequest) (Pick, error) {
		return Pick{Destination: "[FD00::0001]:8000", Prefiller: "[fd00::2]:8001"}, nil
	}}
	h := newHarness(t, Options{Picker: picker})
	d, err := h.client.Do(testCtx(t), extproctest.HTTPRequest{Body: chatBody()})
	require.NoError(t, err)
	require.Equal(t, "[fd00::1]:8000", d.Destination)
	require.Equal(t, "[fd00::1]:8000", d.MetadataDestination)
	require.Equal(t, "[fd00::2]:8001", d.Prefiller)
}

func TestNilSettleIsAllowed(t *testing.T) {
	be := newBackend(t, "w1")
	h := newHarness(t, Options{Picker: PickerFunc(func(context.Context, PickRequest) (Pick, error) {
		return Pick{Destination: be.addr()}, nil
	})})
	res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{Body: chatBody()},
		extproctest.HTTPForward(forwardClient(t)))
	require.NoError(t, err)
	require.Equal(t, expectedBody("w1"), string(res.Body))
}

func TestNewServerValidation(t *testing.T) {
	_, err := NewServer(Options{})
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = NewServer(Options{Picker: routeTo("10.0.0.1:1"), MaxBodyBytes: -1, ChunkSize: MaxChunkSize + 1, MaxInflight: -1})
	require.ErrorIs(t, err, ErrInvalidOptions)
	for _, field := range []string{"MaxBodyBytes", "ChunkSize", "MaxInflight"} {
		require.True(t, strings.Contains(err.Error(), field), "%s reported in %v", field, err)
	}
	s, err := NewServer(Options{Picker: routeTo("10.0.0.1:1")})
	require.NoError(t, err)
	require.Equal(t, DefaultMaxBodyBytes, s.maxBody)
	require.Equal(t, DefaultChunkSize, s.chunk)
	require.EqualValues(t, DefaultMaxInflight, s.maxFlight)
}
