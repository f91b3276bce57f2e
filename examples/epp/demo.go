package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/kvindex/kvevents"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// demoOptions tune --demo.
type demoOptions struct {
	engines, requests int
	// workersFile names engines the user runs; the demo then starts no fake
	// engines, and workers holds the file's workers once runDemo has read it.
	workersFile    string
	workers        []catalog.Worker
	dialect        fakeengine.Dialect // the fake engines' KV-event dialect
	model          string             // the model requests name; default demoModel, else the workers'
	groups         int                // shared system prompts
	capacityTokens int                // each fake engine's KV cache, in tokens
	concurrency    int
	parityDelay    time.Duration // FeedTrust.ParityDelay of the kvselect runs
	tokenInterval  time.Duration // the fake engines' wait between two streamed tokens
	maxTokens      int           // each request's max_tokens; default 8
	// shortEvery > 0 makes every shortEvery-th request a short question with
	// no system prompt (the disaggregated demo); 0: none.
	shortEvery int
	seed       uint64
	logger     *slog.Logger
}

const demoModel = "demo-model"

func (o *demoOptions) defaults() {
	if o.engines <= 0 {
		o.engines = 4
	}
	if o.requests <= 0 {
		o.requests = 480
	}
	if o.groups <= 0 {
		o.groups = 3 * o.engines
	}
	if o.capacityTokens <= 0 {
		// About two and a half system prompts per engine: most of an engine's
		// share of the groups (three) fits when routing keeps groups apart,
		// while an engine that sees every group keeps evicting them.
		o.capacityTokens = 1024
	}
	if o.concurrency <= 0 {
		o.concurrency = 4
	}
	if o.maxTokens <= 0 {
		o.maxTokens = 8
	}
	if o.parityDelay <= 0 {
		o.parityDelay = 10 * time.Millisecond
	}
	if o.seed == 0 {
		o.seed = 7
		if o.workersFile != "" {
			// Engines the user runs keep their caches between demos: new prompts
			// every time, so that no run starts warm.
			o.seed = uint64(time.Now().UnixNano())
		}
	}
	if o.model == "" {
		o.model = demoModel
	}
	if o.logger == nil {
		o.logger = slog.New(slog.DiscardHandler)
	}
}

// demoResult is one policy's run.
type demoResult struct {
	policy      string
	requests    int
	failed      int
	prompt      int       // prompt tokens, from the engines' usage reports
	cached      int       // cached prompt tokens, idem
	ttfts       []float64 // ms from sending a request to its first streamed byte
	itls        []float64 // ms between two streamed tokens of a request, as the client read them
	perEndpoint map[string]int
	// perPrefiller counts the requests whose x-prefiller-host-port named each
	// prefill endpoint (disaggregated runs).
	perPrefiller map[string]int
	// Requests whose decision named no prefill worker: every request of an
	// aggregated run; in a disaggregated one, those its decode worker
	// prefilled itself. perUnpaired counts them per endpoint, unpairedShort
	// the short prompts (demoRequest.short) among them, unpairedTTFTs are
	// their TTFTs and pairedTTFTs the others'.
	perUnpaired                map[string]int
	unpairedShort              int
	unpairedTTFTs, pairedTTFTs []float64
	endpoints                  []string
	firstFailure               string // the first failed request: its error or status and body
	// engineStats are the fake engines' counters at the end of the run, in
	// endpoint order (nil with engines the user runs).
	engineStats []fakeengine.HTTPStats
	feeds       []feedRow // kvselect runs: each worker rank's KV-event feed at the end
	// engineRenders counts the render answers the fake engines gave, and
	// serviceRenders those of the separate render service (TensorRT-LLM).
	engineRenders, serviceRenders uint64
}

func (r demoResult) hitRate() float64 {
	if r.prompt == 0 {
		return 0
	}
	return float64(r.cached) / float64(r.prompt)
}

