// Command epp is kvselect's reference Endpoint Picker: the ext_proc server an
// Envoy-based Gateway (Gateway API Inference Extension) calls for every request.
// It discovers workers (Kubernetes InferencePool + Pods, or a static file),
// tokenizes each request with the engines' own tokenizer, books the best worker
// with kvselect, and tells Envoy where to send the request.
//
//	go run ./examples/epp --demo            # fake engines, a workload, kvselect vs round-robin
//	go run ./examples/epp --demo --topology disaggregated  # prefill engines, decode engines behind sidecars, conditional, vs aggregated
//	go run ./examples/epp --print-env-table # the environment contract as Markdown
//
// Configuration follows the environment contract of Dynamo's standalone EPP;
// every variable also has a flag, and flags win. See the README for the table.
//
// After the pick the EPP follows each response through ext_proc
// (docs/OBSERVABILITY.md): it renews the request's leases while the response
// starts or flows (DYN_EPP_RENEW_INTERVAL_MS; a stream gone silent expires at
// its lease), grows its decode booking with the SSE events of its stream
// (DYN_EPP_OUTPUT_GROWTH, off by default), returns fallback endpoints after
// the pick in the GAIE destination list (DYN_EPP_FALLBACKS) and moves the
// booking to the worker the gateway reports as served (or frees it when that
// is no worker it can book). It exports per-rank load, decision quality
// (overlap ratio, cost margin, retries), rebookings and renewals on /metrics
// (a Grafana dashboard is in docs/grafana), OpenTelemetry spans for pick,
// tokenize and book when DYN_EPP_OTLP_ENDPOINT names a collector, and with
// DYN_EPP_DEBUG_HEADER the cost terms of the cheapest candidates in an
// x-kvselect-debug response header.
//
// Several replicas of the EPP share their active load (docs/REPLICAS.md) when
// DYN_EPP_PEER_SERVICE is set (each embeds a NATS server routed to the ready
// endpoints of that headless Service, on DYN_EPP_REPLICA_SYNC_PORT; RBAC
// services get and endpointslices list, watch), or DYN_EPP_PEERS (the same
// with static routes), or DYN_EPP_NATS_URL (an existing NATS cluster). One
// Replicator per role (both roles in disaggregated mode) rides the one
// connection; the Replicators start once discovery has registered the
// workers, and the EPP reports ready once each has made its initial sync.
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/big"
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
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/extproc"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("epp", flag.ContinueOnError)
	fs.SetOutput(stderr)
	demo := fs.Bool("demo", false, "run the self-contained demo: fake engines, a shared-prefix workload, kvselect vs round-robin (with --topology disaggregated: prefill engines and decode engines behind sidecars, a prefill leg for every request and then conditionally, vs aggregated serving)")
	demoEngines := fs.Int("demo-engines", 4, "demo: number of fake engines")
	demoRequests := fs.Int("demo-requests", 480, "demo: requests per policy")
	demoWorkers := fs.String("demo-workers-file", "", "demo: drive engines you already run (static workers file) instead of fake ones")
	demoDialect := fs.String("demo-engine-dialect", fakeengine.DialectVLLMMap.String(), "demo: the KV-event dialect the fake engines speak, one of:"+dialectHelp())
	printEnv := fs.Bool("print-env-table", false, "print the environment contract as a Markdown table and exit")
	cfg, err := loadConfig(fs, args, getenv)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, err)
		return 2
	}
	dialect, err := fakeengine.ParseDialect(*demoDialect)
	if err != nil {
		fmt.Fprintf(stderr, "--demo-engine-dialect: unknown dialect %q; want one of %s\n", *demoDialect, dialectNames())
		return 2
	}
	if *printEnv {
		fmt.Fprint(stdout, envTable())
		return 0
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	if *demo {
		opts := demoOptions{engines: *demoEngines, requests: *demoRequests, workersFile: *demoWorkers, dialect: dialect}
		if err := runDemo(ctx, cfg, opts, stdout); err != nil {
			fmt.Fprintln(stderr, "demo:", err)
			return 1
		}
		return 0
	}
	if err := cfg.requireForServing(); err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	if err := serve(ctx, cfg, logger); err != nil && !errors.Is(err, context.Canceled) {
		logger.Error("epp stopped", "err", err)
		return 1
	}
	return 0
}

