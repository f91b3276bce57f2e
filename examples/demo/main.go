package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/kvselect/kvselect/examples/epp/eppserver"
	"github.com/kvselect/kvselect/internal/fakeengine"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// usage heads the flags' help.
const usage = `Usage: go run ./examples/demo [flags]

kvselect's demo: fake engines, a shared-prefix chat workload routed through the
reference EPP's ext_proc server in process, kvselect vs round-robin. With
--topology disaggregated: prefill engines and decode engines behind sidecars, a
prefill leg for every request and then conditionally, vs aggregated serving.

The --demo-* flags are the demo's; every other flag, and its environment
variable, configures the EPP (the README's table: go run ./examples/epp --print-env-table).

`

// run is main with its inputs and outputs: 0 when the demo ran, 1 when it
// failed, 2 for bad flags or settings.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage)
		fs.PrintDefaults()
	}
	engines := fs.Int("demo-engines", 4, "number of fake engines (with --topology disaggregated: half prefill, rounded up, the rest decode)")
	requests := fs.Int("demo-requests", 480, "requests per policy")
	workers := fs.String("demo-workers-file", "", "drive engines you already run (static workers file) instead of fake ones")
	dialectName := fs.String("demo-engine-dialect", fakeengine.DialectVLLMMap.String(), "the KV-event dialect the fake engines speak, one of:"+dialectHelp())
	overhead := fs.Duration("demo-engine-overhead", 0, "each fake engine's fixed cost per request before it can be scheduled (HTTP, tokenization); 0: the fake engine's 1ms")
	slowFraction := fs.Float64("demo-slow-fraction", 0, "share of the fake engines that are slow (the last ones, rounded), e.g. 0.5 for half")
	slowSpeed := fs.Float64("demo-slow-speed", 0.5, "with --demo-slow-fraction: the slow engines' speed (0.5: twice as slow)")
	cfg, err := eppserver.LoadConfig(fs, args, getenv)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, err)
		return 2
	}
	dialect, err := fakeengine.ParseDialect(*dialectName)
	if err != nil {
		fmt.Fprintf(stderr, "--demo-engine-dialect: unknown dialect %q; want one of %s\n", *dialectName, dialectNames())
		return 2
	}
	if *overhead < 0 || !(*slowFraction >= 0 && *slowFraction <= 1) || !(*slowSpeed > 0 && *slowSpeed <= 1e6) {
		fmt.Fprintf(stderr, "--demo-engine-overhead %v, --demo-slow-fraction %v, --demo-slow-speed %v: want an overhead >= 0, a fraction in [0, 1] and a speed > 0\n",
			*overhead, *slowFraction, *slowSpeed)
		return 2
	}
	o := options{engines: *engines, requests: *requests, workersFile: *workers, dialect: dialect,
		engineOverhead: *overhead, slowFraction: *slowFraction, slowSpeed: *slowSpeed}
	if err := runDemo(ctx, cfg, o, stdout); err != nil {
		fmt.Fprintln(stderr, "demo:", err)
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
