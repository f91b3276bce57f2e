package extproctest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// scripted is an ext_proc server whose behaviour each test writes; it records
// what it received and how its stream ended.
type scripted struct {
	extprocv3.UnimplementedExternalProcessorServer
	reply func(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse

	mu     sync.Mutex
	got    []*extprocv3.ProcessingRequest
	ends   []error
	endedc chan struct{}
}

func (s *scripted) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	for {
		req, err := stream.Recv()
		if err != nil {
			s.mu.Lock()
			s.ends = append(s.ends, err)
			s.mu.Unlock()
			s.endedc <- struct{}{}
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		s.mu.Lock()
		s.got = append(s.got, req)
		s.mu.Unlock()
		for _, r := range s.reply(req) {
			if err := stream.Send(r); err != nil {
				return err
			}
		}
	}
}

func (s *scripted) received() []*extprocv3.ProcessingRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*extprocv3.ProcessingRequest(nil), s.got...)
}

func (s *scripted) lastEnd(t *testing.T) error {
	t.Helper()
	select {
	case <-s.endedc:
	case <-time.After(10 * time.Second):
		t.Fatal("server stream did not end")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ends[len(s.ends)-1]
}

func serve(t *testing.T, s *scripted, opts Options) *Client {
	t.Helper()
	s.endedc = make(chan struct{}, 64)
	lis := bufconn.Listen(1 << 20)
	g := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(g, s)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = g.Serve(lis)
	}()
	conn, err := grpc.NewClient("passthrough:///x",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = conn.Close()
		g.Stop()
		<-done
	})
	c, err := NewClient(conn, opts)
	require.NoError(t, err)
	return c
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func headersReply(set map[string]string, remove ...string) *extprocv3.ProcessingResponse {
	m := &extprocv3.HeaderMutation{RemoveHeaders: remove}
	for k, v := range set {
		m.SetHeaders = append(m.SetHeaders, &corev3.HeaderValueOption{
			Header:       &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
			AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
		})
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{HeaderMutation: m, ClearRouteCache: true}},
	}}
}

func withMetadata(r *extprocv3.ProcessingResponse, dest string) *extprocv3.ProcessingResponse {
	r.DynamicMetadata = &structpb.Struct{Fields: map[string]*structpb.Value{
		MetadataNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			HeaderDestination: structpb.NewStringValue(dest),
		}}),
	}}
	return r
}

func echo(request bool, b *extprocv3.HttpBody) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{
			Body: b.GetBody(), EndOfStream: b.GetEndOfStream(),
		}},
	}}}
	if request {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
}

func continueResponseHeaders() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}},
	}}
}

// router is a minimal full-duplex EPP: it holds the headers reply until the
// body ended, routes to dest, and echoes everything else.
func router(dest string) func(*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	var body []byte // one stream at a time
	return func(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			if r.RequestHeaders.GetEndOfStream() {
				return []*extprocv3.ProcessingResponse{withMetadata(headersReply(map[string]string{HeaderDestination: dest}), dest)}
			}
		case *extprocv3.ProcessingRequest_RequestBody:
			body = append(body, r.RequestBody.GetBody()...)
			if r.RequestBody.GetEndOfStream() {
				all := &extprocv3.HttpBody{Body: body, EndOfStream: true}
				body = nil
				return []*extprocv3.ProcessingResponse{
					withMetadata(headersReply(map[string]string{HeaderDestination: dest}, "x-secret"), dest),
					echo(true, all),
				}
			}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			return []*extprocv3.ProcessingResponse{continueResponseHeaders()}
		case *extprocv3.ProcessingRequest_ResponseBody:
			return []*extprocv3.ProcessingResponse{echo(false, r.ResponseBody)}
		}
		return nil
	}
}

func upstream(t *testing.T) (*httptest.Server, *[]http.Header) {
	var mu sync.Mutex
	var seen []http.Header
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, r.Header.Clone())
		mu.Unlock()
		fl := w.(http.Flusher)
		for i := range 3 {
			_, _ = fmt.Fprintf(w, "part%d:%d;", i, len(body))
			fl.Flush()
		}
	}))
	t.Cleanup(s.Close)
	return s, &seen
}

