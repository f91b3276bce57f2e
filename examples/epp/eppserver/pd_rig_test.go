package eppserver

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
)

// pdRig is an EPP in disaggregated mode in process (its ext_proc server not
// listening yet) over a demofleet.PDFleet it owns. (examples/demo has its own,
// built on the package's exported API; this one reaches the EPP's insides.)
type pdRig struct {
	e     *EPP
	fleet *demofleet.PDFleet
}

// newPDRig starts the fleet and an EPP whose catalogs hold it, and waits until
// the EPP follows every prefill engine's KV events. The sidecars check hints
// with the EPP's key (cfg.PDHintKey; none: unsigned hints); fo.Model,
// fo.BlockSize and fo.RoleLabel come from cfg.
func newPDRig(ctx context.Context, base *Config, fo demofleet.PDFleetOptions, logger *slog.Logger) (*pdRig, error) {
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
	e, err := New(ctx, &cfg, Options{Logger: logger, Configure: func(b *selection.SelectionServiceBuilder) {
		b.EventFeed(selection.FeedOptions{ReconnectMin: 5 * time.Millisecond, ReconnectMax: 200 * time.Millisecond})
	}})
	if err != nil {
		fleet.Close()
		return nil, err
	}
	r := &pdRig{e: e, fleet: fleet}
	e.Apply(discovery.Snapshot{Workers: fleet.Workers(), Synced: true})
	if err := fleet.WaitSubscribed(ctx); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

// drive sends the workload through the EPP's ext_proc server to the
// sidecars, concurrency requests at a time.
func (r *pdRig) drive(ctx context.Context, concurrency int, workload []demofleet.Request) (demofleet.Result, error) {
	return demofleet.Drive(ctx, r.e.server, workload, demofleet.DriveOptions{Concurrency: concurrency, Endpoints: r.fleet.View().DecodeEndpoints})
}

// waitSettled waits (within 10 s) until the EPP holds no plan and no load on
// either role, and returns what is left otherwise.
func (r *pdRig) waitSettled(ctx context.Context) error {
	return demofleet.WaitFor(ctx, 10*time.Second, r.unsettled)
}

func (r *pdRig) unsettled() error {
	if st := r.e.pairs.Stats().Plans; st.Active != 0 {
		return fmt.Errorf("%d plans live (%+v)", st.Active, st)
	}
	for _, role := range []roles.Role{roles.Prefill, roles.Decode} {
		for _, l := range r.e.rs.Service(role).Loads(r.e.cfg.Model) {
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
