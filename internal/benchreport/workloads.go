package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kvselect/kvselect/internal/trace"
)

// workloadPolicies are the policies of the workload sweep, kvselect first.
var workloadPolicies = []string{"kvselect", "round-robin", "least-loaded", "max-overlap-only"}

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
			args := []string{"run", "./examples/replay", "--workload", string(w), "--rate", "8", "--seed", strconv.Itoa(seed),
				"--policies", strings.Join(workloadPolicies, ",")}
			if seed == qualitySeeds[0] {
				cmds = append(cmds, "go "+strings.Join(quoteArgs(args), " "))
			}
			csvPath := filepath.Join(dir, fmt.Sprintf("%s-%d.csv", w, seed))
			cmd := exec.Command("go", append(args, "--csv", csvPath)...)
			cmd.Stderr = os.Stderr
			fmt.Fprintln(os.Stderr, "== go", strings.Join(quoteArgs(args), " "))
			if o, err := cmd.Output(); err != nil {
				fmt.Fprintf(os.Stderr, "benchreport: workload %s: %v\n%s", w, err, o)
				continue
			}
			rows, err := readReplayCSV(csvPath)
			if err != nil {
				fmt.Fprintf(os.Stderr, "benchreport: workload %s: %v\n", w, err)
				continue
			}
			for label, row := range rows {
				got[w][label] = append(got[w][label], row)
			}
		}
	}
	fmt.Fprintf(&b, "Each generator of `internal/trace` (docs/ROUTING.md says what each models) at 8 req/s, 8 simulated workers x\n"+
		"10,000 blocks; medians over seeds %v for every policy.\n\n", qualitySeeds)
	b.WriteString("| Workload | Policy | Hit rate | Of reachable | Imbalance | TTFT p50 (s) | p90 (s) | p99 (s) |\n|---|---|---|---|---|---|---|---|\n")
	type med struct{ hit, reach, imb, p50, p90, p99 float64 }
	meds := map[trace.Workload]map[string]med{}
	for _, w := range trace.Workloads() {
		meds[w] = map[string]med{}
		for _, p := range workloadPolicies {
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
			m := med{
				hit: pick(func(r replayRow) float64 { return r.hit }), reach: pick(func(r replayRow) float64 { return r.hit / r.reachable }),
				imb: pick(func(r replayRow) float64 { return r.imbalance }), p50: pick(func(r replayRow) float64 { return r.p50 }),
				p90: pick(func(r replayRow) float64 { return r.p90 }), p99: pick(func(r replayRow) float64 { return r.p99 }),
			}
			meds[w][p] = m
			fmt.Fprintf(&b, "| %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", w, p, m.hit, m.reach, m.imb, m.p50, m.p90, m.p99)
		}
	}
	b.WriteString("\nIssue #22's bar for kvselect's defaults on every generator (not yet a project budget):\n\n")
	b.WriteString("| Workload | >= 90% of reachable | best TTFT p90 of all policies | imbalance <= 1.15 |\n|---|---|---|---|\n")
	verdict := func(ok bool, fig string) string {
		if ok {
			return fig + ", met"
		}
		return fig + ", **missed**"
	}
	for _, w := range trace.Workloads() {
		k, ok := meds[w]["kvselect"]
		if !ok {
			fmt.Fprintf(&b, "| %s | replay failed | replay failed | replay failed |\n", w)
			continue
		}
		best, bestName := k.p90, "kvselect"
		for _, p := range workloadPolicies[1:] {
			if m, ok := meds[w][p]; ok && m.p90 < best {
				best, bestName = m.p90, p
			}
		}
		p90 := fmt.Sprintf("%.2f s", k.p90)
		if bestName != "kvselect" {
			p90 += fmt.Sprintf(" (%s %.2f s)", bestName, best)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", w, verdict(k.reach >= 0.90, fmt.Sprintf("%.1f%%", 100*k.reach)),
			verdict(bestName == "kvselect", p90), verdict(k.imb <= 1.15, fmt.Sprintf("%.3f", k.imb)))
	}
	return b.String(), cmds
}
