package main

import (
	"encoding/csv"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/kvselect/kvselect/selection"
)

// replayRun is one `go run ./examples/replay` invocation of the routing-quality
// section; its CSV rows are keyed by label.
type replayRun struct {
	name string // what it shows; runs of one name differ only in seed
	seed int
	args []string
}

// qualitySeeds are the seeds of the kvselect replays. Tie-breaking is random, so
// the request imbalance of one replay moves by several hundredths from seed to
// seed; the verdicts use the median over these seeds.
var qualitySeeds = []int{1, 2, 3, 4, 5}

// replayRuns replays the Mooncake synthetic trace as the performance targets ask:
// the baselines once; with every seed kvselect's defaults on the trace, on the
// trace with a block every request shares and as three replicas with sync;
// and for comparison kvselect's weights under Dynamo's cost (the defaults
// before issue #22) and Dynamo's own defaults.
func replayRuns(tracePath string) []replayRun {
	base := []string{"run", "./examples/replay", "--trace", tracePath, "--workers", "8", "--capacity", "10000"}
	with := func(seed int, extra ...string) []string {
		return append(append(append([]string{}, base...), "--seed", strconv.Itoa(seed)), extra...)
	}
	runs := []replayRun{{name: "baselines", seed: 1, args: with(1, "--policies", "round-robin,least-loaded")}}
	for _, seed := range qualitySeeds {
		runs = append(runs,
			replayRun{name: "defaults", seed: seed, args: with(seed, "--policies", "kvselect")},
			replayRun{name: "shared block 0", seed: seed, args: with(seed, "--policies", "kvselect", "--common-blocks", "1")},
			replayRun{name: "3 replicas", seed: seed, args: with(seed, "--policies", "kvselect", "--replicas", "3")},
			replayRun{name: "Dynamo's cost", seed: seed, args: with(seed, "--policies", "kvselect", "--cost", "dynamo")},
			replayRun{name: "Dynamo's weights", seed: seed, args: with(seed, "--policies", "kvselect", "--cost", "dynamo", "--overlap-credit", "1", "--prefill-scale", "1", "--inflight-weight", "0")},
		)
	}
	return runs
}

// replayRow is the part of a replay CSV row the report uses.
type replayRow struct {
	hit, reachable, imbalance, p50, p90, p99, wall float64
}

// spread is the median and range of one figure over seeds.
type spread struct{ median, lo, hi float64 }

func spreadOf(vs []float64) spread {
	if len(vs) == 0 {
		return spread{}
	}
	s := append([]float64(nil), vs...)
	sort.Float64s(s)
	return spread{median: median(s), lo: s[0], hi: s[len(s)-1]}
}