// runDemo replays a shared-prefix chat workload through the real ext_proc
// server, once routed by kvselect and once round-robin, and prints the table.
func runDemo(ctx context.Context, cfg *config, o demoOptions, out io.Writer) error {
	if cfg.Topology == "disaggregated" {
		return runDisaggregatedDemo(ctx, cfg, o, out)
	}
	o.defaults()
	if o.workersFile != "" {
		if err := o.loadWorkers(ctx, cfg); err != nil {
			return err
		}
	}
	// The configured weights (kvselect's defaults unless the environment says
	// otherwise), the same with Dynamo's default weights, with the other cost
	// function, and round-robin.
	dynamo := *cfg
	d := selection.DynamoConfig(cfg.Router.BlockSize)
	dynamo.Router.OverlapScoreCredit, dynamo.Router.PrefillLoadScale, dynamo.Router.InFlightHitWeight = d.OverlapScoreCredit, d.PrefillLoadScale, d.InFlightHitWeight
	dynamo.Router.Cost = selection.CostDynamo
	// The other cost: Dynamo's unless it is the configured one. (CostAuto
	// predicts on the demo's few workers.)
	other, otherName := *cfg, "kvselect, Dynamo's cost"
	other.Router.Cost = selection.CostDynamo
	if cfg.Router.Cost == selection.CostDynamo {
		other.Router.Cost, otherName = selection.CostPredictive, "kvselect, predictive cost"
	}
	other.OutputGrowth = other.Router.Cost == selection.CostPredictive
	runs := []struct {
		name   string
		cfg    *config
		policy string
	}{
		{"kvselect", cfg, "kvselect"},
		{"kvselect, Dynamo's weights (1, 1, no in-flight credit)", &dynamo, "kvselect"},
		{otherName, &other, "kvselect"},
		{"round-robin", cfg, "round-robin"},
	}
	var results []demoResult
	for i, r := range runs {
		res, err := demoRun(ctx, r.cfg, o, r.policy, demoWorkload(o, i))
		if err != nil {
			return fmt.Errorf("%s: %w", r.name, err)
		}
		res.policy = r.name
		results = append(results, res)
	}
	printDemo(out, results, o)
	for _, r := range results {
		if r.failed > 0 {
			return fmt.Errorf("%s: %d requests failed", r.policy, r.failed)
		}
	}
	return nil
}

// loadWorkers reads the workers file once: every run drives the same engines,
// and requests name the workers' model.
func (o *demoOptions) loadWorkers(ctx context.Context, cfg *config) error {
	st, err := discovery.NewStatic(discovery.StaticOptions{Path: o.workersFile, Defaults: discovery.Defaults{Model: demoModel, BlockSize: cfg.BlockSize}})
	if err != nil {
		return err
	}
	snap, err := firstSnapshot(ctx, st)
	if err != nil {
		return err
	}
	if len(snap.Workers) == 0 {
		return fmt.Errorf("%s names no workers", o.workersFile)
	}
	o.workers = snap.Workers
	o.model = snap.Workers[0].Model
	return nil
}

type demoRequest struct {
	body  []byte
	short bool // a short question without a system prompt (demoOptions.shortEvery)
}

// demoWorkload builds the chat requests of run number run: each of o.groups
// system prompts (a few hundred tokens, e.g. an agent's instructions) is shared
// by many users asking short questions; requests of all groups arrive
// interleaved. Every run gets the same requests, except that the system prompts
// start with the run's number, so that no run finds the previous run's prompts
// in the engines' caches (engines the user runs are not restarted between runs).
// With o.shortEvery, every shortEvery-th request is a short question of its
// own instead, without a system prompt (a chat's first turn, a quick lookup).
// Requests stream their answers, as chat clients do, so that the driver can time
// the first byte.
func demoWorkload(o demoOptions, run int) []demoRequest {
	r := rand.New(rand.NewPCG(o.seed, 1))
	words := strings.Fields("the router sends each request to the engine whose cache already holds the longest prefix of its prompt while keeping load balanced across every worker of the pool so that time to first token stays low")
	sentence := func(n int) string {
		var b strings.Builder
		for i := range n {
			if i > 0 {
				b.WriteByte(' ')
			}
			b.WriteString(words[r.IntN(len(words))])
		}
		return b.String()
	}
	systems := make([]string, o.groups)
	for g := range systems {
		systems[g] = fmt.Sprintf("Session %d. You are assistant number %d. ", run, g) + sentence(380)
	}
	reqs := make([]demoRequest, o.requests)
	for i := range reqs {
		short := o.shortEvery > 0 && i%o.shortEvery == o.shortEvery-1
		var messages []map[string]string
		if !short {
			messages = append(messages, map[string]string{"role": "system", "content": systems[r.IntN(o.groups)]})
		}
		messages = append(messages, map[string]string{"role": "user", "content": fmt.Sprintf("Question %d: ", i) + sentence(12+r.IntN(20))})
		body, _ := json.Marshal(map[string]any{
			"model":          o.model,
			"messages":       messages,
			"max_tokens":     o.maxTokens,
			"stream":         true,
			"stream_options": map[string]bool{"include_usage": true},
		})
		reqs[i] = demoRequest{body: body, short: short}
	}
	return reqs
}

