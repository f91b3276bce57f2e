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

	"github.com/kvselect/kvselect/tokenize"
)

// config is the gateway's configuration. Every setting has a flag and an
// environment variable (flags win); the variables shared with the reference
// EPP have its names, so one deployment's environment serves both.
type config struct {
	Addr              string
	WorkersFile       string
	Model             string
	TokenizerURL      string
	TokenizerProtocol string
	TokenizerTimeout  time.Duration
	BlockSize         int
	UseKVEvents       bool
	MaxBodyBytes      int64
	FailureEjection   time.Duration
}

// protocols are the tokenizer protocols tokenize.New accepts.
var protocols = []string{tokenize.ProtocolVLLMRender, tokenize.ProtocolVLLMTokenize, tokenize.ProtocolSGLang}

// setting is one configuration variable.
type setting struct {
	env, flag, def, help string
	parse                func(c *config, v string) error
}

func settings() []setting {
	return []setting{
		{"GATEWAY_ADDR", "addr", ":8080", "listen address (host:port) of the OpenAI API",
			func(c *config, v string) error {
				if _, _, err := net.SplitHostPort(v); err != nil {
					return fmt.Errorf("%q is not host:port", v)
				}
				c.Addr = v
				return nil
			}},
		{"DYN_EPP_WORKERS_FILE", "workers-file", "", "workers file (JSON or YAML: {\"workers\": [{id, endpoint, kv_events_endpoint, ...}]}), watched; required",
			func(c *config, v string) error { c.WorkersFile = v; return nil }},
		{"DYN_MODEL_NAME", "model", "default", "model of the worker entries that name none; requests are routed by their body's \"model\"",
			func(c *config, v string) error { c.Model = v; return nil }},
		{"DYN_EPP_TOKENIZER_SERVICE_URL", "tokenizer-url", "", "absolute http(s) base URL of the engines' tokenizer/render service; required",
			func(c *config, v string) error {
				u, err := url.Parse(v)
				if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
					return fmt.Errorf("%q is not an absolute http(s) URL", v)
				}
				c.TokenizerURL = v
				return nil
			}},
		{"DYN_EPP_TOKENIZER_PROTOCOL", "tokenizer-protocol", tokenize.ProtocolVLLMRender, "one of " + strings.Join(protocols, ", "),
			func(c *config, v string) error {
				if !slices.Contains(protocols, v) {
					return fmt.Errorf("%q is not one of %s", v, strings.Join(protocols, ", "))
				}
				c.TokenizerProtocol = v
				return nil
			}},
		{"DYN_EPP_TOKENIZATION_TIMEOUT_MS", "tokenization-timeout-ms", "5000", "per-call tokenizer timeout in ms (>= 1)",
			func(c *config, v string) error {
				n, err := strconv.Atoi(v)
				if err != nil || n < 1 {
					return fmt.Errorf("%q is not an integer >= 1", v)
				}
				c.TokenizerTimeout = time.Duration(n) * time.Millisecond
				return nil
			}},
		{"DYN_KV_CACHE_BLOCK_SIZE", "block-size", "16", "KV block size in tokens; must equal the engines' block size",
			func(c *config, v string) error {
				n, err := strconv.Atoi(v)
				if err != nil || n < 1 || n > 1<<16 {
					return fmt.Errorf("%q is not an integer in [1, 65536]", v)
				}
				c.BlockSize = n
				return nil
			}},
		{"DYN_ROUTER_USE_KV_EVENTS", "use-kv-events", "true", "subscribe to the engines' KV events (false: approximate mode, routed on the gateway's own decisions)",
			func(c *config, v string) error {
				b, err := strconv.ParseBool(v)
				if err != nil {
					return fmt.Errorf("%q is not a boolean", v)
				}
				c.UseKVEvents = b
				return nil
			}},
		{"DYN_EPP_MAX_BODY_BYTES", "max-body-bytes", "8388608", "largest request body buffered (excess: 413)",
			func(c *config, v string) error {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil || n < 1024 || n > 1<<30 {
					return fmt.Errorf("%q is not an integer in [1024, 2^30]", v)
				}
				c.MaxBodyBytes = n
				return nil
			}},
		{"GATEWAY_FAILURE_EJECTION", "failure-ejection", "10s", "how long a worker that refused a connection or answered 5xx is left out of the picks (a Go duration > 0)",
			func(c *config, v string) error {
				d, err := time.ParseDuration(v)
				if err != nil || d <= 0 {
					return fmt.Errorf("%q is not a positive duration", v)
				}
				c.FailureEjection = d
				return nil
			}},
	}
}

// errConfig wraps every configuration problem.
var errConfig = errors.New("gateway: invalid configuration")

// loadConfig reads the environment through getenv, lets the flags in args
// override it, and returns the configuration or one error naming every bad
// or missing setting.
func loadConfig(fs *flag.FlagSet, args []string, getenv func(string) string) (config, error) {
	sets := settings()
	vals := make(map[string]*string, len(sets))
	for _, s := range sets {
		help := fmt.Sprintf("%s (env %s", s.help, s.env)
		if s.def != "" {
			help += ", default " + s.def
		}
		vals[s.flag] = fs.String(s.flag, "", help+")")
	}
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("%w: unexpected arguments %q", errConfig, fs.Args())
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var c config
	var errs []error
	for _, s := range sets {
		v, src := s.def, "default"
		if e := strings.TrimSpace(getenv(s.env)); e != "" {
			v, src = e, s.env
		}
		if given[s.flag] {
			v, src = strings.TrimSpace(*vals[s.flag]), "--"+s.flag
		}
		if v == "" {
			continue
		}
		if err := s.parse(&c, v); err != nil {
			errs = append(errs, fmt.Errorf("--%s / %s (from %s): %w", s.flag, s.env, src, err))
		}
	}
	if c.WorkersFile == "" {
		errs = append(errs, errors.New("--workers-file / DYN_EPP_WORKERS_FILE: required"))
	}
	if c.TokenizerURL == "" {
		errs = append(errs, errors.New("--tokenizer-url / DYN_EPP_TOKENIZER_SERVICE_URL: required"))
	}
	if len(errs) > 0 {
		return config{}, fmt.Errorf("%w:\n  %w", errConfig, errors.Join(errs...))
	}
	return c, nil
}
