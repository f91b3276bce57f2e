// Command replay compares routing policies by replaying a request trace against
// simulated workers with LRU prefix caches: kvselect (the real SelectionService
// fed by the simulated engines' KV events), kvselect without events, and the
// baselines round-robin, random, least-loaded and max-overlap-only.
//
// Replay a Mooncake-format JSONL trace:
//
//	go run ./examples/replay --trace FILE --workers 8 --capacity 10000
//
// or, without --trace, a synthetic shared-prefix workload (--groups,
// --prompts-per-group, --system-blocks, --question-blocks, --output-tokens,
// --rate). --common-blocks N puts N blocks shared by every request in front of
// every prompt. --sweep replays kvselect over a grid of overlap credit, prefill
// load scale and temperature. --csv writes every row to a file.
//
// --replicas 1,3 replays each kvselect policy once per value: with R router
// replicas, each with its own SelectionService and ledger, fed every engine's
// events, arrivals spread over them round-robin, and each booking and settling
// call reaching the others --sync-delay later. --no-sync adds, for every R > 1,
// a row whose replicas never hear of each other's bookings:
//
//	go run ./examples/replay --rate 12 --policies kvselect,kvselect-approx --replicas 1,3 --no-sync
//
// --seed draws the workload and the routers' random choices; --router-seed K
// draws the routers' tie-breaks again on the same workload, for medians over
// several draws where a workload is chaotic (agent loops).
//
// Each worker runs the engine model of internal/enginemodel (vLLM's scheduler:
// steps with a token budget, chunked prefill, shared decode steps):
// --max-batched-tokens, --step-base and --request-overhead shape it, and
// --slow-fraction 0.5 --slow-speed 0.5 makes half the workers twice as slow.
//
// See internal/replay for the simulation model.
package main

import (
	"cmp"
	"context"
	"encoding/csv"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/kvselect/kvselect/internal/enginemodel"
	"github.com/kvselect/kvselect/internal/replay"
	"github.com/kvselect/kvselect/internal/trace"
	"github.com/kvselect/kvselect/selection"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "replay:", err)
		os.Exit(2)
	}
}

// config is the parsed command line.
type config struct {
	inflightW  float64
	decay      float64
	tracePath  string
	blockSize  int
	skipBad    bool
	workers    int
	capacity   int
	policies   []replay.Policy
	speedup    float64
	prefill    float64
	tpot       time.Duration
	maxRunning int
	seed       uint64
	routerSeed uint64
	csvPath    string
	sweep      bool
	sweepGrid  [3][]float64 // credit, scale, temperature
	explain    bool
	parallel   int
	common     int
	replicas   []int
	syncDelay  time.Duration
	noSync     bool
	noSpread   bool
	hold       bool
	batch      int
	growth     bool
	decodeKV   bool
	// the engine model's step budget, fixed costs and slow workers
	batched   int
	stepBase  time.Duration
	overhead  time.Duration
	slowFrac  float64
	slowSpeed float64

	synth trace.SharedPrefixConfig
	// workload is the generator when not the shared-prefix one (its flags:
	// --requests, --rate, --output-tokens, --seed).
	workload trace.Workload
	requests int

	credit, scale, temperature, reqWeight float64
	// the cost function, and the predictive cost's weights and fixed rate
	cost                                        selection.CostModel
	backlogWeight, decodeWeight, evictionWeight float64
	saturationGrowth                            float64
	balanceWeight, balanceSlack                 float64
	balanceWindow                               time.Duration
	fixedRate                                   bool
}

