package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/eppserver"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/internal/enginemodel"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/kvindex/kvevents"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// options tune the demo.
type options struct {
	engines, requests int
	// workersFile names engines the user runs; the demo then starts no fake
	// engines, and workers holds the file's workers once runDemo has read it.
	workersFile    string
	workers        []catalog.Worker
	dialect        fakeengine.Dialect // the fake engines' KV-event dialect
	model          string             // the model requests name; default demofleet.Model, else the workers'
	groups         int                // shared system prompts
	capacityTokens int                // each fake engine's KV cache, in tokens
	concurrency    int
	parityDelay    time.Duration // FeedTrust.ParityDelay of the kvselect runs
	maxTokens      int           // each request's max_tokens; default 8
	// The fake engines' scheduler model (enginemodel): engineOverhead is
	// each request's fixed cost before it can be scheduled (0: the fake
	// engine's default, 1 ms); the last round(slowFraction x engines)
	// engines run at slowSpeed (0.5: twice as slow).
	engineOverhead          time.Duration
	slowFraction, slowSpeed float64
	// shortEvery > 0 makes every shortEvery-th request a short question with
	// no system prompt (the disaggregated demo); 0: none.
	shortEvery int
	seed       uint64
	logger     *slog.Logger
}

func (o *options) defaults() {
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
	if o.slowSpeed <= 0 {
		o.slowSpeed = 0.5
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
		o.model = demofleet.Model
	}
	if o.logger == nil {
		o.logger = slog.New(slog.DiscardHandler)
	}
}

// slowEngines is how many of n fake engines are slow.
func (o options) slowEngines(n int) int { return int(math.Round(o.slowFraction * float64(n))) }

// timing is fake engine i's (of n) scheduler model: the demo's overhead, and
// the slow speed for the last slowEngines(n).
func (o options) timing(i, n int) enginemodel.Params {
	p := enginemodel.Params{RequestOverhead: o.engineOverhead}
	if i >= n-o.slowEngines(n) {
		p.Speed = o.slowSpeed
	}
	return p
}

// engineText describes the fake engines' model for the tables' headings.
func (o options) engineText(n int) string {
	overhead := o.engineOverhead
	if overhead == 0 {
		overhead = fakeengine.DefaultTTFTBase
	}
	s := fmt.Sprintf("%v fixed per request, then vLLM-like steps (%v each, %v per uncached prompt token, %v per decoding request)",
		overhead, enginemodel.DefaultStepBase, fakeengine.DefaultPerTokenPrefill, enginemodel.DefaultDecodeSeq)
	if k := o.slowEngines(n); k > 0 {
		s += fmt.Sprintf("; %d of %d engines at speed %g", k, n, o.slowSpeed)
	}
	return s
}

// workload is the shared-prefix workload of run number run (see
// demofleet.Workload), shaped by o once its defaults are set.
func (o options) workload(run int) ([]demofleet.Request, error) {
	return demofleet.Workload(demofleet.WorkloadOptions{Requests: o.requests, Groups: o.groups, MaxTokens: o.maxTokens,
		ShortEvery: o.shortEvery, Model: o.model, Seed: o.seed}, run)
}

// result is one policy's run: what the client saw, and what the engines and
// the selection service report at its end.
type result struct {
	demofleet.Result
	policy string
	// engineStats are the fake engines' counters at the end of the run, in
	// endpoint order (nil with engines the user runs).
	engineStats []fakeengine.HTTPStats
	feeds       []feedRow // kvselect runs: each worker rank's KV-event feed at the end
	// calibration is the kvselect run's fit of its bookings' times to first
	// token at the end, and loads each rank's calibrated rate and slowness.
	calibration reservation.Calibration
	loads       []selection.WorkerLoad
	// engineRenders counts the render answers the fake engines gave, and
	// serviceRenders those of the separate render service (TensorRT-LLM).
	engineRenders, serviceRenders uint64
}

