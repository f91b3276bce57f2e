package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/examples/epp/eppserver"
	"github.com/kvselect/kvselect/examples/internal/demofleet"
	"github.com/kvselect/kvselect/internal/fakeengine"
	"github.com/kvselect/kvselect/kvindex/kvevents"
	"github.com/kvselect/kvselect/selection"
)

// TestMain fails the package when a test leaves a goroutine behind (the fake
// engines' ZMQ library leaves one by design).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
}

// load is the configuration of env and args, as the demo reads it.
func load(t *testing.T, env map[string]string, args ...string) (*eppserver.Config, error) {
	t.Helper()
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return eppserver.LoadConfig(fs, args, func(k string) string { return env[k] })
}

// workload is o's workload of run number run.
func workload(t *testing.T, o options, run int) []demofleet.Request {
	t.Helper()
	w, err := o.workload(run)
	require.NoError(t, err)
	return w
}

// TestDemoDialects runs the demo small, once per fake-engine dialect: fake
// engines, the real ext_proc server, the real tokenizer client and selection
// service. kvselect must at least double round-robin's engine-reported
// prefix-cache hits, and its service must have followed every engine's feed:
// healthy, trusted, no event skipped but by design, token parity 1.
func TestDemoDialects(t *testing.T) {
	cfg, err := load(t, nil)
	require.NoError(t, err)
	for _, d := range fakeengine.Dialects() {
		t.Run(d.String(), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			// Parity is judged ParityDelay after a request's first byte: give a
			// starved machine time to deliver the engine's stored event first.
			o := options{engines: 4, requests: 120, concurrency: 4, dialect: d, parityDelay: 250 * time.Millisecond}
			o.defaults()
			kv, err := policyRun(ctx, cfg, o, "kvselect", workload(t, o, 0))
			require.NoError(t, err)
			rr, err := policyRun(ctx, cfg, o, "round-robin", workload(t, o, 1))
			require.NoError(t, err)
			t.Logf("hit rate: kvselect %.2f (calibration used: %v), round-robin %.2f", kv.HitRate(), kv.calibration.Ready, rr.HitRate())
			require.Zero(t, kv.Failed)
			require.Zero(t, rr.Failed)
			require.Equal(t, o.requests, kv.Requests)
			require.Len(t, kv.TTFTs, o.requests, "every streamed answer is timed")
			if kv.HitRate() < 2*rr.HitRate() {
				var report bytes.Buffer
				printDemo(&report, []result{kv, rr}, o)
				t.Logf("the runs:\n%s", report.String())
			}
			require.GreaterOrEqual(t, kv.HitRate(), 2*rr.HitRate(), "kvselect %.2f vs round-robin %.2f", kv.HitRate(), rr.HitRate())
			if d == fakeengine.DialectTRTLLM {
				// Token ids came from the separate vLLM render service.
				require.Zero(t, kv.engineRenders)
				require.Positive(t, kv.serviceRenders)
			} else {
				require.Positive(t, kv.engineRenders)
			}
			// The small caches evict all the time; parity counts what the engine
			// stored for each request, so it is still exactly 1.
			requireFeedsHealthy(t, kv.feeds, o.engines, d == fakeengine.DialectHybrid, true)

			var out bytes.Buffer
			printDemo(&out, []result{kv, rr}, o)
			require.Contains(t, out.String(), "TTFT (client, first byte)")
			require.Contains(t, out.String(), "hit rate")
			require.Contains(t, out.String(), "speaking "+d.String())
			require.Regexp(t, `kvselect\s+engine-0\s+\d+\s+\S.*healthy\s+yes`, out.String())
		})
	}
}

// requireFeedsHealthy checks a kvselect run's feed report: one healthy,
// trusted feed per engine, events applied, nothing skipped (a hybrid model's
// sliding-window group is skipped by design), and, with exactParity, parity
// sampled and exactly 1.
func requireFeedsHealthy(t *testing.T, feeds []feedRow, engines int, hybrid, exactParity bool) {
	t.Helper()
	require.Len(t, feeds, engines)
	for _, f := range feeds {
		require.True(t, f.subscribed, "%s: no event source", f.worker)
		require.Positive(t, f.applied, "%s: no event applied", f.worker)
		for reason, n := range f.skipped {
			if hybrid && kvevents.SkipReason(reason) == kvevents.SkipNonMainGroup {
				require.Positive(t, n, "%s: the sliding-window group is skipped", f.worker)
				continue
			}
			require.Zero(t, n, "%s: %d events skipped as %s", f.worker, n, kvevents.SkipReason(reason))
		}
		require.Zero(t, f.decodeErrors, f.worker)
		require.Zero(t, f.lostBatches, f.worker)
		require.True(t, f.judged, f.worker)
		require.Equal(t, selection.FeedHealthy, f.state, f.worker)
		require.True(t, f.trusted, f.worker)
		if exactParity {
			require.Positive(t, f.paritySamples, "%s: parity sampled", f.worker)
			require.Equal(t, 1.0, f.parity, "%s: parity over %d samples", f.worker, f.paritySamples)
		}
	}
}

// TestDemoWorkersFile drives engines named by a workers file, the way a user
// points the demo at engines already running: the feed report covers them too.
func TestDemoWorkersFile(t *testing.T) {
	cfg, err := load(t, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var file strings.Builder
	file.WriteString("workers:\n")
	for i := range 2 {
		e, err := fakeengine.New(fakeengine.Options{
			BlockSize: cfg.BlockSize, CapacityBlocks: 4096, EnableReplay: true, EnableHTTP: true,
			Model: "user-model", Topic: "kv@127.0.0.1@user-model", SleepTTFT: true,
		})
		require.NoError(t, err)
		require.NoError(t, e.Start(ctx))
		t.Cleanup(func() { _ = e.Close() })
		fmt.Fprintf(&file, "  - {id: mine-%d, endpoint: %q, model: user-model, kv_events_endpoint: %q, replay_endpoint: %q}\n",
			i, e.HTTPEndpoint(), e.PubEndpoint(), e.ReplayEndpoint())
	}
	path := filepath.Join(t.TempDir(), "workers.yaml")
	require.NoError(t, os.WriteFile(path, []byte(file.String()), 0o600))

	o := options{requests: 64, groups: 4, concurrency: 4, workersFile: path, parityDelay: 100 * time.Millisecond}
	o.defaults()
	require.NoError(t, o.loadWorkers(ctx, cfg))
	require.Equal(t, "user-model", o.model)
	kv, err := policyRun(ctx, cfg, o, "kvselect", workload(t, o, 0))
	require.NoError(t, err)
	require.Zero(t, kv.Failed)
	require.Len(t, kv.TTFTs, o.requests)
	requireFeedsHealthy(t, kv.feeds, 2, false, true)
	require.Equal(t, "mine-0", kv.feeds[0].worker)

	var out bytes.Buffer
	printDemo(&out, []result{kv}, o)
	require.Contains(t, out.String(), "2 engines from "+path)
	require.Regexp(t, `kvselect\s+mine-1\s+\d+\s+none\s+healthy\s+yes`, out.String())
}

func TestRunRejectsUnknownDialect(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"--demo-engine-dialect", "vllm-mapp"}, func(string) string { return "" }, &out, &errb)
	require.Equal(t, 2, code)
	require.Contains(t, errb.String(), `--demo-engine-dialect: unknown dialect "vllm-mapp"`)
	for _, d := range fakeengine.Dialects() {
		require.Contains(t, errb.String(), d.String())
	}
	require.Empty(t, out.String(), "nothing ran")
}
