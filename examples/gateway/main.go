package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/prommetrics"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/selection/httproute"
	"github.com/kvselect/kvselect/tokenize"
)

// shutdownGrace is how long in-flight answers may finish after a signal.
const shutdownGrace = 10 * time.Second

// readHeaderTimeout bounds reading a request's headers.
const readHeaderTimeout = 10 * time.Second

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) int {
	fs := flag.NewFlagSet("gateway", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg, err := loadConfig(fs, args, getenv)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, err)
		return 2
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	g, err := newGateway(ctx, cfg, logger, nil)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	defer g.close()
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", cfg.Addr)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	mln, err := lc.Listen(ctx, "tcp", cfg.MetricsAddr)
	if err != nil {
		_ = ln.Close()
		fmt.Fprintln(stderr, err)
		return 1
	}
	logger.Info("gateway listening", slog.String("addr", ln.Addr().String()), slog.String("metrics", mln.Addr().String()),
		slog.String("workers_file", cfg.WorkersFile), slog.String("topology", cfg.Topology.String()), slog.Bool("kv_events", cfg.UseKVEvents), slog.Int("tokenizers", len(cfg.TokenizerURLs)))
	if err := g.serve(ctx, ln, mln); err != nil {
		logger.Error("gateway stopped", slog.String("error", err.Error()))
		return 1
	}
	return 0
}

// gateway is the assembled program: tokenizers, selection services, pair
// booker, Router, the workers file, the HTTP handler and the metrics
// registry.
type gateway struct {
	log  *slog.Logger
	cfg  config
	pool *tokenize.Pool // a Client per tokenizer URL
	// tokenizers gives pool the workers' own endpoints when no tokenizer
	// URL is configured (nil otherwise); apply drives it.
	tokenizers *discovery.Tokenizers
	cache      *tokenize.Cache // over pool
	// rs holds a selection service per role of cfg.Topology (aggregated; or
	// prefill and decode), pairs books every request on them.
	rs     *roles.RoleSelectors
	pairs  *roles.PairBooker
	router *httproute.Router
	source *discovery.Static
	mux    *http.ServeMux
	// reg holds every series GET /metrics serves; nothing is registered
	// in a global registry.
	reg *prometheus.Registry
	// synced is closed once the first workers snapshot is applied.
	synced chan struct{}
}

// selectionConfig is the selection configuration the gateway's services
// start from: the defaults, with what its flags set.
func (cfg config) selectionConfig() selection.Config {
	scfg := selection.DefaultConfig(cfg.BlockSize)
	scfg.UseKVEvents = cfg.UseKVEvents
	scfg.FailureEjection = cfg.FailureEjection
	scfg.Cost = cfg.Cost
	scfg.FeedTrust = cfg.FeedTrust
	scfg.Classes = cfg.Classes
	return scfg
}