func parse(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var policies, sweepCredit, sweepScale, sweepTemp, replicas string
	var seed, routerSeed int64
	fs.StringVar(&c.tracePath, "trace", "", "Mooncake-format JSONL trace (default: a synthetic shared-prefix workload)")
	fs.IntVar(&c.blockSize, "block-size", trace.DefaultBlockSize, "tokens per trace block")
	fs.BoolVar(&c.skipBad, "skip-bad", false, "skip malformed trace lines instead of failing")
	fs.IntVar(&c.workers, "workers", 8, "simulated workers")
	fs.IntVar(&c.capacity, "capacity", 10_000, "prefix-cache capacity per worker, in trace blocks")
	fs.StringVar(&policies, "policies", "all", "comma-separated policies, or all: "+policyNames())
	fs.Float64Var(&c.speedup, "speedup", 1, "divide arrival times by this factor")
	fs.Float64Var(&c.prefill, "prefill-rate", replay.DefaultPrefillTokensPerSecond, "prefill speed per worker, uncached tokens per second")
	fs.DurationVar(&c.tpot, "tpot", replay.DefaultDecodeTokenTime, "decode time per output token of a request decoding alone: the engine step's fixed cost plus one decoding request's (0s for none)")
	fs.DurationVar(&c.stepBase, "step-base", 0, "the part of --tpot every engine step costs whatever it holds; each decoding request adds the rest (0 = all of --tpot)")
	fs.IntVar(&c.maxRunning, "max-running", replay.DefaultMaxRunning, "requests a worker runs at once (vLLM's max_num_seqs); more wait at the worker")
	fs.IntVar(&c.batched, "max-batched-tokens", enginemodel.DefaultMaxBatchedTokens, "tokens an engine step computes at most (vLLM's max_num_batched_tokens): longer prompts are prefilled over several steps")
	fs.DurationVar(&c.overhead, "request-overhead", 0, "fixed time from a request's arrival at its worker to the moment the engine can schedule it (HTTP, tokenization)")
	fs.Float64Var(&c.slowFrac, "slow-fraction", 0, "share of the workers that are slow (the last ones), rounded to a whole number")
	fs.Float64Var(&c.slowSpeed, "slow-speed", 0.5, "with --slow-fraction: the slow workers' speed (0.5 = twice as slow)")
	fs.Int64Var(&seed, "seed", 1, "seed of every random choice")
	fs.Int64Var(&routerSeed, "router-seed", 0, "another draw of the routers' random choices (tie-breaks) on the same workload; 0: what --seed alone draws")
	fs.StringVar(&c.csvPath, "csv", "", "also write the results as CSV to this file")
	fs.BoolVar(&c.explain, "explain", false, "break down which kvselect cost terms pulled requests away from their cached prefix")
	fs.BoolVar(&c.sweep, "sweep", false, "replay kvselect over a grid of overlap credit x prefill load scale x temperature")
	fs.StringVar(&sweepCredit, "sweep-credit", "0.5,1,2,4", "--sweep: overlap credits")
	fs.StringVar(&sweepScale, "sweep-scale", "0.5,1,2,4", "--sweep: prefill load scales")
	fs.StringVar(&sweepTemp, "sweep-temperature", "0,0.1", "--sweep: temperatures")
	fs.IntVar(&c.parallel, "parallel", runtime.GOMAXPROCS(0), "replays to run at once")
	fs.IntVar(&c.common, "common-blocks", 0, "prepend this many blocks shared by every request (every request shares block 0)")
	fs.StringVar(&replicas, "replicas", "1", "kvselect: comma-separated router replica counts, one row each (e.g. 1,3); arrivals go to the replicas round-robin")
	fs.DurationVar(&c.syncDelay, "sync-delay", replay.DefaultSyncDelay, "kvselect with replicas: how long a booking or settling call takes to reach the other replicas, in simulated time (0 = at once)")
	fs.BoolVar(&c.noSync, "no-sync", false, "kvselect with replicas: also replay every --replicas value above 1 without sync (the baseline)")
	fs.BoolVar(&c.hold, "hold", false, "kvselect with replicas: also replay every --replicas value above 1 synced and holding a burst's requests until the peers ahead have booked theirs (selection.Peers.Hold)")
	fs.BoolVar(&c.noSpread, "no-spread", false, "kvselect with replicas: also replay every --replicas value above 1 synced but without pricing the peers' same-instant bookings (the herding baseline)")
	fs.IntVar(&c.batch, "batch", 0, "give arrivals same-instant batches of this many requests, each at its batch's first arrival (bursts a gateway spreads over its replicas; 0 or 1: as generated)")
	fs.BoolVar(&c.decodeKV, "decode-holds-kv", false, "engines: a running request's generated tokens take prefix-cache space until it finishes (one block per block of output), as in vLLM")
	fs.BoolVar(&c.growth, "output-growth", false, "kvselect: also replay each kvselect row with output growth (bookings grow one block per block of generated tokens), one row each")

	var workload string
	fs.StringVar(&workload, "workload", string(trace.WorkloadSharedPrefix), "synthetic workload: "+workloadNames()+" (shared-prefix takes --groups and the other shared-prefix flags; the others --requests, --rate, --output-tokens)")
	fs.IntVar(&c.requests, "requests", 1024, "synthetic workloads other than shared-prefix: about this many requests")
	fs.IntVar(&c.synth.Groups, "groups", 64, "synthetic: prefix groups")
	fs.IntVar(&c.synth.PromptsPerGroup, "prompts-per-group", 16, "synthetic: prompts per group")
	fs.IntVar(&c.synth.SystemBlocks, "system-blocks", 16, "synthetic: blocks of each group's system prompt")
	fs.IntVar(&c.synth.QuestionBlocks, "question-blocks", 2, "synthetic: blocks of each prompt's own question")
	fs.IntVar(&c.synth.OutputTokens, "output-tokens", 200, "synthetic: output tokens per request")
	fs.Float64Var(&c.synth.Rate, "rate", 4, "synthetic: mean arrivals per second (Poisson); 0 = all at once")

	def := selection.DefaultConfig(1)
	fs.Float64Var(&c.credit, "overlap-credit", def.OverlapScoreCredit, "kvselect: prefill blocks saved per cached block")
	fs.Float64Var(&c.scale, "prefill-scale", def.PrefillLoadScale, "kvselect: weight of the prefill term")
	fs.Float64Var(&c.temperature, "temperature", def.Temperature, "kvselect: softmax temperature (0 = argmin)")
	fs.Float64Var(&c.decay, "credit-decay", def.OverlapCreditDecay, "kvselect: overlap credit decay with a worker's queued prefill (Dynamo's overlap_score_credit_decay; 0 = off)")
	fs.Float64Var(&c.inflightW, "inflight-weight", def.InFlightHitWeight, "kvselect: credit for the prefix blocks in-flight requests are computing on a worker, as a fraction of a cached block")
	fs.Float64Var(&c.reqWeight, "active-request-weight", def.DecodeActiveRequestWeight, "kvselect: block-equivalent cost per active request")

	var costName string
	fs.StringVar(&costName, "cost", def.Cost.String(), "kvselect: cost function, dynamo, predictive (predicted time to first token) or auto (predictive below 128 ranks)")
	fs.Float64Var(&c.balanceWeight, "balance-weight", def.Predictive.BalanceWeight, "kvselect --cost predictive: what a worker's cost gains per unit of its share of recent requests above the mean and the slack, in times to prefill the mean prompt (0 = off)")
	fs.Float64Var(&c.balanceSlack, "balance-slack", def.Predictive.BalanceSlack, "kvselect --cost predictive: share of recent requests above the mean that costs nothing")
	fs.DurationVar(&c.balanceWindow, "balance-window", def.Predictive.BalanceWindow, "kvselect --cost predictive: time constant over which recent requests decay")
	fs.Float64Var(&c.decodeWeight, "decode-weight", def.Predictive.DecodeWeight, "kvselect --cost predictive: cost of an active block, in blocks of prefill time")
	fs.Float64Var(&c.backlogWeight, "backlog-weight", def.Predictive.BacklogWeight, "kvselect --cost predictive: extra weight of a request's own uncached prefill (the time it adds to the requests queued behind it)")
	fs.Float64Var(&c.saturationGrowth, "saturation-growth", def.Predictive.SaturationGrowth, "kvselect --cost predictive: on a saturated fleet (more than 4 mean prompts queued per worker), how much of itself the backlog weight grows per mean prompt queued beyond that (0 = off)")
	fs.Float64Var(&c.evictionWeight, "eviction-weight", def.Predictive.EvictionWeight, "kvselect --cost predictive: extra weight of a request's uncached prefill on a worker whose cache runs full, times its cache pressure")
	fs.BoolVar(&c.fixedRate, "fixed-rate", false, "kvselect --cost predictive: use --prefill-rate for every worker instead of learning each one's rate")

	err := fs.Parse(args)
	if err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	if c.cost, err = selection.ParseCostModel(costName); err != nil {
		bad("--cost %q: want dynamo, predictive or auto", costName)
	} else if (c.explain || c.sweep) && c.cost != selection.CostDynamo {
		bad("--explain and --sweep break down and vary Dynamo's cost (its overlap credit and prefill scale): add --cost dynamo")
	}
	if c.blockSize <= 0 {
		bad("--block-size %d: want > 0", c.blockSize)
	}
	if c.workers <= 0 {
		bad("--workers %d: want > 0", c.workers)
	}
	if c.capacity <= 0 {
		bad("--capacity %d: want > 0", c.capacity)
	}
	if !(c.speedup > 0) || c.speedup > 1e9 {
		bad("--speedup %v: want a value > 0", c.speedup)
	}
	if !(c.prefill > 0) || c.prefill > 1e15 {
		bad("--prefill-rate %v: want a value > 0", c.prefill)
	}
	if c.tpot < 0 {
		bad("--tpot %v: want >= 0", c.tpot)
	}
	if c.maxRunning <= 0 {
		bad("--max-running %d: want > 0", c.maxRunning)
	}
	if c.batched < c.maxRunning {
		bad("--max-batched-tokens %d: want >= --max-running %d", c.batched, c.maxRunning)
	}
	if c.stepBase < 0 || c.stepBase > c.tpot {
		bad("--step-base %v: want between 0 and --tpot %v", c.stepBase, c.tpot)
	}
	if c.overhead < 0 {
		bad("--request-overhead %v: want >= 0", c.overhead)
	}
	if !(c.slowFrac >= 0 && c.slowFrac <= 1) {
		bad("--slow-fraction %v: want a value in [0, 1]", c.slowFrac)
	}
	if !(c.slowSpeed > 0) || math.IsInf(c.slowSpeed, 0) {
		bad("--slow-speed %v: want a value > 0", c.slowSpeed)
	}
	if c.parallel <= 0 {
		bad("--parallel %d: want > 0", c.parallel)
	}
	if c.common < 0 {
		bad("--common-blocks %d: want >= 0", c.common)
	}
	if seed < 0 {
		bad("--seed %d: want >= 0", seed)
	}
	if routerSeed < 0 {
		bad("--router-seed %d: want >= 0", routerSeed)
	}
	if c.syncDelay < 0 {
		bad("--sync-delay %v: want >= 0", c.syncDelay)
	}
	if c.replicas, err = parseReplicas(replicas); err != nil {
		bad("--replicas: %w", err)
	} else if c.noSync && slices.Max(c.replicas) == 1 {
		bad("--no-sync needs a --replicas value above 1")
	} else if c.noSpread && slices.Max(c.replicas) == 1 {
		bad("--no-spread needs a --replicas value above 1")
	} else if c.hold && slices.Max(c.replicas) == 1 {
		bad("--hold needs a --replicas value above 1")
	}
	if c.batch < 0 || c.batch > 1<<16 {
		bad("--batch %d: want 0 to %d", c.batch, 1<<16)
	}
	c.seed, c.routerSeed = uint64(seed), uint64(routerSeed)
	c.synth.Seed = c.seed
	c.synth.BlockSize = c.blockSize
	if w, err := trace.ParseWorkload(workload); err != nil {
		bad("--workload: %w", err)
	} else {
		c.workload = w
	}
	if c.tracePath != "" {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		for _, n := range []string{"groups", "prompts-per-group", "system-blocks", "question-blocks", "output-tokens", "rate"} {
			if set[n] {
				bad("--%s applies to synthetic mode only (drop --trace or the flag)", n)
			}
		}
	}
	if policies == "all" || policies == "" {
		c.policies = replay.Policies()
	} else {
		for _, name := range strings.Split(policies, ",") {
			p, err := replay.ParsePolicy(strings.TrimSpace(name))
			if err != nil {
				errs = append(errs, fmt.Errorf("--policies: %w", err))
				continue
			}
			c.policies = append(c.policies, p)
		}
	}
	cfg := c.selectionConfig(c.credit, c.scale, c.temperature)
	if err := cfg.Validate(); err != nil {
		bad("kvselect knobs: %w", err)
	}
	for i, l := range []struct{ name, list string }{{"sweep-credit", sweepCredit}, {"sweep-scale", sweepScale}, {"sweep-temperature", sweepTemp}} {
		vals, err := parseFloats(l.list)
		if err != nil {
			bad("--%s: %w", l.name, err)
		}
		c.sweepGrid[i] = vals
	}
	return c, errors.Join(errs...)
}