// runDemo replays a shared-prefix chat workload through the real ext_proc
// server, once routed by kvselect and once round-robin, and prints the table.
func runDemo(ctx context.Context, cfg *eppserver.Config, o options, out io.Writer) error {
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
	// Dynamo's preset for agentic workloads (its --agentic): overlap credit
	// 2, prefill load scale 4, decode active-request weight 64, Dynamo's
	// cost, no in-flight credit.
	agentic := dynamo
	agentic.Router.OverlapScoreCredit, agentic.Router.PrefillLoadScale, agentic.Router.DecodeActiveRequestWeight = 2, 4, 64
	runs := []struct {
		name   string
		cfg    *eppserver.Config
		policy string
	}{
		{"kvselect", cfg, "kvselect"},
		{"kvselect, Dynamo's weights (1, 1, no in-flight credit)", &dynamo, "kvselect"},
		{otherName, &other, "kvselect"},
		{"kvselect, Dynamo's agentic preset (2, 4, 64 per request)", &agentic, "kvselect"},
		{"round-robin", cfg, "round-robin"},
	}
	var results []result
	for i, r := range runs {
		workload, err := o.workload(i)
		if err != nil {
			return err
		}
		res, err := policyRun(ctx, r.cfg, o, r.policy, workload)
		if err != nil {
			return fmt.Errorf("%s: %w", r.name, err)
		}
		res.policy = r.name
		results = append(results, res)
	}
	printDemo(out, results, o)
	for _, r := range results {
		if r.Failed > 0 {
			return fmt.Errorf("%s: %d requests failed", r.policy, r.Failed)
		}
	}
	return nil
}

