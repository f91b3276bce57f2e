package eppserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/examples/epp/oteltracing"
	"github.com/kvselect/kvselect/examples/epp/prommetrics"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// Options are what a caller of New adds to the configuration.
type Options struct {
	// Logger receives the EPP's log; nil discards it.
	Logger *slog.Logger
	// Configure, when set, adjusts every selection service's builder after
	// the EPP has configured it (the demo shortens the feeds' reconnect
	// backoff).
	Configure func(*selection.SelectionServiceBuilder)
}

// EPP is one assembled Endpoint Picker: the tokenizer, one selection service
// per role of the topology, the pair booker, the router and the ext_proc
// server, with its Prometheus registry. It listens nowhere: Serve serves it,
// and a caller in process (the demo) registers ExtProc on a gRPC server of
// its own. Create it with New and Close it.
type EPP struct {
	cfg    *Config
	logger *slog.Logger
	// pool fails over between the tokenizer endpoints (a Client per URL),
	// and cache (the router's tokenizer) wraps the pool. tokenizers keeps
	// the pool's URLs equal to the discovered workers' when no URL is
	// configured; nil otherwise. Apply owns it.
	pool       *tokenize.Pool
	cache      *tokenize.Cache
	tokenizers *discovery.Tokenizers
	// rs owns one selection service per role of the topology (one in
	// aggregated mode); pairs books every request on them, in both modes.
	rs     *roles.RoleSelectors
	pairs  *roles.PairBooker
	router *router
	server *extproc.Server
	reg    *prometheus.Registry
	// excluded is what the last snapshot excluded (id -> reason and value), so
	// that only changes are logged. Apply owns it (one discovery loop).
	excluded map[string]string
	// rep shares the active load with the EPP's peers; nil without
	// replicas. The EPP owns its Replicators; the link is the caller's.
	rep *replication
	// lora is LoRA-adapter affinity; nil when off (DYN_EPP_LORA_AFFINITY).
	lora *loraPolicy
}

// New builds an EPP from cfg (a LoadConfig result, possibly adjusted): it
// starts the selection services (their sweepers, and their KV-event feeds as
// Apply registers workers) but listens nowhere. It reports ready once Apply
// has applied a synced snapshot.
func New(ctx context.Context, cfg *Config, o Options) (*EPP, error) {
	return build(ctx, cfg, o, extras{})
}

// extras are the parts of an EPP that Serve (and the tests) own.
type extras struct {
	// rep, when set, shares the load with peers: one Replicator per role,
	// observing its role's service, started by Apply once discovery has
	// synced.
	rep *replication
	// tracing, when set, traces every pick (DYN_EPP_OTLP_ENDPOINT); nil
	// traces nothing and spends nothing on it.
	tracing trace.TracerProvider
	// now, when set, is the clock of the selection services and of the
	// plans' leases (tests); nil: the wall clock.
	now func() time.Time
}