// roundRobin is the baseline Picker.
type roundRobin struct {
	endpoints []string
	next      atomic.Uint64
}

func (p *roundRobin) Pick(context.Context, extproc.PickRequest) (extproc.Pick, error) {
	i := p.next.Add(1) - 1
	return extproc.Pick{Destination: p.endpoints[i%uint64(len(p.endpoints))], Settle: extproc.NopSettler{}}, nil
}

// demoRun starts the engines (fake ones unless a workers file names real
// ones), an EPP, and drives the workload through ext_proc.
func demoRun(ctx context.Context, base *config, o demoOptions, policy string, workload []demoRequest) (demoResult, error) {
	cfg := *base
	cfg.Model = o.model
	cfg.TokenizerProtocol = "vllm-render"
	// Judge the feeds often, and sample parity often and soon, so that the
	// report at the end of a few-second run covers all of it.
	cfg.Router.FeedTrust.CheckInterval = 10 * time.Millisecond
	cfg.Router.FeedTrust.ParityDelay = o.parityDelay
	cfg.Router.FeedTrust.ParityEvery = 4
	// The demo forwards requests itself (no Envoy), so engines named by host
	// (localhost:8000 in a workers file) can be routed to.
	cfg.Router.Endpoints.AllowHostnames = true
	workers := o.workers
	var engines []*fakeengine.Engine
	var renderService *fakeengine.Engine // the tokenizer, when it is not an engine
	defer func() {
		for _, e := range engines {
			_ = e.Close()
		}
	}()
	if o.workersFile != "" {
		if cfg.TokenizerURL == "" && len(workers) > 0 {
			cfg.TokenizerURL = "http://" + workers[0].Endpoint
		}
	} else {
		for i := range o.engines {
			// SleepTTFT: the engine really waits its simulated TTFT (1 ms plus
			// 20 us per uncached prompt token), so the client's clock sees cache hits.
			opts := o.dialect.Apply(fakeengine.Options{
				BlockSize: cfg.BlockSize, CapacityBlocks: o.capacityTokens / cfg.BlockSize, EnableReplay: true, EnableHTTP: true,
				Model: o.model, Topic: fmt.Sprintf("kv@127.0.0.1@%s", o.model), SleepTTFT: true,
				TokenInterval: o.tokenInterval,
			})
			if opts.PubMode != fakeengine.PubBind {
				// Engines that dial in need the EPP's bind listener and topics that
				// name each engine's port; no dialect does that yet.
				return demoResult{}, fmt.Errorf("dialect %s: engines that dial their PUB socket are not supported by the demo", o.dialect)
			}
			e, err := fakeengine.New(opts)
			if err != nil {
				return demoResult{}, err
			}
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err = e.Start(sctx)
			cancel()
			if err != nil {
				return demoResult{}, err
			}
			engines = append(engines, e)
			workers = append(workers, catalog.Worker{
				ID: fmt.Sprintf("engine-%d", i), Identity: fmt.Sprintf("fake engine %d", i), Model: o.model,
				Endpoint: e.HTTPEndpoint(), DPSize: 1, BlockSize: cfg.BlockSize,
				KVEventEndpoints: map[int]string{0: e.PubEndpoint()}, ReplayEndpoint: e.ReplayEndpoint(),
			})
		}
		cfg.TokenizerURL = "http://" + engines[0].HTTPEndpoint()
		if o.dialect == fakeengine.DialectTRTLLM {
			// TensorRT-LLM serves no tokenizer endpoint: a TRT-LLM pool takes its
			// token ids from a vLLM render service for the same model, which runs
			// without the engine (vllm launch render --model ...). A fake engine
			// that only answers HTTP plays it.
			rs, err := fakeengine.New(fakeengine.Options{BlockSize: cfg.BlockSize, EnableHTTP: true, Model: o.model})
			if err != nil {
				return demoResult{}, err
			}
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err = rs.Start(sctx)
			cancel()
			if err != nil {
				return demoResult{}, err
			}
			defer func() { _ = rs.Close() }()
			renderService = rs
			cfg.TokenizerURL = "http://" + rs.HTTPEndpoint()
		}
	}
	if len(workers) == 0 {
		return demoResult{}, errors.New("no workers")
	}
	endpoints := make([]string, len(workers))
	for i, w := range workers {
		endpoints[i] = w.Endpoint
	}
	if policy == "round-robin" { // the baseline needs no selection service
		rr, err := extproc.NewServer(extproc.Options{Picker: &roundRobin{endpoints: endpoints}, Status: statusOf, Logger: o.logger})
		if err != nil {
			return demoResult{}, err
		}
		rr.SetReady(true)
		return demoDrive(ctx, o, policy, workload, rr, endpoints)
	}
	cfg.Topology = "aggregated"
	e, err := newEPP(ctx, &cfg, o.logger, func(b *selection.SelectionServiceBuilder) {
		b.EventFeed(selection.FeedOptions{ReconnectMin: 5 * time.Millisecond, ReconnectMax: 200 * time.Millisecond})
	})
	if err != nil {
		return demoResult{}, err
	}
	defer e.close()
	e.apply(discovery.Snapshot{Workers: workers, Synced: true})
	for _, eng := range engines { // events sent before the feed subscribes are lost
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := eng.WaitSubscribed(wctx)
		cancel()
		if err != nil {
			return demoResult{}, fmt.Errorf("engine never subscribed: %w", err)
		}
	}
	res, err := demoDrive(ctx, o, policy, workload, e.server, endpoints)
	if err != nil {
		return res, err
	}
	for _, en := range engines {
		st := en.HTTPStats()
		res.engineRenders += st.Renders
		res.engineStats = append(res.engineStats, st)
	}
	if renderService != nil {
		res.serviceRenders = renderService.HTTPStats().Renders
	}
	res.feeds, err = feedReport(ctx, e.rs.Service(roles.Aggregated), cfg.Router.FeedTrust, e.withDefaults(workers))
	return res, err
}

