package demofleet

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

// DriveOptions tune Drive.
type DriveOptions struct {
	// Concurrency is the number of requests in flight (> 0).
	Concurrency int
	// Endpoints are the workers' endpoints, in the order reports list them
	// (Result.Endpoints).
	Endpoints []string
}

// Result is what one Drive saw, as a client behind the gateway sees it.
type Result struct {
	Requests, Failed int
	FirstFailure     string // the first failed request: its error or status and body
	// PromptTokens and CachedTokens sum the engines' usage reports.
	PromptTokens, CachedTokens int
	TTFTs                      []float64 // ms from sending a request to its first streamed byte
	ITLs                       []float64 // ms between two streamed tokens of a request, as the client read them
	PerEndpoint                map[string]int
	// PerPrefiller counts the requests whose x-prefiller-host-port named
	// each prefill endpoint (disaggregated serving).
	PerPrefiller map[string]int
	// Requests whose decision named no prefill worker: every request of an
	// aggregated run; in a disaggregated one, those its decode worker
	// prefilled itself. PerUnpaired counts them per endpoint, UnpairedShort
	// the short prompts (Request.Short) among them; UnpairedTTFTs are their
	// TTFTs and PairedTTFTs the others'.
	PerUnpaired                map[string]int
	UnpairedShort              int
	UnpairedTTFTs, PairedTTFTs []float64
	Endpoints                  []string // DriveOptions.Endpoints
}

// HitRate is the engines' prefix-cache hit rate over the run: cached over
// prompt tokens, as their usage reports said.
func (r Result) HitRate() float64 {
	if r.PromptTokens == 0 {
		return 0
	}
	return float64(r.CachedTokens) / float64(r.PromptTokens)
}

// Unpaired counts the requests whose decision named no prefill worker.
func (r Result) Unpaired() int {
	n := 0
	for _, c := range r.PerUnpaired {
		n += c
	}
	return n
}

