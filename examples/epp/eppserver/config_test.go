package eppserver

import (
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

func envOf(kv map[string]string) func(string) string {
	return func(k string) string { return kv[k] }
}

func load(t *testing.T, env map[string]string, args ...string) (*Config, error) {
	t.Helper()
	fs := flag.NewFlagSet("epp", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return LoadConfig(fs, args, envOf(env))
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
	want.FailureEjection = selection.DefaultFailureEjection
	want.Endpoints.AllowHostnames = false // Envoy's original destination needs an IP
	want.Sessions.MaxSessions, want.Sessions.IdleTTL = selection.DefaultMaxSessions, selection.DefaultSessionIdleTTL
	require.Equal(t, want, c.Router)
	require.Equal(t, "x-session-id", c.SessionHeader)
	// A real run needs the pool and the namespace; without a tokenizer URL
	// the discovered workers are the tokenizers.
	require.Empty(t, c.TokenizerURLs)
	err = c.requireForServing()
	require.ErrorContains(t, err, "DYN_EPP_INFERENCE_POOL_NAME")
	require.ErrorContains(t, err, "POD_NAMESPACE")
	require.NotContains(t, err.Error(), "DYN_EPP_TOKENIZER_SERVICE_URL")
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
	require.Zero(t, c.Router.PrefillLoadScale, "deprecated alias read: it sets the prefill scale")
	require.Zero(t, c.Router.OverlapScoreCredit, "deprecated alias at 0 zeroes the credit")
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
	require.ErrorIs(t, err, ErrConfig)
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
	table := EnvTable()
	for _, name := range sortedEnv() {
		require.Contains(t, table, "`"+name+"`")
	}
	require.Equal(t, len(sortedEnv())+2, strings.Count(table, "\n"))
}

// The README's table is generated by --print-env-table; this keeps it current.
func TestReadmeHasTheEnvTable(t *testing.T) {
	readme, err := os.ReadFile("../../../README.md")
	require.NoError(t, err)
	require.Contains(t, string(readme), EnvTable(), "regenerate with: go run ./examples/epp --print-env-table")
}

// sortedEnv lists the variables of the contract, for tests.
func sortedEnv() []string {
	var c Config
	var out []string
	for _, s := range c.settings() {
		out = append(out, s.Env)
	}
	sort.Strings(out)
	return out
}

func TestConfigRefusesValuesThatWouldBeSilentlyChanged(t *testing.T) {
	for env, val := range map[string]string{
		"DYN_ROUTER_TTL_SECS":                "1e-10",
		"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "1e308",
		"DYN_ROUTER_PREFILL_LOAD_SCALE":      "1e7",
		"DYN_ROUTER_TEMPERATURE":             "1e9",
	} {
		cfg, err := load(t, map[string]string{env: val, "DYN_EPP_TOKENIZER_SERVICE_URL": "http://127.0.0.1:1"})
		if err == nil {
			err = cfg.Router.Validate()
		}
		require.Error(t, err, env)
	}
}

// The deprecated single weight wins over the prefill scale and keeps the credit
// unless it is 0 (Dynamo's rule), whatever the order of the variables.
func TestDeprecatedOverlapScoreWeight(t *testing.T) {
	c, err := load(t, map[string]string{"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "3", "DYN_ROUTER_PREFILL_LOAD_SCALE": "9"})
	require.NoError(t, err)
	require.Equal(t, 3.0, c.Router.PrefillLoadScale)
	require.Equal(t, selection.DefaultOverlapScoreCredit, c.Router.OverlapScoreCredit)
	c, err = load(t, map[string]string{"DYN_ROUTER_PREFILL_LOAD_SCALE": "9"}, "--overlap-score-weight", "0")
	require.NoError(t, err)
	require.Zero(t, c.Router.PrefillLoadScale)
	require.Zero(t, c.Router.OverlapScoreCredit)
}

func TestConfigSessionsAndCredits(t *testing.T) {
	c, err := load(t, map[string]string{
		"DYN_EPP_SESSION_AFFINITY": "HARD", "DYN_EPP_SESSION_HEADER": "X-Conversation", "DYN_EPP_MAX_SESSIONS": "10",
		"DYN_EPP_SESSION_TTL_SECS": "30", "DYN_EPP_INFLIGHT_HIT_WEIGHT": "0", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY": "0.5",
	})
	require.NoError(t, err)
	require.Equal(t, selection.SessionHard, c.Router.Sessions.Mode)
	require.Equal(t, "x-conversation", c.SessionHeader)
	require.Equal(t, 10, c.Router.Sessions.MaxSessions)
	require.Equal(t, 30*time.Second, c.Router.Sessions.IdleTTL)
	require.Zero(t, c.Router.InFlightHitWeight)
	require.Equal(t, 0.5, c.Router.OverlapCreditDecay)
	_, err = load(t, map[string]string{"DYN_EPP_SESSION_AFFINITY": "sticky", "DYN_EPP_SESSION_HEADER": "bad header", "DYN_EPP_INFLIGHT_HIT_WEIGHT": "2"})
	require.ErrorContains(t, err, "DYN_EPP_SESSION_AFFINITY")
	require.ErrorContains(t, err, "DYN_EPP_SESSION_HEADER")
	require.ErrorContains(t, err, "InFlightHitWeight")
}

// DYN_EPP_COST picks the cost function; the predictive cost's settings
// reach the router, and output growth follows the cost unless it is set.
func TestConfigPredictiveCost(t *testing.T) {
	c, err := load(t, nil)
	require.NoError(t, err)
	require.Equal(t, selection.CostAuto, c.Router.Cost)
	require.Equal(t, selection.DefaultConfig(16).Predictive, c.Router.Predictive, "the table's defaults are the library's")
	require.False(t, c.OutputGrowth, "auto: off with the auto cost, Dynamo's on large models")

	c, err = load(t, map[string]string{"DYN_EPP_COST": "dynamo"})
	require.NoError(t, err)
	require.Equal(t, selection.CostDynamo, c.Router.Cost)
	require.False(t, c.OutputGrowth, "auto: off with the Dynamo cost")

	c, err = load(t, map[string]string{
		"DYN_EPP_COST": "Predictive", "DYN_EPP_PREFILL_TOKENS_PER_SECOND": "25000", "DYN_EPP_LEARN_PREFILL_RATE": "false",
		"DYN_EPP_PREDICTIVE_BACKLOG_WEIGHT": "1", "DYN_EPP_PREDICTIVE_DECODE_WEIGHT": "0.25", "DYN_EPP_PREDICTIVE_EVICTION_WEIGHT": "2", "DYN_EPP_PREDICTIVE_SATURATION_GROWTH": "0",
		"DYN_EPP_BALANCE_WEIGHT": "3", "DYN_EPP_BALANCE_SLACK": "0.2", "DYN_EPP_BALANCE_WINDOW_SECONDS": "60",
	})
	require.NoError(t, err)
	require.Equal(t, selection.CostPredictive, c.Router.Cost)
	require.Equal(t, selection.PredictiveCost{PrefillTokensPerSecond: 25000, FixedRate: true, BacklogWeight: 1, DecodeWeight: 0.25,
		EvictionWeight: 2, BalanceWeight: 3, BalanceSlack: 0.2, BalanceWindow: time.Minute}, c.Router.Predictive)
	require.True(t, c.OutputGrowth, "auto: on with the predictive cost")

	c, err = load(t, map[string]string{"DYN_EPP_COST": "predictive", "DYN_EPP_OUTPUT_GROWTH": "false"})
	require.NoError(t, err)
	require.False(t, c.OutputGrowth, "set explicitly")

	// A subnormal rate is above 0, and would make every cost infinite.
	_, err = load(t, map[string]string{"DYN_EPP_COST": "fastest", "DYN_EPP_PREFILL_TOKENS_PER_SECOND": "4.9e-324", "DYN_EPP_OUTPUT_GROWTH": "sometimes",
		"DYN_EPP_BALANCE_WEIGHT": "-1", "DYN_EPP_BALANCE_WINDOW_SECONDS": "0", "DYN_EPP_PREDICTIVE_EVICTION_WEIGHT": "-0.5"})
	require.ErrorContains(t, err, "DYN_EPP_BALANCE_WEIGHT")
	require.ErrorContains(t, err, "DYN_EPP_PREDICTIVE_EVICTION_WEIGHT")
	require.ErrorContains(t, err, "DYN_EPP_BALANCE_WINDOW_SECONDS")
	require.ErrorContains(t, err, "DYN_EPP_COST")
	require.ErrorContains(t, err, "DYN_EPP_PREFILL_TOKENS_PER_SECOND")
	require.ErrorContains(t, err, "DYN_EPP_OUTPUT_GROWTH")
}

// DYN_EPP_TOKENIZER_SERVICE_URL takes one URL or several, comma-separated,
// each checked; a list with a bad, repeated or no URL is refused, naming it.
func TestConfigTokenizerURLs(t *testing.T) {
	c, err := load(t, map[string]string{"DYN_EPP_TOKENIZER_SERVICE_URL": "http://tok:8000"})
	require.NoError(t, err)
	require.Equal(t, []string{"http://tok:8000"}, c.TokenizerURLs, "one URL: a pool of one, as before")
	require.False(t, c.TokenizerNoDegrade, "the degraded mode is on by default")
	c, err = load(t, map[string]string{"DYN_EPP_TOKENIZER_NO_DEGRADE": "true"},
		"--tokenizer-url", " http://10.0.0.5:8000, https://10.0.0.6:8000/base ,,http://10.0.0.7:8000 ")
	require.NoError(t, err)
	require.Equal(t, []string{"http://10.0.0.5:8000", "https://10.0.0.6:8000/base", "http://10.0.0.7:8000"}, c.TokenizerURLs)
	require.True(t, c.TokenizerNoDegrade)
	for v, want := range map[string]string{
		"http://a:1,tok:8000":       `"tok:8000" is not an absolute http(s) URL`,
		"http://a:1,ftp://b:2":      `"ftp://b:2" is not an absolute http(s) URL`,
		"http://a:1, http://a:1":    `"http://a:1" is listed twice`,
		" , ":                       "names no URL",
		"http://a:1/x,http://a:1/y": "", // two paths on one host: two endpoints
	} {
		_, err := load(t, map[string]string{"DYN_EPP_TOKENIZER_SERVICE_URL": v})
		if want == "" {
			require.NoError(t, err, v)
			continue
		}
		require.ErrorContains(t, err, "DYN_EPP_TOKENIZER_SERVICE_URL", v)
		require.ErrorContains(t, err, want, v)
	}
	var many []string
	for i := range discovery.MaxTokenizers + 1 {
		many = append(many, fmt.Sprintf("http://10.0.0.%d:8000", i))
	}
	_, err = load(t, map[string]string{"DYN_EPP_TOKENIZER_SERVICE_URL": strings.Join(many, ",")})
	require.ErrorContains(t, err, fmt.Sprintf("at most %d", discovery.MaxTokenizers))
}

// DYN_EPP_TOKENIZER_PROTOCOL takes the four protocols, Dynamo's
// sglang-renderer among them, and refuses any other by name.
func TestConfigTokenizerProtocol(t *testing.T) {
	c, err := load(t, nil)
	require.NoError(t, err)
	require.Equal(t, tokenize.ProtocolVLLMRender, c.TokenizerProtocol)
	for _, p := range []string{"vllm-render", "vllm-tokenize", "sglang", " sglang-renderer "} {
		c, err := load(t, map[string]string{"DYN_EPP_TOKENIZER_PROTOCOL": p})
		require.NoError(t, err, p)
		require.Equal(t, strings.TrimSpace(p), c.TokenizerProtocol)
	}
	_, err = load(t, map[string]string{"DYN_EPP_TOKENIZER_PROTOCOL": "openai"})
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorContains(t, err, "DYN_EPP_TOKENIZER_PROTOCOL")
	require.ErrorContains(t, err, `"openai" is not one of vllm-render, vllm-tokenize, sglang, sglang-renderer`)
}

// Dynamo's DYN_EPP_SELECTION_HTTP_PORT (a peer index dump over HTTP) is
// refused with the way kvselect warms a replica instead, not ignored.
func TestSelectionHTTPPortIsRefusedWithTheWarmStart(t *testing.T) {
	_, err := load(t, map[string]string{"DYN_EPP_SELECTION_HTTP_PORT": "8081"})
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorContains(t, err, "DYN_EPP_SELECTION_HTTP_PORT")
	require.ErrorContains(t, err, "over NATS")
	require.ErrorContains(t, err, "DYN_EPP_PEER_SERVICE")
	_, err = load(t, map[string]string{"DYN_EPP_SELECTION_HTTP_PORT": " "})
	require.NoError(t, err, "unset (blank) is fine")
}
