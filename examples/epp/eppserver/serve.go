package eppserver

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/epp/oteltracing"
)

// Serve runs the EPP cfg describes until ctx is done: replicas (when
// configured), tracing (DYN_EPP_OTLP_ENDPOINT), the EPP itself, discovery,
// and the ext_proc, health and metrics listeners. A configuration that
// lacks what serving needs (a pool or a workers file) is
// refused first, with ErrConfig. It returns nil once ctx is done and every
// goroutine it started has stopped, or the first error that stopped it. A
// nil logger discards.
func Serve(ctx context.Context, cfg *Config, logger *slog.Logger) error {
	if err := cfg.requireForServing(); err != nil {
		return err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
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
		defer rp.closeLink() // after e.Close, which closes the Replicators and the services
	}
	x := extras{rep: rp}
	if cfg.OTLPEndpoint != "" {
		tp, err := oteltracing.NewProvider(ctx, cfg.OTLPEndpoint)
		if err != nil {
			return err
		}
		defer func() { // after e.Close: the last spans are flushed
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := tp.Shutdown(sctx); err != nil {
				logger.Warn("tracing shutdown", "err", err)
			}
		}()
		x.tracing = tp
		logger.Info("tracing on", "otlp_endpoint", cfg.OTLPEndpoint)
	}
	e, err := build(ctx, cfg, Options{Logger: logger}, x)
	if err != nil {
		return err
	}
	defer e.Close()
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
		if err := e.reg.Register(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kvselect_workers_file_rejected_total",
			Help: "Reloads of the workers file refused (unreadable, invalid, past the bounds on workers or ranks); the last good set is kept.",
		}, func() float64 { return float64(st.Rejections()) })); err != nil {
			return err
		}
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
		if a := e.rs.Service(r).Events().BindAddr(); a != nil { // engines dial this address
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
	g.Go(func() error { return src.Run(gctx, e.Apply) })
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

// newSource builds the discovery source the configuration names.
func newSource(cfg *Config, logger *slog.Logger) (discovery.Source, error) {
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
func kubeConfig(cfg *Config) (*rest.Config, error) {
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
func newPeers(cfg *Config, logger *slog.Logger) (*discovery.Peers, error) {
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

// metricsHandler serves /metrics from the EPP's registry.
func (e *EPP) metricsHandler() http.Handler {
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