// parseReplicas parses a comma-separated list of distinct replica counts >= 1.
func parseReplicas(list string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(list, ",") {
		f = strings.TrimSpace(f)
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 || n > 1024 {
			return nil, fmt.Errorf("%q is not a replica count in [1, 1024]", f)
		}
		if slices.Contains(out, n) {
			return nil, fmt.Errorf("%d is listed twice", n)
		}
		out = append(out, n)
	}
	return out, nil
}

// parseFloats parses a comma-separated list of finite values >= 0.
func parseFloats(list string) ([]float64, error) {
	var out []float64
	for _, f := range strings.Split(list, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return nil, fmt.Errorf("%q is not a finite number >= 0", strings.TrimSpace(f))
		}
		out = append(out, v)
	}
	return out, nil
}

func workloadNames() string {
	var names []string
	for _, w := range trace.Workloads() {
		names = append(names, string(w))
	}
	return strings.Join(names, ",")
}

func policyNames() string {
	var names []string
	for _, p := range replay.Policies() {
		names = append(names, string(p))
	}
	return strings.Join(names, ",")
}

func (c config) selectionConfig(credit, scale, temperature float64) selection.Config {
	cfg := selection.DefaultConfig(1)
	cfg.OverlapScoreCredit, cfg.PrefillLoadScale, cfg.Temperature = credit, scale, temperature
	cfg.DecodeActiveRequestWeight = c.reqWeight
	cfg.InFlightHitWeight = c.inflightW
	cfg.OverlapCreditDecay = c.decay
	cfg.Cost = c.cost
	cfg.Predictive.BacklogWeight = c.backlogWeight
	cfg.Predictive.EvictionWeight = c.evictionWeight
	cfg.Predictive.SaturationGrowth = c.saturationGrowth
	cfg.Predictive.DecodeWeight = c.decodeWeight
	cfg.Predictive.BalanceWeight, cfg.Predictive.BalanceSlack, cfg.Predictive.BalanceWindow = c.balanceWeight, c.balanceSlack, c.balanceWindow
	cfg.Predictive.FixedRate = c.fixedRate
	return cfg
}

