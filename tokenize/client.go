package tokenize

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// Defaults applied by New to zero Options fields.
const (
	DefaultTimeout          = 5 * time.Second
	DefaultMaxResponseBytes = 16 << 20
	DefaultMaxRequestBytes  = 8 << 20
	// DefaultMaxPromptTokens bounds the ids of one prompt: 1M, the longest
	// context windows engines serve, 4 MiB as ids, half the default
	// request body (DefaultMaxRequestBytes).
	DefaultMaxPromptTokens = 1 << 20
)

// Options configure a Client. The zero value of every field but Protocol and
// BaseURL means the documented default; New copies the struct and never
// modifies the caller's.
type Options struct {
	// Protocol is one of ProtocolVLLMRender, ProtocolVLLMTokenize,
	// ProtocolSGLang, ProtocolSGLangRenderer. Required.
	Protocol string
	// BaseURL is the service's absolute http or https URL, e.g.
	// "http://renderer.ns.svc:8000" or one with a path prefix. It must have a
	// host and no user information, query or fragment. Required.
	BaseURL string
	// Timeout bounds each call, connection and reading the answer included.
	// Default DefaultTimeout (5 s); negative is an error. The caller's context
	// deadline applies too, the earlier wins.
	Timeout time.Duration
	// MaxResponseBytes bounds the answer's body; a larger one is ErrUpstream.
	// Default DefaultMaxResponseBytes (16 MiB); negative is an error.
	MaxResponseBytes int64
	// MaxRequestBytes bounds Request.Body; a larger one is ErrBadRequest before
	// anything is sent. Default DefaultMaxRequestBytes (8 MiB); negative is an
	// error.
	MaxRequestBytes int64
	// MaxPromptTokens bounds the token ids of any one prompt, in the service's
	// answer or in a completions prompt sent as ids: more is ErrPromptTooLong
	// (413), refused before more than MaxPromptTokens ids are stored (each
	// costs 4 bytes in the Result, and a Cache and the selection service hold
	// more per id). Default DefaultMaxPromptTokens (1M); negative is an error.
	MaxPromptTokens int
	// HTTPClient, when set, is used for the calls. New copies it and sets
	// CheckRedirect on the copy so that no redirect is ever followed; its
	// Transport is shared with the caller and not closed by Close. Default: a
	// client owned by the Client whose transport keeps up to 64 idle connections
	// to the service for 90 s, speaks HTTP/1.1, does not ask for compression and
	// ignores HTTP_PROXY/HTTPS_PROXY (the tokenizer is an in-cluster service; a
	// proxy picked up from the environment would silently carry every prompt
	// through it).
	HTTPClient *http.Client
	// Logger receives one debug record per service call (status, duration,
	// bytes). Default: none. Nothing is logged on the error path that is not
	// also in the returned error.
	Logger *slog.Logger
}

// Client calls one tokenizer service. It is safe for concurrent use; calls share
// the client's connection pool. Create it with New; a zero Client is unusable.
type Client struct {
	protocol string
	base     string // without a trailing slash
	timeout  time.Duration
	maxResp  int64
	maxReq   int64
	maxToks  int
	http     *http.Client
	owned    *http.Transport // closed by Close; nil when the caller gave HTTPClient
	log      *slog.Logger
}

var _ Tokenizer = (*Client)(nil)

// New validates opts and returns a Client. It reports every problem at once,
// wrapped in ErrInvalidOptions. It starts nothing and dials nothing.
func New(opts Options) (*Client, error) {
	problems := opts.problems()
	base, err := checkBaseURL(opts.BaseURL)
	if err != nil {
		problems = append(problems, err.Error())
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
	}
	c := &Client{
		protocol: opts.Protocol,
		base:     base,
		timeout:  orDefault(opts.Timeout, DefaultTimeout),
		maxResp:  orDefault(opts.MaxResponseBytes, DefaultMaxResponseBytes),
		maxReq:   orDefault(opts.MaxRequestBytes, DefaultMaxRequestBytes),
		maxToks:  orDefault(opts.MaxPromptTokens, DefaultMaxPromptTokens),
		log:      opts.Logger,
	}
	if opts.HTTPClient != nil {
		hc := *opts.HTTPClient
		c.http = &hc
	} else {
		c.owned = newTransport()
		c.http = &http.Client{Transport: c.owned}
	}
	c.http.CheckRedirect = refuseRedirect
	return c, nil
}