// Drive sends the workload through server (over a loopback gRPC connection,
// as Envoy would, with the ext_proc driver of extproctest forwarding each
// request to the destination the server chose), o.Concurrency at a time, and
// collects what the engines answer. A request's TTFT runs from the moment the
// driver sends it to the EPP to the first byte of the streamed answer, as a
// client behind the gateway sees it (routing and tokenization included). It
// returns once every request is done, with ctx's error if ctx ended first.
func Drive(ctx context.Context, server *extproc.Server, workload []Request, o DriveOptions) (Result, error) {
	if server == nil || o.Concurrency <= 0 {
		return Result{}, errors.New("demofleet: Drive needs a server and a concurrency above 0")
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return Result{}, err
	}
	gs := grpc.NewServer(server.GRPCServerOptions()...)
	server.Register(gs)
	served := make(chan struct{})
	go func() { defer close(served); _ = gs.Serve(lis) }()
	defer func() { gs.Stop(); <-served }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return Result{}, err
	}
	defer conn.Close()
	client, err := extproctest.NewClient(conn, extproctest.Options{})
	if err != nil {
		return Result{}, err
	}
	httpc := &http.Client{Timeout: 30 * time.Second}
	defer httpc.CloseIdleConnections()

	res := Result{PerEndpoint: map[string]int{}, PerPrefiller: map[string]int{}, PerUnpaired: map[string]int{}, Endpoints: o.Endpoints}
	var mu sync.Mutex
	next := atomic.Int64{}
	var wg sync.WaitGroup
	for range o.Concurrency {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= len(workload) || ctx.Err() != nil {
					return
				}
				var body *streamClock
				forward := func(_ string, req *http.Request) (*http.Response, error) {
					resp, err := httpc.Do(req)
					if err == nil {
						body = &streamClock{ReadCloser: resp.Body}
						resp.Body = body
					}
					return resp, err
				}
				hdr := http.Header{"Content-Type": {"application/json"}}
				sent := time.Now()
				resp, err := client.Roundtrip(ctx, extproctest.HTTPRequest{Path: "/v1/chat/completions", Headers: hdr, Body: workload[i].Body}, forward)
				mu.Lock()
				res.record(i, workload[i], sent, body, resp, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return res, ctx.Err()
}

// record adds request i's outcome; the caller holds the lock.
func (res *Result) record(i int, req Request, sent time.Time, body *streamClock, resp extproctest.Response, err error) {
	res.Requests++
	if err != nil || resp.StatusCode != http.StatusOK {
		res.Failed++
		if res.FirstFailure == "" {
			res.FirstFailure = fmt.Sprintf("request %d: status %d, %.200q, err %v", i, resp.StatusCode, resp.Body, err)
		}
		return
	}
	res.PerEndpoint[resp.Served]++
	paired := resp.Decision.Prefiller != ""
	if paired {
		res.PerPrefiller[resp.Decision.Prefiller]++
	} else {
		res.PerUnpaired[resp.Served]++
		if req.Short {
			res.UnpairedShort++
		}
	}
	p, c := usageOf(resp.Body)
	res.PromptTokens += p
	res.CachedTokens += c
	if body == nil || body.first.IsZero() {
		return
	}
	ttft := ms(body.first.Sub(sent))
	res.TTFTs = append(res.TTFTs, ttft)
	if paired {
		res.PairedTTFTs = append(res.PairedTTFTs, ttft)
	} else {
		res.UnpairedTTFTs = append(res.UnpairedTTFTs, ttft)
	}
	for k := 1; k < len(body.tokens); k++ {
		res.ITLs = append(res.ITLs, ms(body.tokens[k].Sub(body.tokens[k-1])))
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// streamClock is an upstream response body that notes when its first byte
// arrived and when each streamed token did (a server-sent event whose choices
// carry text). Roundtrip reads it on the calling goroutine, before it returns.
type streamClock struct {
	io.ReadCloser
	first   time.Time
	tokens  []time.Time
	pending []byte // the start of an event not complete yet
}

func (b *streamClock) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n == 0 {
		return n, err
	}
	now := time.Now()
	if b.first.IsZero() {
		b.first = now
	}
	b.pending = append(b.pending, p[:n]...)
	for {
		end := bytes.Index(b.pending, []byte("\n\n"))
		if end < 0 {
			break
		}
		if isTokenEvent(b.pending[:end]) {
			b.tokens = append(b.tokens, now)
		}
		b.pending = b.pending[end+2:]
	}
	return n, err
}

// isTokenEvent reports whether a server-sent event is a completion chunk with
// generated text (not the role chunk, the usage chunk or the end marker).
func isTokenEvent(ev []byte) bool {
	data, ok := bytes.CutPrefix(bytes.TrimSpace(ev), []byte("data:"))
	if !ok {
		return false
	}
	var chunk struct {
		Choices []struct {
			Text  string `json:"text"`
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
		} `json:"choices"`
	}
	if json.Unmarshal(bytes.TrimSpace(data), &chunk) != nil {
		return false
	}
	for _, c := range chunk.Choices {
		if c.Text != "" || c.Delta.Content != "" {
			return true
		}
	}
	return false
}

// usageOf reads prompt and cached tokens from an OpenAI answer's usage block:
// the last SSE chunk that has one (stream_options.include_usage), or the JSON
// body of an answer that did not stream.
func usageOf(body []byte) (prompt, cached int) {
	type usage struct {
		Usage *struct {
			PromptTokens  int `json:"prompt_tokens"`
			PromptDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	read := func(b []byte) bool {
		var u usage
		if json.Unmarshal(b, &u) != nil || u.Usage == nil {
			return false
		}
		prompt, cached = u.Usage.PromptTokens, u.Usage.PromptDetails.CachedTokens
		return true
	}
	streamed := false
	for line := range bytes.Lines(body) {
		if data, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte("data:")); ok {
			streamed = true
			read(bytes.TrimSpace(data))
		}
	}
	if !streamed {
		read(body)
	}
	return prompt, cached
}

// Percentile is the p-quantile (0 <= p <= 1) of v, by rank; 0 for no values.
func Percentile(v []float64, p float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

// HitRate is the prefix-cache hit rate the engines counted: cached over
// prompt tokens, summed over sts.
func HitRate(sts []fakeengine.HTTPStats) float64 {
	var prompt, cached uint64
	for _, s := range sts {
		prompt += s.PromptTokens
		cached += s.CachedTokens
	}
	if prompt == 0 {
		return 0
	}
	return float64(cached) / float64(prompt)
}

// WaitFor calls check every 2 ms until it returns nil, and returns nil; or,
// once timeout has passed (or ctx ended), check's last error.
func WaitFor(ctx context.Context, timeout time.Duration, check func() error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		err := check()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not settled: %w", err)
		case <-t.C:
		}
	}
}
