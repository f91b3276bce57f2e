// Command pdsidecar is the decode sidecar of disaggregated prefill/decode
// serving: it listens in front of the local decode engine and, for a chat or
// completions request the Endpoint Picker gave an x-prefiller-host-port hint,
// runs the engines' P/D protocol (vLLM NIXL, SGLang or TensorRT-LLM) with that
// prefill engine before the decode engine answers. Everything else is proxied
// to the decode engine as it came. The reusable part is package sidecar.
//
//	go run ./examples/pdsidecar                          # vLLM NIXL, 0.0.0.0:8000 -> http://127.0.0.1:8001
//	DYN_PD_PROTOCOL=sglang go run ./examples/pdsidecar
//	DYN_SIDECAR_PORT=9000 DYN_DECODE_ENGINE_PORT=9001 go run ./examples/pdsidecar  # Dynamo's names
//	go run ./examples/pdsidecar --print-env-table        # the environment contract as Markdown
//
// It reads Dynamo's sidecar variables (DYN_SIDECAR_PORT,
// DYN_DECODE_ENGINE_PORT, DYN_SIDECAR_*_TIMEOUT_MS) and the DYN_PD_* names of
// the earlier contract; where both name a setting, Dynamo's wins and a WARN
// names the one ignored. Every setting also has a flag, and flags win; invalid
// values are reported at startup, all at once, each with its variable's name.
// Prometheus metrics are on DYN_PD_METRICS_ADDR (/metrics). See
// docs/SIDECAR.md.
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

	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("pdsidecar", flag.ContinueOnError)
	fs.SetOutput(stderr)
	printEnv := fs.Bool("print-env-table", false, "print the environment contract as a Markdown table and exit")
	cfg, err := loadConfig(fs, args, getenv)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, err)
		return 2
	}
	if *printEnv {
		fmt.Fprint(stdout, envTable())
		return 0
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: cfg.logLevel}))
	for _, c := range cfg.conflicts {
		log.Warn("pdsidecar: two variables set the same setting differently; the first one is used",
			"used", c.Used, "ignored", c.Ignored)
	}
	cfg.sidecar.Logger = log
	sc, err := sidecar.New(cfg.sidecar)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	defer sc.Close()
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", cfg.listenAddr)
	if err != nil {
		fmt.Fprintf(stderr, "pdsidecar: DYN_PD_LISTEN_ADDR: %v\n", err)
		return 1
	}
	mln, err := lc.Listen(ctx, "tcp", cfg.metricsAddr)
	if err != nil {
		ln.Close()
		fmt.Fprintf(stderr, "pdsidecar: DYN_PD_METRICS_ADDR: %v\n", err)
		return 1
	}
	log.Info("pdsidecar: serving", "listen", ln.Addr().String(), "metrics", mln.Addr().String(),
		"decode", cfg.sidecar.DecodeURL, "protocol", sc.Stats().Protocol, "signed_hints", cfg.sidecar.HintKey != nil)
	if err := serve(ctx, sc, ln, mln, cfg.drainTimeout, log); err != nil {
		log.Error("pdsidecar: stopped", "error", err)
		return 1
	}
	return 0
}

// serve runs the sidecar on ln and its metrics on mln until ctx ends or a
// server fails, then shuts both down (requests in flight get drain to
// finish) and waits for them.
func serve(ctx context.Context, sc *sidecar.Sidecar, ln, mln net.Listener, drain time.Duration, log *slog.Logger) error {
	errLog := slog.NewLogLogger(log.Handler(), slog.LevelWarn)
	api := &http.Server{Handler: sc, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, ErrorLog: errLog}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_ = writeMetrics(w, sc.Stats())
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	metrics := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ErrorLog: errLog}

	errc := make(chan error, 2)
	go func() { errc <- api.Serve(ln) }()
	go func() { errc <- metrics.Serve(mln) }()
	var failed error
	pending := 2
	select {
	case <-ctx.Done():
	case failed = <-errc:
		pending--
	}
	sctx, cancel := context.WithTimeout(context.Background(), drain)
	defer cancel()
	// Past the drain timeout, streams still running are cut.
	shutdownErr := errors.Join(api.Shutdown(sctx), metrics.Shutdown(sctx))
	if shutdownErr != nil {
		_ = api.Close()
		_ = metrics.Close()
	}
	for ; pending > 0; pending-- {
		if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
			failed = errors.Join(failed, err)
		}
	}
	if errors.Is(failed, http.ErrServerClosed) {
		failed = nil
	}
	return errors.Join(failed, shutdownErr)
}