// newGateway builds everything that does not listen yet. configure, when set,
// adjusts every role's selection service builder (tests use it).
func newGateway(ctx context.Context, cfg config, logger *slog.Logger, configure func(*selection.SelectionServiceBuilder)) (*gateway, error) {
	g := &gateway{log: logger, cfg: cfg, synced: make(chan struct{})}
	var err error
	defer func() {
		if err != nil {
			g.close()
		}
	}()
	g.source, err = discovery.NewStatic(discovery.StaticOptions{
		Path: cfg.WorkersFile, Defaults: discovery.Defaults{Model: cfg.Model, BlockSize: cfg.BlockSize}, RoleLabel: g.roleLabel(), Logger: logger,
	})
	if err != nil {
		return nil, err
	}
	// One URL is a Pool of one: the same calls, and the same counters.
	if g.pool, err = tokenize.NewClientPool(tokenize.Options{Protocol: cfg.TokenizerProtocol, Timeout: cfg.TokenizerTimeout,
		MaxRequestBytes: cfg.MaxBodyBytes, MaxPromptTokens: cfg.MaxPromptTokens, Logger: logger}, cfg.TokenizerURLs, tokenize.PoolOptions{}); err != nil {
		return nil, err
	}
	// The Router only hashes the ids: share the cached slices. A call is
	if len(cfg.TokenizerURLs) == 0 {
		g.tokenizers = discovery.NewTokenizers(g.pool, cfg.Model, cfg.TokenizerProtocol, logger)
		logger.Info("tokenizers: the workers' own endpoints, following the workers file", "protocol", cfg.TokenizerProtocol, "model", cfg.Model)
	}
	// bounded by the pool's failover (up to three endpoints' timeouts).
	g.cache, err = tokenize.NewCache(g.pool, tokenize.CacheOptions{ShareResults: true, Protocol: cfg.TokenizerProtocol,
		Model: cfg.Model, CallTimeout: g.pool.CallTimeout(cfg.TokenizerTimeout), MaxCalls: cfg.MaxInflight, Logger: logger})
	if err != nil {
		return nil, err
	}
	g.reg = prometheus.NewRegistry()
	var decisions *prommetrics.Decisions
	if decisions, err = prommetrics.NewDecisions(g.reg); err != nil {
		return nil, err
	}
	g.rs, err = roles.New(ctx, roles.RoleOptions{Mode: cfg.Topology, LabelKey: cfg.RoleLabel, Base: cfg.selectionConfig(), Logger: logger,
		Configure: func(r roles.Role, b *selection.SelectionServiceBuilder) {
			b.Logger(logger).Recorder(decisions.ForRole(r.String()))
			if r != roles.Decode && cfg.UseKVEvents && cfg.KVEventBind != "" { // decode workers publish no events
				b.BindEvents(cfg.KVEventBind)
				if cfg.KVEventBindAny {
					b.BindEventsFromAnyPeer()
				}
			}
			if configure != nil {
				configure(b)
			}
		}})
	if err != nil {
		return nil, err
	}
	for _, r := range cfg.Topology.Roles() {
		if a := g.rs.Service(r).Events().BindAddr(); a != nil {
			logger.Info("kv events: bound for engines that dial out", "role", r.String(), "addr", a.String())
		}
	}
	// One booker in either topology: a pair per request, or one aggregated
	// worker; its plans are the Router's handles.
	if g.pairs, err = roles.NewPairBooker(g.rs, roles.BookerOptions{}); err != nil {
		return nil, err
	}
	g.router, err = httproute.New(httproute.Options{Service: httproute.Pairs(g.pairs), Tokenizer: g.cache, MaxBodyBytes: cfg.MaxBodyBytes,
		BodyTimeout: cfg.BodyTimeout, MaxInflight: cfg.MaxInflight, MaxPromptTokens: cfg.MaxPromptTokens, Logger: logger,
		OutputGrowth: cfg.Cost == selection.CostPredictive, NoDegrade: cfg.TokenizerNoDegrade, OverloadStatus: cfg.OverloadStatus})
	if err != nil {
		return nil, err
	}
	if err = g.registerMetrics(); err != nil {
		return nil, err
	}
	g.mux = http.NewServeMux()
	g.mux.Handle("POST /v1/chat/completions", g.router)
	g.mux.Handle("POST /v1/completions", g.router)
	g.mux.HandleFunc("GET /health", g.health)
	return g, nil
}

// close releases what newGateway built; it is safe on a partial gateway.
func (g *gateway) close() {
	if g.router != nil {
		g.router.CloseIdleConnections()
	}
	if g.pairs != nil {
		g.pairs.Close()
	}
	if g.rs != nil {
		_ = g.rs.Close()
	}
	if g.cache != nil {
		g.cache.Close()
	}
	if g.pool != nil {
		g.pool.Close()
	}
}