func httpClient(t *testing.T) *http.Client {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func TestRoundtripFullDuplexMessageSequence(t *testing.T) {
	up, seen := upstream(t)
	dest := up.Listener.Addr().String()
	srv := &scripted{reply: router(dest)}
	c := serve(t, srv, Options{})
	body := make([]byte, 40_000)
	res, err := c.Roundtrip(ctxT(t), HTTPRequest{
		Path: "/v1/completions", Body: body, ChunkSize: 16 << 10, SubsetHint: []string{dest},
		Headers: http.Header{"X-Secret": {"s"}, "X-Keep": {"k"}},
	}, HTTPForward(httpClient(t)))
	require.NoError(t, err)
	require.ErrorIs(t, srv.lastEnd(t), io.EOF, "the server saw a clean half-close")

	require.Equal(t, http.StatusOK, res.StatusCode)
	require.Equal(t, dest, res.Decision.Destination)
	require.Equal(t, dest, res.Decision.MetadataDestination)
	require.Equal(t, dest, res.Served)
	require.Equal(t, []string{"x-secret"}, res.Decision.RemovedHeaders)
	require.Equal(t, "part0:40000;part1:40000;part2:40000;", string(res.Body))
	require.Empty(t, (*seen)[0].Values("X-Secret"))
	require.Equal(t, "k", (*seen)[0].Get("X-Keep"))
	require.Equal(t, dest, (*seen)[0].Get(HeaderDestination))

	got := srv.received()
	first := got[0]
	require.Equal(t, extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED, first.GetProtocolConfig().GetRequestBodyMode())
	require.Equal(t, extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED, first.GetProtocolConfig().GetResponseBodyMode())
	hdrs := map[string]string{}
	for _, h := range first.GetRequestHeaders().GetHeaders().GetHeaders() {
		require.Empty(t, h.GetValue(), "raw_value only")
		hdrs[h.GetKey()] = string(h.GetRawValue())
	}
	require.Equal(t, "POST", hdrs[":method"])
	require.Equal(t, "/v1/completions", hdrs[":path"])
	require.Equal(t, "40000", hdrs["content-length"])
	require.Equal(t, "s", hdrs["x-secret"])
	require.NotEmpty(t, hdrs["x-request-id"])
	subset := first.GetMetadataContext().GetFilterMetadata()[SubsetNamespace].GetFields()[SubsetKey]
	require.Equal(t, dest, subset.GetListValue().GetValues()[0].GetStringValue())

	// headers, 3 body chunks (16k, 16k, 7.9k; the last ends the stream)
	var sizes []int
	for _, m := range got[1:4] {
		sizes = append(sizes, len(m.GetRequestBody().GetBody()))
	}
	require.Equal(t, []int{16384, 16384, 7232}, sizes)
	require.True(t, got[3].GetRequestBody().GetEndOfStream())
	rh := got[4].GetResponseHeaders()
	require.NotNil(t, rh)
	served := got[4].GetMetadataContext().GetFilterMetadata()[MetadataNamespace].GetFields()[ServedKey]
	require.Equal(t, dest, served.GetStringValue())
	last := got[len(got)-1].GetResponseBody()
	require.True(t, last.GetEndOfStream())
	for _, m := range got[5 : len(got)-1] {
		require.NotNil(t, m.GetResponseBody())
		require.False(t, m.GetResponseBody().GetEndOfStream())
	}
}

func TestRoundtripBuffered(t *testing.T) {
	up, _ := upstream(t)
	dest := up.Listener.Addr().String()
	srv := &scripted{reply: func(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
		switch req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			return []*extprocv3.ProcessingResponse{headersReply(nil)}
		case *extprocv3.ProcessingRequest_RequestBody:
			return []*extprocv3.ProcessingResponse{withMetadata(&extprocv3.ProcessingResponse{
				Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
					Response: &extprocv3.CommonResponse{
						HeaderMutation: headersReply(map[string]string{HeaderDestination: dest}).GetRequestHeaders().GetResponse().GetHeaderMutation(),
					}}}}, dest)}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			return []*extprocv3.ProcessingResponse{continueResponseHeaders()}
		case *extprocv3.ProcessingRequest_ResponseBody:
			return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseBody{
				ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}}}
		}
		return nil
	}}
	c := serve(t, srv, Options{})
	res, err := c.Roundtrip(ctxT(t), HTTPRequest{Body: []byte("hello"), Mode: Buffered}, HTTPForward(httpClient(t)))
	require.NoError(t, err)
	require.Equal(t, dest, res.Decision.Destination)
	require.Equal(t, []byte("hello"), res.Decision.Body)
	require.Equal(t, "part0:5;part1:5;part2:5;", string(res.Body))
	got := srv.received()
	require.Len(t, got, 4, "headers, whole body, response headers, whole response body")
	require.True(t, got[1].GetRequestBody().GetEndOfStream())
	require.True(t, got[3].GetResponseBody().GetEndOfStream())
}

