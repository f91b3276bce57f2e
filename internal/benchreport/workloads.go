package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/kvselect/kvselect/internal/trace"
)

// workloadPolicies are the policies of the workload sweep, kvselect first.
var workloadPolicies = []string{"kvselect", "round-robin", "least-loaded", "max-overlap-only"}

// The other kvselect rows of the sweep: Dynamo's cost with kvselect's
// weights (the defaults before issue #22), and the defaults without the
// predictive cost's balance term (burst protection off).
const (
	dynamoLabel    = "kvselect dynamo"
	noBalanceLabel = "kvselect no balance"
)

// workloadRuns are the replays of each generator and seed: the policies at
// kvselect's defaults, then kvselect with Dynamo's cost and without the
// balance term (their rows relabelled).
var workloadRuns = []struct {
	args  []string
	label string // replaces the kvselect label when set
}{
	{args: []string{"--policies", strings.Join(workloadPolicies, ",")}},
	{args: []string{"--policies", "kvselect", "--cost", "dynamo"}, label: dynamoLabel},
	{args: []string{"--policies", "kvselect", "--balance-weight", "0"}, label: noBalanceLabel},
}

// kvselectOptions are the kvselect rows the bar is judged on.
var kvselectOptions = []string{"kvselect", dynamoLabel}

// workloadSection replays every generator of package trace (issue #22's sweep)
// with every seed of qualitySeeds against the baselines, and returns the
// report's section with medians over the seeds and the verdicts of #22's bar,
// and the commands it ran (seed 1).
func workloadSection() (string, []string) {
	var b strings.Builder
	b.WriteString("\n## Routing quality on every workload shape\n\n")
	dir, err := os.MkdirTemp("", "benchreport-workloads-")
	if err != nil {
		fmt.Fprintf(&b, "Not run: %v\n", err)
		return b.String(), nil
	}
	defer os.RemoveAll(dir)
	var cmds []string
	got := map[trace.Workload]map[string][]replayRow{}
	for _, w := range trace.Workloads() {
		got[w] = map[string][]replayRow{}
		for _, seed := range qualitySeeds {
			for ri, run := range workloadRuns {
				args := append([]string{"run", "./examples/replay", "--workload", string(w), "--rate", "8", "--seed", strconv.Itoa(seed)}, run.args...)
				if seed == qualitySeeds[0] {
					cmds = append(cmds, "go "+strings.Join(quoteArgs(args), " "))
				}
				csvPath := filepath.Join(dir, fmt.Sprintf("%s-%d-%d.csv", w, seed, ri))
				rows, err := replayCSV(args, csvPath)
				if err != nil {
					fmt.Fprintf(os.Stderr, "benchreport: workload %s: %v\n", w, err)
					continue
				}
				for label, row := range rows {
					if run.label != "" && label == "kvselect" {
						label = run.label
					}
					got[w][label] = append(got[w][label], row)
				}
			}
		}
	}
	fmt.Fprintf(&b, "Each generator of `internal/trace` (docs/ROUTING.md says what each models) at 8 req/s, 8 simulated workers x\n"+
		"10,000 blocks; medians over seeds %v for every policy.\n\n", qualitySeeds)
	b.WriteString("| Workload | Policy | Hit rate | Of reachable | Imbalance | TTFT p50 (s) | p90 (s) | p99 (s) |\n|---|---|---|---|---|---|---|---|\n")
	meds := map[trace.Workload]map[string]workloadMedians{}
	for _, w := range trace.Workloads() {
		meds[w] = map[string]workloadMedians{}
		for _, p := range append(workloadPolicies[:1:1], append([]string{dynamoLabel, noBalanceLabel}, workloadPolicies[1:]...)...) {
			rows := got[w][p]
			if len(rows) == 0 {
				continue
			}
			pick := func(f func(replayRow) float64) float64 {
				vs := make([]float64, len(rows))
				for i, r := range rows {
					vs[i] = f(r)
				}
				return spreadOf(vs).median
			}
			m := workloadMedians{
				hit: pick(func(r replayRow) float64 { return r.hit }), reach: pick(func(r replayRow) float64 { return r.hit / r.reachable }),
				imb: pick(func(r replayRow) float64 { return r.imbalance }), p50: pick(func(r replayRow) float64 { return r.p50 }),
				p90: pick(func(r replayRow) float64 { return r.p90 }), p99: pick(func(r replayRow) float64 { return r.p99 }),
			}
			meds[w][p] = m
			fmt.Fprintf(&b, "| %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", w, p, m.hit, m.reach, m.imb, m.p50, m.p90, m.p99)
		}
	}
	b.WriteString("\nIssue #22's bar on every generator, for kvselect's defaults (the auto cost: predictive on these 8 workers)\n" +
		"and for Dynamo's cost with kvselect's weights (the defaults before #22); each is judged against the baselines:\n\n")
	b.WriteString("| Workload | kvselect | >= 90% of reachable | best TTFT p90 of all policies | imbalance <= 1.15 |\n|---|---|---|---|---|\n")
	verdict := func(ok bool, fig string) string {
		if ok {
			return fig + ", met"
		}
		return fig + ", **missed**"
	}
	met := map[string]int{}
	for _, w := range trace.Workloads() {
		for _, opt := range kvselectOptions {
			k, ok := meds[w][opt]
			if !ok {
				fmt.Fprintf(&b, "| %s | %s | replay failed | replay failed | replay failed |\n", w, opt)
				continue
			}
			best, bestName := k.p90, opt
			for _, p := range append(slices.Clone(kvselectOptions), workloadPolicies[1:]...) {
				if m, ok := meds[w][p]; ok && p != opt && m.p90 < best {
					best, bestName = m.p90, p
				}
			}
			p90 := fmt.Sprintf("%.2f s", k.p90)
			if bestName != opt {
				p90 += fmt.Sprintf(" (%s %.2f s)", bestName, best)
			}
			oks := []bool{k.reach >= 0.90, bestName == opt, k.imb <= 1.15}
			for _, ok := range oks {
				if ok {
					met[opt]++
				}
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", w, opt, verdict(oks[0], fmt.Sprintf("%.1f%%", 100*k.reach)),
				verdict(oks[1], p90), verdict(oks[2], fmt.Sprintf("%.3f", k.imb)))
		}
	}
	n := 3 * len(trace.Workloads())
	fmt.Fprintf(&b, "\nBars met: the defaults %d of %d, Dynamo's cost %d of %d.\n", met["kvselect"], n, met[dynamoLabel], n)
	b.WriteString(burstProtection(meds[trace.WorkloadBursty]))
	return b.String(), cmds
}