// loadWorkers reads the workers file once: every run drives the same engines,
// and requests name the workers' model.
func (o *options) loadWorkers(ctx context.Context, cfg *eppserver.Config) error {
	st, err := discovery.NewStatic(discovery.StaticOptions{Path: o.workersFile, Defaults: discovery.Defaults{Model: demofleet.Model, BlockSize: cfg.BlockSize}})
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

// firstSnapshot runs src until its first snapshot, and returns it.
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

// roundRobin is the baseline Picker.
type roundRobin struct {
	endpoints []string
	next      atomic.Uint64
}

func (p *roundRobin) Pick(context.Context, extproc.PickRequest) (extproc.Pick, error) {
	i := p.next.Add(1) - 1
	return extproc.Pick{Destination: p.endpoints[i%uint64(len(p.endpoints))], Settle: extproc.NopSettler{}}, nil
}

// policyRun starts the engines (fake ones unless a workers file names real
// ones), an EPP, and drives the workload through ext_proc.
func policyRun(ctx context.Context, base *eppserver.Config, o options, policy string, workload []demofleet.Request) (result, error) {
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
		if len(cfg.TokenizerURLs) == 0 && len(workers) > 0 {
			cfg.TokenizerURLs = []string{"http://" + workers[0].Endpoint}
		}
	} else {
		for i := range o.engines {
			// SleepTTFT: the engine runs its scheduler model in real time, so
			// the client's clock sees cache hits, queues and batching.
			opts := o.dialect.Apply(fakeengine.Options{
				BlockSize: cfg.BlockSize, CapacityBlocks: o.capacityTokens / cfg.BlockSize, EnableReplay: true, EnableHTTP: true,
				Model: o.model, Topic: fmt.Sprintf("kv@127.0.0.1@%s", o.model), SleepTTFT: true,
				Timing: o.timing(i, o.engines),
			})
			if opts.PubMode != fakeengine.PubBind {
				// Engines that dial in need the EPP's bind listener and topics that
				// name each engine's port; no dialect does that yet.
				return result{}, fmt.Errorf("dialect %s: engines that dial their PUB socket are not supported by the demo", o.dialect)
			}
			e, err := fakeengine.New(opts)
			if err != nil {
				return result{}, err
			}
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err = e.Start(sctx)
			cancel()
			if err != nil {
				return result{}, err
			}
			engines = append(engines, e)
			workers = append(workers, catalog.Worker{
				ID: fmt.Sprintf("engine-%d", i), Identity: fmt.Sprintf("fake engine %d", i), Model: o.model,
				Endpoint: e.HTTPEndpoint(), DPSize: 1, BlockSize: cfg.BlockSize,
				KVEventEndpoints: map[int]string{0: e.PubEndpoint()}, ReplayEndpoint: e.ReplayEndpoint(),
			})
		}
		cfg.TokenizerURLs = []string{"http://" + engines[0].HTTPEndpoint()}
		if o.dialect == fakeengine.DialectTRTLLM {
			// TensorRT-LLM serves no tokenizer endpoint: a TRT-LLM pool takes its
			// token ids from a vLLM render service for the same model, which runs
			// without the engine (vllm launch render --model ...). A fake engine
			// that only answers HTTP plays it.
			rs, err := fakeengine.New(fakeengine.Options{BlockSize: cfg.BlockSize, EnableHTTP: true, Model: o.model})
			if err != nil {
				return result{}, err
			}
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err = rs.Start(sctx)
			cancel()
			if err != nil {
				return result{}, err
			}
			defer func() { _ = rs.Close() }()
			renderService = rs
			cfg.TokenizerURLs = []string{"http://" + rs.HTTPEndpoint()}
		}
	}
	if len(workers) == 0 {
		return result{}, errors.New("no workers")
	}
	endpoints := make([]string, len(workers))
	for i, w := range workers {
		endpoints[i] = w.Endpoint
	}
	drive := demofleet.DriveOptions{Concurrency: o.concurrency, Endpoints: endpoints}
	if policy == "round-robin" { // the baseline needs no selection service
		rr, err := extproc.NewServer(extproc.Options{Picker: &roundRobin{endpoints: endpoints}, Logger: o.logger})
		if err != nil {
			return result{}, err
		}
		rr.SetReady(true)
		res, err := demofleet.Drive(ctx, rr, workload, drive)
		return result{Result: res, policy: policy}, err
	}
	cfg.Topology = "aggregated"
	e, err := eppserver.New(ctx, &cfg, eppserver.Options{Logger: o.logger, Configure: func(b *selection.SelectionServiceBuilder) {
		b.EventFeed(selection.FeedOptions{ReconnectMin: 5 * time.Millisecond, ReconnectMax: 200 * time.Millisecond})
	}})
	if err != nil {
		return result{}, err
	}
	defer e.Close()
	e.Apply(discovery.Snapshot{Workers: workers, Synced: true})
	for _, eng := range engines { // events sent before the feed subscribes are lost
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := eng.WaitSubscribed(wctx)
		cancel()
		if err != nil {
			return result{}, fmt.Errorf("engine never subscribed: %w", err)
		}
	}
	dr, err := demofleet.Drive(ctx, e.ExtProc(), workload, drive)
	res := result{Result: dr, policy: policy}
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
	svc := e.Service(roles.Aggregated)
	res.calibration, res.loads = svc.Stats().Calibration, svc.Loads(cfg.Model)
	res.feeds, err = feedReport(ctx, svc, cfg.Router.FeedTrust, workers)
	return res, err
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
	if svc.Events().Health() != nil {
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
		name := wr.WorkerID
		if multi[wr.WorkerID] {
			name = wr.String()
		}
		index[wr] = len(rows)
		rows = append(rows, feedRow{worker: name, parity: math.NaN()})
		return &rows[len(rows)-1]
	}
	for _, st := range svc.Events().Sources() {
		r := row(st.Worker)
		r.subscribed = true
		r.applied, r.skipped, r.decodeErrors = st.Handler.EventsApplied, st.Handler.Skipped, st.Handler.DecodeErrors
		r.lostBatches = st.LostBatches
	}
	for _, h := range svc.Events().Health() {
		r := row(h.Worker)
		r.judged, r.state, r.trusted = true, h.State, h.Trusted
		r.parity, r.paritySamples = h.Parity, h.ParitySamples
	}
	seen := map[string]bool{}
	for wr := range index {
		seen[wr.WorkerID] = true
	}
	for _, w := range workers { // workers the service follows no feed of
		if !seen[w.ID] {
			row(catalog.WorkerRank{WorkerID: w.ID, Rank: w.DPStart})
		}
	}
	return rows, nil
}

