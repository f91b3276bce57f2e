package main

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/examples/internal/envconf"
	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/tokenize"
)

// config is the gateway's configuration. Every setting has a flag and an
// environment variable (flags win); the variables shared with the reference
// EPP have its names, so one deployment's environment serves both.
type config struct {
	// Addr serves the OpenAI API and /health; MetricsAddr serves GET
	// /metrics, a listener of its own (the EPP's DYN_EPP_METRICS_ADDR).
	Addr        string
	MetricsAddr string
	WorkersFile string
	Model       string
	// Topology is aggregated (every worker serves whole requests) or
	// disaggregated: RoleLabel's value splits the workers into prefill and
	// decode workers, and each request is booked on a pair
	// (roles.PairBooker) and sent to the decode worker's sidecar with the
	// prefill worker in x-prefiller-host-port.
	Topology  roles.TopologyMode
	RoleLabel string
	// TokenizerURLs are the tokenizer endpoints (one or more base URLs),
	// one tokenize.Pool over them; TokenizerNoDegrade refuses a request
	// whose tokenization failed on the tokenizers' side instead of routing
	// it on load alone (httproute.Options.NoDegrade).
	TokenizerURLs      []string
	TokenizerNoDegrade bool
	TokenizerProtocol  string
	TokenizerTimeout   time.Duration
	BlockSize          int
	UseKVEvents        bool
	// KVEventBind binds a SUB there for engines that dial out (the EPP's
	// DYN_EPP_KV_EVENT_BIND), instead of dialing each engine's PUB;
	// KVEventBindAny lets any address publish on it.
	KVEventBind     string
	KVEventBindAny  bool
	MaxBodyBytes    int64
	FailureEjection time.Duration
	// Bounds of the HTTP side (docs/BOUNDS.md): the server's timeouts, the
	// Router's body deadline, in-flight slots and prompt tokens.
	ReadTimeout     time.Duration
	IdleTimeout     time.Duration
	BodyTimeout     time.Duration
	MaxInflight     int
	MaxPromptTokens int
	// Cost is the selection cost; with the predictive one, streamed answers
	// grow their bookings (httproute.Options.OutputGrowth).
	Cost selection.CostModel
	// FeedTrust is how the selection service judges each worker's KV-event
	// feed (selection.Config.FeedTrust). No flag sets it: the zero value is
	// the library's defaults; a program that embeds the gateway's assembly
	// (its tests) may shorten it.
	FeedTrust selection.FeedTrust
	// Classes are fair admission's policy classes (selection.Config.Classes);
	// OverloadStatus answers their refusals and other overloads
	// (httproute.Options.OverloadStatus).
	Classes        []selection.Class
	OverloadStatus int
}

// protocols are the tokenizer protocols tokenize.New accepts.
var protocols = tokenize.Protocols()

