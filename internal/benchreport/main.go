// Command benchreport runs the repository's benchmarks and writes
// docs/BENCHMARKS.md: every figure next to its budget (the project's performance targets),
// its in-run baseline ratio where one exists, and the machine it ran on.
//
//	go run ./internal/benchreport [-count 5] [-out docs/BENCHMARKS.md] [-jobs 0,2]
//
// It is what `make bench` runs. Each benchmark runs -count times on one core
// (-cpu 1) unless its row says otherwise; the table shows the median.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"
)

// job is one `go test -bench` invocation.
type job struct {
	pkg, pattern, benchtime, cpu string
}

// row is one line of the report.
type row struct {
	what      string
	bench     string // benchmark name without the -GOMAXPROCS suffix
	metric    string
	budget    string
	ok        func(v float64) bool // nil: informational
	baseline  string               // benchmark whose same metric is the baseline
	higherBtr bool                 // higher values are better (throughputs)
	// maxOfBaseline, when > 0, makes the row a cost ratio: the verdict is
	// value/baseline <= maxOfBaseline and the ratio column shows value/baseline.
	maxOfBaseline float64
	// minSpeedup, when > 0, makes the verdict baseline/value >= minSpeedup
	// (and ok, when set, must hold too).
	minSpeedup float64
	// asCost shows an informational ratio as value/baseline ("the cost of").
	asCost   bool
	jobIndex int
}

var jobs = []job{
	{pkg: "./kvindex", pattern: "^(BenchmarkHashPrompt|BenchmarkFindMatches|BenchmarkApplyStored|BenchmarkBlockHash)$", benchtime: "3000x", cpu: "1"},
	{pkg: "./kvindex", pattern: "^BenchmarkIndexMemory$", benchtime: "1x", cpu: "1"},
	{pkg: "./kvindex/kvevents", pattern: "^(BenchmarkDecodeBatch|BenchmarkDecodeApply)$", benchtime: "20000x", cpu: "1"},
	{pkg: "./kvindex/kvevents", pattern: "^BenchmarkFeedThroughput$", benchtime: "100000x", cpu: "2"},
	{pkg: "./selection", pattern: "^(BenchmarkSelectAndReserve|BenchmarkPredictiveCost)$", benchtime: "20000x", cpu: "1"},
	{pkg: "./selection", pattern: "^(BenchmarkSelectAndReserveParallel|BenchmarkSelectAndReserveParallelQueued)$", benchtime: "20000x", cpu: "1,2"},
	{pkg: "./selection", pattern: "^BenchmarkSelectAndReserveScaling$", benchtime: "12x", cpu: "2"},
	{pkg: "./reservation", pattern: "^(BenchmarkAppendLoads|BenchmarkBookFree|BenchmarkBookFreeFresh|BenchmarkNaiveNewBlocks)$", benchtime: "5000x", cpu: "1"},
	{pkg: "./tokenize", pattern: "^BenchmarkCachedTokenize$", benchtime: "20000x", cpu: "1"},
	{pkg: "./roles", pattern: "^(BenchmarkPairBook|BenchmarkSingleSelectAndReserve)$", benchtime: "3000x", cpu: "1"},
	{pkg: "./examples/epp/extproc", pattern: "^BenchmarkExtProcAddedLatency$", benchtime: "3000x", cpu: "2"},
	// The scale fleet (8M entries, 1,024 worker ranks) is built once per test
	// binary, so each of these two jobs builds it once for all its runs.
	{pkg: "./kvindex", pattern: "^(BenchmarkScaleFindMatches|BenchmarkScaleMemory|BenchmarkScaleDecodeApply)$", benchtime: "2000x", cpu: "1"},
	{pkg: "./kvindex", pattern: "^BenchmarkScaleRemoveWorker$", benchtime: "100x", cpu: "1"},
	// The fleets (64 to 16,384 ranks) are built once per test binary.
	{pkg: "./selection", pattern: "^BenchmarkSelectAndReserveFleet$", benchtime: "5000x", cpu: "1"},
	// Replication off and on, in one binary run (the publisher on the other core).
	{pkg: "./replica", pattern: "^BenchmarkSelectAndReserveReplicated$", benchtime: "20000x", cpu: "2"},
	{pkg: "./replica/natsbus", pattern: "^BenchmarkBookingReachesPeers$", benchtime: "500x", cpu: "2"},
	// Registering 1,000 and 10,000 workers one by one (a service built per
	// registration).
	{pkg: "./selection", pattern: "^BenchmarkRegisterWorkers$", benchtime: "9x", cpu: "1"},
	// Issue #33's workload: Dynamo's indexer harness rebuilt (the Mooncake
	// shape, 128-token blocks, 16 engines' LRU caches, ballast to 1M and 8M
	// entries), its events applied as vLLM msgpack through the real handler.
	{pkg: "./kvindex", pattern: "^BenchmarkDynamoFindMatches$", benchtime: "8192x", cpu: "1"},
	{pkg: "./kvindex", pattern: "^BenchmarkDynamoApplySources$", benchtime: "20x", cpu: "2"},
	// The fleet shapes at 8M / 1,024 and 32M / 4,096 ranks (about 2 GB, built once).
	{pkg: "./kvindex", pattern: "^BenchmarkFleetFindMatches$", benchtime: "20000x", cpu: "1"},
	// Lookups beside one engine feed's replay, on two cores.
	{pkg: "./kvindex", pattern: "^BenchmarkDynamoLookupsUnderFeed$", benchtime: "5x", cpu: "2"},
}

func le(limit float64) func(float64) bool { return func(v float64) bool { return v <= limit } }
func ge(limit float64) func(float64) bool { return func(v float64) bool { return v >= limit } }

