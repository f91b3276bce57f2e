package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// Defaults of the disaggregated demo's engines.
const (
	pdDemoTokenInterval = 2 * time.Millisecond
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
// listening yet) over a pdFleet it owns.
type pdRig struct {
	e     *epp
	fleet *pdFleet
}

// newPDRig starts the fleet and an EPP whose catalogs hold it, and waits until
// the EPP follows every prefill engine's KV events. The sidecars check hints
// with the EPP's key (cfg.PDHintKey; none: unsigned hints); fo.model,
// fo.blockSize and fo.roleLabel come from cfg.
func newPDRig(ctx context.Context, base *config, fo pdFleetOptions, logger *slog.Logger) (*pdRig, error) {
	cfg := *base
	cfg.Topology = "disaggregated"
	cfg.TokenizerProtocol = "vllm-render"
	if fo.model != "" {
		cfg.Model = fo.model
	}
	fo.model, fo.blockSize, fo.roleLabel, fo.hintKey = cfg.Model, cfg.BlockSize, cfg.RoleLabel, cfg.PDHintKey
	fleet, err := startPDFleet(ctx, fo)
	if err != nil {
		return nil, err
	}
	cfg.TokenizerURL = "http://" + fleet.prefills[0].HTTPEndpoint()
	e, err := newEPP(ctx, &cfg, logger, func(b *selection.SelectionServiceBuilder) {
		b.EventFeed(selection.FeedOptions{ReconnectMin: 5 * time.Millisecond, ReconnectMax: 200 * time.Millisecond})
	})
	if err != nil {
		fleet.close()
		return nil, err
	}
	r := &pdRig{e: e, fleet: fleet}
	e.apply(discovery.Snapshot{Workers: fleet.workers, Synced: true})
	if err := fleet.waitSubscribed(ctx); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

// drive sends the workload through the EPP's ext_proc server to the sidecars.
func (r *pdRig) drive(ctx context.Context, o demoOptions, workload []demoRequest) (demoResult, error) {
	return demoDrive(ctx, o, "disaggregated", workload, r.e.server, r.fleet.fronts)
}

// waitSettled waits (within 10 s) until the EPP holds no plan and no load on
// either role, and returns what is left otherwise.
func (r *pdRig) waitSettled(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		err := r.unsettled()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not settled: %w", err)
		case <-t.C:
		}
	}
}

func (r *pdRig) unsettled() error {
	if st := r.e.pairs.Stats().Plans; st.Active != 0 {
		return fmt.Errorf("%d plans live (%+v)", st.Active, st)
	}
	for _, role := range []roles.Role{roles.Prefill, roles.Decode} {
		for _, l := range r.e.rs.Service(role).Loads(r.e.cfg.Model) {
			if l.ActiveRequests != 0 || l.ActiveBlocks != 0 || l.ActivePrefillTokens != 0 {
				return fmt.Errorf("%v: load left on %s: %+v", role, l.Worker, l)
			}
		}
	}
	return nil
}

func (r *pdRig) close() {
	r.e.close()
	r.fleet.close()
}

// pdDemoResult is the disaggregated run of the demo.
type pdDemoResult struct {
	client   demoResult // the client's view: latencies, decode endpoints, prefillers named
	prefill  []fakeengine.HTTPStats
	decode   []fakeengine.HTTPStats
	sidecars []sidecar.Stats
	booker   roles.BookerStats
	fleet    pdFleetView
	// localBelow is the run's BookerOptions.LocalPrefillBelow (0: a prefill
	// leg for every request).
	localBelow int
}

// pdFleetView names a fleet's workers, in its order.
type pdFleetView struct {
	prefillIDs, prefillEndpoints []string
	decodeIDs, decodeEndpoints   []string // the sidecars' endpoints
}

func (f *pdFleet) view() pdFleetView {
	var v pdFleetView
	for i, w := range f.workers { // the prefill workers come first
		if i < len(f.prefills) {
			v.prefillIDs, v.prefillEndpoints = append(v.prefillIDs, w.ID), append(v.prefillEndpoints, w.Endpoint)
		} else {
			v.decodeIDs, v.decodeEndpoints = append(v.decodeIDs, w.ID), append(v.decodeEndpoints, w.Endpoint)
		}
	}
	return v
}

// prefillHitRate is the prefill engines' prefix-cache hit rate: cached over
// prompt tokens of the prefill legs.
func (r pdDemoResult) prefillHitRate() float64 { return hitRateOf(r.prefill) }

