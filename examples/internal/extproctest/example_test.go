package extproctest_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

	"github.com/kvselect/kvselect/examples/internal/extproctest"
)

// echoProcessor continues headers and echoes bodies: the smallest valid
// full-duplex ext_proc server. It routes nothing, so the Client falls back to
// its Fallback destination.
type echoProcessor struct {
	extprocv3.UnimplementedExternalProcessorServer
}

func (echoProcessor) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	for {
		req, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return err
		}
		resp := &extprocv3.ProcessingResponse{}
		cont := &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}}
		echo := func(b *extprocv3.HttpBody) *extprocv3.BodyResponse {
			return &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
				Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{
					Body: b.GetBody(), EndOfStream: b.GetEndOfStream()}}}}}
		}
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			resp.Response = &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: cont}
		case *extprocv3.ProcessingRequest_RequestBody:
			resp.Response = &extprocv3.ProcessingResponse_RequestBody{RequestBody: echo(r.RequestBody)}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			resp.Response = &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: cont}
		case *extprocv3.ProcessingRequest_ResponseBody:
			resp.Response = &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: echo(r.ResponseBody)}
		default:
			continue
		}
		if err := s.Send(resp); err != nil {
			return err
		}
	}
}

// Roundtrip plays Envoy for one request: request phase through ext_proc,
// real HTTP to the destination, response streamed back through ext_proc.
func ExampleClient_Roundtrip() {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "got %d bytes on %s", len(b), r.URL.Path)
	}))
	defer backend.Close()

	lis := bufconn.Listen(1 << 20)
	g := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(g, echoProcessor{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = g.Serve(lis)
	}()
	defer func() {
		g.Stop()
		<-done
	}()
	conn, _ := grpc.NewClient("passthrough:///epp",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	defer conn.Close()

	envoy, _ := extproctest.NewClient(conn, extproctest.Options{Fallback: backend.Listener.Addr().String()})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	res, err := envoy.Roundtrip(context.Background(), extproctest.HTTPRequest{
		Path: "/v1/completions", Body: []byte(`{"prompt":"hello"}`),
	}, extproctest.HTTPForward(&http.Client{Transport: tr}))
	fmt.Println(res.StatusCode, string(res.Body), err)
	// Output:
	// 200 got 18 bytes on /v1/completions <nil>
}
