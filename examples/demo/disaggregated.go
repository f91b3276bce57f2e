package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/eppserver"
	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// Defaults of the disaggregated demo's engines.
const (
	// pdDemoTransferPerBlock is a decode leg's simulated KV pull per block,
	// sixteen times faster than computing the block (PerTokenPrefill, 20 us
	// per token).
	pdDemoTransferPerBlock = 20 * time.Microsecond
	pdDecodeBlocks         = 4096 // decode engines never evict in the demo
	// pdDemoShortEvery: one request in four is a short question without a
	// system prompt.
	pdDemoShortEvery = 4
	// pdDemoLocalPrefillBelow is the conditional run's
	// DYN_EPP_LOCAL_PREFILL_BELOW when the environment sets none: above a
	// short question (under 40 tokens) and the part of a request a decode
	// engine holding its system prompt has not cached (the rest of the last
	// cached block and the question, under 60), far below a whole system
	// prompt (about 400).
	pdDemoLocalPrefillBelow = 64
)

// pdRig is an EPP in disaggregated mode in process (its ext_proc server not
// listening yet) over a fleet it owns.
type pdRig struct {
	e     *eppserver.EPP
	model string
	fleet *demofleet.PDFleet
}

// newPDRig starts the fleet and an EPP whose catalogs hold it, and waits until
// the EPP follows every prefill engine's KV events. The sidecars check hints
// with the EPP's key (cfg.PDHintKey; none: unsigned hints); fo.Model,
// fo.BlockSize and fo.RoleLabel come from cfg.
func newPDRig(ctx context.Context, base *eppserver.Config, fo demofleet.PDFleetOptions, logger *slog.Logger) (*pdRig, error) {
	cfg := *base
	cfg.Topology = "disaggregated"
	cfg.TokenizerProtocol = "vllm-render"
	if fo.Model != "" {
		cfg.Model = fo.Model
	}
	fo.Model, fo.BlockSize, fo.RoleLabel, fo.HintKey = cfg.Model, cfg.BlockSize, cfg.RoleLabel, cfg.PDHintKey
	fleet, err := demofleet.StartPDFleet(ctx, fo)
	if err != nil {
		return nil, err
	}
	cfg.TokenizerURLs = []string{fleet.TokenizerURL()}
	e, err := eppserver.New(ctx, &cfg, eppserver.Options{Logger: logger, Configure: func(b *selection.SelectionServiceBuilder) {
		b.EventFeed(selection.FeedOptions{ReconnectMin: 5 * time.Millisecond, ReconnectMax: 200 * time.Millisecond})
	}})
	if err != nil {
		fleet.Close()
		return nil, err
	}
	r := &pdRig{e: e, model: cfg.Model, fleet: fleet}
	e.Apply(discovery.Snapshot{Workers: fleet.Workers(), Synced: true})
	if err := fleet.WaitSubscribed(ctx); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

// drive sends the workload through the EPP's ext_proc server to the sidecars.
func (r *pdRig) drive(ctx context.Context, o options, workload []demofleet.Request) (demofleet.Result, error) {
	return demofleet.Drive(ctx, r.e.ExtProc(), workload, demofleet.DriveOptions{Concurrency: o.concurrency, Endpoints: r.fleet.View().DecodeEndpoints})
}

// waitSettled waits (within 10 s) until the EPP holds no plan and no load on
// either role, and returns what is left otherwise.
func (r *pdRig) waitSettled(ctx context.Context) error {
	return demofleet.WaitFor(ctx, 10*time.Second, r.unsettled)
}

func (r *pdRig) unsettled() error {
	if st := r.e.BookerStats().Plans; st.Active != 0 {
		return fmt.Errorf("%d plans live (%+v)", st.Active, st)
	}
	for _, role := range []roles.Role{roles.Prefill, roles.Decode} {
		for _, l := range r.e.Service(role).Loads(r.model) {
			if l.ActiveRequests != 0 || l.ActiveBlocks != 0 || l.ActivePrefillTokens != 0 {
				return fmt.Errorf("%v: load left on %s: %+v", role, l.WorkerID, l)
			}
		}
	}
	return nil
}

func (r *pdRig) close() {
	r.e.Close()
	r.fleet.Close()
}

// pdResult is the disaggregated run of the demo.
type pdResult struct {
	client   result // the client's view: latencies, decode endpoints, prefillers named
	prefill  []fakeengine.HTTPStats
	decode   []fakeengine.HTTPStats
	sidecars []sidecar.Stats
	booker   roles.BookerStats
	fleet    demofleet.PDFleetView
	// localBelow is the run's DYN_EPP_LOCAL_PREFILL_BELOW (0: a prefill leg
	// for every request).
	localBelow int
}

// prefillHitRate is the prefill engines' prefix-cache hit rate: cached over
// prompt tokens of the prefill legs.
func (r pdResult) prefillHitRate() float64 { return demofleet.HitRate(r.prefill) }

// splitEngines divides the demo's engines between the roles: half prefill
// (rounded up), the rest decode.
func splitEngines(n int) (prefill, decode int) {
	prefill = (n + 1) / 2
	return prefill, n - prefill
}

// runDisaggregatedDemo is the demo with --topology disaggregated: the
// shared-prefix workload, one request in pdDemoShortEvery a short question
// without a system prompt, through an EPP in disaggregated mode (prefill
// engines that publish KV events, decode engines behind decode sidecars), once
// with a prefill leg for every request and once with conditional
// disaggregation (DYN_EPP_LOCAL_PREFILL_BELOW), beside aggregated serving of
// the same workload on as many engines, and the tables.
func runDisaggregatedDemo(ctx context.Context, cfg *eppserver.Config, o options, out io.Writer) error {
	if o.workersFile != "" {
		return errors.New("the disaggregated demo runs its own fake engines and sidecars: drop --demo-workers-file")
	}
	if o.engines == 0 {
		o.engines = 4
	}
	if o.engines < 2 {
		return fmt.Errorf("the disaggregated demo needs at least 2 engines (a prefill and a decode one), got %d", o.engines)
	}
	prefill, decode := splitEngines(o.engines)
	if o.groups <= 0 {
		// As many groups per prefill engine as the aggregated demo has per
		// engine: the prefill engines hold the prompts.
		o.groups = 3 * prefill
	}
	if o.shortEvery <= 0 {
		o.shortEvery = pdDemoShortEvery
	}
	o.defaults()

	// Every run starts fresh engines: the same requests, no warm cache. The
	// disaggregated run books a prefill leg for every request, whatever the
	// environment says; the conditional one uses DYN_EPP_LOCAL_PREFILL_BELOW
	// when it is set.
	workload, err := o.workload(0)
	if err != nil {
		return err
	}
	agg, err := policyRun(ctx, cfg, o, "kvselect", workload)
	if err != nil {
		return fmt.Errorf("aggregated: %w", err)
	}
	agg.policy = "aggregated"
	always := *cfg
	always.LocalPrefillBelow = 0
	pd, err := pdRun(ctx, &always, o, prefill, decode, workload)
	if err != nil {
		return fmt.Errorf("disaggregated: %w", err)
	}
	conditional := *cfg
	if conditional.LocalPrefillBelow <= 0 {
		conditional.LocalPrefillBelow = pdDemoLocalPrefillBelow
	}
	cond, err := pdRun(ctx, &conditional, o, prefill, decode, workload)
	if err != nil {
		return fmt.Errorf("disaggregated, conditional: %w", err)
	}
	cond.client.policy = "disaggregated, conditional"
	rr, err := demofleet.RoundRobinPrefillHitRate(o.fleetOptions(cfg, prefill, decode), workload)
	if err != nil {
		return err
	}
	printPDDemo(out, agg, pd, cond, rr, o, prefill, decode)
	for _, r := range []result{agg, pd.client, cond.client} {
		if r.Failed > 0 {
			return fmt.Errorf("%s: %d requests failed, the first: %s", r.policy, r.Failed, r.FirstFailure)
		}
	}
	return nil
}

// fleetOptions are the demo's fleet: engines as the aggregated run's, the
// prefill ones speaking its KV-event dialect.
func (o options) fleetOptions(cfg *eppserver.Config, prefill, decode int) demofleet.PDFleetOptions {
	return demofleet.PDFleetOptions{
		Prefill: prefill, Decode: decode, Model: o.model, BlockSize: cfg.BlockSize, RoleLabel: cfg.RoleLabel,
		PrefillBlocks: o.capacityTokens / cfg.BlockSize, DecodeBlocks: pdDecodeBlocks, Dialect: o.dialect,
		SleepTTFT: true, TransferPerBlock: pdDemoTransferPerBlock, Timing: o.timing,
		Fallback: sidecar.FallbackLocal, Logger: o.logger,
	}
}

// pdRun is the disaggregated run: a fresh fleet, an EPP, the workload.
func pdRun(ctx context.Context, cfg *eppserver.Config, o options, prefill, decode int, workload []demofleet.Request) (pdResult, error) {
	rig, err := newPDRig(ctx, cfg, o.fleetOptions(cfg, prefill, decode), o.logger)
	if err != nil {
		return pdResult{}, err
	}
	defer rig.close()
	res := pdResult{fleet: rig.fleet.View(), localBelow: cfg.LocalPrefillBelow}
	dr, err := rig.drive(ctx, o, workload)
	res.client = result{Result: dr, policy: "disaggregated"}
	if err != nil {
		return res, err
	}
	if err := rig.waitSettled(ctx); err != nil {
		return res, err
	}
	res.prefill, res.decode, res.booker = rig.fleet.PrefillStats(), rig.fleet.DecodeStats(), rig.e.BookerStats()
	for _, sc := range rig.fleet.Sidecars() {
		res.sidecars = append(res.sidecars, sc.Stats())
	}
	return res, nil
}

func printPDDemo(out io.Writer, agg result, pd, cond pdResult, rrHitRate float64, o options, prefill, decode int) {
	fmt.Fprintf(out, "kvselect demo, disaggregated: %d fake prefill engines (publishing KV events, %s) and %d fake decode engines,\n"+
		"each behind a decode sidecar (vLLM NIXL), beside aggregated serving of the same workload on %d fake engines;\n"+
		"%d shared system prompts and, one request in %d, a short question without one; %d chat requests per run,\n"+
		"%d in flight, routed through the EPP's ext_proc server. The conditional run sets DYN_EPP_LOCAL_PREFILL_BELOW=%d:\n"+
		"a request whose uncached prompt on its decode worker is at most that many tokens skips the prefill leg.\n"+
		"Each engine caches %d tokens (a few system prompts; decode engines never evict); engines: %s;\n"+
		"latencies are timed by the client.\n\n",
		prefill, o.dialect, decode, prefill+decode, o.groups, o.shortEvery, o.requests, o.concurrency, cond.localBelow,
		o.capacityTokens, o.engineText(prefill+decode))
	pct := demofleet.Percentile
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "serving\trequests\tfailed\tTTFT p50\tTTFT p90\tTTFT p99\tITL p50\tITL p90\tITL p99\tprefill-cache hit rate\tskipped prefill\tfallbacks")
	row := func(r result, hit float64, skipped, fb string) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f ms\t%.1f ms\t%.1f ms\t%.2f ms\t%.2f ms\t%.2f ms\t%.1f%%\t%s\t%s\n", r.policy, r.Requests, r.Failed,
			pct(r.TTFTs, 0.5), pct(r.TTFTs, 0.9), pct(r.TTFTs, 0.99),
			pct(r.ITLs, 0.5), pct(r.ITLs, 0.9), pct(r.ITLs, 0.99), 100*hit, skipped, fb)
	}
	row(agg, demofleet.HitRate(agg.engineStats), "-", "-")
	for _, r := range []pdResult{pd, cond} {
		row(r.client, r.prefillHitRate(), fmt.Sprint(r.booker.Conditional), fmt.Sprint(r.fallbacks()))
	}
	_ = tw.Flush()

	fmt.Fprintln(out, "\nWhere each leg landed (booked: what the EPP sent there; served: what the engine counted; local: prefilled by\n"+
		"the decode engine itself, no prefill leg):")
	tw = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "serving\tworker\trole\tbooked\tserved\tprefix-cache hit rate\tKV transferred")
	for i, ep := range agg.Endpoints {
		var st fakeengine.HTTPStats
		if i < len(agg.engineStats) {
			st = agg.engineStats[i]
		}
		fmt.Fprintf(tw, "aggregated\tengine-%d\taggregated\t%d requests\t%d requests\t%.1f%%\t-\n", i, agg.PerEndpoint[ep], st.Requests,
			100*demofleet.HitRate([]fakeengine.HTTPStats{st}))
	}
	for _, r := range []pdResult{pd, cond} {
		r.printLegs(tw)
	}
	_ = tw.Flush()

	fmt.Fprintln(out)
	if rrHitRate > 0 {
		fmt.Fprintf(out, "Round-robin prefill placement of the same workload would hit %.1f%% (its prompts replayed through the\n"+
			"engines' cache model): kvselect's prefill placement hits %.1fx that.\n", 100*rrHitRate, pd.prefillHitRate()/rrHitRate)
	}
	for _, r := range []pdResult{pd, cond} {
		r.printSummary(out)
	}
	c := cond.client
	fmt.Fprintf(out, "Conditional: %d of %d requests skipped the prefill leg, %d of the %d short questions and %d requests whose\n"+
		"system prompt their decode engine held (the decode service's approximate index knew it). TTFT p50 %.1f ms for\n"+
		"them, %.1f ms for the %d with a prefill leg; the run's p50 %.1f ms against %.1f ms with a prefill leg for every\n"+
		"request (p90 %.1f ms against %.1f ms).\n",
		cond.booker.Conditional, c.Requests, c.UnpairedShort, countShort(o), c.Unpaired()-c.UnpairedShort,
		pct(c.UnpairedTTFTs, 0.5), pct(c.PairedTTFTs, 0.5), len(c.PairedTTFTs),
		pct(c.TTFTs, 0.5), pct(pd.client.TTFTs, 0.5), pct(c.TTFTs, 0.9), pct(pd.client.TTFTs, 0.9))
}