func hitRateOf(sts []fakeengine.HTTPStats) float64 {
	var prompt, cached uint64
	for _, s := range sts {
		prompt += s.PromptTokens
		cached += s.CachedTokens
	}
	if prompt == 0 {
		return 0
	}
	return float64(cached) / float64(prompt)
}

// splitEngines divides the demo's engines between the roles: half prefill
// (rounded up), the rest decode.
func splitEngines(n int) (prefill, decode int) {
	prefill = (n + 1) / 2
	return prefill, n - prefill
}

// runDisaggregatedDemo is --demo --topology disaggregated: the shared-prefix
// workload, one request in pdDemoShortEvery a short question without a system
// prompt, through an EPP in disaggregated mode (prefill engines that publish KV
// events, decode engines behind decode sidecars), once with a prefill leg for
// every request and once with conditional disaggregation
// (DYN_EPP_LOCAL_PREFILL_BELOW), beside aggregated serving of the same workload
// on as many engines, and the tables.
func runDisaggregatedDemo(ctx context.Context, cfg *config, o demoOptions, out io.Writer) error {
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
	if o.tokenInterval <= 0 {
		o.tokenInterval = pdDemoTokenInterval
	}
	if o.shortEvery <= 0 {
		o.shortEvery = pdDemoShortEvery
	}
	o.defaults()

	// Every run starts fresh engines: the same requests, no warm cache. The
	// disaggregated run books a prefill leg for every request, whatever the
	// environment says; the conditional one uses DYN_EPP_LOCAL_PREFILL_BELOW
	// when it is set.
	workload := demoWorkload(o, 0)
	agg, err := demoRun(ctx, cfg, o, "kvselect", workload)
	if err != nil {
		return fmt.Errorf("aggregated: %w", err)
	}
	agg.policy = "aggregated"
	always := *cfg
	always.LocalPrefillBelow = 0
	pd, err := demoPDRun(ctx, &always, o, prefill, decode, workload)
	if err != nil {
		return fmt.Errorf("disaggregated: %w", err)
	}
	conditional := *cfg
	if conditional.LocalPrefillBelow <= 0 {
		conditional.LocalPrefillBelow = pdDemoLocalPrefillBelow
	}
	cond, err := demoPDRun(ctx, &conditional, o, prefill, decode, workload)
	if err != nil {
		return fmt.Errorf("disaggregated, conditional: %w", err)
	}
	cond.client.policy = "disaggregated, conditional"
	rr, err := roundRobinPrefillHitRate(o.pdFleetOptions(cfg, prefill, decode), workload)
	if err != nil {
		return err
	}
	printPDDemo(out, agg, pd, cond, rr, o, prefill, decode)
	for _, r := range []demoResult{agg, pd.client, cond.client} {
		if r.failed > 0 {
			return fmt.Errorf("%s: %d requests failed, the first: %s", r.policy, r.failed, r.firstFailure)
		}
	}
	return nil
}

// pdFleetOptions are the demo's fleet: engines as the aggregated run's, the
// prefill ones speaking its KV-event dialect.
func (o demoOptions) pdFleetOptions(cfg *config, prefill, decode int) pdFleetOptions {
	return pdFleetOptions{
		prefill: prefill, decode: decode, model: o.model, blockSize: cfg.BlockSize, roleLabel: cfg.RoleLabel,
		prefillBlocks: o.capacityTokens / cfg.BlockSize, decodeBlocks: pdDecodeBlocks, dialect: o.dialect,
		sleepTTFT: true, tokenInterval: o.tokenInterval, transferPerBlock: pdDemoTransferPerBlock,
		fallback: sidecar.FallbackLocal, logger: o.logger,
	}
}

// demoPDRun is the disaggregated run: a fresh fleet, an EPP, the workload.
func demoPDRun(ctx context.Context, cfg *config, o demoOptions, prefill, decode int, workload []demoRequest) (pdDemoResult, error) {
	rig, err := newPDRig(ctx, cfg, o.pdFleetOptions(cfg, prefill, decode), o.logger)
	if err != nil {
		return pdDemoResult{}, err
	}
	defer rig.close()
	res := pdDemoResult{fleet: rig.fleet.view(), localBelow: rig.e.cfg.LocalPrefillBelow}
	if res.client, err = rig.drive(ctx, o, workload); err != nil {
		return res, err
	}
	if err := rig.waitSettled(ctx); err != nil {
		return res, err
	}
	res.prefill, res.decode, res.booker = rig.fleet.prefillStats(), rig.fleet.decodeStats(), rig.e.pairs.Stats()
	for _, sc := range rig.fleet.sidecars {
		res.sidecars = append(res.sidecars, sc.Stats())
	}
	return res, nil
}