// build is New with the extras.
func build(ctx context.Context, cfg *Config, o Options, x extras) (*EPP, error) {
	if cfg == nil {
		return nil, errors.New("eppserver: New needs a configuration")
	}
	rp, logger := x.rep, o.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	// Without configured URLs the pool starts empty and follows discovery
	// (Apply gives it the workers' own endpoints).
	pool, err := tokenize.NewClientPool(tokenize.Options{
		Protocol: cfg.TokenizerProtocol, Timeout: cfg.TokenizerTimeout,
		MaxResponseBytes: int64(cfg.TokenizerMaxResp), MaxPromptTokens: cfg.MaxPromptTokens, Logger: logger,
	}, cfg.TokenizerURLs, tokenize.PoolOptions{})
	if err != nil {
		return nil, err
	}
	// A shared call outlives the caller that started it: it is bounded by the
	// configured timeout (not the cache's default), once per endpoint it may
	// fail over to (Pool.CallTimeout), and counted against the same
	// admission as requests, so cancelled requests cannot pile up calls.
	cache, err := tokenize.NewCache(pool, tokenize.CacheOptions{
		ShareResults: true, Protocol: cfg.TokenizerProtocol, Model: cfg.Model, Logger: logger,
		CallTimeout: pool.CallTimeout(cfg.TokenizerTimeout), MaxCalls: cfg.MaxInflight,
	})
	if err != nil {
		pool.Close()
		return nil, err
	}
	e := &EPP{cfg: cfg, logger: logger, pool: pool, cache: cache, reg: prometheus.NewRegistry(), rep: rp}
	if e.lora, err = newLoRA(cfg); err != nil {
		e.Close()
		return nil, err
	}
	if len(cfg.TokenizerURLs) == 0 {
		e.tokenizers = discovery.NewTokenizers(pool, cfg.Model, cfg.TokenizerProtocol, logger)
		logger.Info("tokenizers: the discovered workers' own endpoints, following discovery (DYN_EPP_TOKENIZER_SERVICE_URL unset)",
			"protocol", cfg.TokenizerProtocol, "model", cfg.Model, "left_out_when", discovery.EngineLabel+" != "+e.tokenizers.Engine())
	} else {
		logger.Info("tokenizers: the configured URLs (DYN_EPP_TOKENIZER_SERVICE_URL)", "protocol", cfg.TokenizerProtocol, "urls", cfg.TokenizerURLs)
	}
	fail := func(err error) (*EPP, error) {
		e.Close()
		return nil, err
	}
	setup := func(b *selection.SelectionServiceBuilder) {
		b.Logger(logger)
		if x.now != nil {
			b.Clock(x.now)
		}
		if o.Configure != nil {
			o.Configure(b)
		}
	}
	mode := roles.ModeAggregated
	if cfg.Topology == "disaggregated" {
		mode = roles.ModeDisaggregated
	}
	decisions, err := prommetrics.NewDecisions(e.reg)
	if err != nil {
		return fail(err)
	}
	var tracer trace.Tracer
	if x.tracing != nil {
		tracer = x.tracing.Tracer(oteltracing.TracerName)
	}
	if rp != nil {
		if err := rp.newReplicators(cfg, mode); err != nil {
			return fail(err)
		}
	}
	e.rs, err = roles.New(ctx, roles.RoleOptions{
		Mode: mode, LabelKey: cfg.RoleLabel, Base: cfg.Router, Logger: logger,
		Profile: roles.ProfileOptions{PrefillMaxNumBatchedTokens: cfg.PrefillMaxBatched, DecodeMaxNumBatchedTokens: cfg.DecodeMaxBatched},
		Configure: func(r roles.Role, b *selection.SelectionServiceBuilder) {
			setup(b)
			e.lora.configure(b)
			b.Recorder(decisions.ForRole(r.String()))
			if tracer != nil {
				dt, _ := oteltracing.NewDecisionTracer(tracer, r.String()) // never a nil tracer here
				b.Tracer(dt)
			}
			if rp != nil {
				rp.observe(r, b)
			}
			if r != roles.Decode && cfg.KVEventBind != "" { // decode workers publish no events
				b.BindEvents(cfg.KVEventBind)
				if cfg.KVEventBindAny {
					b.BindEventsFromAnyPeer()
				}
			}
		},
	})
	if err == nil {
		e.pairs, err = roles.NewPairBooker(e.rs, roles.BookerOptions{LocalPrefillBelow: cfg.LocalPrefillBelow, Now: x.now})
	}
	if err != nil {
		return fail(err)
	}
	dest := e.rs.Service(mode.Destination())
	e.router = newRouter(cfg.Model, cache, e.lora.booker(e.pairs), dest)
	e.router.noDegrade = cfg.TokenizerNoDegrade
	if rp != nil && cfg.HoldBursts {
		e.router.hold = dest.Replicas().Hold
	}
	e.router.sessionHeader = cfg.SessionHeader
	e.router.fallbacks, e.router.growth, e.router.debug = cfg.Fallbacks, cfg.OutputGrowth, cfg.DebugHeader
	e.router.tracer, e.router.log = tracer, logger
	if e.router.m, err = prommetrics.NewResponses(e.reg); err != nil {
		return fail(err)
	}
	if cfg.RenewInterval > 0 {
		e.router.renew = newRenewer(e.router.m)
	}
	if cfg.PDHintKey != nil {
		e.router.signer = &hintSigner{key: cfg.PDHintKey, ttl: cfg.PDHintTTL, now: time.Now}
	}
	services := map[string]*selection.SelectionService{}
	for _, r := range mode.Roles() {
		services[r.String()] = e.rs.Service(r)
	}
	sc, err := prommetrics.NewServiceCollector(prommetrics.ServiceOptions{Services: services, Cache: cache, Model: cfg.Model})
	if err != nil {
		return fail(err)
	}
	tc, err := prommetrics.NewTokenizerCollector(prommetrics.TokenizerOptions{Pool: pool, Degraded: e.router.degraded.Load})
	if err != nil {
		return fail(err)
	}
	cs := []prometheus.Collector{collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), sc, tc}
	if rp != nil {
		ro := prommetrics.ReplicaOptions{Replicators: rp.reps, RefusedReplies: rp.cl.Bus().RefusedReplies}
		if rp.srv != nil {
			ro.Routes, ro.Configured, ro.RefusedRoutes = rp.srv.Peers, rp.srv.Routes, rp.srv.RefusedRoutes
		}
		rc, err := prommetrics.NewReplicaCollector(ro)
		if err != nil {
			return fail(err)
		}
		cs = append(cs, rc)
	}
	for _, c := range cs {
		if err := e.reg.Register(c); err != nil {
			return fail(err)
		}
	}
	sm, err := prommetrics.NewExtProcRecorder(e.reg)
	if err != nil {
		return fail(err)
	}
	e.server, err = extproc.NewServer(extproc.Options{
		Picker: e.lora.picker(e.router), Status: overloadAs(statusOf, cfg.OverloadStatus), Reason: selection.RefusalReason, MaxBodyBytes: cfg.MaxBodyBytes, MaxInflight: cfg.MaxInflight,
		Logger: logger, Metrics: sm, ConformanceTestHooks: cfg.ConformanceTestHooks,
	})
	if err != nil {
		return fail(err)
	}
	return e, nil
}