var rows = []row{
	{what: "hash an 8k-token prompt (512 blocks of 16)", bench: "BenchmarkHashPrompt", metric: "ns/op", budget: "<= 20 us", ok: le(20_000), jobIndex: 0},
	{what: "hash an 8k-token prompt: allocations", bench: "BenchmarkHashPrompt", metric: "allocs/op", budget: "0", ok: le(0), jobIndex: 0},
	{what: "one 16-token block: one-shot XXH64 vs streaming digest", bench: "BenchmarkBlockHash/oneshot", metric: "ns/op", baseline: "BenchmarkBlockHash/digest", jobIndex: 0},
	{what: "FindMatches p50, 512 blocks, 128 workers, 1M entries", bench: "BenchmarkFindMatches/index", metric: "p50-ns", budget: "<= 30 us", ok: le(30_000), baseline: "BenchmarkFindMatches/naive", jobIndex: 0},
	{what: "FindMatches p99", bench: "BenchmarkFindMatches/index", metric: "p99-ns", baseline: "BenchmarkFindMatches/naive", jobIndex: 0},
	{what: "FindMatches allocations", bench: "BenchmarkFindMatches/index", metric: "allocs/op", budget: "0", ok: le(0), jobIndex: 0},
	{what: "apply BlockStored (16 blocks x 16 tokens) into the index", bench: "BenchmarkApplyStored", metric: "blocks/s", higherBtr: true, jobIndex: 0},
	{what: "memory per (block, worker) entry, shared-prefix fleet", bench: "BenchmarkIndexMemory/fleet", metric: "heap-B/entry", budget: "<= 100 B", ok: le(100), jobIndex: 1},
	{what: "memory per entry, worst case (no sharing)", bench: "BenchmarkIndexMemory/unshared", metric: "heap-B/entry", budget: "<= 100 B", ok: le(100), jobIndex: 1},
	{what: "decode one BlockStored batch (16x16), array form: allocations", bench: "BenchmarkDecodeBatch/array", metric: "allocs/op", budget: "0", ok: le(0), jobIndex: 2},
	{what: "decode one batch, map form (vLLM >= 0.26)", bench: "BenchmarkDecodeBatch/map", metric: "blocks/s", higherBtr: true, jobIndex: 2},
	{what: "decode + apply into the real index", bench: "BenchmarkDecodeApply/index", metric: "blocks/s", budget: ">= 3M blocks/s", ok: ge(3e6), higherBtr: true, jobIndex: 2},
	{what: "ZMQ feed end to end (1 KiB batches, loopback)", bench: "BenchmarkFeedThroughput", metric: "batches/s", budget: ">= 50k batches/s", ok: ge(50_000), higherBtr: true, jobIndex: 3},
	{what: "SelectAndReserve + Free p50, 8 workers, 2k tokens", bench: "BenchmarkSelectAndReserve/workers=8", metric: "p50-ns", jobIndex: 4},
	{what: "SelectAndReserve + Free p50, 64 workers, 2k tokens", bench: "BenchmarkSelectAndReserve/workers=64", metric: "p50-ns", budget: "<= 20 us", ok: le(20_000), jobIndex: 4},
	{what: "the same, lock-free booking vs the model lock (queueing on), 1 core", bench: "BenchmarkSelectAndReserve/workers=64", metric: "p50-ns", baseline: "BenchmarkSelectAndReserve/workers=64/queued", jobIndex: 4},
	{what: "the same with the built-in event feed and its feed checks (health, parity) vs without, 1 core", bench: "BenchmarkSelectAndReserve/workers=64/feed-checks", metric: "p50-ns", baseline: "BenchmarkSelectAndReserve/workers=64", jobIndex: 4},
	{what: "the same with the predictive cost vs Dynamo's, requests alternating between the two services, 1 core", bench: "BenchmarkPredictiveCost", metric: "predictive/dynamo", jobIndex: 4},
	{what: "SelectAndReserve + Free p50, 512 workers, 2k tokens", bench: "BenchmarkSelectAndReserve/workers=512", metric: "p50-ns", jobIndex: 4},
	{what: "SelectAndReserve + Free throughput, 64 workers, 2 goroutines vs 1 on one service (alternating phases)", bench: "BenchmarkSelectAndReserveScaling/shared", metric: "speedup-x", budget: ">= 1.3x (grows with GOMAXPROCS)", ok: ge(1.3), higherBtr: true, baseline: "BenchmarkSelectAndReserveScaling/independent", jobIndex: 6},
	{what: "the same with one service per goroutine (nothing shared: how far this machine scales)", bench: "BenchmarkSelectAndReserveScaling/independent", metric: "speedup-x", higherBtr: true, jobIndex: 6},
	{what: "SelectAndReserve + Free, 64 workers, RunParallel, 2 cores vs 1 (separate runs: machine drift shows)", bench: "BenchmarkSelectAndReserveParallel@2", metric: "ns/op", baseline: "BenchmarkSelectAndReserveParallel@1", jobIndex: 5},
	{what: "the same, lock-free booking vs the model lock (queueing on), 2 cores", bench: "BenchmarkSelectAndReserveParallel@2", metric: "ns/op", baseline: "BenchmarkSelectAndReserveParallelQueued@2", jobIndex: 5},
	{what: "ledger AppendLoads, 64 workers x 128 hashes (vs per-worker maps)", bench: "BenchmarkAppendLoads/64workers", metric: "ns/op", baseline: "BenchmarkNaiveNewBlocks", jobIndex: 7},
	{what: "ledger AppendRankLoads (resolved handles), 64 workers x 128 hashes", bench: "BenchmarkAppendLoads/64workers/resolved", metric: "ns/op", baseline: "BenchmarkAppendLoads/64workers", jobIndex: 7},
	{what: "ledger Book + Free, 64 workers, a prompt whose 64-block tail was never booked before (vs a recurring prompt)", bench: "BenchmarkBookFreeFresh", metric: "ns/op", baseline: "BenchmarkBookFree/64workers", asCost: true, jobIndex: 7},
	{what: "tokenizer cache hit (2k tokens, shared results)", bench: "BenchmarkCachedTokenize/shared/tokens=2048/body=8KiB", metric: "ns/op", budget: "<= 2 us", ok: le(2000), jobIndex: 8},
	{what: "prefill/decode pair booking (Book+Handoff+Complete) vs one SelectAndReserve", bench: "BenchmarkPairBook", metric: "ns/op", budget: "<= 2x single", baseline: "BenchmarkSingleSelectAndReserve", maxOfBaseline: 2, jobIndex: 9},
	{what: "EPP ext_proc added latency p50 vs a no-op ext_proc server (loopback, tokenizer stubbed)", bench: "BenchmarkExtProcAddedLatency", metric: "extra-p50-us", budget: "<= 250 us", ok: le(250), jobIndex: 10},
	{what: "EPP ext_proc added latency p99 vs a no-op ext_proc server", bench: "BenchmarkExtProcAddedLatency", metric: "extra-p99-us", budget: "<= 1000 us", ok: le(1000), jobIndex: 10},
	{what: "FindMatches p50, 512 blocks, 1,024 workers, 8M entries", bench: "BenchmarkScaleFindMatches/index", metric: "p50-ns", budget: "<= 30 us, >= 20x naive", ok: le(30_000), baseline: "BenchmarkScaleFindMatches/naive", minSpeedup: 20, jobIndex: 11},
	{what: "FindMatches p99, 8M entries", bench: "BenchmarkScaleFindMatches/index", metric: "p99-ns", baseline: "BenchmarkScaleFindMatches/naive", jobIndex: 11},
	{what: "FindMatches allocations, 8M entries", bench: "BenchmarkScaleFindMatches/index", metric: "allocs/op", budget: "0", ok: le(0), jobIndex: 11},
	{what: "memory per (block, worker) entry, shared-prefix fleet, 8M entries, 1,024 workers (vs the naive map of sets)", bench: "BenchmarkScaleMemory/index", metric: "heap-B/entry", budget: "<= 48 B", ok: le(48), baseline: "BenchmarkScaleMemory/naive", asCost: true, jobIndex: 11},
	{what: "building that 8M-entry index through Apply (16,384 stored runs of 512 blocks, generating their tokens included)", bench: "BenchmarkScaleMemory/index", metric: "build-s", jobIndex: 11},
	{what: "decode + apply into an index of 8M entries (vs an index holding only the chain extended)", bench: "BenchmarkScaleDecodeApply/entries=8M", metric: "blocks/s", budget: ">= 3M blocks/s", ok: ge(3e6), higherBtr: true, baseline: "BenchmarkScaleDecodeApply/entries=0", jobIndex: 11},
	{what: "decode + apply into an index of 8M entries: allocations", bench: "BenchmarkScaleDecodeApply/entries=8M", metric: "allocs/op", budget: "0", ok: le(0), jobIndex: 11},
	// A full scan would grow with the 8x entries; what grows is cache misses.
	{what: "SelectAndReserve + Free p50, 64 ranks (8 per worker), 2k tokens, default decision (the full scan below 128 ranks; vs the forced full scan)", bench: "BenchmarkSelectAndReserveFleet/ranks=64/default", metric: "p50-ns", baseline: "BenchmarkSelectAndReserveFleet/ranks=64/full-scan", jobIndex: 13},
	{what: "the same at 512 ranks (sparse decision)", bench: "BenchmarkSelectAndReserveFleet/ranks=512/default", metric: "p50-ns", baseline: "BenchmarkSelectAndReserveFleet/ranks=512/full-scan", jobIndex: 13},
	{what: "the same at 4,096 ranks", bench: "BenchmarkSelectAndReserveFleet/ranks=4096/default", metric: "p50-ns", budget: "<= 30 us", ok: le(30_000), baseline: "BenchmarkSelectAndReserveFleet/ranks=4096/full-scan", jobIndex: 13},
	{what: "the same at 16,384 ranks", bench: "BenchmarkSelectAndReserveFleet/ranks=16384/default", metric: "p50-ns", baseline: "BenchmarkSelectAndReserveFleet/ranks=16384/full-scan", jobIndex: 13},
	{what: "4,096 ranks vs 64 ranks (default decisions, requests alternating between the two fleets)", bench: "BenchmarkSelectAndReserveFleet/ranks=4096/alternating", metric: "x-ranks64", budget: "<= 2x the 64-rank figure", ok: le(2), jobIndex: 13},
	{what: "16,384 ranks vs 64 ranks (the same)", bench: "BenchmarkSelectAndReserveFleet/ranks=16384/alternating", metric: "x-ranks64", budget: "<= 3x the 64-rank figure", ok: le(3), jobIndex: 13},
	{what: "SelectAndReserve + Free at 16,384 ranks: allocations (vs the full scan)", bench: "BenchmarkSelectAndReserveFleet/ranks=16384/default", metric: "allocs/op", budget: "no more than the full scan", baseline: "BenchmarkSelectAndReserveFleet/ranks=16384/full-scan", maxOfBaseline: 1, jobIndex: 13},
	{what: "SelectAndReserve + Free with replication on (a Replicator publishing every booking and free to a bus that discards) vs off, requests alternating between the two services", bench: "BenchmarkSelectAndReserveReplicated/interleaved", metric: "on/off", budget: "<= 1.15", ok: le(1.15), jobIndex: 14},
	{what: "the same, each service in a run of its own, one after the other (wall time; noisier)", bench: "BenchmarkSelectAndReserveReplicated/on", metric: "ns/op", baseline: "BenchmarkSelectAndReserveReplicated/off", asCost: true, jobIndex: 14},
	{what: "the same in CPU time of the whole process (the publisher's encoding included)", bench: "BenchmarkSelectAndReserveReplicated/on", metric: "cpu-ns/op", baseline: "BenchmarkSelectAndReserveReplicated/off", asCost: true, jobIndex: 14},
	{what: "a booking in both peers' loads, p50, three replicas over an embedded NATS server on loopback", bench: "BenchmarkBookingReachesPeers", metric: "p50-ns", jobIndex: 15},
	{what: "the same, p99", bench: "BenchmarkBookingReachesPeers", metric: "p99-ns", jobIndex: 15},
	{what: "10,000 workers upserted one by one until the service picks among them all (vs 1,000)", bench: "BenchmarkRegisterWorkers/workers=10000", metric: "ns/op", budget: "< 2 s", ok: le(2e9), baseline: "BenchmarkRegisterWorkers/workers=1000", asCost: true, jobIndex: 16},
	{what: "the same: 10,000 workers over 1,000 (each 10,000-worker run over the last 1,000-worker run of the same binary run)", bench: "BenchmarkRegisterWorkers/workers=10000", metric: "x-workers1000", budget: "<= 12x", ok: le(12), jobIndex: 16},
	{what: "lookup p50, Dynamo-shaped workload, 1M entries (lookups alone, cache warm)", bench: "BenchmarkDynamoFindMatches/entries=1M/static", metric: "p50-ns", budget: "<= 1.2 us", ok: le(1200), jobIndex: 17},
	{what: "the same, p99", bench: "BenchmarkDynamoFindMatches/entries=1M/static", metric: "p99-ns", budget: "<= 8 us", ok: le(8000), jobIndex: 17},
	{what: "lookup p99, 1M entries, each lookup followed by its request's events (as a router sees them)", bench: "BenchmarkDynamoFindMatches/entries=1M/replay", metric: "p99-ns", budget: "<= 8 us", ok: le(8000), jobIndex: 17},
	{what: "lookup p50, Dynamo-shaped workload, 8M entries (lookups alone)", bench: "BenchmarkDynamoFindMatches/entries=8M/static", metric: "p50-ns", budget: "<= 1.2 us", ok: le(1200), jobIndex: 17},
	{what: "the same, p99", bench: "BenchmarkDynamoFindMatches/entries=8M/static", metric: "p99-ns", budget: "<= 8 us", ok: le(8000), jobIndex: 17},
	{what: "lookup p99, 8M entries, interleaved with the events", bench: "BenchmarkDynamoFindMatches/entries=8M/replay", metric: "p99-ns", budget: "<= 8 us", ok: le(8000), jobIndex: 17},
	{what: "decode + apply of the Dynamo-shaped events (128-token blocks, vLLM msgpack, Llama 3 ids) on one core", bench: "BenchmarkDynamoApplySources", metric: "blocks/s-1", budget: ">= 2M blocks/s", ok: ge(2_000_000), higherBtr: true, jobIndex: 18},
	{what: "lookup p99, 1M entries, while one feed applies the Dynamo-shaped events into the same index on the other core (vs the feed into a separate index)", bench: "BenchmarkDynamoLookupsUnderFeed/feed=shared", metric: "p99-ns", baseline: "BenchmarkDynamoLookupsUnderFeed/feed=apart", asCost: true, jobIndex: 20},
	{what: "the same, p99.9", bench: "BenchmarkDynamoLookupsUnderFeed/feed=shared", metric: "p999-ns", baseline: "BenchmarkDynamoLookupsUnderFeed/feed=apart", asCost: true, jobIndex: 20},
	{what: "applying the Dynamo-shaped events from two sources on 2 cores vs one on 1 core", bench: "BenchmarkDynamoApplySources", metric: "speedup", budget: ">= 1.7x", ok: ge(1.7), higherBtr: true, jobIndex: 18},
	{what: "the same two halves into two separate indexes sharing nothing (how far this machine scales the work)", bench: "BenchmarkDynamoApplySources", metric: "speedup-apart", higherBtr: true, jobIndex: 18},
	{what: "one shared index's speedup over the separate indexes' (what sharing costs)", bench: "BenchmarkDynamoApplySources", metric: "of-apart", higherBtr: true, jobIndex: 18},
	{what: "FindMatches p50, fleet shape, 8M entries / 1,024 ranks", bench: "BenchmarkFleetFindMatches/entries=8M/ranks=1024", metric: "p50-ns", budget: "<= 4 us", ok: le(4000), jobIndex: 19},
	{what: "FindMatches p50, fleet shape, 32M entries / 4,096 ranks", bench: "BenchmarkFleetFindMatches/entries=32M/ranks=4096", metric: "p50-ns", budget: "<= 8 us", ok: le(8000), jobIndex: 19},
	{what: "RemoveWorker p50, a rank holding 8,192 blocks, 8M entries / 1,024 workers (vs the same rank size at 1M / 128)", bench: "BenchmarkScaleRemoveWorker/entries=8M", metric: "p50-ns", budget: "<= 3x the 1M figure (8x the entries)", baseline: "BenchmarkScaleRemoveWorker/entries=1M", maxOfBaseline: 3, jobIndex: 12},
}