func TestDoAndImmediateResponse(t *testing.T) {
	srv := &scripted{reply: func(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
		if req.GetRequestHeaders() == nil {
			return nil
		}
		return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{Status: &typev3.HttpStatus{Code: 429}, Body: []byte("slow down")},
		}}}
	}}
	c := serve(t, srv, Options{})
	d, err := c.Do(ctxT(t), HTTPRequest{Body: make([]byte, 100_000)})
	require.NoError(t, err)
	require.Equal(t, 429, d.Status)
	require.Equal(t, []byte("slow down"), d.ImmediateBody)
	res, err := c.Roundtrip(ctxT(t), HTTPRequest{}, HTTPForward(httpClient(t)))
	require.NoError(t, err)
	require.Equal(t, 429, res.StatusCode)
	require.Equal(t, []byte("slow down"), res.Body)
}

func TestProtocolViolationsAreReported(t *testing.T) {
	dest := "127.0.0.1:1"
	cases := map[string]func(*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse{
		"body reply before headers reply": func(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
			if b := req.GetRequestBody(); b != nil {
				return []*extprocv3.ProcessingResponse{echo(true, b)}
			}
			return nil
		},
		"CONTINUE instead of streamed body": func(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
			if req.GetRequestBody() != nil {
				return []*extprocv3.ProcessingResponse{headersReply(nil), {Response: &extprocv3.ProcessingResponse_RequestBody{
					RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}}}
			}
			return nil
		},
		"value and raw_value": func(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
			if b := req.GetRequestBody(); b != nil {
				r := headersReply(map[string]string{HeaderDestination: dest})
				r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].Header.Value = dest
				return []*extprocv3.ProcessingResponse{r, echo(true, b)}
			}
			return nil
		},
	}
	for name, reply := range cases {
		t.Run(name, func(t *testing.T) {
			c := serve(t, &scripted{reply: reply}, Options{})
			_, err := c.Do(ctxT(t), HTTPRequest{Body: []byte("x")})
			require.True(t, errors.Is(err, ErrProtocol) || errors.Is(err, ErrInvalidMutation), "%v", err)
		})
	}
}

func TestDestinationRules(t *testing.T) {
	up, _ := upstream(t)
	dest := up.Listener.Addr().String()
	// Header only: forwarded by header.
	headerOnly := &scripted{reply: func(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
		r := router(dest)(req)
		for _, m := range r {
			m.DynamicMetadata = nil
		}
		return r
	}}
	c := serve(t, headerOnly, Options{})
	res, err := c.Roundtrip(ctxT(t), HTTPRequest{}, HTTPForward(httpClient(t)))
	require.NoError(t, err)
	require.Equal(t, dest, res.Served)

	mismatch := &scripted{reply: func(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
		r := router(dest)(req)
		for _, m := range r {
			if m.DynamicMetadata != nil {
				withMetadata(m, "10.0.0.9:80")
			}
		}
		return r
	}}
	c = serve(t, mismatch, Options{})
	_, err = c.Roundtrip(ctxT(t), HTTPRequest{}, HTTPForward(httpClient(t)))
	require.ErrorIs(t, err, ErrDestinationMismatch)

	none := &scripted{reply: func(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			return []*extprocv3.ProcessingResponse{headersReply(nil)}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			return []*extprocv3.ProcessingResponse{continueResponseHeaders()}
		case *extprocv3.ProcessingRequest_ResponseBody:
			return []*extprocv3.ProcessingResponse{echo(false, r.ResponseBody)}
		}
		return nil
	}}
	c = serve(t, none, Options{})
	_, err = c.Roundtrip(ctxT(t), HTTPRequest{}, HTTPForward(httpClient(t)))
	require.ErrorIs(t, err, ErrNoDestination)
	c = serve(t, none, Options{Fallback: dest})
	res, err = c.Roundtrip(ctxT(t), HTTPRequest{}, HTTPForward(httpClient(t)))
	require.NoError(t, err)
	require.Equal(t, "part0:0;part1:0;part2:0;", string(res.Body))
}