// Close closes the Replicators, the pair booker, the selection services and
// the tokenizer, and waits for their goroutines. The caller stops serving
// ExtProc first.
func (e *EPP) Close() {
	if e.rep != nil { // before the services: a Replicator frees its peers' bookings there
		e.rep.closeReplicators()
	}
	if e.pairs != nil {
		e.pairs.Close()
	}
	if e.rs != nil {
		_ = e.rs.Close()
	}
	e.cache.Close()
	e.pool.Close()
}

// TokenizerStats are the tokenizer pool's counters: failovers, hedges,
// exhaustion and each endpoint's calls, failures and circuit.
func (e *EPP) TokenizerStats() tokenize.PoolStats { return e.pool.Stats() }

// ExtProc is the EPP's ext_proc server, to register on a gRPC server.
func (e *EPP) ExtProc() *extproc.Server { return e.server }

// Service is role's selection service; nil for a role the topology does
// not have.
func (e *EPP) Service(r roles.Role) *selection.SelectionService { return e.rs.Service(r) }

// BookerStats are the pair booker's counters: the plans booked, handed off,
// completed, expired and live, and the requests booked without a prefill
// leg.
func (e *EPP) BookerStats() roles.BookerStats { return e.pairs.Stats() }

// withDefaults fills what discovery does not know from the configuration.
func (e *EPP) withDefaults(ws []catalog.Worker) []catalog.Worker {
	desired := make([]catalog.Worker, 0, len(ws))
	for _, w := range ws {
		if w.MaxNumBatchedTokens == 0 {
			w.MaxNumBatchedTokens = e.cfg.MaxBatched
		}
		if w.TotalKVBlocks == 0 {
			w.TotalKVBlocks = e.cfg.TotalKVBlocks
		}
		if w.BlockSize == 0 {
			w.BlockSize = e.cfg.BlockSize
		}
		desired = append(desired, w)
	}
	return desired
}

// Apply reconciles the selection service(s) with a discovery snapshot; the
// first synced snapshot makes the EPP ready (with replicas, once they have
// synced too). One goroutine at a time calls it: the discovery loop's.
func (e *EPP) Apply(s discovery.Snapshot) {
	desired := e.withDefaults(s.Workers)
	res, err := e.rs.Reconcile(desired)
	if err != nil {
		e.logger.Warn("reconcile", "err", err)
	}
	for _, plan := range res.Plans {
		for _, inv := range plan.Invalid {
			e.logger.Warn("invalid worker", "id", inv.ID, "err", inv.Err)
		}
	}
	for _, rec := range res.NotSchedulable {
		e.logger.Info("worker not schedulable", "id", rec.Worker.ID, "identity", rec.Worker.Identity, "reasons", fmt.Sprint(rec.Reasons))
	}
	e.logExclusions(res.Excluded)
	if e.tokenizers != nil { // before the EPP reports ready: its first requests find tokenizers
		e.tokenizers.Follow(desired, s.Synced)
	}
	e.router.setWorkers(desired)
	e.lora.update(desired)
	switch {
	case !s.Synced:
	case e.rep != nil:
		// The workers are registered: the Replicators start, and
		// readyWhenSynced reports ready once they have synced.
		e.rep.start(e.rs)
	case !e.server.Ready():
		e.server.SetReady(true)
		e.logger.Info("discovery synced; serving", "workers", len(desired))
	}
}

// logExclusions logs the workers the role split excluded, once per change: a
// new exclusion, a changed reason or value, and an exclusion that ended.
func (e *EPP) logExclusions(xs []roles.Excluded) {
	now := make(map[string]string, len(xs))
	for _, x := range xs {
		key := x.Reason + "\x00" + x.Value
		now[x.ID] = key
		if e.excluded[x.ID] != key {
			e.logger.Info("worker excluded", "id", x.ID, "reason", x.Reason, "value", x.Value)
		}
	}
	for id := range e.excluded {
		if _, still := now[id]; !still {
			e.logger.Info("worker no longer excluded", "id", id)
		}
	}
	e.excluded = now
}