func (c *config) settings() []envconf.Var {
	return []envconf.Var{
		{Env: "GATEWAY_ADDR", Flag: "addr", Default: ":8080", Help: "listen address (host:port) of the OpenAI API",
			Set: func(v string) error {
				if _, _, err := net.SplitHostPort(v); err != nil {
					return fmt.Errorf("%q is not host:port", v)
				}
				c.Addr = v
				return nil
			}},
		{Env: "DYN_EPP_WORKERS_FILE", Flag: "workers-file", Help: "workers file (JSON or YAML: {\"workers\": [{id, endpoint, kv_events_endpoint, ...}]}), watched; required",
			Set: func(v string) error { c.WorkersFile = v; return nil }},
		{Env: "DYN_EPP_TOPOLOGY_MODE", Flag: "topology", Default: "aggregated", Help: "`aggregated` or `disaggregated`: prefill/decode, the workers split by --role-label, each request booked on a prefill and a decode worker and sent to the decode worker (its sidecar, examples/pdsidecar) with the prefill worker in x-prefiller-host-port",
			Set: func(v string) (err error) {
				c.Topology, err = roles.ParseTopologyMode(v)
				if err != nil {
					return fmt.Errorf("%q: want aggregated or disaggregated", v)
				}
				return nil
			}},
		{Env: "DYN_EPP_WORKER_ROLE_LABEL", Flag: "role-label", Default: roles.DefaultRoleLabel, Help: "the workers' label (the workers file's labels) that carries `prefill` or `decode` (disaggregated topology)",
			Set: func(v string) error { c.RoleLabel = v; return nil }},
		{Env: "DYN_MODEL_NAME", Flag: "model", Default: "default", Help: "model of the worker entries that name none; requests are routed by their body's \"model\"",
			Set: func(v string) error { c.Model = v; return nil }},
		{Env: "DYN_EPP_METRICS_ADDR", Flag: "metrics-addr", Default: ":9090", Help: "listen address (host:port) of GET /metrics (Prometheus): the selection service, KV-event feeds, tokenizer cache and pool, and Router series",
			Set: func(v string) error {
				if _, _, err := net.SplitHostPort(v); err != nil {
					return fmt.Errorf("%q is not host:port", v)
				}
				c.MetricsAddr = v
				return nil
			}},
		{Env: "DYN_EPP_TOKENIZER_SERVICE_URL", Flag: "tokenizer-url", Help: fmt.Sprintf("absolute http(s) base URL of the engines' tokenizer/render service, or several, comma-separated (at most %d); a list set here wins. Unset: the workers file's workers of --model (the first %[1]d by id) are the tokenizers, each at http://<endpoint> (every vLLM and SGLang engine serves render/tokenize), following the file, except those whose %s label names another engine than the protocol's. Calls go round robin, fail over to the next URL on an error or timeout, are hedged on a second URL past the recent calls' p95 (at least 50 ms), and skip a URL for 5 s after 3 failures in a row", discovery.MaxTokenizers, discovery.EngineLabel),
			Set: func(v string) error {
				urls, err := tokenize.ParseBaseURLs(v, discovery.MaxTokenizers)
				c.TokenizerURLs = urls
				return err
			}},
		{Env: "DYN_EPP_TOKENIZER_NO_DEGRADE", Flag: "tokenizer-no-degrade", Default: "false", Help: "when no tokenizer URL answers (unreachable, timed out, an upstream error), refuse the request with that error's status (503, 504 or 502) instead of routing it on load alone, without prefix reuse (the degraded mode, counted in kvselect_httproute_refusals_total{reason=\"tokenizer_degraded\"})",
			Set: func(v string) error {
				b, err := strconv.ParseBool(v)
				if err != nil {
					return fmt.Errorf("%q is not a boolean", v)
				}
				c.TokenizerNoDegrade = b
				return nil
			}},
		{Env: "DYN_EPP_TOKENIZER_PROTOCOL", Flag: "tokenizer-protocol", Default: tokenize.ProtocolVLLMRender, Help: "one of " + strings.Join(protocols, ", "),
			Set: func(v string) error {
				if !slices.Contains(protocols, v) {
					return fmt.Errorf("%q is not one of %s", v, strings.Join(protocols, ", "))
				}
				c.TokenizerProtocol = v
				return nil
			}},
		{Env: "DYN_EPP_TOKENIZATION_TIMEOUT_MS", Flag: "tokenization-timeout-ms", Default: "5000", Help: "per-call tokenizer timeout in ms (>= 1), for each tokenizer URL a call tries; with several URLs one request's tokenization may take up to three of them (failover)",
			Set: func(v string) error {
				n, err := strconv.Atoi(v)
				if err != nil || n < 1 {
					return fmt.Errorf("%q is not an integer >= 1", v)
				}
				c.TokenizerTimeout = time.Duration(n) * time.Millisecond
				return nil
			}},
		{Env: "DYN_KV_CACHE_BLOCK_SIZE", Flag: "block-size", Default: "16", Help: "KV block size in tokens; must equal the engines' block size",
			Set: func(v string) error {
				n, err := strconv.Atoi(v)
				if err != nil || n < 1 || n > 1<<16 {
					return fmt.Errorf("%q is not an integer in [1, 65536]", v)
				}
				c.BlockSize = n
				return nil
			}},
		{Env: "DYN_ROUTER_USE_KV_EVENTS", Flag: "use-kv-events", Default: "true", Help: "subscribe to the engines' KV events (false: approximate mode, routed on the gateway's own decisions)",
			Set: func(v string) error {
				b, err := strconv.ParseBool(v)
				if err != nil {
					return fmt.Errorf("%q is not a boolean", v)
				}
				c.UseKVEvents = b
				return nil
			}},
		{Env: "DYN_EPP_KV_EVENT_BIND", Flag: "kv-event-bind", Help: "bind a SUB here (tcp://host:port) for engines that dial out (vLLM's kv-events-config with a connect endpoint), instead of dialing each worker's kv_events_endpoint; only workers' addresses may connect, each publishing its own topic (kv@<ip:port>@<model>)",
			Set: func(v string) error {
				u, err := url.Parse(v)
				if err != nil || u.Scheme != "tcp" || u.Host == "" || u.Port() == "" {
					return fmt.Errorf("%q is not tcp://host:port", v)
				}
				c.KVEventBind = v
				return nil
			}},
		{Env: "DYN_EPP_KV_EVENT_BIND_ANY_PEER", Flag: "kv-event-bind-any-peer", Default: "false", Help: "let any address publish on the bind port (engines behind NAT); anyone reaching the port can then publish as any worker",
			Set: func(v string) error {
				b, err := strconv.ParseBool(v)
				if err != nil {
					return fmt.Errorf("%q is not a boolean", v)
				}
				c.KVEventBindAny = b
				return nil
			}},
		{Env: "DYN_EPP_MAX_BODY_BYTES", Flag: "max-body-bytes", Default: "8388608", Help: "largest request body buffered (excess: 413)",
			Set: func(v string) error {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil || n < 1024 || n > 1<<30 {
					return fmt.Errorf("%q is not an integer in [1024, 2^30]", v)
				}
				c.MaxBodyBytes = n
				return nil
			}},
		{Env: "DYN_EPP_COST", Flag: "cost", Default: "auto", Help: "`dynamo` (Dynamo's cost), `predictive` (predicted time to first token with a price on more than a fair share of the requests, bookings growing with the streamed output) or `auto` (predictive on small models, Dynamo's on large ones; docs/ROUTING.md)",
			Set: func(v string) (err error) {
				c.Cost, err = selection.ParseCostModel(v)
				return err
			}},
		{Env: "GATEWAY_FAILURE_EJECTION", Flag: "failure-ejection", Default: "10s", Help: "how long a worker that refused a connection or answered 5xx is left out of the picks (a Go duration > 0)",
			Set: positiveDuration(&c.FailureEjection)},
		{Env: "GATEWAY_BODY_TIMEOUT", Flag: "body-timeout", Default: "30s", Help: "how long a request body may take to arrive whole (past it: 408, connection closed; a Go duration > 0)",
			Set: positiveDuration(&c.BodyTimeout)},
		{Env: "GATEWAY_READ_TIMEOUT", Flag: "read-timeout", Default: "40s", Help: "how long reading a whole request, headers and body, may take on any path (the completions paths' bodies are bounded by --body-timeout instead; a Go duration > 0)",
			Set: positiveDuration(&c.ReadTimeout)},
		{Env: "GATEWAY_IDLE_TIMEOUT", Flag: "idle-timeout", Default: "2m", Help: "how long a keep-alive connection may wait for its next request (a Go duration > 0)",
			Set: positiveDuration(&c.IdleTimeout)},
		{Env: "DYN_EPP_MAX_INFLIGHT_REQUESTS", Flag: "max-inflight", Default: "1024", Help: "requests being read, tokenized or booked at once; more are answered 503 (also bounds the tokenizer calls in progress)",
			Set: func(v string) error {
				n, err := strconv.Atoi(v)
				if err != nil || n < 1 || n > 1<<20 {
					return fmt.Errorf("%q is not an integer in [1, 2^20]", v)
				}
				c.MaxInflight = n
				return nil
			}},
		{Env: "DYN_EPP_POLICY_CLASSES", Flag: "policy-classes", Help: "policy classes, as the EPP reads them (`name:key=value,...;...`, e.g. `interactive:weight=3;batch:inflight=64`): a request's class is its x-dynamo-meta-policy-class header, else its x-gateway-inference-objective, and an unknown or missing one is the first class's; the gateway does not queue, so of a class's settings only inflight (most of its requests held at once, more refused with 429 and class_inflight_full:<class>) applies (unset: no classes)",
			Set: func(v string) error {
				cs, err := selection.ParseClasses(v)
				if err != nil {
					return err
				}
				cfg := selection.DefaultConfig(16)
				cfg.Classes = cs
				if err := cfg.Validate(); err != nil {
					return err
				}
				c.Classes = cs
				return nil
			}},
		{Env: "DYN_EPP_OVERLOAD_STATUS", Flag: "overload-status", Default: "429", Help: "status of an overload or admission refusal: `429` or `529` (Dynamo's frontend's default), with Retry-After and the reason in x-llm-d-request-dropped-reason",
			Set: func(v string) (err error) {
				c.OverloadStatus, err = gaie.ParseOverloadStatus(v)
				return err
			}},
		{Env: "DYN_EPP_MAX_PROMPT_TOKENS", Flag: "max-prompt-tokens", Default: "1048576", Help: "most token ids one request's prompt may have (excess: 413)",
			Set: func(v string) error {
				n, err := strconv.Atoi(v)
				if err != nil || n < 1 || n > 1<<26 {
					return fmt.Errorf("%q is not an integer in [1, 2^26]", v)
				}
				c.MaxPromptTokens = n
				return nil
			}},
	}
}