func TestInterruptsAsSeenByTheServer(t *testing.T) {
	up, _ := upstream(t)
	dest := up.Listener.Addr().String()
	for _, at := range []InterruptPoint{AfterDecision, AfterResponseHeaders, AfterFirstChunk} {
		srv := &scripted{reply: router(dest)}
		c := serve(t, srv, Options{})
		res, err := c.Roundtrip(ctxT(t), HTTPRequest{Body: []byte("x"), Interrupt: Interrupt{At: at, Kind: Abort}},
			HTTPForward(httpClient(t)))
		require.NoError(t, err)
		require.True(t, res.Interrupted)
		require.ErrorIs(t, srv.lastEnd(t), io.EOF, "abort is a half-close")
		last := srv.received()[len(srv.received())-1]
		if at == AfterFirstChunk {
			require.NotEmpty(t, last.GetResponseBody().GetBody())
			require.False(t, last.GetResponseBody().GetEndOfStream())
		}

		res, err = c.Roundtrip(ctxT(t), HTTPRequest{Body: []byte("x"), Interrupt: Interrupt{At: at, Kind: Cancel}},
			HTTPForward(httpClient(t)))
		require.NoError(t, err)
		require.True(t, res.Interrupted)
		require.Equal(t, codes.Canceled, status.Code(srv.lastEnd(t)), "cancel is a reset")
	}
}

func TestUpstreamFailureIsALocal503ThroughExtProc(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	dead := lis.Addr().String()
	require.NoError(t, lis.Close())
	srv := &scripted{reply: router(dead)}
	c := serve(t, srv, Options{})
	res, err := c.Roundtrip(ctxT(t), HTTPRequest{Body: []byte("x")}, HTTPForward(httpClient(t)))
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, res.StatusCode)
	require.Equal(t, "upstream connect error\n", string(res.Body))
	require.ErrorIs(t, srv.lastEnd(t), io.EOF)
}

func TestApplyMutation(t *testing.T) {
	opt := func(k, v string, action corev3.HeaderValueOption_HeaderAppendAction) *corev3.HeaderValueOption {
		return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)}, AppendAction: action}
	}
	h := http.Header{"a": {"1"}, "b": {"2"}, "c": {"3"}, ":path": {"/"}, "host": {"h"}, "d": {"4"}}
	removed, set, err := applyMutation(h, &extprocv3.HeaderMutation{
		RemoveHeaders: []string{"B", ":path", "host", "a"},
		SetHeaders: []*corev3.HeaderValueOption{
			opt("a", "new", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD), // removed then set: added
			opt("c", "x", corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD),
			opt("c", "y", corev3.HeaderValueOption_ADD_IF_ABSENT),
			opt("e", "z", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS),
			opt("d", "w", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS),
			opt(":authority", "evil", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD),
			opt("x-envoy-original-path", "evil", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD),
			opt("f", "", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD),
			{Header: &corev3.HeaderValue{Key: "g", Value: "v"}, Append: wrapperspb.Bool(false)},
			{Header: &corev3.HeaderValue{Key: "c", Value: "q"}, Append: wrapperspb.Bool(true),
				AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD},
		},
	})
	require.NoError(t, err)
	require.Equal(t, []string{"b", ":path", "host", "a"}, removed)
	require.Equal(t, http.Header{"a": {"new"}, "c": {"3", "x", "q"}, ":path": {"/"}, "host": {"h"}, "d": {"w"}, "g": {"v"}}, h)
	require.Equal(t, "new", set["a"])

	for name, hv := range map[string]*corev3.HeaderValue{
		"both encodings": {Key: "a", Value: "1", RawValue: []byte("1")},
		"newline":        {Key: "a", RawValue: []byte("1\r\nb: 2")},
		"bad name":       {Key: "a b", RawValue: []byte("1")},
		"empty name":     {Key: "", RawValue: []byte("1")},
	} {
		before := http.Header{"k": {"v"}}
		_, _, err := applyMutation(before, &extprocv3.HeaderMutation{
			RemoveHeaders: []string{"k"}, SetHeaders: []*corev3.HeaderValueOption{{Header: hv}},
		})
		require.ErrorIs(t, err, ErrInvalidMutation, name)
		require.Equal(t, http.Header{"k": {"v"}}, before, "%s: rejected as a whole", name)
	}
}

func TestInvalidInputs(t *testing.T) {
	_, err := NewClient(nil, Options{})
	require.ErrorIs(t, err, ErrInvalidOptions)
	c := serve(t, &scripted{reply: router("127.0.0.1:1")}, Options{})
	_, err = c.Do(ctxT(t), HTTPRequest{SubsetHint: 42})
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = c.Do(ctxT(t), HTTPRequest{Mode: 7})
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = c.Roundtrip(ctxT(t), HTTPRequest{}, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
}