// printLegs writes the run's rows of the per-worker table.
func (r pdResult) printLegs(tw io.Writer) {
	name := r.client.policy
	for i, st := range r.prefill {
		fmt.Fprintf(tw, "%s\t%s\tprefill\t%d prefill legs\t%d prefill legs\t%.1f%%\t%d handed over\n", name, r.fleet.PrefillIDs[i],
			r.client.PerPrefiller[r.fleet.PrefillEndpoints[i]], st.PrefillLegs, 100*demofleet.HitRate([]fakeengine.HTTPStats{st}), st.Pulls)
	}
	for i, st := range r.decode {
		ep := r.fleet.DecodeEndpoints[i]
		booked, served := fmt.Sprintf("%d requests", r.client.PerEndpoint[ep]), fmt.Sprintf("%d decode legs", st.DecodeLegs)
		if r.localBelow > 0 {
			// A request without a prefill leg is a plain one to the engine.
			booked += fmt.Sprintf(", %d local", r.client.PerUnpaired[ep])
			served += fmt.Sprintf(", %d local", st.Requests-st.DecodeLegs)
		}
		fmt.Fprintf(tw, "%s\t%s\tdecode\t%s\t%s\t-\t%d tokens pulled\n", name, r.fleet.DecodeIDs[i], booked, served, st.TransferredTokens)
	}
}