// positiveDuration sets *dst to a Go duration > 0.
func positiveDuration(dst *time.Duration) func(string) error {
	return func(v string) error {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return fmt.Errorf("%q is not a positive duration", v)
		}
		*dst = d
		return nil
	}
}

// errConfig wraps every configuration problem.
var errConfig = errors.New("gateway: invalid configuration")

// loadConfig reads the environment through getenv, lets the flags in args
// override it, and returns the configuration or one error naming every bad
// or missing setting.
func loadConfig(fs *flag.FlagSet, args []string, getenv func(string) string) (config, error) {
	var c config
	var errs []error
	if err := envconf.Load(fs, args, getenv, c.settings()); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return config{}, err
		}
		errs = append(errs, err)
	}
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("unexpected arguments %q", fs.Args()))
	}
	if c.WorkersFile == "" {
		errs = append(errs, errors.New("--workers-file / DYN_EPP_WORKERS_FILE: required"))
	}
	if c.KVEventBind != "" && !c.UseKVEvents {
		errs = append(errs, errors.New("--kv-event-bind / DYN_EPP_KV_EVENT_BIND: binds for KV events, which --use-kv-events=false turns off"))
	}
	if len(errs) > 0 {
		return config{}, fmt.Errorf("%w:\n  %w", errConfig, errors.Join(errs...))
	}
	return c, nil
}