// job is one replay: a policy with its kvselect knobs and router replicas.
type job struct {
	label                      string
	policy                     replay.Policy
	credit, scale, temperature float64
	replicas                   int // 0 means 1
	noSync, noSpread, hold     bool
	growth                     bool
	res                        replay.Result
	err                        error
}

// replicated reports whether --replicas asks for more than one router.
func (c config) replicated() bool { return len(c.replicas) > 1 || c.replicas[0] > 1 }

// withReplicas expands every kvselect job into one per --replicas value (and,
// with --no-sync, one more per value above 1). Labels say R and the sync unless
// the only value is 1, so that the default table is unchanged.
func (c config) withReplicas(jobs []*job) []*job {
	if !c.replicated() {
		return jobs
	}
	var out []*job
	for _, j := range jobs {
		if j.policy != replay.KVSelect && j.policy != replay.KVSelectApprox {
			out = append(out, j)
			continue
		}
		for _, r := range c.replicas {
			rj := *j
			rj.replicas = r
			if r == 1 {
				rj.label += " R=1"
				out = append(out, &rj)
				continue
			}
			rj.label += fmt.Sprintf(" R=%d sync %v", r, c.syncDelay)
			out = append(out, &rj)
			if c.noSync {
				nj := *j
				nj.replicas, nj.noSync = r, true
				nj.label += fmt.Sprintf(" R=%d no sync", r)
				out = append(out, &nj)
			}
			if c.noSpread {
				nj := *j
				nj.replicas, nj.noSpread = r, true
				nj.label += fmt.Sprintf(" R=%d sync %v no spread", r, c.syncDelay)
				out = append(out, &nj)
			}
			if c.hold {
				hj := *j
				hj.replicas, hj.hold = r, true
				hj.label += fmt.Sprintf(" R=%d sync %v hold", r, c.syncDelay)
				out = append(out, &hj)
			}
		}
	}
	return out
}

