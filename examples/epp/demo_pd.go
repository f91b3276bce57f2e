package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
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
// workload through an EPP in disaggregated mode (prefill engines that publish
// KV events, decode engines behind decode sidecars), beside aggregated serving
// of the same workload on as many engines, and the tables.
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
	o.defaults()

	// Both runs start fresh engines: the same requests, no warm cache.
	workload := demoWorkload(o, 0)
	agg, err := demoRun(ctx, cfg, o, "kvselect", workload)
	if err != nil {
		return fmt.Errorf("aggregated: %w", err)
	}
	agg.policy = "aggregated"
	pd, err := demoPDRun(ctx, cfg, o, prefill, decode, workload)
	if err != nil {
		return fmt.Errorf("disaggregated: %w", err)
	}
	rr, err := roundRobinPrefillHitRate(o.pdFleetOptions(cfg, prefill, decode), workload)
	if err != nil {
		return err
	}
	printPDDemo(out, agg, pd, rr, o, prefill, decode)
	for _, r := range []demoResult{agg, pd.client} {
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
	res := pdDemoResult{fleet: rig.fleet.view()}
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

func printPDDemo(out io.Writer, agg demoResult, pd pdDemoResult, rrHitRate float64, o demoOptions, prefill, decode int) {
	fmt.Fprintf(out, "kvselect demo, disaggregated: %d fake prefill engines (publishing KV events, %s) and %d fake decode engines,\n"+
		"each behind a decode sidecar (vLLM NIXL), beside aggregated serving of the same workload on %d fake engines;\n"+
		"%d shared system prompts, %d chat requests per run, %d in flight, routed through the EPP's ext_proc server.\n"+
		"Each engine caches %d tokens (a few system prompts), waits its simulated TTFT and %v between tokens;\n"+
		"latencies are timed by the client.\n\n",
		prefill, o.dialect, decode, prefill+decode, o.groups, o.requests, o.concurrency, o.capacityTokens, o.tokenInterval)
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "serving\trequests\tfailed\tTTFT p50\tTTFT p90\tTTFT p99\tITL p50\tITL p90\tITL p99\tprefill-cache hit rate\tfallbacks")
	fallbacks := uint64(pd.booker.LocalPrefill)
	for _, s := range pd.sidecars {
		fallbacks += s.Fallbacks
	}
	row := func(r demoResult, hit float64, fb string) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f ms\t%.1f ms\t%.1f ms\t%.2f ms\t%.2f ms\t%.2f ms\t%.1f%%\t%s\n", r.policy, r.requests, r.failed,
			percentile(r.ttfts, 0.5), percentile(r.ttfts, 0.9), percentile(r.ttfts, 0.99),
			percentile(r.itls, 0.5), percentile(r.itls, 0.9), percentile(r.itls, 0.99), 100*hit, fb)
	}
	row(agg, hitRateOf(agg.engineStats), "-")
	row(pd.client, pd.prefillHitRate(), fmt.Sprint(fallbacks))
	_ = tw.Flush()

	fmt.Fprintln(out, "\nWhere each leg landed (booked: what the EPP sent there; served: what the engine counted):")
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
	for i, st := range pd.prefill {
		fmt.Fprintf(tw, "disaggregated\t%s\tprefill\t%d prefill legs\t%d prefill legs\t%.1f%%\t%d handed over\n", pd.fleet.prefillIDs[i],
			pd.client.perPrefiller[pd.fleet.prefillEndpoints[i]], st.PrefillLegs, 100*hitRateOf([]fakeengine.HTTPStats{st}), st.Pulls)
	}
	for i, st := range pd.decode {
		fmt.Fprintf(tw, "disaggregated\t%s\tdecode\t%d requests\t%d decode legs\t-\t%d tokens pulled\n", pd.fleet.decodeIDs[i],
			pd.client.perEndpoint[pd.fleet.decodeEndpoints[i]], st.DecodeLegs, st.TransferredTokens)
	}
	_ = tw.Flush()

	fmt.Fprintln(out)
	if rrHitRate > 0 {
		fmt.Fprintf(out, "Round-robin prefill placement of the same workload would hit %.1f%% (its prompts replayed through the\n"+
			"engines' cache model): kvselect's prefill placement hits %.1fx that.\n", 100*rrHitRate, pd.prefillHitRate()/rrHitRate)
	}
	var prefillOK, prefillFailed, bad uint64
	for _, s := range pd.sidecars {
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
	}
	var sidecarFallbacks uint64
	for _, s := range pd.sidecars {
		sidecarFallbacks += s.Fallbacks
	}
	b := pd.booker
	fmt.Fprintf(out, "Fallbacks: the EPP booked %d requests on a decode worker alone (%d of them because no prefill worker could\n"+
		"take them), the sidecars prefilled %d locally after a failed prefill leg; sidecars: %d prefill legs ok, %d failed,\n"+
		"%d hints refused. Plans: %d booked, %d handed off at the first byte, %d completed, %d expired.\n",
		b.LocalPrefill, b.Fallbacks, sidecarFallbacks, prefillOK, prefillFailed, bad, b.Booked, b.Plans.HandedOff, b.Plans.Completed, b.Plans.Expired)
}