// dialectHelp lists the fake engine's dialects, one a line, for the flag's help.
func dialectHelp() string {
	var b strings.Builder
	for _, d := range fakeengine.Dialects() {
		fmt.Fprintf(&b, "\n  %-13s %s", d, d.Summary())
	}
	return b.String()
}

// dialectNames lists the fake engine's dialect names, comma-separated.
func dialectNames() string {
	var names []string
	for _, d := range fakeengine.Dialects() {
		names = append(names, d.String())
	}
	return strings.Join(names, ", ")
}

// epp is one assembled Endpoint Picker: tokenizer, selection, ext_proc server.
type epp struct {
	cfg    *config
	logger *slog.Logger
	client *tokenize.Client
	cache  *tokenize.Cache
	// rs owns one selection service per role of the topology (one in
	// aggregated mode); pairs books every request on them, in both modes.
	rs     *roles.RoleSelectors
	pairs  *roles.PairBooker
	router *router
	server *extproc.Server
	reg    *prometheus.Registry
	// excluded is what the last snapshot excluded (id -> reason and value), so
	// that only changes are logged. apply owns it (one discovery loop).
	excluded map[string]string
	// rep shares the active load with the EPP's peers; nil without
	// replicas. The EPP owns its Replicators; the link is the caller's.
	rep *replication
}

// newEPP builds everything that does not listen yet. configure, when set,
// adjusts every selection service's builder (the demo uses it).
func newEPP(ctx context.Context, cfg *config, logger *slog.Logger, configure func(*selection.SelectionServiceBuilder)) (*epp, error) {
	return buildEPP(ctx, cfg, logger, configure, eppExtras{})
}

// eppExtras are the parts of an EPP its caller owns.
type eppExtras struct {
	// rep, when set, shares the load with peers: one Replicator per role,
	// observing its role's service, started by apply once discovery has
	// synced.
	rep *replication
	// tracing, when set, traces every pick (DYN_EPP_OTLP_ENDPOINT); nil
	// traces nothing and spends nothing on it.
	tracing trace.TracerProvider
	// now, when set, is the clock of the selection services and of the
	// plans' leases (tests); nil: the wall clock.
	now func() time.Time
}