// registerMetrics registers what GET /metrics serves: the Go runtime and
// the process, the selection services (labelled by role, the EPP's families)
// with their KV-event feeds and the tokenizer cache, the tokenizer pool, the
// Router and the workers file.
func (g *gateway) registerMetrics() error {
	services := map[string]*selection.SelectionService{}
	for _, r := range g.cfg.Topology.Roles() {
		services[r.String()] = g.rs.Service(r)
	}
	sc, err := prommetrics.NewServiceCollector(prommetrics.ServiceOptions{Services: services, Cache: g.cache, Model: g.cfg.Model})
	if err != nil {
		return err
	}
	rc, err := prommetrics.NewRouterCollector(g.router)
	if err != nil {
		return err
	}
	// The pool's counters (the EPP's families). The degraded requests are
	// the Router's: kvselect_httproute_refusals_total{reason="tokenizer_degraded"}.
	pc, err := prommetrics.NewTokenizerCollector(prommetrics.TokenizerOptions{Pool: g.pool})
	if err != nil {
		return err
	}
	wc, err := prommetrics.NewWorkersFileCollector(g.source)
	if err != nil {
		return err
	}
	for _, c := range []prometheus.Collector{collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		sc, rc, pc, wc} {
		if err := g.reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// health answers 200 once the workers file is applied and a request can be
// booked (a schedulable worker, of each role when disaggregated), 503 before.
func (g *gateway) health(w http.ResponseWriter, _ *http.Request) {
	select {
	case <-g.synced:
	default:
		http.Error(w, "workers file not applied yet", http.StatusServiceUnavailable)
		return
	}
	if !g.pairs.Ready() {
		var counts []string
		for _, rc := range g.rs.Census().Roles {
			counts = append(counts, fmt.Sprintf("%s: %d of %d schedulable", rc.Role, rc.Schedulable, rc.Workers))
		}
		http.Error(w, "no schedulable worker ("+strings.Join(counts, ", ")+")", http.StatusServiceUnavailable)
		return
	}
	_, _ = io.WriteString(w, "ok\n")
}

// roleLabel is the label that carries a worker's role.
func (g *gateway) roleLabel() string { return cmp.Or(g.cfg.RoleLabel, roles.DefaultRoleLabel) }

// apply reconciles the role services with a workers snapshot (deletes
// first, then upserts; roles.RoleSelectors.Reconcile). The workers file's
// Run calls it, one snapshot at a time.
func (g *gateway) apply(s discovery.Snapshot) {
	res, err := g.rs.Reconcile(s.Workers)
	if res.Plans == nil { // refused whole: nothing changed
		g.log.Warn("workers file not applied", slog.String("error", err.Error()))
		return
	}
	if err != nil { // the upserts a service refused; the rest is applied
		g.log.Warn("workers not applied", slog.String("error", err.Error()))
	}
	for _, r := range g.cfg.Topology.Roles() {
		for _, inv := range res.Plans[r].Invalid {
			g.log.Warn("invalid worker", slog.String("id", inv.ID), slog.String("role", r.String()), slog.String("error", inv.Err.Error()))
		}
	}
	for _, rec := range res.NotSchedulable {
		g.log.Info("worker not schedulable", slog.String("id", rec.Worker.ID), slog.String("reasons", fmt.Sprint(rec.Reasons)))
	}
	for _, x := range res.Excluded {
		g.log.Warn("worker excluded: its role label names no role", slog.String("id", x.ID), slog.String("label", g.roleLabel()),
			slog.String("reason", x.Reason), slog.String("value", x.Value))
	}
	if g.cfg.Topology == roles.ModeAggregated {
		g.warnRoleLabels(s.Workers)
	}
	if g.tokenizers != nil { // before the first snapshot counts as applied: the first requests find tokenizers
		g.tokenizers.Follow(s.Workers, s.Synced)
	}
	select {
	case <-g.synced:
	default:
		close(g.synced)
		g.log.Info("workers file applied", slog.Int("workers", len(s.Workers)), slog.String("topology", g.cfg.Topology.String()))
	}
}

// warnRoleLabels warns when workers of an aggregated gateway are labelled
// prefill or decode: they look like a disaggregated pool, whose decode
// workers need a prefill worker named to them.
func (g *gateway) warnRoleLabels(ws []catalog.Worker) {
	split, err := roles.Split(ws, roles.ModeDisaggregated, g.roleLabel())
	if err != nil {
		return // the label key is checked by roles.New: not reached
	}
	var labelled []string
	for _, r := range []roles.Role{roles.Prefill, roles.Decode} {
		for _, w := range split.ByRole[r] {
			labelled = append(labelled, w.ID)
		}
	}
	if len(labelled) > 0 {
		g.log.Warn("workers labelled prefill or decode are served as aggregated workers; pair them with --topology=disaggregated",
			slog.String("label", g.roleLabel()), slog.Any("workers", labelled))
	}
}

// metricsHandler serves GET /metrics from the gateway's registry.
func (g *gateway) metricsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(g.reg, promhttp.HandlerOpts{}))
	return mux
}

// serve runs the workers file's watcher, the HTTP server on ln and the
// metrics server on mln until ctx is done, then lets the answers in flight
// finish (at most shutdownGrace). It returns nil after a shutdown requested
// through ctx.
func (g *gateway) serve(ctx context.Context, ln, mln net.Listener) error {
	errLog := slog.NewLogLogger(g.log.Handler(), slog.LevelDebug)
	srv := &http.Server{
		Handler:           g.mux,
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       g.cfg.ReadTimeout,
		IdleTimeout:       g.cfg.IdleTimeout,
		ErrorLog:          errLog,
	}
	ms := &http.Server{Handler: g.metricsHandler(), ReadHeaderTimeout: readHeaderTimeout, ReadTimeout: g.cfg.ReadTimeout,
		IdleTimeout: g.cfg.IdleTimeout, ErrorLog: errLog}
	eg, ctx := errgroup.WithContext(ctx)
	eg.Go(func() error { return g.source.Run(ctx, g.apply) })
	serveOn := func(s *http.Server, l net.Listener) func() error {
		return func() error {
			if err := s.Serve(l); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		}
	}
	eg.Go(serveOn(srv, ln))
	eg.Go(serveOn(ms, mln))
	eg.Go(func() error {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownGrace)
		defer cancel()
		if err := ms.Shutdown(sctx); err != nil {
			_ = ms.Close()
		}
		if err := srv.Shutdown(sctx); err != nil {
			return srv.Close()
		}
		return nil
	})
	if err := eg.Wait(); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}
