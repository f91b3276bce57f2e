package extproc

import (
	"context"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/kvselect/kvselect/examples/internal/extproctest"
)

func TestInterruptionsSettleExactlyOnce(t *testing.T) {
	points := []extproctest.InterruptPoint{
		extproctest.AfterDecision, extproctest.AfterResponseHeaders, extproctest.AfterFirstChunk,
	}
	for _, kind := range []extproctest.InterruptKind{extproctest.Cancel, extproctest.Abort} {
		for i, at := range points {
			be := newBackend(t, "w1")
			picker := routeTo(be.addr())
			h := newHarness(t, Options{Picker: picker})
			res, err := h.client.Roundtrip(testCtx(t), extproctest.HTTPRequest{
				Body: chatBody(), Interrupt: extproctest.Interrupt{At: at, Kind: kind},
			}, extproctest.HTTPForward(forwardClient(t)))
			require.NoError(t, err)
			require.True(t, res.Interrupted)
			s := picker.Settlers()[0]
			if kind == extproctest.Cancel {
				// A reset does not wait for the server; Done follows shortly.
				require.Eventually(t, func() bool { return s.done.Load() == 1 }, 5*time.Second, time.Millisecond)
			}
			require.EqualValues(t, 1, s.done.Load(), "kind %d point %d", kind, at)
			wantFirst := int32(0)
			if at == extproctest.AfterFirstChunk {
				wantFirst = 1
			}
			require.Equal(t, wantFirst, s.first.Load(), "kind %d point %d", kind, i)
		}
	}
}

// TestReservationLifecycle runs 1000 requests, 20% of them cancelled by the
// client and 5% aborted by the data plane at various points, and checks that
// every booking was settled exactly once.
func TestReservationLifecycle(t *testing.T) {
	const n, workers = 1000, 16
	backends := []*backend{newBackend(t, "w0"), newBackend(t, "w1"), newBackend(t, "w2")}
	var mu sync.Mutex
	next := 0
	picker := &fakePicker{decide: func(context.Context, PickRequest) (Pick, error) {
		mu.Lock()
		defer mu.Unlock()
		next++
		return Pick{Destination: backends[next%len(backends)].addr()}, nil
	}}
	rec := newFakeRecorder()
	h := newHarness(t, Options{Picker: picker, Metrics: rec})
	client := forwardClient(t)
	ctx := testCtx(t)

	type result struct {
		interrupted bool
		complete    bool
		err         error
	}
	results := make([]result, n)
	jobs := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				req := extproctest.HTTPRequest{Path: "/v1/chat/completions", Body: chatBody()}
				if i%2 == 1 {
					req.Mode = extproctest.Buffered
				}
				point := extproctest.InterruptPoint(1 + i%3)
				switch {
				case i%20 < 4: // 20%
					req.Interrupt = extproctest.Interrupt{At: point, Kind: extproctest.Cancel}
				case i%20 == 4: // 5%
					req.Interrupt = extproctest.Interrupt{At: point, Kind: extproctest.Abort}
				}
				res, err := h.client.Roundtrip(ctx, req, extproctest.HTTPForward(client))
				results[i] = result{interrupted: res.Interrupted, err: err,
					complete: err == nil && !res.Interrupted && res.StatusCode == http.StatusOK && len(res.Body) > 0}
			}
		}()
	}
	for i := range n {
		jobs <- i
	}
	close(jobs)
	wg.Wait()

	interrupted, complete := 0, 0
	for i, r := range results {
		require.NoError(t, r.err, "request %d", i)
		if r.interrupted {
			interrupted++
		}
		if r.complete {
			complete++
		}
	}
	require.Equal(t, 250, interrupted)
	require.Equal(t, 750, complete)

	settlers := picker.Settlers()
	require.Len(t, settlers, n)
	// Cancelled streams are reset without waiting for the server.
	require.Eventually(t, func() bool {
		for _, s := range settlers {
			if s.done.Load() == 0 {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond)
	firsts := 0
	for i, s := range settlers {
		require.EqualValues(t, 1, s.done.Load(), "settler %d", i)
		require.LessOrEqual(t, s.first.Load(), int32(1), "settler %d", i)
		firsts += int(s.first.Load())
	}
	require.GreaterOrEqual(t, firsts, complete, "every complete response reported its first byte")
	require.Zero(t, h.srv.Inflight())
	st := rec.snapshot()
	require.Equal(t, map[int]int{200: n}, st.outcomes)
	require.Zero(t, st.inflight)
	require.Zero(t, st.mismatches)
}

func TestClientCancelDuringPickReleasesEverything(t *testing.T) {
	entered := make(chan struct{})
	picker := &fakePicker{decide: func(ctx context.Context, _ PickRequest) (Pick, error) {
		close(entered)
		<-ctx.Done()
		return Pick{}, ctx.Err()
	}}
	rec := newFakeRecorder()
	h := newHarness(t, Options{Picker: picker, Metrics: rec})
	ctx, cancel := context.WithCancel(testCtx(t))
	errc := make(chan error, 1)
	go func() {
		_, err := h.client.Do(ctx, extproctest.HTTPRequest{Body: chatBody()})
		errc <- err
	}()
	<-entered
	cancel()
	require.Error(t, <-errc)
	require.Eventually(t, func() bool { return rec.snapshot().outcomes[0] == 1 }, 5*time.Second, time.Millisecond)
	require.Zero(t, h.srv.Inflight())
	require.Empty(t, picker.Settlers())
}

func TestHealth(t *testing.T) {
	h := newHarness(t, Options{Picker: routeTo("10.0.0.1:8000")})
	hc := healthpb.NewHealthClient(h.conn)
	check := func(service string) healthpb.HealthCheckResponse_ServingStatus {
		r, err := hc.Check(testCtx(t), &healthpb.HealthCheckRequest{Service: service})
		require.NoError(t, err)
		return r.GetStatus()
	}
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, check(HealthLiveness))
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, check(HealthReadiness))
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, check(HealthExtProc))
	require.False(t, h.srv.Ready())
	h.srv.SetReady(true)
	require.True(t, h.srv.Ready())
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, check(HealthReadiness))
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, check(HealthExtProc))
	h.srv.SetReady(false)
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, check(HealthExtProc))
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, check(HealthLiveness))
}