// problems lists what is wrong with every option but BaseURL.
func (opts *Options) problems() []string {
	var problems []string
	if !validProtocol(opts.Protocol) {
		problems = append(problems, fmt.Sprintf("protocol %q is not one of %s", opts.Protocol, protocolList()))
	}
	if opts.Timeout < 0 {
		problems = append(problems, fmt.Sprintf("timeout %v is negative", opts.Timeout))
	}
	if opts.MaxResponseBytes < 0 {
		problems = append(problems, fmt.Sprintf("max response bytes %d is negative", opts.MaxResponseBytes))
	}
	if opts.MaxRequestBytes < 0 {
		problems = append(problems, fmt.Sprintf("max request bytes %d is negative", opts.MaxRequestBytes))
	}
	if opts.MaxPromptTokens < 0 {
		problems = append(problems, fmt.Sprintf("max prompt tokens %d is negative", opts.MaxPromptTokens))
	}
	return problems
}

func orDefault[T int | int64 | time.Duration](v, def T) T {
	if v == 0 {
		return def
	}
	return v
}

// checkBaseURL returns the base URL without a trailing slash, or why it is
// unusable.
func checkBaseURL(raw string) (string, error) {
	if raw == "" {
		return "", errors.New("base URL is empty")
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return "", fmt.Errorf("base URL %q: %v", raw, err)
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("base URL %q: scheme must be http or https", raw)
	case u.Host == "" || u.Hostname() == "":
		return "", fmt.Errorf("base URL %q: no host", raw)
	case u.User != nil:
		return "", fmt.Errorf("base URL %q: user information is not allowed (no credentials are sent)", u.Redacted())
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		return "", fmt.Errorf("base URL %q: query and fragment are not allowed", raw)
	}
	return strings.TrimRight(raw, "/"), nil
}

