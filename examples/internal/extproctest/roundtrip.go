package extproctest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// Response is what the client received at the end of a Roundtrip.
type Response struct {
	// Decision is the outcome of the request phase.
	Decision Decision
	// StatusCode is the status the client saw: the ImmediateResponse status,
	// or the upstream status (503 when the upstream could not be reached).
	StatusCode int
	// Header holds the response headers after the server's mutations
	// (lower-cased keys, without :status).
	Header http.Header
	// Body is the body the client received: what the server streamed back.
	Body []byte
	// Served is the endpoint the request was really sent to, as reported to
	// the server in envoy.lb metadata.
	Served string
	// Interrupted reports that the exchange was interrupted on purpose.
	Interrupted bool
}

// Forward sends the request to the chosen destination and returns the
// upstream response. The request's URL is http://dest/path. The endpoint
// reported as served is resp.Request.URL.Host when set, else dest, so a
// Forward that sends elsewhere makes a served-endpoint mismatch.
type Forward func(dest string, req *http.Request) (*http.Response, error)

// HTTPForward returns a Forward that sends the request with c.
func HTTPForward(c *http.Client) Forward {
	return func(_ string, req *http.Request) (*http.Response, error) { return c.Do(req) }
}

// Roundtrip runs a whole request like Envoy: the request phase (see Do), then,
// when the request is routed, forwards it with forward to the destination
// (the envoy.lb metadata, else the header, else Options.Fallback; the first
// entry of a list), and streams the upstream response through the same
// ext_proc stream: the headers (with the served endpoint in metadata), each
// body chunk as it is read, then end of stream. The client gets the body the
// server sends back. req.Interrupt stops the exchange early. Roundtrip returns
// after the server has ended the stream, except after a Cancel interruption
// (a reset does not wait for the server).
func (c *Client) Roundtrip(ctx context.Context, req HTTPRequest, forward Forward) (Response, error) {
	if forward == nil {
		return Response{}, fmt.Errorf("%w: nil forward", ErrInvalidOptions)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.epp.Process(ctx)
	if err != nil {
		return Response{}, fmt.Errorf("extproctest: open stream: %w", err)
	}
	d, err := c.requestPhase(st, &req)
	res := Response{Decision: d, StatusCode: d.Status}
	if err != nil {
		return res, err
	}
	if d.Status != http.StatusOK {
		res.Body = d.ImmediateBody
		return res, finishStream(st)
	}
	if req.Interrupt.At == AfterDecision {
		res.Interrupted = true
		if req.Interrupt.Kind == Cancel {
			cancel()
			return res, nil
		}
		if err := finishStream(st); errors.Is(err, ErrProtocol) {
			return res, err
		}
		return res, nil
	}
	dest, err := c.destination(d)
	if err != nil {
		return res, errors.Join(err, finishStream(st))
	}
	r := newReader(st, req.Mode)
	defer func() {
		cancel()
		r.wait()
	}()
	upstream, served := c.forward(ctx, dest, &req, d, forward)
	defer upstream.Body.Close()
	res.Served = served
	res.StatusCode = upstream.StatusCode
	res.Header = lowerHeader(upstream.Header)
	return res, c.responsePhase(ctx, st, r, &req, upstream, served, &res, cancel)
}

func (c *Client) destination(d Decision) (string, error) {
	dest := d.MetadataDestination
	switch {
	case dest != "" && d.Destination != "" && dest != d.Destination:
		return "", fmt.Errorf("%w: header %q, metadata %q", ErrDestinationMismatch, d.Destination, dest)
	case dest == "":
		dest = d.Destination
	}
	if dest == "" {
		dest = c.fallback
	}
	if dest == "" {
		return "", ErrNoDestination
	}
	first, _, _ := strings.Cut(dest, ",")
	return first, nil
}

// forward sends the request upstream; a failure becomes Envoy's local 503.
func (c *Client) forward(ctx context.Context, dest string, req *HTTPRequest, d Decision,
	forward Forward) (*http.Response, string) {
	hreq, err := http.NewRequestWithContext(ctx, req.Method, "http://"+dest+req.Path, bytes.NewReader(d.Body))
	if err == nil {
		hreq.Host = req.Authority
		for k, vs := range d.Headers {
			switch {
			case strings.HasPrefix(k, ":"), k == "content-length", k == "host", k == "transfer-encoding",
				k == "connection":
				continue
			}
			for _, v := range vs {
				hreq.Header.Add(k, v)
			}
		}
		var resp *http.Response
		if resp, err = forward(dest, hreq); err == nil {
			served := dest
			if resp.Request != nil && resp.Request.URL != nil && resp.Request.URL.Host != "" {
				served = resp.Request.URL.Host
			}
			return resp, served
		}
	}
	body := "upstream connect error\n"
	return &http.Response{
		StatusCode:    http.StatusServiceUnavailable,
		ContentLength: int64(len(body)),
		Header:        http.Header{"Content-Type": {"text/plain"}, "Content-Length": {strconv.Itoa(len(body))}},
		Body:          io.NopCloser(strings.NewReader(body)),
	}, dest
}

func lowerHeader(h http.Header) http.Header {
	out := make(http.Header, len(h))
	for k, vs := range h {
		out[strings.ToLower(k)] = append([]string(nil), vs...)
	}
	return out
}

func (c *Client) responsePhase(ctx context.Context, st extprocv3.ExternalProcessor_ProcessClient, r *reader,
	req *HTTPRequest, upstream *http.Response, served string, res *Response, cancel context.CancelFunc) error {
	md := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		MetadataNamespace: {Fields: map[string]*structpb.Value{ServedKey: structpb.NewStringValue(served)}},
	}}
	hdr := lowerHeader(upstream.Header)
	hdr[":status"] = []string{strconv.Itoa(upstream.StatusCode)}
	r.setHeaders(res.Header)
	if err := st.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: headerMap(hdr), EndOfStream: upstream.ContentLength == 0,
		}},
		MetadataContext: md,
	}); err != nil {
		return r.fail(ctx, res, fmt.Errorf("extproctest: send response headers: %w", err))
	}
	if err := r.waitFor(ctx, r.headersDone); err != nil {
		return r.fail(ctx, res, err)
	}
	if r.immediateSeen() {
		return r.finish(ctx, st, res, false)
	}
	if req.Interrupt.At == AfterResponseHeaders {
		return r.interrupt(st, cancel, req.Interrupt.Kind, res)
	}
	if upstream.ContentLength == 0 {
		return r.finish(ctx, st, res, false)
	}
	if req.Mode == Buffered {
		body, err := io.ReadAll(upstream.Body)
		if err != nil {
			return r.fail(ctx, res, fmt.Errorf("extproctest: read upstream: %w", err))
		}
		r.setOriginalBody(body)
		if err := st.Send(&extprocv3.ProcessingRequest{
			Request:         &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}},
			MetadataContext: md,
		}); err != nil {
			return r.fail(ctx, res, fmt.Errorf("extproctest: send response body: %w", err))
		}
		if req.Interrupt.At == AfterFirstChunk && len(body) > 0 {
			// The whole body is the first chunk: interrupt once it was answered.
			if err := r.waitFor(ctx, r.ended); err != nil {
				return r.fail(ctx, res, err)
			}
			return r.interrupt(st, cancel, req.Interrupt.Kind, res)
		}
		return r.finish(ctx, st, res, true)
	}
	buf := make([]byte, req.ChunkSize)
	sentFirst := false
	for {
		n, rerr := upstream.Body.Read(buf)
		eos := errors.Is(rerr, io.EOF)
		if rerr != nil && !eos {
			return r.fail(ctx, res, fmt.Errorf("extproctest: read upstream: %w", rerr))
		}
		if n > 0 || eos {
			// Data that arrives with the end of the body goes first, the end
			// of stream follows in an empty chunk (the last HTTP/1 chunk).
			err := st.Send(&extprocv3.ProcessingRequest{
				Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
					Body: append([]byte(nil), buf[:n]...), EndOfStream: eos && n == 0,
				}},
				MetadataContext: md,
			})
			if err != nil {
				return r.fail(ctx, res, fmt.Errorf("extproctest: send response body: %w", err))
			}
		}
		if n > 0 && !sentFirst {
			sentFirst = true
			if req.Interrupt.At == AfterFirstChunk {
				if err := r.waitFor(ctx, r.firstEcho); err != nil {
					return r.fail(ctx, res, err)
				}
				return r.interrupt(st, cancel, req.Interrupt.Kind, res)
			}
		}
		if eos && n > 0 {
			err := st.Send(&extprocv3.ProcessingRequest{
				Request:         &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{EndOfStream: true}},
				MetadataContext: md,
			})
			if err != nil {
				return r.fail(ctx, res, fmt.Errorf("extproctest: send response body: %w", err))
			}
		}
		if eos {
			return r.finish(ctx, st, res, true)
		}
	}
}

