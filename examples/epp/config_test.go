package main

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/selection"
)

func envOf(kv map[string]string) func(string) string {
	return func(k string) string { return kv[k] }
}

func load(t *testing.T, env map[string]string, args ...string) (*config, error) {
	t.Helper()
	fs := flag.NewFlagSet("epp", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return loadConfig(fs, args, envOf(env))
}

func TestConfigDefaults(t *testing.T) {
	c, err := load(t, nil)
	require.NoError(t, err)
	require.Equal(t, "standalone", c.Mode)
	require.Equal(t, "aggregated", c.Topology)
	require.Equal(t, "nvidia.com/dynamo-worker-role", c.RoleLabel)
	require.Equal(t, 16, c.BlockSize)
	require.Equal(t, 16, c.Router.BlockSize)
	require.Equal(t, 5557, c.KVEventPort)
	require.Equal(t, 1024, c.MaxInflight)
	require.True(t, c.SecureServing)
	require.Equal(t, 5*time.Second, c.TokenizerTimeout)
	require.Equal(t, ":9002", c.ExtProcAddr)
	require.Equal(t, ":9003", c.HealthAddr)
	want := selection.DefaultConfig(16)
	want.QueueLimit = 1024
	want.RouterTTL = 120 * time.Second
	want.ActiveRequestExpiry = 300 * time.Second
	require.Equal(t, want, c.Router)
	// A real run needs the pool, the namespace and the tokenizer.
	err = c.requireForServing()
	require.ErrorContains(t, err, "DYN_EPP_INFERENCE_POOL_NAME")
	require.ErrorContains(t, err, "POD_NAMESPACE")
	require.ErrorContains(t, err, "DYN_EPP_TOKENIZER_SERVICE_URL")
}

func TestConfigFromEnvAndFlags(t *testing.T) {
	env := map[string]string{
		"DYN_EPP_TOPOLOGY_MODE":                 "Disaggregated",
		"DYN_EPP_INFERENCE_POOL_NAME":           "pool",
		"POD_NAMESPACE":                         "ns",
		"DYN_EPP_TOKENIZER_SERVICE_URL":         "http://tok:8000",
		"DYN_KV_CACHE_BLOCK_SIZE":               "64",
		"DYN_ROUTER_QUEUE_THRESHOLD":            "2.5",
		"DYN_EPP_MAX_NUM_BATCHED_TOKENS":        "8192",
		"DYN_ROUTER_TEMPERATURE":                "0.5",
		"DYN_OVERLAP_SCORE_WEIGHT":              "0",
		"DYN_USE_KV_EVENTS":                     "false",
		"DYN_ROUTER_QUEUE_POLICY":               "wspt",
		"DYN_EPP_TOKENIZATION_TIMEOUT_MS":       "250",
		"DYN_SECURE_SERVING":                    "false",
		"DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS": "60",
	}
	c, err := load(t, env, "--block-size", "32", "--router-temperature=0")
	require.NoError(t, err)
	require.NoError(t, c.requireForServing())
	require.Equal(t, "disaggregated", c.Topology)
	require.Equal(t, 32, c.BlockSize, "flags override env")
	require.Equal(t, 32, c.Router.BlockSize)
	require.Equal(t, 0.0, c.Router.Temperature)
	require.Equal(t, 2.5, *c.Router.QueueThreshold)
	require.Equal(t, 0.0, *c.Router.OverlapScoreWeight, "alias read")
	require.False(t, c.Router.UseKVEvents, "alias read")
	require.Equal(t, selection.QueueWSPT, c.Router.QueuePolicy)
	require.Equal(t, 250*time.Millisecond, c.TokenizerTimeout)
	require.False(t, c.SecureServing)
	require.Equal(t, time.Minute, c.Router.ActiveRequestExpiry)
}

func TestConfigReportsEveryBadVariable(t *testing.T) {
	env := map[string]string{
		"DYN_EPP_MODE":                       "dynamo",
		"DYN_EPP_TOPOLOGY_MODE":              "both",
		"DYN_EPP_TOKENIZER_SERVICE_URL":      "tok:8000",
		"DYN_KV_CACHE_BLOCK_SIZE":            "0",
		"DYN_EPP_KV_EVENT_PORT":              "70000",
		"DYN_ROUTER_TEMPERATURE":             "-1",
		"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "NaN",
		"DYN_ROUTER_QUEUE_POLICY":            "sjf",
		"DYN_SECURE_SERVING":                 "maybe",
		"DYN_EPP_MAX_INFLIGHT_REQUESTS":      "many",
		"DYN_ROUTER_QUEUE_THRESHOLD":         "1",
		"DYN_EPP_EXTPROC_ADDR":               "9002",
	}
	_, err := load(t, env)
	require.ErrorIs(t, err, errConfig)
	for _, name := range []string{"DYN_EPP_MODE", "DYN_EPP_TOPOLOGY_MODE", "DYN_EPP_TOKENIZER_SERVICE_URL",
		"DYN_KV_CACHE_BLOCK_SIZE", "DYN_EPP_KV_EVENT_PORT", "DYN_ROUTER_TEMPERATURE", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",
		"DYN_ROUTER_QUEUE_POLICY", "DYN_SECURE_SERVING", "DYN_EPP_MAX_INFLIGHT_REQUESTS", "DYN_EPP_MAX_NUM_BATCHED_TOKENS",
		"DYN_EPP_EXTPROC_ADDR"} {
		require.ErrorContains(t, err, name)
	}
	// A flag's error names the flag as its source.
	_, err = load(t, nil, "--block-size", "x")
	require.ErrorContains(t, err, "DYN_KV_CACHE_BLOCK_SIZE (from --block-size)")
}

func TestEnvTableListsEveryVariable(t *testing.T) {
	table := envTable()
	for _, name := range sortedEnv() {
		require.Contains(t, table, "`"+name+"`")
	}
	require.Equal(t, len(sortedEnv())+2, strings.Count(table, "\n"))
}