// burstProtection is #22's burst bar from the bursty generator's medians:
// TTFT p99 with the balance term lower than without it.
func burstProtection(m map[string]workloadMedians) string {
	var b strings.Builder
	b.WriteString("\nBurst protection on the bursty generator: the balance term bounds a worker's share of the recent requests,\n" +
		"on top of the predictive cost's queue term; without either (max-overlap-only) a hot prefix draws its whole burst.\n\n")
	b.WriteString("| Policy | Imbalance | TTFT p90 (s) | p99 (s) |\n|---|---|---|---|\n")
	for _, p := range []string{"kvselect", noBalanceLabel, "max-overlap-only"} {
		if r, ok := m[p]; ok {
			fmt.Fprintf(&b, "| %s | %.3f | %.3f | %.3f |\n", p, r.imb, r.p90, r.p99)
		}
	}
	on, okOn := m["kvselect"]
	off, okOff := m[noBalanceLabel]
	switch {
	case !okOn || !okOff:
		b.WriteString("\nTTFT p99 with burst protection lower than without: replay failed, **missed**.\n")
	case on.p99 < off.p99:
		fmt.Fprintf(&b, "\nTTFT p99 with burst protection lower than without: %.2f s vs %.2f s, met.\n", on.p99, off.p99)
	default:
		fmt.Fprintf(&b, "\nTTFT p99 with burst protection lower than without: %.2f s vs %.2f s, **missed**.\n", on.p99, off.p99)
	}
	return b.String()
}