// rawStream opens an ext_proc stream for hand-written message sequences.
func rawStream(t *testing.T, h *harness) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	st, err := extprocv3.NewExternalProcessorClient(h.conn).Process(testCtx(t))
	require.NoError(t, err)
	return st
}

func recvStatus(t *testing.T, st extprocv3.ExternalProcessor_ProcessClient) codes.Code {
	t.Helper()
	for {
		_, err := st.Recv()
		if err == io.EOF {
			return codes.OK
		}
		if err != nil {
			return status.Code(err)
		}
	}
}

func headersMsg(eos bool, mode extprocfilterv3.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: headerMapOf(":method", "POST", ":path", "/"), EndOfStream: eos,
		}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: mode},
	}
}

func TestProtocolViolations(t *testing.T) {
	picker := routeTo("10.0.0.1:8000")
	h := newHarness(t, Options{Picker: picker})

	st := rawStream(t, h)
	require.NoError(t, st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{}}}))
	require.Equal(t, codes.InvalidArgument, recvStatus(t, st), "response before request")

	st = rawStream(t, h)
	require.NoError(t, st.Send(headersMsg(false, extprocfilterv3.ProcessingMode_STREAMED)))
	require.Equal(t, codes.FailedPrecondition, recvStatus(t, st), "STREAMED body mode")

	st = rawStream(t, h)
	m := headersMsg(true, extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	m.ObservabilityMode = true
	require.NoError(t, st.Send(m))
	require.Equal(t, codes.FailedPrecondition, recvStatus(t, st), "observability mode")

	st = rawStream(t, h)
	require.NoError(t, st.Send(headersMsg(false, extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED)))
	require.NoError(t, st.Send(headersMsg(false, extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED)))
	require.Equal(t, codes.InvalidArgument, recvStatus(t, st), "headers twice")

	require.Empty(t, picker.Calls())
	require.Zero(t, h.srv.Inflight())
}

func TestNoProtocolConfigMeansFullDuplex(t *testing.T) {
	h := newHarness(t, Options{Picker: routeTo("10.0.0.1:8000")})
	st := rawStream(t, h)
	m := headersMsg(false, 0)
	m.ProtocolConfig = nil // Envoy before 1.32
	require.NoError(t, st.Send(m))
	require.NoError(t, st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte("{}"), EndOfStream: true}}}))
	r, err := st.Recv()
	require.NoError(t, err)
	require.NotNil(t, r.GetRequestHeaders(), "headers reply first")
	r, err = st.Recv()
	require.NoError(t, err)
	require.Equal(t, []byte("{}"), r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody())
	require.NoError(t, st.CloseSend())
	require.Equal(t, codes.OK, recvStatus(t, st))
}

func TestRequestTrailersInFullDuplex(t *testing.T) {
	picker := routeTo("10.0.0.1:8000")
	h := newHarness(t, Options{Picker: picker})
	st := rawStream(t, h)
	require.NoError(t, st.Send(headersMsg(false, extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED)))
	require.NoError(t, st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte("abc")}}}))
	require.NoError(t, st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{
		RequestTrailers: &extprocv3.HttpTrailers{}}}))
	r, err := st.Recv()
	require.NoError(t, err)
	require.NotNil(t, r.GetRequestHeaders())
	r, err = st.Recv()
	require.NoError(t, err)
	sr := r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	require.Equal(t, []byte("abc"), sr.GetBody())
	require.False(t, sr.GetEndOfStream(), "trailers follow")
	r, err = st.Recv()
	require.NoError(t, err)
	require.NotNil(t, r.GetRequestTrailers())
	require.NoError(t, st.CloseSend())
	require.Equal(t, codes.OK, recvStatus(t, st))
	require.Equal(t, []byte("abc"), picker.Calls()[0].Body)
	require.EqualValues(t, 1, picker.Settlers()[0].done.Load())
}