// reader receives the replies of the response phase on its own goroutine,
// like Envoy's event loop, so a server may answer chunks at its own pace.
type reader struct {
	mode        Mode
	headersDone chan struct{}
	firstEcho   chan struct{}
	ended       chan struct{} // response end of stream answered, or immediate
	exited      chan struct{}

	mu        sync.Mutex
	header    http.Header
	body      []byte
	original  []byte
	gotBody   bool
	immediate *extprocv3.ImmediateResponse
	err       error
	closed    [3]bool
	// halfClosed: the driver ended its side; the server ending the stream
	// is then expected.
	halfClosed bool
}

func newReader(st extprocv3.ExternalProcessor_ProcessClient, mode Mode) *reader {
	r := &reader{
		mode:        mode,
		headersDone: make(chan struct{}),
		firstEcho:   make(chan struct{}),
		ended:       make(chan struct{}),
		exited:      make(chan struct{}),
	}
	go r.run(st)
	return r
}

func (r *reader) run(st extprocv3.ExternalProcessor_ProcessClient) {
	defer close(r.exited)
	for {
		m, err := st.Recv()
		if err != nil {
			r.mu.Lock()
			switch {
			case r.err != nil || r.isClosed(2) || r.halfClosed:
			case errors.Is(err, io.EOF):
				r.err = fmt.Errorf("%w: stream ended before the response", ErrProtocol)
			default:
				r.err = fmt.Errorf("extproctest: response phase: %w", err)
			}
			r.closeAll()
			r.mu.Unlock()
			return
		}
		r.mu.Lock()
		if perr := r.handle(m); perr != nil && r.err == nil {
			r.err = perr
			r.closeAll()
		}
		r.mu.Unlock()
	}
}