func printDemo(out io.Writer, results []result, o options) {
	engines := fmt.Sprintf("%d fake engines speaking %s", len(results[0].Endpoints), o.dialect)
	if o.workersFile != "" {
		engines = fmt.Sprintf("%d engines from %s", len(results[0].Endpoints), o.workersFile)
	}
	fmt.Fprintf(out, "kvselect demo: %s, %d shared system prompts, %d chat requests per policy, %d in flight,\n"+
		"routed through the EPP's ext_proc server; hit rates as the engines report them, TTFTs timed by the client.\n",
		engines, o.groups, o.requests, o.concurrency)
	if o.workersFile == "" {
		fmt.Fprintf(out, "Engines: %s.\n", o.engineText(len(results[0].Endpoints)))
	}
	fmt.Fprintln(out)
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	const ttft = "TTFT (client, first byte)"
	fmt.Fprintf(tw, "policy\trequests\tfailed\tprefix-cache hit rate\t%s p50\t%s p90\trequests per worker\n", ttft, ttft)
	for _, r := range results {
		var per []string
		for _, ep := range r.Endpoints {
			per = append(per, strconv.Itoa(r.PerEndpoint[ep]))
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f%%\t%.1f ms\t%.1f ms\t%s\n", r.policy, r.Requests, r.Failed, 100*r.HitRate(),
			demofleet.Percentile(r.TTFTs, 0.5), demofleet.Percentile(r.TTFTs, 0.9), strings.Join(per, " / "))
	}
	_ = tw.Flush()
	rr := results[len(results)-1]
	if rr.HitRate() > 0 {
		fmt.Fprintln(out)
		for _, r := range results[:len(results)-1] {
			fmt.Fprintf(out, "%s: hit rate %.1fx round-robin's (engine-reported cached prompt tokens)\n", r.policy, r.HitRate()/rr.HitRate())
		}
	}
	printCalibration(out, results)
	printFeeds(out, results)
}

// printCalibration prints, for each kvselect run that fitted its
// calibration (reservation.CalibrationSamples completions or more), the fit
// of its bookings' times to first token and each rank's slowness against
// it (reservation.Calibration), and whether the fit was evidence enough to
// be used.
func printCalibration(out io.Writer, results []result) {
	header := false
	for _, r := range results {
		c := r.calibration
		if c.Samples < reservation.CalibrationSamples {
			continue
		}
		if !header {
			fmt.Fprintln(out, "\nTime to first token as each kvselect run calibrated it from its bookings (the predictive cost's prices):")
			header = true
		}
		fmt.Fprintf(out, "%s: %s + %s x queued token + %s x active request + %s (+/- %s) x own token (mean error %s, %d prefills)",
			r.policy, secs(c.Overhead), secs(c.QueuedToken), secs(c.ActiveRequest), secs(c.OwnToken), secs(c.OwnTokenError), secs(c.Residual), c.Samples)
		if !c.Ready {
			fmt.Fprint(out, "; not used: the own-token price is not told from the noise, so the cost priced tokens at the configured rate")
		}
		var slow []string
		for _, l := range r.loads {
			if l.Slowness > 0 {
				slow = append(slow, fmt.Sprintf("%s %.2f", l.WorkerID, l.Slowness))
			}
		}
		if len(slow) > 0 {
			fmt.Fprintf(out, "; slowness %s", strings.Join(slow, ", "))
		}
		fmt.Fprintln(out)
	}
}

// secs renders seconds as the duration they are.
func secs(s float64) string {
	if math.IsInf(s, 0) || math.IsNaN(s) {
		return "unbounded"
	}
	return time.Duration(s * float64(time.Second)).Round(10 * time.Nanosecond).String()
}

// printFeeds prints, for each kvselect run, what its selection service saw of
// every worker rank's KV events (EventPlane.Sources) and how it judged the feed
// (FeedHealth).
func printFeeds(out io.Writer, results []result) {
	fmt.Fprintln(out, "\nKV-event feeds at the end of each kvselect run, as its selection service saw them:")
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "policy\tworker\tevents applied\tskipped or lost\tfeed\ttrusted\tparity (samples)")
	for _, r := range results {
		for _, f := range r.feeds {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.policy, f.worker, f.appliedText(), f.lossText(), f.stateText(), f.trustedText(), f.parityText())
		}
	}
	_ = tw.Flush()
	fmt.Fprint(out, feedLegend)
}

// feedLegend explains the feed table's columns.
const feedLegend = `
events applied: KV events (stored, removed, cleared) the index applied from the engine.
skipped or lost: events refused, by reason, and batches lost to gaps no replay closed ("none": all applied).
feed: healthy; silent (it spoke, then stopped while requests went there); never-heard (no batch ever:
  nothing connected, see the WARN for the cause); mis-speaking (most of its stores cannot be applied).
trusted: "yes" routes the engine on its events; "no" on the router's own recent bookings until it heals.
parity (samples): the share of a sampled request's blocks the engine stored as the router hashed them
  (1.00: the same tokenizer, chat template, block size and salt), over the samples judged.
`

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