// newTransport is the default transport: a bounded keep-alive pool to one
// service, HTTP/1.1, no proxy, no compression.
func newTransport() *http.Transport {
	return &http.Transport{
		Proxy: nil,
		DialContext: (&net.Dialer{
			Timeout:   2 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		MaxIdleConns:          128,
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   5 * time.Second,
		ExpectContinueTimeout: time.Second,
		DisableCompression:    true,
		ForceAttemptHTTP2:     false,
	}
}

// refuseRedirect stops the client at the first redirect: the 3xx answer is then
// returned as is and reported as ErrUpstream, and the body is never sent to
// another host.
func refuseRedirect(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// Protocol returns the client's protocol name.
func (c *Client) Protocol() string { return c.protocol }

// Close releases the idle connections of the transport the Client owns (none
// when Options.HTTPClient was given). Calls in flight finish normally; the
// Client stays usable, Close only drops idle connections.
func (c *Client) Close() {
	if c.owned != nil {
		c.owned.CloseIdleConnections()
	}
}

// Tokenize asks the service for req's token ids. Errors wrap ErrBadRequest,
// ErrUnavailable, ErrTimeout, ErrUpstream or ErrCanceled (see their docs); the
// request body is never quoted in them. Only Content-Type and Accept headers are
// sent; no header of the client's request is forwarded.
func (c *Client) Tokenize(ctx context.Context, req Request) (Result, error) {
	chat, err := isChat(req.Path)
	if err != nil {
		return Result{}, err
	}
	if int64(len(req.Body)) > c.maxReq {
		return Result{}, fmt.Errorf("%w: body of %d bytes exceeds the limit of %d", ErrBadRequest, len(req.Body), c.maxReq)
	}
	out, err := buildRequest(c.protocol, chat, req, c.maxToks)
	if err != nil {
		return Result{}, err
	}
	if out.direct != nil {
		return *out.direct, nil
	}
	return c.call(ctx, out)
}

func (c *Client) call(parent context.Context, out outbound) (Result, error) {
	ctx, cancel := context.WithTimeout(parent, c.timeout)
	defer cancel()
	start := time.Now()
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+out.path, bytes.NewReader(out.body))
	if err != nil {
		return Result{}, fmt.Errorf("%w: %s: %v", ErrBadRequest, out.path, err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set("Accept", "application/json")
	resp, err := c.http.Do(hreq)
	if err != nil {
		return Result{}, c.transportError(parent, ctx, out.path, "sending", err)
	}
	defer resp.Body.Close()

	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return Result{}, statusError(out.path, resp)
	}
	if resp.ContentLength > c.maxResp {
		return Result{}, fmt.Errorf("%w: %s: answer of %d bytes exceeds the limit of %d", ErrUpstream, out.path, resp.ContentLength, c.maxResp)
	}
	buf := getBuffer()
	defer putBuffer(buf)
	if resp.ContentLength > 0 {
		buf.Grow(int(resp.ContentLength))
	}
	n, err := buf.ReadFrom(io.LimitReader(resp.Body, c.maxResp+1))
	if err != nil {
		return Result{}, c.transportError(parent, ctx, out.path, "reading the answer", err)
	}
	if n > c.maxResp {
		return Result{}, fmt.Errorf("%w: %s: answer exceeds the limit of %d bytes", ErrUpstream, out.path, c.maxResp)
	}
	res, err := parseResponse(c.protocol, buf.Bytes(), c.maxToks)
	if c.log != nil {
		c.log.LogAttrs(parent, slog.LevelDebug, "tokenize call",
			slog.String("path", out.path), slog.Int("status", resp.StatusCode),
			slog.Duration("duration", time.Since(start)), slog.Int64("bytes", n),
			slog.Int("tokens", len(res.Tokens)), slog.Bool("ok", err == nil))
	}
	if err != nil {
		return Result{}, fmt.Errorf("%w (%s)", err, out.path)
	}
	return res, nil
}

// transportError classifies a failure to send or to read: the caller's
// cancellation, a deadline (the caller's or the per-call timeout), a body cut
// short (the service's fault), or a connection that could not be made.
func (c *Client) transportError(parent, ctx context.Context, path, doing string, err error) error {
	var nerr net.Error
	switch {
	case errors.Is(parent.Err(), context.Canceled):
		return fmt.Errorf("%w: %s: %w", ErrCanceled, path, context.Canceled)
	case parent.Err() != nil:
		return fmt.Errorf("%w: %s: no answer before the caller's deadline: %w", ErrTimeout, path, context.DeadlineExceeded)
	case ctx.Err() != nil:
		return fmt.Errorf("%w: %s: no answer within %v: %w", ErrTimeout, path, c.timeout, context.DeadlineExceeded)
	case errors.As(err, &nerr) && nerr.Timeout():
		return fmt.Errorf("%w: %s: %s: %v", ErrTimeout, path, doing, err)
	case doing != "sending":
		return fmt.Errorf("%w: %s: %s: %v", ErrUpstream, path, doing, err)
	default:
		return fmt.Errorf("%w: %s: %v", ErrUnavailable, path, err)
	}
}

// statusError maps a non-2xx answer: 408 is a timeout, 429 an unavailable
// service, any other 4xx the client's request, everything else (5xx, a refused
// 3xx redirect, 1xx) the service's fault. The message quotes the service's
// error message, or the start of its body.
func statusError(path string, resp *http.Response) error {
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	// Drain a little more so a short error body does not cost the connection.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	msg := errorMessage(body)
	var kind error
	switch code := resp.StatusCode; {
	case code == http.StatusRequestTimeout:
		kind = ErrTimeout
	case code == http.StatusTooManyRequests:
		kind = ErrUnavailable
	case code == http.StatusBadRequest || code == http.StatusRequestEntityTooLarge || code == http.StatusUnprocessableEntity:
		// The service refused the request itself: the client's fault.
		kind = ErrBadRequest
	default:
		kind = ErrUpstream
	}
	return fmt.Errorf("%w: %s: status %d: %q", kind, path, resp.StatusCode, msg)
}

// errorMessage extracts the message of an OpenAI-style error body
// ({"error": {"message": ...}} or {"message": ...}), else an excerpt of the body.
func errorMessage(body []byte) string {
	var e struct {
		Message string `json:"message"`
		Error   struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil {
		if e.Error.Message != "" {
			return excerpt([]byte(e.Error.Message))
		}
		if e.Message != "" {
			return excerpt([]byte(e.Message))
		}
	}
	return excerpt(body)
}

// Answer buffers are pooled; one larger than maxPooled is dropped after use.
const maxPooled = 1 << 20

var bufPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

func getBuffer() *bytes.Buffer { return bufPool.Get().(*bytes.Buffer) }

func putBuffer(b *bytes.Buffer) {
	if b.Cap() > maxPooled {
		return
	}
	b.Reset()
	bufPool.Put(b)
}