// withGrowth adds, with --output-growth, a row with output growth after
// every kvselect row.
func (c config) withGrowth(jobs []*job) []*job {
	if !c.growth {
		return jobs
	}
	var out []*job
	for _, j := range jobs {
		out = append(out, j)
		if j.policy == replay.KVSelect || j.policy == replay.KVSelectApprox {
			gj := *j
			gj.growth = true
			gj.label += " +growth"
			out = append(out, &gj)
		}
	}
	return out
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, err := parse(args, stderr)
	if err != nil {
		return err
	}
	reqs, source, err := c.load()
	if err != nil {
		return err
	}
	sum := trace.Summarize(reqs)
	fmt.Fprintf(stdout, "trace: %s\n", source)
	fmt.Fprintf(stdout, "  %d requests over %v, %d block refs (%d distinct), mean input %.0f tokens, mean output %.0f tokens, reachable hit rate %.3f\n",
		sum.Requests, sum.Span.Round(time.Millisecond), sum.Blocks, sum.DistinctBlocks,
		float64(sum.InputTokens)/float64(max(1, sum.Requests)), float64(sum.OutputTokens)/float64(max(1, sum.Requests)), sum.ReachableHitRate)
	fmt.Fprintf(stdout, "model: %d workers x %d blocks, prefill %.0f tok/s per worker, tpot %v, max running %d, speedup %g, seed %d\n",
		c.workers, c.capacity, c.prefill, c.tpot, c.maxRunning, c.speedup, c.seed)
	if c.routerSeed != 0 {
		fmt.Fprintf(stdout, "routers: random choices drawn with router seed %d\n", c.routerSeed)
	}
	fmt.Fprintf(stdout, "engines: steps of at most %d tokens costing %v each, request overhead %v%s\n",
		c.batched, cmp.Or(c.stepBase, c.tpot), c.overhead, c.slowText())
	if c.replicated() {
		fmt.Fprintf(stdout, "replicas: kvselect with R router replicas, arrivals round-robin over them, every engine's events to each, bookings to the others after %v of simulated time\n",
			c.syncDelay)
	}
	fmt.Fprintln(stdout)

	var jobs []*job
	for _, p := range c.policies {
		jobs = append(jobs, &job{label: string(p), policy: p, credit: c.credit, scale: c.scale, temperature: c.temperature})
	}
	if c.sweep {
		for _, t := range c.sweepGrid[2] {
			for _, cr := range c.sweepGrid[0] {
				for _, sc := range c.sweepGrid[1] {
					jobs = append(jobs, &job{
						label:  fmt.Sprintf("kvselect c=%g s=%g t=%g", cr, sc, t),
						policy: replay.KVSelect, credit: cr, scale: sc, temperature: t,
					})
				}
			}
		}
	}
	jobs = c.withReplicas(jobs)
	jobs = c.withGrowth(jobs)
	start := time.Now()
	c.runAll(ctx, reqs, jobs)
	total := time.Since(start)
	for _, j := range jobs {
		if j.err != nil {
			return fmt.Errorf("%s: %w", j.label, j.err)
		}
	}
	printTable(stdout, jobs)
	if c.explain {
		printExplain(stdout, jobs)
	}
	fmt.Fprintf(stdout, "\n%d replays in %v wall (parallel %d)\n", len(jobs), total.Round(time.Millisecond), c.parallel)
	if c.csvPath != "" {
		if err := c.writeCSV(c.csvPath, jobs); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s\n", c.csvPath)
	}
	return nil
}

