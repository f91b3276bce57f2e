package main

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
)

// config is the sidecar binary's configuration: the DYN_PD_* environment of
// Dynamo's decode sidecar, each variable also a flag (flags win).
type config struct {
	listenAddr  string
	metricsAddr string
	logLevel    slog.Level
	sidecar     sidecar.Options
}

// variable is one DYN_PD_* setting: its environment name, flag, default,
// meaning, and how a value lands in the config.
type variable struct {
	env, flag, def, help string
	apply                func(v string) error
}

// variables binds the contract to c, in the README table's order.
func (c *config) variables() []variable {
	o := &c.sidecar
	return []variable{
		{"DYN_PD_LISTEN_ADDR", "listen-addr", "0.0.0.0:8000", "address the sidecar serves the OpenAI API on", hostPort(&c.listenAddr)},
		{"DYN_PD_DECODE_URL", "decode-url", sidecar.DefaultDecodeURL, "base URL of the local decode engine", func(v string) error {
			o.DecodeURL = v // New validates it
			return nil
		}},
		{"DYN_PD_PROTOCOL", "protocol", string(sidecar.ProtocolVLLMNIXL), "P/D protocol: `vllm-nixl`, `sglang` or `trtllm`", func(v string) (err error) {
			o.Protocol, err = sidecar.ParseProtocol(v)
			return err
		}},
		{"DYN_PD_METRICS_ADDR", "metrics-addr", ":9091", "address of the Prometheus /metrics listener", hostPort(&c.metricsAddr)},
		{"DYN_PD_PREFILL_FALLBACK", "prefill-fallback", string(sidecar.FallbackFail), "when the prefill leg fails: `fail` (502) or `local` (the decode engine prefills)", func(v string) (err error) {
			o.Fallback, err = sidecar.ParseFallback(v)
			return err
		}},
		{"DYN_PD_PREFILL_TIMEOUT_MS", "prefill-timeout-ms", "30000", "deadline of the prefill leg, its whole answer included", millis(&o.PrefillTimeout)},
		{"DYN_PD_DECODE_TIMEOUT_MS", "decode-timeout-ms", "600000", "deadline of a decode or pass-through leg, its whole stream included", millis(&o.DecodeTimeout)},
		{"DYN_PD_BODY_READ_TIMEOUT_MS", "body-read-timeout-ms", "30000", "deadline for a P/D client's body to arrive (408 past it)", millis(&o.BodyReadTimeout)},
		{"DYN_PD_DIAL_TIMEOUT_MS", "dial-timeout-ms", "10000", "deadline for connecting to an engine", millis(&o.DialTimeout)},
		{"DYN_PD_MAX_BODY_BYTES", "max-body-bytes", "8388608", "largest client request body (413 past it)", bytesIn(&o.MaxRequestBytes)},
		{"DYN_PD_MAX_PREFILL_RESPONSE_BYTES", "max-prefill-response-bytes", "1048576", "largest prefill answer read (502 past it)", bytesIn(&o.MaxPrefillResponseBytes)},
		{"DYN_PD_SGLANG_BOOTSTRAP_PORT", "sglang-bootstrap-port", strconv.Itoa(sidecar.DefaultSGLangBootstrapPort), "prefill engines' SGLang bootstrap port (their --disaggregation-bootstrap-port)", func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 65535 {
				return errors.New("not a port in [1, 65535]")
			}
			o.SGLangBootstrapPort = n
			return nil
		}},
		{"DYN_PD_PREFILL_ALLOW_CIDRS", "prefill-allow-cidrs", "", "comma-separated CIDRs prefill hints must point into (unset: any routable address)", func(v string) error {
			o.AllowedPrefillPrefixes = nil
			for _, f := range strings.Split(v, ",") {
				p, err := netip.ParsePrefix(strings.TrimSpace(f))
				if err != nil {
					return fmt.Errorf("%q is not a CIDR", strings.TrimSpace(f))
				}
				o.AllowedPrefillPrefixes = append(o.AllowedPrefillPrefixes, p.Masked())
			}
			return nil
		}},
		{"DYN_PD_HINT_KEY", "hint-key", "", "key of signed hints: `file:<path>` or an absolute path is read, anything else is the key itself (unset: hints are not signed)", func(v string) error {
			key, err := pdhint.LoadKey(v)
			o.HintKey = key
			return err
		}},
		{"DYN_PD_HINT_MAX_LIFETIME_MS", "hint-max-lifetime-ms", "300000", "signed hints expiring further away are refused", millis(&o.HintMaxLifetime)},
		{"DYN_PD_HINT_REPLAY_CACHE", "hint-replay-cache", "65536", "most hint nonces remembered (replay protection)", func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 1<<24 {
				return errors.New("not an integer in [1, 16777216]")
			}
			o.HintReplayCache = n
			return nil
		}},
		{"DYN_PD_LOG_LEVEL", "log-level", "info", "`debug`, `info`, `warn` or `error`", func(v string) error {
			return c.logLevel.UnmarshalText([]byte(v))
		}},
	}
}

func hostPort(dst *string) func(string) error {
	return func(v string) error {
		if _, _, err := net.SplitHostPort(v); err != nil {
			return errors.New("not host:port")
		}
		*dst = v
		return nil
	}
}

func millis(dst *time.Duration) func(string) error {
	return func(v string) error {
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil || ms < 1 || ms > 86_400_000 {
			return errors.New("not a whole number of milliseconds in [1, 86400000]")
		}
		*dst = time.Duration(ms) * time.Millisecond
		return nil
	}
}

func bytesIn(dst *int64) func(string) error {
	return func(v string) error {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1024 || n > 1<<30 {
			return errors.New("not a byte count in [1024, 1073741824]")
		}
		*dst = n
		return nil
	}
}

// errConfig wraps every startup configuration problem.
var errConfig = errors.New("pdsidecar: invalid configuration")

// loadConfig reads each variable from its flag, else the environment, else its
// default, and returns one error naming every variable whose value is invalid.
func loadConfig(fs *flag.FlagSet, args []string, getenv func(string) string) (*config, error) {
	c := &config{}
	vars := c.variables()
	fromFlag := make(map[string]*string, len(vars))
	for _, v := range vars {
		fromFlag[v.flag] = fs.String(v.flag, "", v.help+" (env "+v.env+")")
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var problems []error
	for _, v := range vars {
		val, from := v.def, "default"
		if e := getenv(v.env); e != "" {
			val, from = e, "environment"
		}
		if given[v.flag] {
			val, from = *fromFlag[v.flag], "--"+v.flag
		}
		if val = strings.TrimSpace(val); val == "" {
			continue
		}
		if err := v.apply(val); err != nil {
			problems = append(problems, fmt.Errorf("%s (%s): %w", v.env, from, err))
		}
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("%w:\n  %w", errConfig, errors.Join(problems...))
	}
	return c, nil
}

// envTable renders the contract as a Markdown table (docs/SIDECAR.md).
func envTable() string {
	var b strings.Builder
	b.WriteString("| Variable | Flag | Default | Meaning |\n|---|---|---|---|\n")
	for _, v := range new(config).variables() {
		def := v.def
		if def == "" {
			def = "(unset)"
		}
		fmt.Fprintf(&b, "| `%s` | `--%s` | %s | %s |\n", v.env, v.flag, def, v.help)
	}
	return b.String()
}