// demoDrive sends the workload through server (over a loopback gRPC
// connection, as Envoy would) and to the engines, and collects what they report.
// A request's TTFT runs from the moment the driver sends it to the EPP to the
// first byte of the streamed answer, as a client behind the gateway sees it
// (routing and tokenization included).
func demoDrive(ctx context.Context, o demoOptions, policy string, workload []demoRequest, server *extproc.Server, endpoints []string) (demoResult, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return demoResult{}, err
	}
	gs := grpc.NewServer(server.GRPCServerOptions()...)
	server.Register(gs)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return demoResult{}, err
	}
	defer conn.Close()
	client, err := extproctest.NewClient(conn, extproctest.Options{})
	if err != nil {
		return demoResult{}, err
	}
	httpc := &http.Client{Timeout: 30 * time.Second}
	defer httpc.CloseIdleConnections()

	res := demoResult{policy: policy, perEndpoint: map[string]int{}, perPrefiller: map[string]int{}, perUnpaired: map[string]int{}, endpoints: endpoints}
	var mu sync.Mutex
	next := atomic.Int64{}
	var wg sync.WaitGroup
	for range o.concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
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
				resp, err := client.Roundtrip(ctx, extproctest.HTTPRequest{Path: "/v1/chat/completions", Headers: hdr, Body: workload[i].body}, forward)
				mu.Lock()
				res.requests++
				if err != nil || resp.StatusCode != http.StatusOK {
					res.failed++
					if res.firstFailure == "" {
						res.firstFailure = fmt.Sprintf("request %d: status %d, %.200q, err %v", i, resp.StatusCode, resp.Body, err)
					}
					mu.Unlock()
					continue
				}
				res.perEndpoint[resp.Served]++
				paired := resp.Decision.Prefiller != ""
				if paired {
					res.perPrefiller[resp.Decision.Prefiller]++
				} else {
					res.perUnpaired[resp.Served]++
					if workload[i].short {
						res.unpairedShort++
					}
				}
				p, c := usageOf(resp.Body)
				res.prompt += p
				res.cached += c
				if body != nil && !body.first.IsZero() {
					ttft := ms(body.first.Sub(sent))
					res.ttfts = append(res.ttfts, ttft)
					if paired {
						res.pairedTTFTs = append(res.pairedTTFTs, ttft)
					} else {
						res.unpairedTTFTs = append(res.unpairedTTFTs, ttft)
					}
					for k := 1; k < len(body.tokens); k++ {
						res.itls = append(res.itls, ms(body.tokens[k].Sub(body.tokens[k-1])))
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return res, ctx.Err()
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

// feedRow is one worker rank's KV-event feed at the end of a kvselect run.
type feedRow struct {
	worker string // worker id, with the rank when the worker has several
	// subscribed: the service has an event source for the rank; applied,
	// skipped, decodeErrors and lostBatches are its counters.
	subscribed   bool
	applied      uint64
	skipped      [kvevents.NumSkipReasons]uint64
	decodeErrors uint64 // batches whose envelope could not be decoded
	lostBatches  uint64 // batches known missing and not replayed
	// judged: the service judges the rank's feed (FeedTrust not Off); the
	// fields below are its FeedHealth.
	judged        bool
	state         selection.FeedState
	trusted       bool
	parity        float64 // NaN before the first sample
	paritySamples uint64
}

// feedReport waits until the service has judged the end of the run (parity
// samples of the last requests included), then reads its event counters and
// feed health, one row per worker rank.
func feedReport(ctx context.Context, svc *selection.SelectionService, trust selection.FeedTrust, workers []catalog.Worker) ([]feedRow, error) {
	if svc.FeedHealth() != nil {
		t := time.NewTimer(trust.ParityDelay + 3*trust.CheckInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-t.C:
		}
	}
	multi := map[string]bool{}
	for _, w := range workers {
		multi[w.ID] = w.DPSize > 1
	}
	var rows []feedRow
	index := map[catalog.WorkerRank]int{}
	row := func(wr catalog.WorkerRank) *feedRow {
		if i, ok := index[wr]; ok {
			return &rows[i]
		}
		name := wr.Worker
		if multi[wr.Worker] {
			name = wr.String()
		}
		index[wr] = len(rows)
		rows = append(rows, feedRow{worker: name, parity: math.NaN()})
		return &rows[len(rows)-1]
	}
	for _, st := range svc.EventStats() {
		r := row(st.Worker)
		r.subscribed = true
		r.applied, r.skipped, r.decodeErrors = st.Handler.EventsApplied, st.Handler.Skipped, st.Handler.DecodeErrors
		r.lostBatches = st.LostBatches
	}
	for _, h := range svc.FeedHealth() {
		r := row(h.Worker)
		r.judged, r.state, r.trusted = true, h.State, h.Trusted
		r.parity, r.paritySamples = h.Parity, h.ParitySamples
	}
	seen := map[string]bool{}
	for wr := range index {
		seen[wr.Worker] = true
	}
	for _, w := range workers { // workers the service follows no feed of
		if !seen[w.ID] {
			row(catalog.WorkerRank{Worker: w.ID, Rank: w.DPStart})
		}
	}
	return rows, nil
}

func firstSnapshot(ctx context.Context, src discovery.Source) (discovery.Snapshot, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	got := make(chan discovery.Snapshot, 1)
	errc := make(chan error, 1)
	go func() {
		errc <- src.Run(ctx, func(s discovery.Snapshot) {
			select {
			case got <- s:
			default:
			}
		})
	}()
	select {
	case s := <-got:
		cancel()
		<-errc
		return s, nil
	case err := <-errc:
		return discovery.Snapshot{}, err
	}
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

func percentile(v []float64, p float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

func printDemo(out io.Writer, results []demoResult, o demoOptions) {
	engines := fmt.Sprintf("%d fake engines speaking %s", len(results[0].endpoints), o.dialect)
	if o.workersFile != "" {
		engines = fmt.Sprintf("%d engines from %s", len(results[0].endpoints), o.workersFile)
	}
	fmt.Fprintf(out, "kvselect demo: %s, %d shared system prompts, %d chat requests per policy, %d in flight,\n"+
		"routed through the EPP's ext_proc server; hit rates as the engines report them, TTFTs timed by the client.\n\n",
		engines, o.groups, o.requests, o.concurrency)
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	const ttft = "TTFT (client, first byte)"
	fmt.Fprintf(tw, "policy\trequests\tfailed\tprefix-cache hit rate\t%s p50\t%s p90\trequests per worker\n", ttft, ttft)
	for _, r := range results {
		var per []string
		for _, ep := range r.endpoints {
			per = append(per, strconv.Itoa(r.perEndpoint[ep]))
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f%%\t%.1f ms\t%.1f ms\t%s\n", r.policy, r.requests, r.failed, 100*r.hitRate(),
			percentile(r.ttfts, 0.5), percentile(r.ttfts, 0.9), strings.Join(per, " / "))
	}
	_ = tw.Flush()
	rr := results[len(results)-1]
	if rr.hitRate() > 0 {
		fmt.Fprintln(out)
		for _, r := range results[:len(results)-1] {
			fmt.Fprintf(out, "%s: hit rate %.1fx round-robin's (engine-reported cached prompt tokens)\n", r.policy, r.hitRate()/rr.hitRate())
		}
	}
	printFeeds(out, results)
}

// printFeeds prints, for each kvselect run, what its selection service saw of
// every worker rank's KV events (EventStats) and how it judged the feed
// (FeedHealth).
func printFeeds(out io.Writer, results []demoResult) {
	fmt.Fprintln(out, "\nKV-event feeds at the end of each kvselect run, as its selection service saw them:")
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "policy\tworker\tevents applied\tskipped or lost\tfeed\ttrusted\tparity (samples)")
	for _, r := range results {
		for _, f := range r.feeds {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.policy, f.worker, f.appliedText(), f.lossText(), f.stateText(), f.trustedText(), f.parityText())
		}
	}
	_ = tw.Flush()
}

func (f feedRow) appliedText() string {
	if !f.subscribed {
		return "-"
	}
	return strconv.FormatUint(f.applied, 10)
}

// lossText lists the non-zero skip reasons, undecodable and lost batches.
func (f feedRow) lossText() string {
	if !f.subscribed {
		return "-"
	}
	var parts []string
	for reason, n := range f.skipped {
		if n > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", kvevents.SkipReason(reason), n))
		}
	}
	if f.decodeErrors > 0 {
		parts = append(parts, fmt.Sprintf("undecodable batches %d", f.decodeErrors))
	}
	if f.lostBatches > 0 {
		parts = append(parts, fmt.Sprintf("lost batches %d", f.lostBatches))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

func (f feedRow) stateText() string {
	switch {
	case f.judged:
		return f.state.String()
	case f.subscribed:
		return "not judged" // FeedTrust off
	default:
		return "no feed" // KV events off, or the worker names no event endpoint
	}
}

func (f feedRow) trustedText() string {
	switch {
	case !f.judged:
		return "-"
	case f.trusted:
		return "yes"
	default:
		return "no"
	}
}

func (f feedRow) parityText() string {
	if !f.judged || f.paritySamples == 0 || math.IsNaN(f.parity) {
		return "-"
	}
	return fmt.Sprintf("%.2f (%d)", f.parity, f.paritySamples)
}