// buildEPP is newEPP with the caller's extras.
func buildEPP(ctx context.Context, cfg *config, logger *slog.Logger, configure func(*selection.SelectionServiceBuilder), x eppExtras) (*epp, error) {
	rp := x.rep
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	client, err := tokenize.New(tokenize.Options{
		Protocol: cfg.TokenizerProtocol, BaseURL: cfg.TokenizerURL, Timeout: cfg.TokenizerTimeout,
		MaxResponseBytes: int64(cfg.TokenizerMaxResp), MaxPromptTokens: cfg.MaxPromptTokens, Logger: logger,
	})
	if err != nil {
		return nil, err
	}
	// A shared call outlives the caller that started it: it is bounded by the
	// configured timeout (not the cache's default) and counted against the same
	// admission as requests, so cancelled requests cannot pile up calls.
	cache, err := tokenize.NewCache(client, tokenize.CacheOptions{
		ShareResults: true, Protocol: cfg.TokenizerProtocol, Model: cfg.Model, Logger: logger,
		CallTimeout: cfg.TokenizerTimeout, MaxCalls: cfg.MaxInflight,
	})
	if err != nil {
		client.Close()
		return nil, err
	}
	e := &epp{cfg: cfg, logger: logger, client: client, cache: cache, reg: prometheus.NewRegistry(), rep: rp}
	setup := func(b *selection.SelectionServiceBuilder) {
		b.Logger(logger)
		if x.now != nil {
			b.Clock(x.now)
		}
		if configure != nil {
			configure(b)
		}
	}
	mode := roles.ModeAggregated
	if cfg.Topology == "disaggregated" {
		mode = roles.ModeDisaggregated
	}
	decisions := newDecisionMetrics(e.reg)
	var tracer trace.Tracer
	if x.tracing != nil {
		tracer = x.tracing.Tracer(tracerName)
	}
	if rp != nil {
		if err := rp.newReplicators(cfg, mode); err != nil {
			e.close()
			return nil, err
		}
	}
	e.rs, err = roles.New(ctx, roles.RoleOptions{
		Mode: mode, LabelKey: cfg.RoleLabel, Base: cfg.Router, Logger: logger,
		Profile: roles.ProfileOptions{PrefillMaxNumBatchedTokens: cfg.PrefillMaxBatched, DecodeMaxNumBatchedTokens: cfg.DecodeMaxBatched},
		Configure: func(r roles.Role, b *selection.SelectionServiceBuilder) {
			setup(b)
			b.Recorder(decisions.forRole(r.String()))
			if tracer != nil {
				b.Tracer(decisionTracer{tr: tracer, role: r.String()})
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
		e.close()
		return nil, err
	}
	dest := e.rs.Service(mode.Destination())
	e.router = newRouter(cfg.Model, cache, e.pairs, dest)
	e.router.sessionHeader = cfg.SessionHeader
	e.router.fallbacks, e.router.growth, e.router.debug = cfg.Fallbacks, cfg.OutputGrowth, cfg.DebugHeader
	e.router.tracer, e.router.log = tracer, logger
	e.router.m = newRouterMetrics(e.reg)
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
	e.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	e.reg.MustRegister(&statsCollector{services: func() map[string]*selection.SelectionService { return services }, cache: cache, model: cfg.Model})
	if rp != nil {
		rc := &replicaCollector{reps: rp.reps, refusedReplies: rp.cl.Bus().RefusedReplies}
		if rp.srv != nil {
			rc.routes, rc.configured, rc.refused = rp.srv.Peers, rp.srv.Routes, rp.srv.RefusedRoutes
		}
		e.reg.MustRegister(rc)
	}
	e.server, err = extproc.NewServer(extproc.Options{
		Picker: e.router, Status: statusOf, MaxBodyBytes: cfg.MaxBodyBytes, MaxInflight: cfg.MaxInflight,
		Logger: logger, Metrics: newServerMetrics(e.reg),
	})
	if err != nil {
		e.close()
		return nil, err
	}
	return e, nil
}

func (e *epp) close() {
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
	e.client.Close()
}

// withDefaults fills what discovery does not know from the configuration.
func (e *epp) withDefaults(ws []catalog.Worker) []catalog.Worker {
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

// apply reconciles the selection service(s) with a discovery snapshot.
func (e *epp) apply(s discovery.Snapshot) {
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
	e.router.setWorkers(desired)
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
func (e *epp) logExclusions(xs []roles.Excluded) {
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

// newSource builds the discovery source the configuration names.
func newSource(cfg *config, logger *slog.Logger) (discovery.Source, error) {
	if cfg.WorkersFile != "" {
		return discovery.NewStatic(discovery.StaticOptions{
			Path:      cfg.WorkersFile,
			Defaults:  discovery.Defaults{Model: cfg.Model, BlockSize: cfg.BlockSize, TotalKVBlocks: cfg.TotalKVBlocks, MaxNumBatchedTokens: cfg.MaxBatched},
			RoleLabel: cfg.RoleLabel, Logger: logger,
		})
	}
	rc, err := kubeConfig(cfg)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	port := cfg.KVEventPort
	if !cfg.Router.UseKVEvents || cfg.KVEventBind != "" {
		port = 0
	}
	return discovery.NewKubernetes(discovery.KubeOptions{
		Dynamic: dyn, Clientset: cs, Namespace: cfg.Namespace, PoolName: cfg.PoolName, Model: cfg.Model,
		BlockSize: cfg.BlockSize, TotalKVBlocks: cfg.TotalKVBlocks, MaxNumBatchedTokens: cfg.MaxBatched,
		KVEventPort: port, ReplayPort: cfg.KVReplayPort, RoleLabel: cfg.RoleLabel, Logger: logger,
	})
}

// kubeConfig is the Kubernetes client configuration: KUBECONFIG, else
// in-cluster.
func kubeConfig(cfg *config) (*rest.Config, error) {
	var rc *rest.Config
	var err error
	if cfg.Kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes client config: %w", err)
	}
	return rc, nil
}

// newPeers builds the peer discovery of DYN_EPP_PEER_SERVICE.
func newPeers(cfg *config, logger *slog.Logger) (*discovery.Peers, error) {
	rc, err := kubeConfig(cfg)
	if err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	return discovery.NewPeers(discovery.PeerOptions{Clientset: cs, Namespace: cfg.Namespace, Service: cfg.PeerService,
		PodIP: cfg.PodIP, Port: cfg.SyncPort, MaxPeers: maxPeers, Logger: logger})
}

// serve runs the EPP until ctx is done.
func serve(ctx context.Context, cfg *config, logger *slog.Logger) error {
	var peers *discovery.Peers
	if cfg.PeerService != "" {
		var err error
		if peers, err = newPeers(cfg, logger); err != nil {
			return err
		}
	}
	rp, err := openReplication(cfg, logger)
	if err != nil {
		return err
	}
	if rp != nil {
		defer rp.closeLink() // after e.close, which closes the Replicators and the services
	}
	x := eppExtras{rep: rp}
	if cfg.OTLPEndpoint != "" {
		tp, err := newTracerProvider(ctx, cfg.OTLPEndpoint)
		if err != nil {
			return err
		}
		defer func() { // after e.close: the last spans are flushed
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := tp.Shutdown(sctx); err != nil {
				logger.Warn("tracing shutdown", "err", err)
			}
		}()
		x.tracing = tp
		logger.Info("tracing on", "otlp_endpoint", cfg.OTLPEndpoint)
	}
	e, err := buildEPP(ctx, cfg, logger, nil, x)
	if err != nil {
		return err
	}
	defer e.close()
	if cfg.Topology == "disaggregated" && cfg.KVEventBind != "" {
		logger.Warn("DYN_EPP_KV_EVENT_BIND binds the prefill role's feed only")
	}
	if cfg.Topology != "disaggregated" && cfg.PDHintKey != nil {
		logger.Warn("DYN_EPP_PD_HINT_KEY is set, but an aggregated EPP gives no prefill hint to sign")
	}
	src, err := newSource(cfg, logger)
	if err != nil {
		return err
	}
	if st, ok := src.(*discovery.Static); ok {
		e.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kvselect_workers_file_rejected_total",
			Help: "Reloads of the workers file refused (unreadable, invalid, past the bounds on workers or ranks); the last good set is kept.",
		}, func() float64 { return float64(st.Rejections()) }))
	}
	var lc net.ListenConfig
	extLis, err := lc.Listen(ctx, "tcp", cfg.ExtProcAddr)
	if err != nil {
		return err
	}
	healthLis, err := lc.Listen(ctx, "tcp", cfg.HealthAddr)
	if err != nil {
		_ = extLis.Close()
		return err
	}
	metricsLis, err := lc.Listen(ctx, "tcp", cfg.MetricsAddr)
	if err != nil {
		_ = extLis.Close()
		_ = healthLis.Close()
		return err
	}
	gopts := e.server.GRPCServerOptions()
	if cfg.SecureServing {
		cert, err := selfSignedCert()
		if err != nil {
			return err
		}
		gopts = append(gopts, grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})))
	}
	gs := grpc.NewServer(gopts...)
	e.server.Register(gs)
	hs := grpc.NewServer()
	e.server.RegisterHealth(hs)
	ms := &http.Server{Handler: e.metricsHandler(), ReadHeaderTimeout: 10 * time.Second}
	logger.Info("epp listening", "extproc", extLis.Addr().String(), "health", healthLis.Addr().String(),
		"metrics", metricsLis.Addr().String(), "tls", cfg.SecureServing, "model", cfg.Model)
	for _, r := range e.rs.Census().Mode.Roles() {
		if a := e.rs.Service(r).EventBindAddr(); a != nil { // engines dial this address
			logger.Info("kv events bound", "role", r.String(), "addr", a.String())
		}
	}

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return gs.Serve(extLis) })
	g.Go(func() error { return hs.Serve(healthLis) })
	g.Go(func() error {
		if err := ms.Serve(metricsLis); !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	})
	g.Go(func() error { return src.Run(gctx, e.apply) })
	if e.router.renew != nil {
		g.Go(func() error { tickEvery(gctx, cfg.RenewInterval, func() { e.router.renew.tick() }); return nil })
	}
	if rp != nil {
		g.Go(func() error { return e.readyWhenSynced(gctx) })
	}
	if peers != nil {
		g.Go(func() error { return rp.followPeers(gctx, peers) })
	}
	g.Go(func() error {
		<-gctx.Done()
		e.server.SetReady(false)
		stopped := make(chan struct{})
		go func() { gs.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(10 * time.Second):
			gs.Stop()
			<-stopped
		}
		hs.Stop()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return ms.Shutdown(sctx)
	})
	err = g.Wait()
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// metricsHandler serves /metrics from the EPP's registry.
func (e *epp) metricsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(e.reg, promhttp.HandlerOpts{}))
	return mux
}

// selfSignedCert makes the certificate the ext_proc port serves with when secure
// serving is on (Envoy is configured not to verify it, as with Dynamo's EPP).
func selfSignedCert() (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "kvselect-epp"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().AddDate(10, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     []string{"localhost", "kvselect-epp"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}