// roundRobinPrefillHitRate replays the workload's prompts through fresh
// prefill engines' cache model (fakeengine's Serve, no sockets), request i on
// engine i mod n: the prefill-cache hit rate of round-robin prefill placement.
func roundRobinPrefillHitRate(fo pdFleetOptions, workload []demoRequest) (float64, error) {
	var sts []fakeengine.HTTPStats
	var engines []*fakeengine.Engine
	defer func() {
		for _, e := range engines {
			_ = e.Close()
		}
	}()
	for range fo.prefill {
		e, err := fakeengine.New(fo.dialect.Apply(fakeengine.Options{BlockSize: fo.blockSize, CapacityBlocks: fo.prefillBlocks, Model: fo.model}))
		if err != nil {
			return 0, err
		}
		engines = append(engines, e)
		sts = append(sts, fakeengine.HTTPStats{})
	}
	for i, r := range workload {
		tokens, err := chatTokens(r.body)
		if err != nil {
			return 0, err
		}
		k := i % len(engines)
		res, err := engines[k].Serve(fakeengine.Request{Tokens: tokens})
		if err != nil {
			return 0, err
		}
		sts[k].PromptTokens += uint64(len(tokens))
		sts[k].CachedTokens += uint64(res.CachedBlocks * fo.blockSize)
	}
	return hitRateOf(sts), nil
}

