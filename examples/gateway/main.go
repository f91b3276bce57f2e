// Command gateway is a plain-HTTP OpenAI gateway that embeds kvselect: every
// chat or completions request is tokenized with the engines' own tokenizer,
// booked on the best worker by the selection service, and proxied there by
// selection/httproute, which settles the booking as the answer streams.
// Workers come from a static file (the reference EPP's format, watched for
// changes); KV events keep the index true, or approximate mode routes on the
// gateway's own decisions.
//
//	go run ./examples/gateway --workers-file workers.json --tokenizer-url http://10.0.0.5:8000
//
// It serves POST /v1/chat/completions, POST /v1/completions and GET /health
// (200 once the workers file is applied and a worker is schedulable) on
// --addr, and GET /metrics (Prometheus: the selection service's, the
// KV-event feeds', the tokenizer cache's and pool's and the Router's series,
// the reference EPP's names) on --metrics-addr, a listener of its own as the
// EPP's. --tokenizer-url takes several URLs, comma-separated: one
// tokenize.Pool over them, failing over from one to the next; when none
// answers, requests are routed on load alone (--tokenizer-no-degrade=true
// refuses them instead). Every flag also reads an environment variable;
// --help lists them.
package main

import (
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
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/prommetrics"
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
		slog.String("workers_file", cfg.WorkersFile), slog.Bool("kv_events", cfg.UseKVEvents), slog.Int("tokenizers", len(cfg.TokenizerURLs)))
	if err := g.serve(ctx, ln, mln); err != nil {
		logger.Error("gateway stopped", slog.String("error", err.Error()))
		return 1
	}
	return 0
}

// gateway is the assembled program: tokenizers, selection service, Router,
// the workers file, the HTTP handler and the metrics registry.
type gateway struct {
	log    *slog.Logger
	cfg    config
	pool   *tokenize.Pool  // a Client per tokenizer URL
	cache  *tokenize.Cache // over pool
	svc    *selection.SelectionService
	router *httproute.Router
	source *discovery.Static
	mux    *http.ServeMux
	// reg holds every series GET /metrics serves; nothing is registered
	// in a global registry.
	reg *prometheus.Registry
	// synced is closed once the first workers snapshot is applied.
	synced chan struct{}
}

// newGateway builds everything that does not listen yet. configure, when set,
// adjusts the selection service's builder (tests use it).
func newGateway(ctx context.Context, cfg config, logger *slog.Logger, configure func(*selection.SelectionServiceBuilder)) (*gateway, error) {
	g := &gateway{log: logger, cfg: cfg, synced: make(chan struct{})}
	var err error
	defer func() {
		if err != nil {
			g.close()
		}
	}()
	g.source, err = discovery.NewStatic(discovery.StaticOptions{
		Path: cfg.WorkersFile, Defaults: discovery.Defaults{Model: cfg.Model, BlockSize: cfg.BlockSize}, Logger: logger,
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
	scfg := selection.DefaultConfig(cfg.BlockSize)
	scfg.UseKVEvents = cfg.UseKVEvents
	scfg.FailureEjection = cfg.FailureEjection
	scfg.Cost = cfg.Cost
	scfg.FeedTrust = cfg.FeedTrust
	b := selection.NewSelectionServiceBuilder(scfg).Logger(logger).Recorder(decisions.ForRole(role))
	if cfg.UseKVEvents && cfg.KVEventBind != "" {
		b.BindEvents(cfg.KVEventBind)
		if cfg.KVEventBindAny {
			b.BindEventsFromAnyPeer()
		}
	}
	if configure != nil {
		configure(b)
	}
	g.svc, err = b.Build(ctx)
	if err != nil {
		return nil, err
	}
	if a := g.svc.Events().BindAddr(); a != nil {
		logger.Info("kv events: bound for engines that dial out", "addr", a.String())
	}
	g.router, err = httproute.New(httproute.Options{Service: httproute.Single(g.svc), Tokenizer: g.cache, MaxBodyBytes: cfg.MaxBodyBytes,
		BodyTimeout: cfg.BodyTimeout, MaxInflight: cfg.MaxInflight, MaxPromptTokens: cfg.MaxPromptTokens, Logger: logger,
		OutputGrowth: cfg.Cost == selection.CostPredictive, NoDegrade: cfg.TokenizerNoDegrade})
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
	if g.svc != nil {
		_ = g.svc.Close()
	}
	if g.cache != nil {
		g.cache.Close()
	}
	if g.pool != nil {
		g.pool.Close()
	}
}

// role is the selection service's role label in the metrics: the gateway
// has one service, the EPP's aggregated one.
const role = "aggregated"

// registerMetrics registers what GET /metrics serves: the Go runtime and
// the process, the selection service with its KV-event feeds and the
// tokenizer cache (the EPP's families, role "aggregated"), the tokenizer
// pool, the Router and the workers file.
func (g *gateway) registerMetrics() error {
	sc, err := prommetrics.NewServiceCollector(prommetrics.ServiceOptions{
		Services: map[string]*selection.SelectionService{role: g.svc}, Cache: g.cache, Model: g.cfg.Model})
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

// health answers 200 once the workers file is applied and a worker is
// schedulable, 503 before.
func (g *gateway) health(w http.ResponseWriter, _ *http.Request) {
	select {
	case <-g.synced:
	default:
		http.Error(w, "workers file not applied yet", http.StatusServiceUnavailable)
		return
	}
	if r := g.svc.Ready(); !r.Ready {
		http.Error(w, fmt.Sprintf("no schedulable worker (%d known)", r.Workers), http.StatusServiceUnavailable)
		return
	}
	_, _ = io.WriteString(w, "ok\n")
}

// apply reconciles the service with a workers snapshot: deletes first, then
// upserts. The workers file's Run calls it, one snapshot at a time.
func (g *gateway) apply(s discovery.Snapshot) {
	plan, err := catalog.Reconcile(g.svc.Workers(), s.Workers)
	if err != nil {
		g.log.Warn("workers file not applied", slog.String("error", err.Error()))
		return
	}
	for _, inv := range plan.Invalid {
		g.log.Warn("invalid worker", slog.String("id", inv.ID), slog.String("error", inv.Err.Error()))
	}
	for _, id := range plan.Deletes {
		if _, err := g.svc.DeleteWorker(id); err != nil {
			g.log.Warn("delete worker", slog.String("id", id), slog.String("error", err.Error()))
		}
	}
	for _, w := range plan.Upserts {
		rec, err := g.svc.UpsertWorker(w)
		switch {
		case err != nil:
			g.log.Warn("upsert worker", slog.String("id", w.ID), slog.String("error", err.Error()))
		case rec.Lifecycle != catalog.Schedulable:
			g.log.Info("worker not schedulable", slog.String("id", w.ID), slog.String("reasons", fmt.Sprint(rec.Reasons)))
		}
	}
	select {
	case <-g.synced:
	default:
		close(g.synced)
		g.log.Info("workers file applied", slog.Int("workers", len(s.Workers)))
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
