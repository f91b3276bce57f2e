package extproc

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/examples/internal/extproctest"
)

// passthrough is the cheapest full-duplex ext_proc server: it continues the
// headers at once and echoes every body chunk. It is the baseline of the
// added-latency benchmark.
type passthrough struct {
	extprocv3.UnimplementedExternalProcessorServer
}

func (passthrough) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	cont := &extprocv3.CommonResponse{}
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		var resp *extprocv3.ProcessingResponse
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
				RequestHeaders: &extprocv3.HeadersResponse{Response: cont}}}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
				ResponseHeaders: &extprocv3.HeadersResponse{Response: cont}}}
		case *extprocv3.ProcessingRequest_RequestBody:
			resp = streamedBody(true, r.RequestBody.GetBody(), r.RequestBody.GetEndOfStream())
		case *extprocv3.ProcessingRequest_ResponseBody:
			resp = streamedBody(false, r.ResponseBody.GetBody(), r.ResponseBody.GetEndOfStream())
		default:
			continue
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
	}
}

// tcpClient serves register on a loopback TCP listener and returns a driver.
func tcpClient(b *testing.B, register func(*grpc.Server), fallback string) *extproctest.Client {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	g := grpc.NewServer()
	register(g)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = g.Serve(lis)
	}()
	b.Cleanup(func() {
		g.Stop()
		<-served
	})
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(b, err)
	b.Cleanup(func() { _ = conn.Close() })
	c, err := extproctest.NewClient(conn, extproctest.Options{Fallback: fallback})
	require.NoError(b, err)
	return c
}

func percentile(d []time.Duration, p float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(float64(len(s))*p))]
}

// BenchmarkExtProcAddedLatency sends the same request (a 1 KB chat body, a
// small JSON answer from a loopback backend) through the full Envoy-like
// round trip three ways, interleaved: through this server with a no-op Picker,
// through a pass-through ext_proc server, and straight to the backend. The
// extra latency of the EPP is reported as p50/p99 differences to the
// pass-through server (extra-p50-us, extra-p99-us) and to no ext_proc at all
// (vs-direct-p50-us).
func BenchmarkExtProcAddedLatency(b *testing.B) {
	b.ReportAllocs()
	answer := []byte(`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}`)
	be := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(answer)
	}))
	b.Cleanup(be.Close)
	dest := be.Listener.Addr().String()

	srv, err := NewServer(Options{Picker: PickerFunc(func(context.Context, PickRequest) (Pick, error) {
		return Pick{Destination: dest, Settle: NopSettler{}}, nil
	})})
	require.NoError(b, err)
	epp := tcpClient(b, srv.Register, "")
	noop := tcpClient(b, func(g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, passthrough{}) }, dest)

	tr := &http.Transport{MaxIdleConnsPerHost: 8}
	b.Cleanup(tr.CloseIdleConnections)
	fwd := extproctest.HTTPForward(&http.Client{Transport: tr})
	body := make([]byte, 1024)
	copy(body, `{"model":"m","messages":[{"role":"user","content":"`)
	for i := 60; i < len(body)-4; i++ {
		body[i] = 'a' + byte(i%26)
	}
	copy(body[len(body)-4:], `"}]}`)
	req := extproctest.HTTPRequest{Path: "/v1/chat/completions", Body: body,
		Headers: http.Header{"Content-Type": {"application/json"}}}
	ctx := context.Background()

	run := func(c *extproctest.Client) time.Duration {
		start := time.Now()
		res, err := c.Roundtrip(ctx, req, fwd)
		if err != nil || res.StatusCode != http.StatusOK || len(res.Body) != len(answer) {
			b.Fatalf("roundtrip: %v status %d body %d", err, res.StatusCode, len(res.Body))
		}
		return time.Since(start)
	}
	direct := func() time.Duration {
		start := time.Now()
		hreq, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+dest+req.Path, nil)
		hreq.Body = io.NopCloser(bytes.NewReader(body))
		resp, err := fwd(dest, hreq)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return time.Since(start)
	}
	for range 200 { // warm up connections and pools
		run(epp)
		run(noop)
		direct()
	}
	ours := make([]time.Duration, 0, b.N)
	base := make([]time.Duration, 0, b.N)
	raw := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		if i%2 == 0 {
			ours = append(ours, run(epp))
			base = append(base, run(noop))
		} else {
			base = append(base, run(noop))
			ours = append(ours, run(epp))
		}
		raw = append(raw, direct())
	}
	b.StopTimer()
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	b.ReportMetric(us(percentile(ours, 0.5)), "epp-p50-us")
	b.ReportMetric(us(percentile(base, 0.5)), "noop-p50-us")
	b.ReportMetric(us(percentile(raw, 0.5)), "direct-p50-us")
	b.ReportMetric(us(percentile(ours, 0.5)-percentile(base, 0.5)), "extra-p50-us")
	b.ReportMetric(us(percentile(ours, 0.99)-percentile(base, 0.99)), "extra-p99-us")
	b.ReportMetric(us(percentile(ours, 0.5)-percentile(raw, 0.5)), "vs-direct-p50-us")
	b.ReportMetric(us(percentile(ours, 0.99)-percentile(raw, 0.99)), "vs-direct-p99-us")
}