func (s spread) String() string {
	if s.lo == s.hi {
		return fmt.Sprintf("%.3f", s.median)
	}
	return fmt.Sprintf("%.3f (%.3f-%.3f)", s.median, s.lo, s.hi)
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
	// per run name and policy label: one row per seed
	got := map[string]map[string][]replayRow{}
	var names []string
	for i, r := range replayRuns(tracePath) {
		if r.seed == 1 || r.name == "baselines" {
			// The recorded command names the trace by its file name: where it
			// lies on the machine that ran it says nothing to a reader.
			shown := slices.Clone(r.args)
			for j, a := range shown {
				if a == tracePath {
					shown[j] = filepath.Base(tracePath)
				}
			}
			cmds = append(cmds, "go "+strings.Join(quoteArgs(shown), " "))
		}
		csvPath := filepath.Join(dir, fmt.Sprintf("%d.csv", i))
		cmd := exec.Command("go", append(r.args, "--csv", csvPath)...)
		cmd.Stderr = os.Stderr
		fmt.Fprintln(os.Stderr, "== go", strings.Join(quoteArgs(r.args), " "))
		if o, err := cmd.Output(); err != nil {
			fmt.Fprintf(os.Stderr, "benchreport: replay %s: %v\n%s", r.name, err, o)
			continue
		}
		rows, err := readReplayCSV(csvPath)
		if err != nil {
			fmt.Fprintf(os.Stderr, "benchreport: replay %s: %v\n", r.name, err)
			continue
		}
		if got[r.name] == nil {
			got[r.name] = map[string][]replayRow{}
			names = append(names, r.name)
		}
		for label, row := range rows {
			if strings.HasPrefix(label, "kvselect R=") { // the replicas' row
				label = "kvselect"
			}
			got[r.name][label] = append(got[r.name][label], row)
		}
	}

	fmt.Fprintf(&b, "Mooncake synthetic trace (3993 requests, 512-token blocks), 8 simulated workers x 10,000 blocks;\n"+
		"the simulator and its time model are described in `internal/replay`. kvselect rows: median (min-max) over seeds %v\n"+
		"(the seed drives tie-breaking); baselines: seed 1. Budgets are the project's performance targets.\n\n", qualitySeeds)
	b.WriteString("| Replay | Policy | Hit rate | Of reachable | Imbalance | TTFT p50 (s) | p90 (s) | p99 (s) | Wall (s) |\n|---|---|---|---|---|---|---|---|---|\n")
	stat := func(rows []replayRow, f func(replayRow) float64) spread {
		var vs []float64
		for _, r := range rows {
			vs = append(vs, f(r))
		}
		return spreadOf(vs)
	}
	type figures struct{ hit, ofReach, imb, p50, p90, p99, wall spread }
	figs := map[string]map[string]figures{}
	for _, name := range names {
		figs[name] = map[string]figures{}
		for _, label := range []string{"kvselect", "round-robin", "least-loaded"} {
			rows := got[name][label]
			if len(rows) == 0 {
				continue
			}
			f := figures{
				hit:     stat(rows, func(r replayRow) float64 { return r.hit }),
				ofReach: stat(rows, func(r replayRow) float64 { return r.hit / r.reachable }),
				imb:     stat(rows, func(r replayRow) float64 { return r.imbalance }),
				p50:     stat(rows, func(r replayRow) float64 { return r.p50 }),
				p90:     stat(rows, func(r replayRow) float64 { return r.p90 }),
				p99:     stat(rows, func(r replayRow) float64 { return r.p99 }),
				wall:    stat(rows, func(r replayRow) float64 { return r.wall }),
			}
			figs[name][label] = f
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", name, label, f.hit, f.ofReach, f.imb, f.p50, f.p90, f.p99, f.wall)
		}
	}

	b.WriteString("\n| Requirement (kvselect defaults, medians) | Figure | Verdict |\n|---|---|---|\n")
	check := func(what string, ok bool, figure string) {
		verdict := "met"
		if !ok {
			verdict = "**missed**"
		}
		fmt.Fprintf(&b, "| %s | %s | %s |\n", what, figure, verdict)
	}
	k, okK := figs["defaults"]["kvselect"]
	rr, okR := figs["baselines"]["round-robin"]
	ll, okL := figs["baselines"]["least-loaded"]
	if okK && okR && okL && rr.hit.median > 0 {
		check(">= 95% of the reachable hit rate", k.ofReach.median >= 0.95, fmt.Sprintf("%.1f%%", 100*k.ofReach.median))
		check("request imbalance <= 1.1", k.imb.median <= 1.1, fmt.Sprintf("%.3f", k.imb.median))
		check(">= 2.5x round-robin's hit rate", k.hit.median >= 2.5*rr.hit.median, fmt.Sprintf("%.2fx", k.hit.median/rr.hit.median))
		check("TTFT p90 better than round-robin and least-loaded", k.p90.median < rr.p90.median && k.p90.median < ll.p90.median,
			fmt.Sprintf("%.2f s vs %.2f s / %.2f s", k.p90.median, rr.p90.median, ll.p90.median))
		check("full replay under 60 s", k.wall.hi < 60, fmt.Sprintf("%.2f s (slowest seed)", k.wall.hi))
	} else {
		b.WriteString("| default policy | replay failed | **missed** |\n")
	}
	if s, ok := figs["shared block 0"]["kvselect"]; ok {
		check("no collapse when every request shares block 0 (imbalance <= 1.1)", s.imb.median <= 1.1, fmt.Sprintf("%.3f", s.imb.median))
	} else {
		b.WriteString("| shared block 0 | replay failed | **missed** |\n")
	}
	if d, ok := figs["Dynamo's cost"]["kvselect"]; ok && okK {
		check("hit rate and TTFT p90 within 2% of the defaults before #22 (Dynamo's cost) or better",
			k.hit.median >= 0.98*d.hit.median && k.p90.median <= 1.02*d.p90.median,
			fmt.Sprintf("hit %.3f vs %.3f, p90 %.2f s vs %.2f s", k.hit.median, d.hit.median, k.p90.median, d.p90.median))
	} else {
		b.WriteString("| Dynamo's cost | replay failed | **missed** |\n")
	}
	if r, ok := figs["3 replicas"]["kvselect"]; ok && okK {
		within := func(a, b float64) bool { return a <= 1.03*b && a >= b/1.03 }
		check("3 replicas with sync: hit rate, imbalance and TTFT p90 within 3% of one router",
			within(r.hit.median, k.hit.median) && within(r.imb.median, k.imb.median) && within(r.p90.median, k.p90.median),
			fmt.Sprintf("hit %.3f, imbalance %.3f, p90 %.2f s", r.hit.median, r.imb.median, r.p90.median))
	} else {
		b.WriteString("| 3 replicas | replay failed | **missed** |\n")
	}
	fmt.Fprintf(&b, "\nkvselect's defaults are Dynamo's except the cost (auto: the predictive cost on these 8 workers, with its balance\n"+
		"weight %s times the mean prompt's prefill, slack %s, window %s), overlap credit %s, prefill load scale %s and the in-flight credit %s (Dynamo: its\n"+
		"own cost, 1, 1 and none; see selection.DefaultConfig). The \"Dynamo's cost\" rows keep kvselect's weights under Dynamo's cost\n"+
		"(the defaults before issue #22), the \"Dynamo's weights\" rows are Dynamo's defaults. Other seeds: add `--seed N` to the\n"+
		"commands below.\n",
		trimFloat(selection.DefaultBalanceWeight), trimFloat(selection.DefaultBalanceSlack), selection.DefaultBalanceWindow,
		trimFloat(selection.DefaultOverlapScoreCredit), trimFloat(selection.DefaultPrefillLoadScale), trimFloat(selection.DefaultInFlightHitWeight))
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