// chatTokens returns the token ids a fake engine gives a chat request's body
// (its default template flags).
func chatTokens(body []byte) ([]uint32, error) {
	var req struct {
		Messages []fakeengine.Message `json:"messages"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		return nil, err
	}
	return fakeengine.ApplyChatTemplate(req.Messages), nil
}

func printPDDemo(out io.Writer, agg demoResult, pd, cond pdDemoResult, rrHitRate float64, o demoOptions, prefill, decode int) {
	fmt.Fprintf(out, "kvselect demo, disaggregated: %d fake prefill engines (publishing KV events, %s) and %d fake decode engines,\n"+
		"each behind a decode sidecar (vLLM NIXL), beside aggregated serving of the same workload on %d fake engines;\n"+
		"%d shared system prompts and, one request in %d, a short question without one; %d chat requests per run,\n"+
		"%d in flight, routed through the EPP's ext_proc server. The conditional run sets DYN_EPP_LOCAL_PREFILL_BELOW=%d:\n"+
		"a request whose uncached prompt on its decode worker is at most that many tokens skips the prefill leg.\n"+
		"Each engine caches %d tokens (a few system prompts; decode engines never evict), waits its simulated TTFT\n"+
		"and %v between tokens; latencies are timed by the client.\n\n",
		prefill, o.dialect, decode, prefill+decode, o.groups, o.shortEvery, o.requests, o.concurrency, cond.localBelow,
		o.capacityTokens, o.tokenInterval)
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "serving\trequests\tfailed\tTTFT p50\tTTFT p90\tTTFT p99\tITL p50\tITL p90\tITL p99\tprefill-cache hit rate\tskipped prefill\tfallbacks")
	row := func(r demoResult, hit float64, skipped, fb string) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f ms\t%.1f ms\t%.1f ms\t%.2f ms\t%.2f ms\t%.2f ms\t%.1f%%\t%s\t%s\n", r.policy, r.requests, r.failed,
			percentile(r.ttfts, 0.5), percentile(r.ttfts, 0.9), percentile(r.ttfts, 0.99),
			percentile(r.itls, 0.5), percentile(r.itls, 0.9), percentile(r.itls, 0.99), 100*hit, skipped, fb)
	}
	row(agg, hitRateOf(agg.engineStats), "-", "-")
	for _, r := range []pdDemoResult{pd, cond} {
		row(r.client, r.prefillHitRate(), fmt.Sprint(r.booker.Conditional), fmt.Sprint(r.fallbacks()))
	}
	_ = tw.Flush()

	fmt.Fprintln(out, "\nWhere each leg landed (booked: what the EPP sent there; served: what the engine counted; local: prefilled by\n"+
		"the decode engine itself, no prefill leg):")
	tw = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "serving\tworker\trole\tbooked\tserved\tprefix-cache hit rate\tKV transferred")
	for i, ep := range agg.endpoints {
		var st fakeengine.HTTPStats
		if i < len(agg.engineStats) {
			st = agg.engineStats[i]
		}
		fmt.Fprintf(tw, "aggregated\tengine-%d\taggregated\t%d requests\t%d requests\t%.1f%%\t-\n", i, agg.perEndpoint[ep], st.Requests,
			100*hitRateOf([]fakeengine.HTTPStats{st}))
	}
	for _, r := range []pdDemoResult{pd, cond} {
		r.printLegs(tw)
	}
	_ = tw.Flush()

	fmt.Fprintln(out)
	if rrHitRate > 0 {
		fmt.Fprintf(out, "Round-robin prefill placement of the same workload would hit %.1f%% (its prompts replayed through the\n"+
			"engines' cache model): kvselect's prefill placement hits %.1fx that.\n", 100*rrHitRate, pd.prefillHitRate()/rrHitRate)
	}
	for _, r := range []pdDemoResult{pd, cond} {
		r.printSummary(out)
	}
	c := cond.client
	fmt.Fprintf(out, "Conditional: %d of %d requests skipped the prefill leg, %d of the %d short questions and %d requests whose\n"+
		"system prompt their decode engine held (the decode service's approximate index knew it). TTFT p50 %.1f ms for\n"+
		"them, %.1f ms for the %d with a prefill leg; the run's p50 %.1f ms against %.1f ms with a prefill leg for every\n"+
		"request (p90 %.1f ms against %.1f ms).\n",
		cond.booker.Conditional, c.requests, c.unpairedShort, countShort(o), c.unpaired()-c.unpairedShort,
		percentile(c.unpairedTTFTs, 0.5), percentile(c.pairedTTFTs, 0.5), len(c.pairedTTFTs),
		percentile(c.ttfts, 0.5), percentile(pd.client.ttfts, 0.5), percentile(c.ttfts, 0.9), percentile(pd.client.ttfts, 0.9))
}

// printLegs writes the run's rows of the per-worker table.
func (r pdDemoResult) printLegs(tw io.Writer) {
	name := r.client.policy
	for i, st := range r.prefill {
		fmt.Fprintf(tw, "%s\t%s\tprefill\t%d prefill legs\t%d prefill legs\t%.1f%%\t%d handed over\n", name, r.fleet.prefillIDs[i],
			r.client.perPrefiller[r.fleet.prefillEndpoints[i]], st.PrefillLegs, 100*hitRateOf([]fakeengine.HTTPStats{st}), st.Pulls)
	}
	for i, st := range r.decode {
		ep := r.fleet.decodeEndpoints[i]
		booked, served := fmt.Sprintf("%d requests", r.client.perEndpoint[ep]), fmt.Sprintf("%d decode legs", st.DecodeLegs)
		if r.localBelow > 0 {
			// A request without a prefill leg is a plain one to the engine.
			booked += fmt.Sprintf(", %d local", r.client.perUnpaired[ep])
			served += fmt.Sprintf(", %d local", st.Requests-st.DecodeLegs)
		}
		fmt.Fprintf(tw, "%s\t%s\tdecode\t%s\t%s\t-\t%d tokens pulled\n", name, r.fleet.decodeIDs[i], booked, served, st.TransferredTokens)
	}
}

// fallbacks counts the requests prefilled by their decode engine for want of
// a prefill leg: booked so by the EPP because no prefill worker could take
// them, or after a failed prefill leg (the sidecars' local fallback).
func (r pdDemoResult) fallbacks() int64 {
	n := r.booker.LocalPrefill - r.booker.Conditional
	for _, s := range r.sidecars {
		n += int64(s.Fallbacks)
	}
	return n
}

// printSummary writes the run's fallbacks, sidecar legs and plans.
func (r pdDemoResult) printSummary(out io.Writer) {
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

// unpaired counts the requests whose decision named no prefill worker.
func (r demoResult) unpaired() int {
	n := 0
	for _, c := range r.perUnpaired {
		n += c
	}
	return n
}

// countShort is the number of short questions in the workload o builds.
func countShort(o demoOptions) int {
	if o.shortEvery <= 0 {
		return 0
	}
	return o.requests / o.shortEvery
}