func (c config) load() ([]trace.Request, string, error) {
	var reqs []trace.Request
	var source string
	if c.tracePath != "" {
		f, err := os.Open(c.tracePath)
		if err != nil {
			return nil, "", err
		}
		defer f.Close()
		rd, err := trace.NewReader(f, trace.ReaderOptions{BlockSize: c.blockSize, SkipBad: c.skipBad})
		if err != nil {
			return nil, "", err
		}
		for {
			r, err := rd.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return nil, "", fmt.Errorf("%s: %w", c.tracePath, err)
			}
			reqs = append(reqs, r)
		}
		source = c.tracePath
		if n := rd.Skipped(); n > 0 {
			source += fmt.Sprintf(" (%d bad lines skipped, first: %v)", n, rd.SkippedErrors()[0])
		}
	} else if c.workload != trace.WorkloadSharedPrefix {
		var err error
		reqs, err = trace.Generate(c.workload, trace.WorkloadConfig{
			Requests: c.requests, Rate: c.synth.Rate, BlockSize: c.blockSize, OutputTokens: c.synth.OutputTokens, Seed: c.seed,
		})
		if err != nil {
			return nil, "", err
		}
		source = fmt.Sprintf("synthetic %s: about %d requests at %g req/s, mean output %d tokens", c.workload, c.requests, c.synth.Rate, c.synth.OutputTokens)
	} else {
		var err error
		if reqs, err = trace.SharedPrefix(c.synth); err != nil {
			return nil, "", err
		}
		s := c.synth
		source = fmt.Sprintf("synthetic shared prefix: %d groups x %d prompts, %d system + %d question blocks, %d output tokens, %g req/s",
			s.Groups, s.PromptsPerGroup, s.SystemBlocks, s.QuestionBlocks, s.OutputTokens, s.Rate)
	}
	if len(reqs) == 0 {
		return nil, "", errors.New("the trace has no requests")
	}
	if c.common > 0 {
		var err error
		if reqs, err = trace.PrependCommon(reqs, c.common, c.blockSize); err != nil {
			return nil, "", err
		}
		source += fmt.Sprintf(", %d common leading block(s) prepended", c.common)
	}
	if c.batch > 1 {
		trace.BatchArrivals(reqs, c.batch)
		source += fmt.Sprintf(", arrivals in same-instant batches of %d", c.batch)
	}
	return reqs, source, nil
}