// results maps benchmark name (with @cpu when -cpu lists several) -> metric -> values.
type results map[string]map[string][]float64

func parse(out []byte, multiCPU bool, into results) {
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		name := f[0]
		procs := ""
		if i := strings.LastIndex(name, "-"); i > 0 {
			if _, err := strconv.Atoi(name[i+1:]); err == nil {
				procs = name[i+1:]
				name = name[:i]
			}
		}
		if multiCPU {
			if procs == "" {
				procs = "1"
			}
			name += "@" + procs
		}
		if into[name] == nil {
			into[name] = map[string][]float64{}
		}
		for i := 2; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				continue
			}
			into[name][f[i+1]] = append(into[name][f[i+1]], v)
		}
	}
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

func human(v float64, metric string) string {
	switch {
	case strings.HasSuffix(metric, "ns/op") || strings.HasSuffix(metric, "-ns"):
		switch {
		case v >= 1e6:
			return fmt.Sprintf("%.2f ms", v/1e6)
		case v >= 1e3:
			return fmt.Sprintf("%.2f us", v/1e3)
		}
		return fmt.Sprintf("%.0f ns", v)
	case strings.HasSuffix(metric, "/s") || strings.Contains(metric, "/s-"):
		switch {
		case v >= 1e6:
			return fmt.Sprintf("%.2fM %s", v/1e6, metric)
		case v >= 1e3:
			return fmt.Sprintf("%.1fk %s", v/1e3, metric)
		}
	case strings.HasSuffix(metric, "-us"):
		return fmt.Sprintf("%.0f us", v)
	}
	return fmt.Sprintf("%.4g %s", v, metric)
}

