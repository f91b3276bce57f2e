package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/kvselect/kvselect/examples/epp/eppserver"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// usage heads the flags' help.
const usage = `Usage: epp [flags]

kvselect's reference Endpoint Picker: an Envoy ext_proc server. Every flag has an
environment variable (Dynamo's EPP contract), and flags win; --print-env-table
prints the contract. The demo is a command of its own: go run ./examples/demo

`

// run is main with its inputs and outputs: 0 once ctx ends (or after --help
// and --print-env-table), 1 when the EPP stopped on an error, 2 for bad flags
// or settings.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if flagName, ok := demoFlag(args); ok {
		fmt.Fprintf(stderr, "epp: %s: the demo is a command of its own now (the EPP binary links no fake engine); run: go run ./examples/demo (it takes the same --demo-* flags and EPP settings)\n", flagName)
		return 2
	}
	fs := flag.NewFlagSet("epp", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage)
		fs.PrintDefaults()
	}
	printEnv := fs.Bool("print-env-table", false, "print the environment contract as a Markdown table and exit")
	cfg, err := eppserver.LoadConfig(fs, args, getenv)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, err)
		return 2
	}
	if *printEnv {
		fmt.Fprint(stdout, eppserver.EnvTable())
		return 0
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	if err := eppserver.Serve(ctx, cfg, logger); err != nil {
		if errors.Is(err, eppserver.ErrConfig) {
			fmt.Fprintln(stderr, err)
			return 2
		}
		logger.Error("epp stopped", "err", err)
		return 1
	}
	return 0
}

// demoFlag finds a flag of the demo the EPP used to run (--demo,
// --demo-engines, ...) among the arguments before a "--".
func demoFlag(args []string) (string, bool) {
	for _, a := range args {
		if a == "--" {
			break
		}
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && (name == "demo" || strings.HasPrefix(name, "demo-")) {
			return "--" + name, true
		}
	}
	return "", false
}