func (c config) runAll(ctx context.Context, reqs []trace.Request, jobs []*job) {
	ch := make(chan *job)
	var wg sync.WaitGroup
	for range min(c.parallel, len(jobs)) {
		wg.Go(func() {
			for j := range ch {
				cfg := c.selectionConfig(j.credit, j.scale, j.temperature)
				j.res, j.err = replay.Run(ctx, reqs, j.policy, replay.Options{
					Workers: c.workers, CapacityBlocks: c.capacity, BlockSize: c.blockSize,
					Speedup: c.speedup, PrefillTokensPerSecond: c.prefill, DecodeTokenTime: tpotOption(c.tpot),
					StepBase: c.stepBase, MaxBatchedTokens: c.batched, RequestOverhead: c.overhead, Speeds: c.speeds(),
					MaxRunning: c.maxRunning, Seed: c.seed, RouterSeed: c.routerSeed, Selection: &cfg, Explain: c.explain,
					Replicas: j.replicas, SyncDelay: syncOption(c.syncDelay), NoSync: j.noSync, NoSpread: j.noSpread, Hold: j.hold, OutputGrowth: j.growth, DecodeHoldsKV: c.decodeKV,
				})
			}
		})
	}
	for _, j := range jobs {
		ch <- j
	}
	close(ch)
	wg.Wait()
}

// slowWorkers is how many workers --slow-fraction makes slow.
func (c config) slowWorkers() int { return int(math.Round(c.slowFrac * float64(c.workers))) }

// speeds are the workers' speeds: the last slowWorkers at --slow-speed, nil
// when none is slow.
func (c config) speeds() []float64 {
	n := c.slowWorkers()
	if n == 0 {
		return nil
	}
	out := make([]float64, c.workers)
	for i := range out {
		out[i] = 1
		if i >= c.workers-n {
			out[i] = c.slowSpeed
		}
	}
	return out
}

// slowText describes the slow workers for the header, "" when none is.
func (c config) slowText() string {
	if n := c.slowWorkers(); n > 0 {
		return fmt.Sprintf(", %d of %d workers at speed %g", n, c.workers, c.slowSpeed)
	}
	return ""
}

