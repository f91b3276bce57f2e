package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvselect/kvselect/internal/fakeengine"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(fakeengine.LeakyZMQFunction))
}

// TestDemoSmoke runs the demo small: fake engines, the real ext_proc server,
// the real tokenizer client and selection service. kvselect must beat
// round-robin on engine-reported prefix-cache hits.
func TestDemoSmoke(t *testing.T) {
	cfg, err := load(t, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	o := demoOptions{engines: 2, requests: 120, groups: 4, concurrency: 4}
	o.defaults()
	workload := demoWorkload(o)
	kv, err := demoRun(ctx, cfg, o, "kvselect", workload)
	require.NoError(t, err)
	rr, err := demoRun(ctx, cfg, o, "round-robin", workload)
	require.NoError(t, err)
	require.Zero(t, kv.failed)
	require.Zero(t, rr.failed)
	require.Equal(t, 120, kv.requests)
	require.Greater(t, kv.hitRate(), rr.hitRate(), "kvselect %.2f vs round-robin %.2f", kv.hitRate(), rr.hitRate())
	require.Len(t, kv.ttfts, 120)

	var out bytes.Buffer
	printDemo(&out, []demoResult{kv, rr}, o)
	require.Contains(t, out.String(), "round-robin")
	require.Contains(t, out.String(), "hit rate")
}

func TestRunPrintsEnvTableAndRejectsBadConfig(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"--print-env-table"}, func(string) string { return "" }, &out, &errb)
	require.Equal(t, 0, code)
	require.Contains(t, out.String(), "DYN_EPP_TOKENIZER_SERVICE_URL")
	out.Reset()
	code = run(context.Background(), nil, func(k string) string {
		if k == "DYN_EPP_MODE" {
			return "dynamo"
		}
		return ""
	}, &out, &errb)
	require.Equal(t, 2, code)
	require.Contains(t, errb.String(), "DYN_EPP_MODE")
	errb.Reset()
	// A real run without its required settings stops before listening.
	code = run(context.Background(), nil, func(string) string { return "" }, &out, &errb)
	require.Equal(t, 2, code)
	require.Contains(t, errb.String(), "DYN_EPP_INFERENCE_POOL_NAME")
}
