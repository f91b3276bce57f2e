package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
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
	"github.com/kvselect/kvselect/internal/extproctest"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/selection"
)

// demoOptions tune --demo.
type demoOptions struct {
	engines, requests int
	workersFile       string
	groups            int // shared system prompts
	capacityTokens    int // each fake engine's KV cache, in tokens
	concurrency       int
	seed              uint64
	logger            *slog.Logger
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
	if o.seed == 0 {
		o.seed = 7
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
	prompt      int // prompt tokens, from the engines' usage reports
	cached      int // cached prompt tokens, idem
	ttfts       []float64
	simulated   bool // TTFTs come from the fake engines' simulation
	perEndpoint map[string]int
	endpoints   []string
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
	o.defaults()
	workload := demoWorkload(o)
	// The configured weights (kvselect's defaults unless the environment says
	// otherwise), the same with Dynamo's default weights, and round-robin.
	dynamo := *cfg
	d := selection.DynamoConfig(cfg.Router.BlockSize)
	dynamo.Router.OverlapScoreCredit, dynamo.Router.PrefillLoadScale = d.OverlapScoreCredit, d.PrefillLoadScale
	dynamo.Router.OverlapScoreWeight = nil
	runs := []struct {
		name   string
		cfg    *config
		policy string
	}{
		{"kvselect", cfg, "kvselect"},
		{"kvselect, Dynamo's weights (1, 1)", &dynamo, "kvselect"},
		{"round-robin", cfg, "round-robin"},
	}
	var results []demoResult
	for _, r := range runs {
		res, err := demoRun(ctx, r.cfg, o, r.policy, workload)
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

type demoRequest struct {
	body []byte
}

// demoWorkload builds chat requests: each of o.groups system prompts (a few
// hundred tokens, e.g. an agent's instructions) is shared by many users asking
// short questions; requests of all groups arrive interleaved.
func demoWorkload(o demoOptions) []demoRequest {
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
		systems[g] = fmt.Sprintf("You are assistant number %d. ", g) + sentence(380)
	}
	reqs := make([]demoRequest, o.requests)
	for i := range reqs {
		g := r.IntN(o.groups)
		body, _ := json.Marshal(map[string]any{
			"model": demoModel,
			"messages": []map[string]string{
				{"role": "system", "content": systems[g]},
				{"role": "user", "content": fmt.Sprintf("Question %d: ", i) + sentence(12+r.IntN(20))},
			},
			"max_tokens": 8,
		})
		reqs[i] = demoRequest{body: body}
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
	cfg.Model = demoModel
	cfg.TokenizerProtocol = "vllm-render"
	var workers []catalog.Worker
	var engines []*fakeengine.Engine
	defer func() {
		for _, e := range engines {
			_ = e.Close()
		}
	}()
	if o.workersFile != "" {
		st, err := discovery.NewStatic(discovery.StaticOptions{Path: o.workersFile, Defaults: discovery.Defaults{Model: demoModel, BlockSize: cfg.BlockSize}})
		if err != nil {
			return demoResult{}, err
		}
		snap, err := firstSnapshot(ctx, st)
		if err != nil {
			return demoResult{}, err
		}
		workers = snap.Workers
		if cfg.TokenizerURL == "" && len(workers) > 0 {
			cfg.TokenizerURL = "http://" + workers[0].Endpoint
		}
	} else {
		for i := range o.engines {
			e, err := fakeengine.New(fakeengine.Options{
				BlockSize: cfg.BlockSize, CapacityBlocks: o.capacityTokens / cfg.BlockSize, EnableReplay: true, EnableHTTP: true,
				Model: demoModel, Topic: fmt.Sprintf("kv@127.0.0.1@%s", demoModel),
			})
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
				ID: fmt.Sprintf("engine-%d", i), Identity: fmt.Sprintf("fake engine %d", i), Model: demoModel,
				Endpoint: e.HTTPEndpoint(), DPSize: 1, BlockSize: cfg.BlockSize,
				KVEventEndpoints: map[int]string{0: e.PubEndpoint()}, ReplayEndpoint: e.ReplayEndpoint(),
			})
		}
		cfg.TokenizerURL = "http://" + engines[0].HTTPEndpoint()
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
	return demoDrive(ctx, o, policy, workload, e.server, endpoints)
}

// demoDrive sends the workload through server (over a loopback gRPC
// connection, as Envoy would) and to the engines, and collects what they report.
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

	res := demoResult{policy: policy, perEndpoint: map[string]int{}, endpoints: endpoints}
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
				hdr := http.Header{"Content-Type": {"application/json"}}
				resp, err := client.Roundtrip(ctx, extproctest.HTTPRequest{Path: "/v1/chat/completions", Headers: hdr, Body: workload[i].body}, extproctest.HTTPForward(httpc))
				mu.Lock()
				res.requests++
				if err != nil || resp.StatusCode != http.StatusOK {
					res.failed++
					mu.Unlock()
					continue
				}
				res.perEndpoint[resp.Served]++
				p, c := usageOf(resp.Body)
				res.prompt += p
				res.cached += c
				if v := resp.Header.Get(fakeengine.HeaderTTFT); v != "" || len(resp.Header[fakeengine.HeaderTTFT]) > 0 {
					if v == "" {
						v = resp.Header[fakeengine.HeaderTTFT][0]
					}
					if f, err := strconv.ParseFloat(v, 64); err == nil {
						res.ttfts = append(res.ttfts, f)
						res.simulated = true
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return res, ctx.Err()
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

// usageOf reads prompt and cached tokens from an OpenAI response's usage block.
func usageOf(body []byte) (prompt, cached int) {
	var r struct {
		Usage struct {
			PromptTokens  int `json:"prompt_tokens"`
			PromptDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(body, &r) != nil {
		return 0, 0
	}
	return r.Usage.PromptTokens, r.Usage.PromptDetails.CachedTokens
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
	fmt.Fprintf(out, "kvselect demo: %d engines, %d shared system prompts, %d chat requests per policy, %d in flight,\nrouted through the EPP's ext_proc server; hit rates and TTFTs as the engines report them.\n\n",
		len(results[0].endpoints), o.groups, o.requests, o.concurrency)
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	ttft := "TTFT"
	if results[0].simulated {
		ttft = "simulated TTFT"
	}
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
}
