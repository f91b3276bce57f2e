package main

import (
	"encoding/csv"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kvselect/kvselect/selection"
)

// replayRun is one `go run ./examples/replay` invocation of the routing-quality
// section; its CSV rows are keyed by label.
type replayRun struct {
	name string
	args []string
}

// replayRuns replays the Mooncake synthetic trace as DESIGN.md section 5 asks:
// kvselect's defaults against the baselines, the same with Dynamo's default
// weights for comparison, and a workload where every request shares block 0.
func replayRuns(tracePath string) []replayRun {
	base := []string{"run", "./examples/replay", "--trace", tracePath, "--workers", "8", "--capacity", "10000"}
	with := func(extra ...string) []string { return append(append([]string{}, base...), extra...) }
	return []replayRun{
		{name: "defaults", args: with("--policies", "kvselect,round-robin,least-loaded")},
		{name: "dynamo", args: with("--policies", "kvselect", "--overlap-credit", "1", "--prefill-scale", "1")},
		{name: "shared-block-0", args: with("--policies", "kvselect,round-robin", "--common-blocks", "1")},
	}
}

// replayRow is the part of a replay CSV row the report uses.
type replayRow struct {
	hit, reachable, imbalance, p50, p90, p99, wall float64
}

// qualitySection runs the replays and returns the report's routing-quality
// section and the commands it ran. A missing trace gives a section that says so.
func qualitySection(tracePath string) (string, []string) {
	var b strings.Builder
	b.WriteString("\n## Routing quality (trace replay)\n\n")
	if _, err := os.Stat(tracePath); err != nil {
		fmt.Fprintf(&b, "Not run: the trace %s is not readable here (%v). Pass `-trace`.\n", tracePath, err)
		return b.String(), nil
	}
	dir, err := os.MkdirTemp("", "benchreport-replay-")
	if err != nil {
		fmt.Fprintf(&b, "Not run: %v\n", err)
		return b.String(), nil
	}
	defer os.RemoveAll(dir)
	var cmds []string
	got := map[string]map[string]replayRow{}
	for _, r := range replayRuns(tracePath) {
		cmds = append(cmds, "go "+strings.Join(quoteArgs(r.args), " "))
		csvPath := filepath.Join(dir, r.name+".csv")
		cmd := exec.Command("go", append(r.args, "--csv", csvPath)...)
		cmd.Stderr = os.Stderr
		fmt.Fprintln(os.Stderr, "==", cmds[len(cmds)-1])
		if o, err := cmd.Output(); err != nil {
			fmt.Fprintf(os.Stderr, "benchreport: replay %s: %v\n%s", r.name, err, o)
			continue
		}
		rows, err := readReplayCSV(csvPath)
		if err != nil {
			fmt.Fprintf(os.Stderr, "benchreport: replay %s: %v\n", r.name, err)
			continue
		}
		got[r.name] = rows
	}

	b.WriteString("Mooncake synthetic trace (3993 requests, 512-token blocks), 8 simulated workers x 10,000 blocks;\n")
	b.WriteString("the simulator and its time model are described in `internal/replay`. Budgets are DESIGN.md section 5.\n\n")
	b.WriteString("| Replay | Policy | Hit rate | Of reachable | Imbalance | TTFT p50 | p90 | p99 | Wall |\n|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range replayRuns(tracePath) {
		for _, label := range sortedLabels(got[r.name]) {
			v := got[r.name][label]
			fmt.Fprintf(&b, "| %s | %s | %.3f | %.1f%% | %.3f | %.3f s | %.3f s | %.3f s | %.2f s |\n",
				r.name, label, v.hit, 100*v.hit/v.reachable, v.imbalance, v.p50, v.p90, v.p99, v.wall)
		}
	}

	b.WriteString("\n| Requirement | Figure | Verdict |\n|---|---|---|\n")
	check := func(what string, ok bool, figure string) {
		verdict := "met"
		if !ok {
			verdict = "**missed**"
		}
		fmt.Fprintf(&b, "| %s | %s | %s |\n", what, figure, verdict)
	}
	d, okD := got["defaults"]
	k, rr, ll := d["kvselect"], d["round-robin"], d["least-loaded"]
	if okD && k.reachable > 0 && rr.hit > 0 {
		check("default policy >= 95% of the reachable hit rate", k.hit >= 0.95*k.reachable, fmt.Sprintf("%.1f%%", 100*k.hit/k.reachable))
		check("default policy request imbalance <= 1.1", k.imbalance <= 1.1, fmt.Sprintf("%.3f", k.imbalance))
		check("default policy >= 2.5x round-robin's hit rate", k.hit >= 2.5*rr.hit, fmt.Sprintf("%.2fx", k.hit/rr.hit))
		check("TTFT p90 better than round-robin and least-loaded", k.p90 < rr.p90 && k.p90 < ll.p90,
			fmt.Sprintf("%.2f s vs %.2f s / %.2f s", k.p90, rr.p90, ll.p90))
		check("full replay under 60 s", k.wall < 60, fmt.Sprintf("%.2f s", k.wall))
	} else {
		b.WriteString("| default policy | replay failed | **missed** |\n")
	}
	if s, ok := got["shared-block-0"]["kvselect"]; ok {
		check("no collapse when every request shares block 0 (imbalance <= 1.1)", s.imbalance <= 1.1, fmt.Sprintf("%.3f", s.imbalance))
	} else {
		b.WriteString("| shared block 0 | replay failed | **missed** |\n")
	}
	if dy, ok := got["dynamo"]["kvselect"]; ok && okD {
		fmt.Fprintf(&b, "\nWith Dynamo's default weights (overlap credit 1, prefill load scale 1) the same replay reaches\n"+
			"%.1f%% of reachable with imbalance %.3f and TTFT p90 %.2f s; kvselect's defaults (credit %s, scale %s)\n"+
			"are chosen on this evidence (see selection.DefaultConfig).\n",
			100*dy.hit/dy.reachable, dy.imbalance, dy.p90,
			trimFloat(selection.DefaultOverlapScoreCredit), trimFloat(selection.DefaultPrefillLoadScale))
	}
	return b.String(), cmds
}

func trimFloat(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }

// readReplayCSV reads the rows of examples/replay's --csv output by label.
func readReplayCSV(path string) (map[string]replayRow, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	if err != nil {
		return nil, err
	}
	if len(recs) < 2 {
		return nil, fmt.Errorf("%s: no rows", path)
	}
	col := map[string]int{}
	for i, h := range recs[0] {
		col[h] = i
	}
	for _, want := range []string{"label", "hit_rate", "reachable_hit_rate", "imbalance", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "wall_s"} {
		if _, ok := col[want]; !ok {
			return nil, fmt.Errorf("%s: no column %q", path, want)
		}
	}
	out := map[string]replayRow{}
	for _, r := range recs[1:] {
		num := func(name string) float64 {
			v, _ := strconv.ParseFloat(r[col[name]], 64)
			return v
		}
		out[r[col["label"]]] = replayRow{
			hit: num("hit_rate"), reachable: num("reachable_hit_rate"), imbalance: num("imbalance"),
			p50: num("ttft_p50_s"), p90: num("ttft_p90_s"), p99: num("ttft_p99_s"), wall: num("wall_s"),
		}
	}
	return out, nil
}

func sortedLabels(m map[string]replayRow) []string {
	order := []string{"kvselect", "round-robin", "least-loaded"}
	var out []string
	for _, l := range order {
		if _, ok := m[l]; ok {
			out = append(out, l)
		}
	}
	return out
}