// workloadMedians are one policy's medians over seeds on one generator.
type workloadMedians struct{ hit, reach, imb, p50, p90, p99 float64 }

// replayCSV runs go with args (a replay) writing its CSV to csvPath, and
// reads the rows back by label.
func replayCSV(args []string, csvPath string) (map[string]replayRow, error) {
	cmd := exec.Command("go", append(args, "--csv", csvPath)...)
	cmd.Stderr = os.Stderr
	fmt.Fprintln(os.Stderr, "== go", strings.Join(quoteArgs(args), " "))
	if o, err := cmd.Output(); err != nil {
		return nil, fmt.Errorf("%w\n%s", err, o)
	}
	return readReplayCSV(csvPath)
}

// growthSection replays long outputs (4,096 tokens, decode holding KV in
// 500-block caches, 2 req/s) with and without output growth under each cost
// (issue #20's bar: TTFT p90 no worse with growth), medians over
// qualitySeeds, and returns the report's section and the commands (seed 1).
func growthSection() (string, []string) {
	var b strings.Builder
	b.WriteString("\n## Output growth on long outputs\n\n")
	dir, err := os.MkdirTemp("", "benchreport-growth-")
	if err != nil {
		fmt.Fprintf(&b, "Not run: %v\n", err)
		return b.String(), nil
	}
	defer os.RemoveAll(dir)
	var cmds []string
	b.WriteString("The synthetic shared-prefix workload with 4,096 output tokens per request at 2 req/s, each request's\n" +
		"output taking cache space as it is generated (`--decode-holds-kv`, 500-block caches); kvselect without\n" +
		"and with output growth (bookings grow one block per block of output), medians over seeds " + fmt.Sprint(qualitySeeds) + ".\n\n")
	b.WriteString("| Cost | Growth | Hit rate | Imbalance | TTFT p50 (s) | p90 (s) | p99 (s) | p90 no worse with growth |\n|---|---|---|---|---|---|---|---|\n")
	for _, cost := range []string{"dynamo", "predictive"} {
		got := map[string][]replayRow{}
		for _, seed := range qualitySeeds {
			args := []string{"run", "./examples/replay", "--policies", "kvselect", "--cost", cost, "--output-growth", "--decode-holds-kv",
				"--output-tokens", "4096", "--rate", "2", "--capacity", "500", "--seed", strconv.Itoa(seed)}
			if seed == qualitySeeds[0] {
				cmds = append(cmds, "go "+strings.Join(quoteArgs(args), " "))
			}
			rows, err := replayCSV(args, filepath.Join(dir, fmt.Sprintf("%s-%d.csv", cost, seed)))
			if err != nil {
				fmt.Fprintf(os.Stderr, "benchreport: growth %s: %v\n", cost, err)
				continue
			}
			for label, row := range rows {
				got[label] = append(got[label], row)
			}
		}
		med := func(label string, f func(replayRow) float64) float64 {
			vs := make([]float64, 0, len(got[label]))
			for _, r := range got[label] {
				vs = append(vs, f(r))
			}
			return spreadOf(vs).median
		}
		p90 := func(r replayRow) float64 { return r.p90 }
		for _, label := range []string{"kvselect", "kvselect +growth"} {
			if len(got[label]) == 0 {
				fmt.Fprintf(&b, "| %s | %s | replay failed | | | | | |\n", cost, label)
				continue
			}
			verdict := ""
			if label != "kvselect" {
				verdict = "met"
				if med(label, p90) > med("kvselect", p90) {
					verdict = "**missed**"
				}
			}
			growth := "off"
			if label != "kvselect" {
				growth = "on"
			}
			fmt.Fprintf(&b, "| %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %s |\n", cost, growth,
				med(label, func(r replayRow) float64 { return r.hit }), med(label, func(r replayRow) float64 { return r.imbalance }),
				med(label, func(r replayRow) float64 { return r.p50 }), med(label, p90),
				med(label, func(r replayRow) float64 { return r.p99 }), verdict)
		}
	}
	return b.String(), cmds
}