// handle processes one reply; r.mu is held.
func (r *reader) handle(m *extprocv3.ProcessingResponse) error {
	if r.isClosed(2) {
		return fmt.Errorf("%w: %T after the response ended", ErrProtocol, m.GetResponse())
	}
	switch x := m.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		r.immediate = x.ImmediateResponse
		r.closeAll()
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		if r.isClosed(0) {
			return fmt.Errorf("%w: second response headers reply", ErrProtocol)
		}
		if _, _, err := applyMutation(r.header, x.ResponseHeaders.GetResponse().GetHeaderMutation()); err != nil {
			return err
		}
		r.close(0)
	case *extprocv3.ProcessingResponse_ResponseBody:
		if !r.isClosed(0) {
			return fmt.Errorf("%w: response body reply before the headers reply", ErrProtocol)
		}
		cr := x.ResponseBody.GetResponse()
		if r.mode == FullDuplex {
			sr := cr.GetBodyMutation().GetStreamedResponse()
			if sr == nil {
				return fmt.Errorf("%w: full-duplex response body reply without streamed_response", ErrProtocol)
			}
			r.body = append(r.body, sr.GetBody()...)
			if len(sr.GetBody()) > 0 {
				r.close(1)
			}
			if sr.GetEndOfStream() {
				r.closeAll()
			}
			return nil
		}
		if _, _, err := applyMutation(r.header, cr.GetHeaderMutation()); err != nil {
			return err
		}
		switch bm := cr.GetBodyMutation().GetMutation().(type) {
		case nil:
			r.body = r.original
		case *extprocv3.BodyMutation_Body:
			r.body = bm.Body
		case *extprocv3.BodyMutation_ClearBody:
		default:
			return fmt.Errorf("%w: %T in buffered mode", ErrProtocol, bm)
		}
		r.gotBody = true
		r.closeAll()
	default:
		return fmt.Errorf("%w: %T in the response phase", ErrProtocol, x)
	}
	return nil
}