// tpotOption maps the flag (0 = no decode time) onto Options (0 = default).
func tpotOption(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// syncOption maps the flag (0 = no delay) onto Options (0 = default).
func syncOption(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

func printTable(w io.Writer, jobs []*job) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\thit\treachable\thit/reach\tbelieved\timbalance\tTTFT p50\tp90\tp99\tmakespan\twall\tdecide p50\tp99\t")
	for _, j := range jobs {
		r := j.res
		fmt.Fprintf(tw, "%s\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n",
			j.label, r.HitRate, r.ReachableHitRate, r.HitRate/r.ReachableHitRate, r.BelievedHitRate, r.Imbalance,
			secs(r.TTFTP50), secs(r.TTFTP90), secs(r.TTFTP99), secs(r.Makespan), r.Wall.Round(time.Millisecond),
			micros(r.Decision.P50), micros(r.Decision.P99))
	}
	_ = tw.Flush()
}

func printExplain(w io.Writer, jobs []*job) {
	fmt.Fprintln(w, "\nkvselect decisions that chose a shorter cached prefix than the best worker had;")
	fmt.Fprintln(w, "mean cost-term difference chosen - best, in weighted blocks (negative pulled the request away):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy	missed	of	blocks lost	prefill load	overlap credit	active blocks	new blocks	active reqs	")
	for _, j := range jobs {
		e := j.res.Explain
		if e == nil {
			continue
		}
		fmt.Fprintf(tw, "%s	%d	%d	%d	%+.1f	%+.1f	%+.1f	%+.1f	%+.1f	\n", j.label, e.Missed, e.Decisions, e.MissedBlocks,
			e.PrefillLoad, e.OverlapCredit, e.ActiveBlocks, e.NewBlocks, e.ActiveRequests)
	}
	_ = tw.Flush()
}

func secs(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', 3, 64) + "s" }

// micros is a decision time in microseconds; "-" for a policy that keeps none.
func micros(d time.Duration) string {
	if d == 0 {
		return "-"
	}
	return strconv.FormatFloat(float64(d)/float64(time.Microsecond), 'f', 1, 64) + "us"
}

func (c config) writeCSV(path string, jobs []*job) (err error) {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, f.Close()) }()
	cw := csv.NewWriter(f)
	_ = cw.Write([]string{"label", "policy", "overlap_credit", "prefill_scale", "temperature", "requests", "blocks", "hit_blocks",
		"hit_rate", "reachable_hit_rate", "believed_hit_rate", "imbalance", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
		"makespan_s", "stored_blocks", "evicted_blocks", "events", "wall_s", "per_worker", "replicas", "sync_delay_s", "remote_bookings",
		"decision_p50_us", "decision_p90_us", "decision_p99_us", "decision_max_us"})
	ff := func(v float64) string { return strconv.FormatFloat(v, 'g', 6, 64) }
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	for _, j := range jobs {
		r := j.res
		sync := ""
		if r.Replicas > 1 && !j.noSync {
			sync = ff(c.syncDelay.Seconds())
		}
		per := make([]string, len(r.PerWorker))
		for i, n := range r.PerWorker {
			per[i] = strconv.Itoa(n)
		}
		_ = cw.Write([]string{j.label, string(j.policy), ff(j.credit), ff(j.scale), ff(j.temperature),
			strconv.Itoa(r.Requests), strconv.FormatInt(r.Blocks, 10), strconv.FormatInt(r.HitBlocks, 10),
			ff(r.HitRate), ff(r.ReachableHitRate), ff(r.BelievedHitRate), ff(r.Imbalance),
			ff(r.TTFTMean.Seconds()), ff(r.TTFTP50.Seconds()), ff(r.TTFTP90.Seconds()), ff(r.TTFTP99.Seconds()),
			ff(r.Makespan.Seconds()), strconv.FormatInt(r.StoredBlocks, 10), strconv.FormatInt(r.EvictedBlocks, 10),
			strconv.FormatInt(r.Events, 10), ff(r.Wall.Seconds()), strings.Join(per, " "),
			strconv.Itoa(r.Replicas), sync, strconv.FormatInt(r.RemoteBookings, 10),
			ff(us(r.Decision.P50)), ff(us(r.Decision.P90)), ff(us(r.Decision.P99)), ff(us(r.Decision.Max))})
	}
	cw.Flush()
	return cw.Error()
}