func machine() string {
	cpu := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "model name") {
				cpu = strings.TrimSpace(l[strings.Index(l, ":")+1:])
				break
			}
		}
	}
	return fmt.Sprintf("%s, %d cores, %s %s/%s", cpu, runtime.NumCPU(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

func main() {
	count := flag.Int("count", 5, "runs of each benchmark; the table shows the median")
	out := flag.String("out", "docs/BENCHMARKS.md", "report path")
	tracePath := flag.String("trace", "../shared/data/mooncake_synthetic_trace.jsonl", "Mooncake trace for the routing-quality replays")
	only := flag.String("jobs", "", "comma-separated indexes of the jobs to run (default all); the others' rows read \"not run\"")
	flag.Parse()
	run := map[int]bool{}
	for _, f := range strings.Split(*only, ",") {
		if i, err := strconv.Atoi(strings.TrimSpace(f)); err == nil {
			run[i] = true
		}
	}
	res := make([]results, len(jobs))
	var cmds []string
	for i, j := range jobs {
		res[i] = results{}
		if len(run) > 0 && !run[i] {
			continue
		}
		args := []string{"test", "-run", "^$", "-bench", j.pattern, "-benchmem", "-count", strconv.Itoa(*count), "-benchtime", j.benchtime, "-cpu", j.cpu, j.pkg}
		cmds = append(cmds, "go "+strings.Join(quoteArgs(args), " "))
		fmt.Fprintln(os.Stderr, "==", cmds[len(cmds)-1])
		cmd := exec.Command("go", args...)
		cmd.Stderr = os.Stderr
		o, err := cmd.Output()
		os.Stderr.Write(o)
		if err != nil {
			fmt.Fprintf(os.Stderr, "benchreport: %s: %v\n", j.pkg, err)
		}
		parse(o, strings.Contains(j.cpu, ","), res[i])
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Benchmarks\n\nGenerated by `make bench` (`go run ./internal/benchreport -count %d`) on %s, %s.\n", *count, time.Now().UTC().Format("2006-01-02"), machine())
	b.WriteString("Each figure is the median of the runs; budgets are the project's performance targets. Baseline ratios compare with a baseline measured in the same run (higher is better for us).\n\n")
	b.WriteString("| What | Benchmark | Median | Budget | Verdict | vs baseline |\n|---|---|---|---|---|---|\n")
	for _, r := range rows {
		vals := res[r.jobIndex][r.bench][r.metric]
		if len(vals) == 0 {
			fmt.Fprintf(&b, "| %s | `%s` | not run | %s | - | |\n", r.what, r.bench, dash(r.budget))
			continue
		}
		v := median(vals)
		verdict := "-"
		if r.ok != nil {
			verdict = "met"
			if !r.ok(v) {
				verdict = "**missed**"
			}
		}
		ratio := ""
		if base := res[r.jobIndex][r.baseline][r.metric]; r.baseline != "" && len(base) > 0 && v > 0 {
			bv := median(base)
			switch {
			case r.maxOfBaseline > 0:
				x := v / bv
				verdict = "met"
				if x > r.maxOfBaseline {
					verdict = "**missed**"
				}
				ratio = fmt.Sprintf("%.2fx the cost of `%s` (%s)", x, r.baseline, human(bv, r.metric))
			case r.minSpeedup > 0:
				x := bv / v
				verdict = "met"
				if x < r.minSpeedup || (r.ok != nil && !r.ok(v)) {
					verdict = "**missed**"
				}
				ratio = fmt.Sprintf("%.2fx faster than `%s` (%s)", x, r.baseline, human(bv, r.metric))
			case r.asCost:
				ratio = fmt.Sprintf("%.2fx the cost of `%s` (%s)", v/bv, r.baseline, human(bv, r.metric))
			case r.higherBtr:
				ratio = fmt.Sprintf("%.1fx (`%s` %s)", v/bv, r.baseline, human(bv, r.metric))
			default:
				ratio = fmt.Sprintf("%.1fx faster than `%s` (%s)", bv/v, r.baseline, human(bv, r.metric))
			}
		}
		fmt.Fprintf(&b, "| %s | `%s` | %s | %s | %s | %s |\n", r.what, r.bench, human(v, r.metric), dash(r.budget), verdict, ratio)
	}
	quality, qcmds := qualitySection(*tracePath)
	b.WriteString(quality)
	cmds = append(cmds, qcmds...)
	workloads, wcmds := workloadSection()
	b.WriteString(workloads)
	cmds = append(cmds, wcmds...)
	growth, gcmds := growthSection()
	b.WriteString(growth)
	cmds = append(cmds, gcmds...)
	b.WriteString(analysis)
	b.WriteString("\n## Reproduce\n\n```sh\n")
	for _, c := range cmds {
		b.WriteString(c + "\n")
	}
	b.WriteString("```\n")
	if err := os.WriteFile(*out, []byte(b.String()), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(1)
	}
	fmt.Fprintln(os.Stderr, "wrote", *out)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func quoteArgs(a []string) []string {
	out := make([]string, len(a))
	for i, s := range a {
		if strings.ContainsAny(s, "^$|()* ") {
			s = "'" + s + "'"
		}
		out[i] = s
	}
	return out
}

// analysis explains the budgets that were missed when this report was written,
// with the profile evidence and the plan. Keep it true when the code changes.
const analysis = `
## Analysis

**SelectAndReserve + Free at 64 workers (budget 20 us p50 on one core).** A CPU profile
(` + "`go test ./selection -run x -bench 'SelectAndReserve$/workers=64' -benchtime 100000x -cpu 1 -cpuprofile cpu.out`" + `)
splits an operation into hashing the prompt about 18%, FindMatches 13%, candidate
evaluation 27% (ledger AppendRankLoads 13%, most of it deduplicating the request's
hashes; cost function 8%), Book 11% and Free 5%. The machine is shared and noisy: single runs
of the same binary vary by 30% or more, so the median of several runs is the figure to
read, and interleaved A/B runs against the previous ledger (one lock) gave the same
single-core cost within that noise.

**Parallel scaling (2 cores vs 1).** Until 2026-11-29 throughput fell on two cores (0.7-0.9x):
one read-write lock guarded the whole ledger, and a CPU profile at -cpu 2 showed the
cores parked on it (121% CPU used of 200%). The ledger now has no ledger-wide lock on the
request path: each worker rank's load entry has its own mutex and counters that
AppendRankLoads reads atomically, the block index is split into 8 hash stripes and the id
map into 32, each with its own mutex, and stamps are per worker rank (entry and a sequence
number every Book advances), so BookAt refuses only a booking on a rank booked since its
read. At -cpu 2 the benchmark now keeps both cores busy (187% CPU).

How it is measured: ` + "`BenchmarkSelectAndReserveScaling`" + ` alternates short phases of one
goroutine and two goroutines on the same service (2000 operations each) and reports the
median ratio of their throughputs, and does the same with one service per goroutine,
which shares nothing and so shows how far this virtual, shared machine scales at all. The
older method (RunParallel at -cpu 1 and at -cpu 2, in separate runs, the informational
rows) is dominated by drift: the same binary's -cpu 1 runs range from 13 to 22 us per
operation within minutes, which alone moves that ratio between 1.2x and 1.9x. The budget
reads "scales with GOMAXPROCS"; the verdict asks for at least 1.3x on two cores, and the
ratio column shows the share of the machine's own ceiling reached. What still
serialises: bookings of one worker rank (by design), and the block stripes, whose locks
every Book, Free and candidate read takes (8 stripes scale clearly better than 4, about like 16), and
whose entries for a shared system prompt every booking of that prompt updates. The
service's statistics counters are not a factor (removing them changed nothing). In the
2026-12-07 runs the shared ratio read 0.84-0.91 (and the ZMQ feed 126-134k batches/s, not
304k) for this code and for the previous session's alike: the machine that day, not a
change.

**Idle blocks.** A freed block stays in its stripe as an idle entry and is re-activated by
the next booking of the prefix (a system prompt, the next turn of a conversation); each
stripe lists entries as they go idle and, past 2048, removes the ones still idle. The
benchmark's 128 prompts recur, so its bookings mostly re-activate; the fresh-prompt ledger
row above shows the cost when a prompt's tail is never seen again (every such block is
inserted and later removed).

**The index at fleet scale (8M entries, 1,024 worker ranks).** The scale fleet is the
1M-entry fleet with 8x the worker ranks (each holds 16 sequences of 512 blocks: a
128-block system prompt of one of 64 groups, then a unique conversation), built once per
test binary through Apply; its build time is the row above. Before this change an
entry took 77 bytes at 1M and 76 at 8M: 37 for the nodes of the unshared conversation
tails (48-byte nodes, 0.77 per entry) and 39 for the worker ranks' Go maps from engine
hash to node, which at 8,192 blocks per rank sit just after a split, under half full.
The maps are now open-addressing tables of 16-byte slots (12 since the arena, below)
that grow by half when 3/4 full (23 bytes per entry on this fleet); the nodes are
unchanged, so FindMatches walks the same structure. Event application was profiled with
` + "`go test ./kvindex -run x -bench ScaleDecodeApply -benchtime 20000x -cpu 1 -cpuprofile cpu.out`" + `:
besides decoding (about a quarter), the costs were the engine-hash Go maps (about 20%:
hashing, probing, deleting), allocating a node for every stored block and the garbage
collection it causes (about 20%, more in an 8M-node heap), a lookup of the tree-wide map
of repeated memberships on every released block (a fifth of the batch time at 8M, where
that map is not empty), and a map built to check large runs for repeated hashes.
Hashing the event tokens was 6-8%, so it was left as it is. Now a released node goes to
a bounded list that the next store reuses (0 allocations per batch, 16 before), a node's
extension counts its repeated memberships so the others skip the lookup, large runs are
checked by sorting a pooled copy, and the decoder reads uint64 hashes inline. Test
binaries of the old and the new code, run interleaved in the same minutes (medians of 3 to
5 rounds): decode + apply (` + "`BenchmarkDecodeApply/index`" + `) 3.91M -> 6.50M blocks/s (1.7x);
the scale benchmark 3.20M -> 8.11M into the small index and 2.34M -> 6.60M into the 8M one
(2.5x, 2.8x: the old code also paid for collections of the 8M-node heap); RemoveWorker
3.16 -> 1.70 ms at 8M and 1.38 -> 0.94 ms at 1M. FindMatches did not change: the original
binary and the new one both gave 4.7-4.8 us at 1M, while the old code compiled with the new
benchmark files gave 4.3 us, which is how much code placement alone moves that figure.

**Decisions at fleet scale (64 to 16,384 ranks).** A decision used to evaluate every rank
(about 0.1 us each: 0.48 ms at 16,384). Without queueing and at temperature 0 it now evaluates
one by one only the ranks the request touches (index matches, ledger holders of its blocks,
its session's pin) and takes the best of the others from the model's cost order, ranks grouped
by load point and ordered by the cost's request-independent part, which the ledger's hooks keep
current on every Book, Free, PrefillComplete, AddOutputBlocks, Move and Expire
(` + "`selection/sparse.go`" + `; the model test ` + "`TestSparseMatchesFullScan`" + ` and its fuzz target compare it
with the full scan). The fleet benchmark gives each 8-rank group its own system prompt, so a
prompt touches about 8 cached ranks and 2 ledger holders at every size, and n/4 background
bookings make the loads differ. Below 128 ranks, and for a request the index matches on more
than a quarter of the ranks, the full scan stays (the workers=N rows above, where every worker
caches every system prompt, still scan). The hooks cost the booking path a lookup of the
rank and a move between groups under the order's mutex, and no allocation.

**Lookups that return a thousand matches (32M entries, 4,096 ranks).** A lookup there
returns 686 matches on average, and a CPU profile
(` + "`go test ./kvindex -run x -bench 'FleetFindMatches/entries=32M' -benchtime 400000x -cpuprofile cpu.out`" + `)
put 70% of it in appending them: one append per match of a struct that holds a string,
each reading its worker rank from that rank's state (a cache miss per rank). The walk now
grows the result once, writes the matches in place and reads the ranks from a dense
slot-to-rank array: p50 7.98 -> 3.77 us at 32M / 4,096 ranks and 3.38 -> 2.29 us at 8M /
1,024 (same binary run, before and after).

**The interleaved lookup tail (Dynamo-shaped workload, p99 ~20 us against 8).** It is not
contention (one goroutine) nor collection (the same with GOGC=off): timing each replayed
lookup twice in a row, the first takes up to 100-300 us where the second takes about 1 us,
and a batch replaced by a write of the same number of bytes leaves it as it is (26 us).
The slow lookups are walks of a few hundred blocks whose nodes the lookups before have not
touched, at a DRAM and TLB miss each (the index is 80 MB at 1M entries, past the cache);
the static rows repeat the same 8,192 walks and keep them cached. Allocating a stored
run's new nodes next to each other (a scratch 64-node slab per tree) brought the first
replay's p99 from 17-25 us to 14 us, at 3 more bytes an entry; the arena below took it
to 8-10 us.

**Nodes in an arena: 32 bytes and no pointers.** A node was 48 bytes of which 24 were
pointers (parent, only child, extension), each one allocated by the runtime, so an 8M-entry
index was 6M objects for the collector to scan. Nodes now live in 128 KiB chunks and name
each other by 32-bit ids (the parent's id shares a word with the node's mark), so a node is
32 bytes, the chunks hold no pointer and are never scanned, and a worker rank's block map
keeps a 12-byte slot (the hash in two halves and the node's id) instead of 16. A detached
node's id is reused (a chunk's lowest free id first, from the chunk that freed last, as the
runtime's allocator does with its spans): keeping the last freed ids instead (a stack)
scattered a run's new nodes, and one core applied the Dynamo-shaped events at 1.49-1.68M
blocks/s against 1.71-1.73M, the difference in misses on each released node's parent.
A walk steps to a child whose id follows its own without reading the chunk table (98% of
the steps of the Dynamo-shaped lookups), and a
node's children, when it has more than one, are in an open-addressing table of ids (the
root's in the tree itself) rather than a Go map, and the extensions that hold such tables
live in chunks too. Same-binary-run comparisons with the code before: heap per entry 62.4 -> 44.3 bytes on the 8M fleet and 63.8 -> 45.6 on the 1M one
(` + "`BenchmarkScaleMemory`" + `, ` + "`BenchmarkIndexMemory`" + `), 78.0 -> 56.5 on the Dynamo-shaped
1M index; the 8M fleet builds in 3.25 s rather than 3.80; ` + "`BenchmarkFindMatches`" + ` p50
1.28-1.80 -> 1.16-1.20 us and p99 7.0-8.0 -> 5.2-5.6 us (five alternating runs); the fleet
p50 1.64 -> 1.49 us at 8M and 2.95 -> 2.77 us at 32M; the interleaved replay's p99, the
first replay of a fresh process, 12.6-14.5 -> 7.6-10.5 us at 1M and 14.6-23 -> 9.1-11.9 us
at 8M (three alternating runs, twice in the day); one core's decode and apply unchanged
within the day's noise (1.66-1.75M and 1.71-1.73M blocks/s). The replay rows above read
more (12.7 and 15.0 us): they are the median of six replays in one process, each after the
16 engines' caches are cleared and stored again, and a cache stored again lands in the ids
its clearing freed, among other engines' nodes, less often next to each other than in the
warm-up (10.3 us the first replay, 11.5-12.1 the next three, one process). Two feeds
sharing one index now gain 0.85-0.89 of what two separate indexes gain (0.91-0.92 before):
their new nodes interleave in the same chunks, where the runtime gave each core its own
spans. A cache-resident index pays for the ids: every node access reads the chunk
table, and ` + "`BenchmarkScaleDecodeApply`" + ` (16-block stores and removals) reads 7.6-8.3M -> 6.4-6.9M
blocks/s into the small index and 6.5-6.9M -> 5.4-5.9M into the 8M one (three alternating
runs, quiet machine); the 8M row's 3.78M above was read in a noisy phase (the old code read
4.3M in one of those runs). A cold walk still costs far more than its nodes: after evicting the caches
(256 MB written), a 300-block walk along contiguous ids takes 40-80 ns a step where the same
path copied into fresh memory takes 9, and the root's table lookup alone takes 3.6 us (4-6
as a Go map): each dependent cold miss, page walk included, costs about a microsecond on
this virtual machine, so the tail follows the number of dependent misses before the walk
streams. An index can hold ` + "`MaxNodes`" + ` (2^31 - 2) nodes; a store that could pass it is
refused with ` + "`ErrIndexFull`" + `.

**What the interleaved tail is made of (2026-12-08).** Over 8,192 replayed lookups at 1M
entries the walks take 424k steps to the node with the next id (97%), 8.9k to a child
elsewhere (12.7k and 15.3k in the replays after the first and second reset) and 10.3k
through a table of children, the root's included. The slowest 1% walk 310-350 blocks (all
lookups: 128) at about 10 ns a block, against 4-5 in the static rows. Five things were
tried against it, none kept:
- Keys beside the nodes (each chunk's keys in an array of their own, and a bit per node
  set while its only child is the next id with the same holders, so that a walk along a
  run compares keys only, eight to a cache line): 97% of the steps read only keys, and
  the p99 did not move (7.5-9.8 us against 7.6-9.0, two alternating rounds of three
  replays), at 1.8 more bytes an entry. Streaming the path is not what the tail costs.
- Never reusing an id (memory without bound; an experiment): the jumps fall to 0.7k and
  the p99 to 6.5-7.9 us against 8.6-9.6 (first round), 8.7-10.3 against 9.3-11.2 (second).
- A stored run's new nodes in consecutive ids, the first gap of 64 in the four chunks
  that last freed ids, else fresh ids while fewer than one in eight is free: 7.9k jumps
  in the first replay but 15.7k and 22.6k after the resets (p99 10.6-14.1 us), 60.8 bytes
  an entry against 56.6. Fresh ids alone (no gap search) read 8.5-9.6 us against 9.5-10.4,
  and under steady churn they run out: the free ids stay at the limit, so runs reuse them.
- The reset storing each engine's cache back as runs rather than a block an event: the
  jumps the same (8.9k, 13.2k, 15.3k, 16.9k).
- Transparent huge pages for the whole heap (733 of 757 MB in 2 MB pages): 10.0-10.7 us.
What is left is the dependent misses a layout of the path does not remove: the root's
table slot and the node it names, each branch's extension, table and child, each jump to a
reused id, at about a microsecond each on this machine; contiguity cuts the jumps only
until churn scatters the free ids again. Three ` + "`make bench`" + ` runs on 2026-12-08 read the
rows above at 8.02 / 8.31, 10.41 / 10.86 and 9.26 / 10.37 us (1M / 8M entries), the
static p99s at 2.56-3.84 us: how quiet the machine is moves them more than anything
tried here.

**Decoding a large vocabulary's token ids.** Llama 3's 128,256 ids are about half in
msgpack's 16-bit form and half in its 32-bit one, in no order a branch predictor learns:
a branch on the form is mispredicted every other id (4.8 ns an id, vocab=128256, where
` + "`BenchmarkDecodeTokens`" + ` cycles through 64 batches; 1.1 for vocab=32000, nearly all one
form). When the previous event's ids came mixed (neither form 7 in 8), the reader reads
them two at a time: the second id's form byte is at 3 or 5, both read with the first's,
and the first's form picks one by a shift, so a pair's offset waits for one load where
one id at a time waits for one load each: 2.47 -> 1.62 ns an id (2.5 was arithmetic on
the form byte, one id at a time; 0.08 of the gain is an offset no longer passed by address,
which had kept it in memory, a store and a load on every pair's chain). A byte select written as an if compiled to a branch,
not a conditional move (Go does not select 8-bit values that way), and a mask select
read 1.9: the shift is the shortest chain found.

**Two feeds on two cores.** Applying the Dynamo-shaped events from two sources on two
cores ran at 1.2-1.6x one core, where two separate indexes ran at 2.0x, and the process
used only 5-15% more CPU than one core did: the time lost was idle, not work. The
mutex-wait metric read about 1%, because it counts the time until a blocked goroutine is
made runnable, not until it runs: sync.RWMutex's Lock spins about a microsecond and then
blocks the second feed, and waking it again takes tens of microseconds on this virtual
machine, longer than the tree part it waited for. A lock that never blocks gave
1.8-1.9x; the index now tries the tree's lock for about 25 us (16,384 tries) before it
blocks: 1.79-1.91x in three alternating runs against 1.21-1.59x (1,024 tries, about
1.5 us, were not enough; 8,192 nearly). With it, a long run's repeat check using a keyed
set rather than a sort (4.5% of the apply), and the decoding above, one core applies
1.70-1.90M blocks a second and two 3.2-3.3M (1.35-1.41M and 1.9-2.2M before, in the same
alternating runs). ` + "`make bench`" + ` read the speedup at 1.773 and at 1.699 in two runs of
that day, with two separate indexes at 1.783 and 1.854: 0.93-0.94 of what the machine's
cores gave, so the row passes or misses the 1.7x by the neighbours' load (the separate
indexes read 1.6 to 2.0 within minutes); since the arena (above) it reads 1.662 against
1.99, and 1.59-1.73 against 1.90-1.99 in three runs on 2026-12-08. What sharing costs is not the lock: counting
the tries, two feeds spend 1-2 ms of a 580 ms replay spinning; keeping the locks' words on
cache lines of their own (a feed's read lock of the registry shared a line with the tree's
lock) read 1.50-1.77x against 1.59-1.77x (six alternating runs), and giving each worker
rank a chunk of its own for its new nodes 1.62-1.83x against 1.55-1.87x: neither kept.
A removal and a stored run now load their blocks' slots of the engine-hash table before
working through them (and a removal its nodes, under the lock), so those cache misses
overlap where they came one after another: ` + "`blockMap.remove`" + ` 1.35 -> 0.88 s of a 6.7 s
profile, one core 1.69M -> 1.77M blocks/s (medians of eight alternating runs),
` + "`make bench`" + ` 1.83-1.95M in three runs that day (1.88M before). A stored run then finds each hash's slot once (a new hash
is added as pending and its node written into the slot after the tree's part; the table
makes its room first, so no slot moves in between) where it probed before the tree and
again after: 1.63M -> 1.72M in six alternating runs on a noisy machine. Decoding the ids
is now 45% of a block's time (` + "`readMixedIDs`" + ` 43%);
a conditional move for the second form byte (Go compiled it to a branch: half the speed),
a big-endian window whose shift needs no mask, and pairs counted in bounds once per run
rather than checked each were tried there and read the same or slower.

Lookups met the same wake-up beside a feed (` + "`BenchmarkDynamoLookupsUnderFeed`" + `: one core
looks up the trace's requests while the other replays the write segment): p99 106 us and
p99.9 167 us when the feed applied into the index looked up, 6 us and 29 us when it applied
into a separate one. Lookups now try the read lock the same way: p99 10-11 us, p99.9 about
110 us. What is left is the longest tree parts: timed on the 1M fixture's events, a tree
part holds the lock 1.7 us at the median, 25 us at p99 (about what the tries last), 56 us
at p99.9 and up to 160 us (a stored run of hundreds of blocks holds it for the whole run,
so that a lookup never sees half an event).

`