func (r *reader) isClosed(i int) bool { return r.closed[i] }

func (r *reader) close(i int) {
	if !r.closed[i] {
		r.closed[i] = true
		close([...]chan struct{}{r.headersDone, r.firstEcho, r.ended}[i])
	}
}

func (r *reader) closeAll() {
	for i := range r.closed {
		r.close(i)
	}
}

func (r *reader) setHeaders(h http.Header) {
	r.mu.Lock()
	r.header = h
	r.mu.Unlock()
}

func (r *reader) setOriginalBody(b []byte) {
	r.mu.Lock()
	r.original = b
	r.mu.Unlock()
}

func (r *reader) immediateSeen() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.immediate != nil || r.err != nil
}

func (r *reader) waitFor(ctx context.Context, ch chan struct{}) error {
	select {
	case <-ch:
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// interrupt stops the exchange as asked and reports it in res: Cancel resets
// the stream, Abort half-closes it; both wait for the reader to exit.
func (r *reader) interrupt(st extprocv3.ExternalProcessor_ProcessClient, cancel context.CancelFunc,
	kind InterruptKind, res *Response) error {
	res.Interrupted = true
	if kind == Cancel {
		cancel()
		<-r.exited
		return nil
	}
	cerr := r.closeSend(st)
	<-r.exited
	r.mu.Lock()
	defer r.mu.Unlock()
	res.Body = r.body
	return errors.Join(r.err, cerr)
}

// finish waits for the end of the response (when a body reply is due),
// half-closes and waits for the server to end the stream.
func (r *reader) finish(ctx context.Context, st extprocv3.ExternalProcessor_ProcessClient, res *Response,
	bodyDue bool) error {
	if bodyDue {
		if err := r.waitFor(ctx, r.ended); err != nil {
			return r.fail(ctx, res, err)
		}
	}
	cerr := r.closeSend(st)
	<-r.exited
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.immediate != nil {
		res.StatusCode = int(r.immediate.GetStatus().GetCode())
		res.Body = r.immediate.GetBody()
		res.Header = http.Header{}
	} else {
		res.Body = r.body
	}
	if r.err != nil {
		return r.err
	}
	if cerr != nil {
		return fmt.Errorf("extproctest: close send: %w", cerr)
	}
	return nil
}

// fail records what was received and returns err; the deferred wait in
// Roundtrip ends the reader once the stream context is cancelled.
func (r *reader) fail(_ context.Context, res *Response, err error) error {
	r.mu.Lock()
	res.Body = r.body
	if r.err != nil && !errors.Is(err, r.err) {
		err = errors.Join(err, r.err)
	}
	r.mu.Unlock()
	return err
}

func (r *reader) closeSend(st extprocv3.ExternalProcessor_ProcessClient) error {
	r.mu.Lock()
	r.halfClosed = true
	r.mu.Unlock()
	return st.CloseSend()
}

// wait blocks until the reader goroutine has exited. Roundtrip calls it after
// its stream context is cancelled or the stream has ended.
func (r *reader) wait() { <-r.exited }
