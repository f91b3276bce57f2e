package extproc_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
)

var errNoWorker = errors.New("router: no worker")

// A Server answers Envoy's ext_proc stream with the Picker's destination,
// as a header and as envoy.lb metadata; Picker errors become short
// ImmediateResponses with the status Options.Status gives.
func ExampleNewServer() {
	picker := extproc.PickerFunc(func(_ context.Context, req extproc.PickRequest) (extproc.Pick, error) {
		if len(req.Subset) > 0 && req.Subset[0] == "10.0.0.9:8000" {
			return extproc.Pick{}, errNoWorker
		}
		return extproc.Pick{Destination: "10.0.0.7:8000", Settle: extproc.NopSettler{}}, nil
	})
	srv, err := extproc.NewServer(extproc.Options{
		Picker: picker,
		Status: func(err error) int {
			if errors.Is(err, errNoWorker) {
				return http.StatusServiceUnavailable
			}
			return http.StatusInternalServerError
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	// Serve it over gRPC (in memory here; the EPP listens on :9002).
	lis := bufconn.Listen(1 << 20)
	g := grpc.NewServer(srv.GRPCServerOptions()...)
	srv.Register(g)
	srv.RegisterHealth(g)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = g.Serve(lis)
	}()
	defer func() {
		g.Stop()
		<-done
	}()
	conn, err := grpc.NewClient("passthrough:///epp",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close()

	// Play Envoy.
	envoy, _ := extproctest.NewClient(conn, extproctest.Options{})
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	d, err := envoy.Do(context.Background(), extproctest.HTTPRequest{
		Path: "/v1/chat/completions", Body: body,
		Headers: http.Header{"X-Gateway-Destination-Endpoint": {"10.6.6.6:1"}}, // spoofed, ignored
	})
	fmt.Println(d.Status, d.Destination, d.MetadataDestination, err)
	d, err = envoy.Do(context.Background(), extproctest.HTTPRequest{Body: body, SubsetHint: []string{"10.0.0.9:8000"}})
	fmt.Printf("%d %q %v\n", d.Status, d.ImmediateBody, err)
	// Output:
	// 200 10.0.0.7:8000 10.0.0.7:8000 <nil>
	// 503 "no endpoint available\n" <nil>
}