// fallbacks counts the requests prefilled by their decode engine for want of
// a prefill leg: booked so by the EPP because no prefill worker could take
// them, or after a failed prefill leg (the sidecars' local fallback).
func (r pdResult) fallbacks() int64 {
	n := r.booker.LocalPrefill - r.booker.Conditional
	for _, s := range r.sidecars {
		n += int64(s.Fallbacks)
	}
	return n
}

// printSummary writes the run's fallbacks, sidecar legs and plans.
func (r pdResult) printSummary(out io.Writer) {
	var prefillOK, prefillFailed, bad, sidecarFallbacks, passed uint64
	for _, s := range r.sidecars {
		passed += s.Passthrough
		for k, n := range s.Legs {
			if k.Leg == sidecar.LegPrefill {
				if k.Outcome == sidecar.OutcomeOK {
					prefillOK += n
				} else {
					prefillFailed += n
				}
			}
		}
		for _, n := range s.BadHints {
			bad += n
		}
		sidecarFallbacks += s.Fallbacks
	}
	b := r.booker
	fmt.Fprintf(out, "%s: the EPP booked %d requests on a decode worker alone (%d conditionally, %d because no\n"+
		"prefill worker could take them), the sidecars prefilled %d locally after a failed prefill leg; sidecars: %d prefill legs\n"+
		"ok, %d failed, %d hints refused, %d requests passed through. Plans: %d booked, %d handed off at the first byte,\n"+
		"%d completed, %d expired.\n",
		capitalize(r.client.policy), b.LocalPrefill, b.Conditional, b.Fallbacks, sidecarFallbacks, prefillOK, prefillFailed, bad,
		passed, b.Booked, b.Plans.HandedOff, b.Plans.Completed, b.Plans.Expired)
}

func capitalize(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// countShort is the number of short questions in the workload o builds.
func countShort(o options) int {
	if o.shortEvery <= 0 {
		return 0
	}
	return o.requests / o.shortEvery
}
