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

	"github.com/kvselect/kvselect/examples/internal/envconf"
	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/examples/pdsidecar/sidecar"
)

// config is the sidecar binary's configuration: the environment of Dynamo's
// decode sidecar (its DYN_SIDECAR_* names, and the DYN_PD_* names of the
// earlier contract), each setting also a flag (flags win).
type config struct {
	listenAddr   string
	metricsAddr  string
	logLevel     slog.Level
	drainTimeout time.Duration
	sidecar      sidecar.Options
	// conflicts are the settings two variables gave different values
	// (Dynamo's name won); run logs them once it has a logger.
	conflicts []envconf.Conflict
}

// variables binds the contract to c, in docs/SIDECAR.md's table's order.
// Dynamo's names are overrides: read first, they win over the DYN_PD_* ones.
func (c *config) variables() []envconf.Var {
	o := &c.sidecar
	return []envconf.Var{
		{Env: "DYN_PD_LISTEN_ADDR", Flag: "listen-addr", Default: "0.0.0.0:8000", Help: "address the sidecar serves the OpenAI API on",
			Overrides: []envconf.Override{{Env: "DYN_SIDECAR_PORT", Form: "a port, served on 0.0.0.0", Convert: portInto("0.0.0.0:%d")}},
			Set:       hostPort(&c.listenAddr)},
		{Env: "DYN_PD_DECODE_URL", Flag: "decode-url", Default: sidecar.DefaultDecodeURL, Help: "base URL of the local decode engine",
			Overrides: []envconf.Override{{Env: "DYN_DECODE_ENGINE_PORT", Form: "a port, at http://127.0.0.1", Convert: portInto("http://127.0.0.1:%d")}},
			Set: func(v string) error {
				o.DecodeURL = v // New validates it
				return nil
			}},
		{Env: "DYN_PD_PROTOCOL", Flag: "protocol", Default: string(sidecar.ProtocolVLLMNIXL), Help: "P/D protocol: `vllm-nixl`, `sglang` or `trtllm`",
			Overrides: []envconf.Override{{Env: "DYN_SIDECAR_PD_BACKEND", Form: "Dynamo's backend selector: `sglang`; `unavailable` is refused", Convert: dynamoBackend}},
			Set: func(v string) (err error) {
				o.Protocol, err = sidecar.ParseProtocol(v)
				return err
			}},
		{Env: "DYN_PD_METRICS_ADDR", Flag: "metrics-addr", Default: ":9091", Help: "address of the Prometheus /metrics listener", Set: hostPort(&c.metricsAddr)},
		{Env: "DYN_PD_PREFILL_FALLBACK", Flag: "prefill-fallback", Default: string(sidecar.FallbackFail), Help: "when the prefill leg fails: `fail` (502) or `local` (the decode engine prefills)", Set: func(v string) (err error) {
			o.Fallback, err = sidecar.ParseFallback(v)
			return err
		}},
		{Env: "DYN_PD_PREFILL_TIMEOUT_MS", Flag: "prefill-timeout-ms", Default: "30000", Help: "deadline of the prefill leg, its whole answer included", Set: millis(&o.PrefillTimeout)},
		{Env: "DYN_PD_DECODE_TIMEOUT_MS", Flag: "decode-timeout-ms", Default: "600000", Help: "deadline of a decode or pass-through leg, its whole stream included", Set: millis(&o.DecodeTimeout)},
		{Env: "DYN_SIDECAR_READ_TIMEOUT_MS", Flag: "read-timeout-ms", Default: "300000", Help: "longest wait for the decode engine's next bytes on a decode or pass-through leg (its headers, then each read of its stream); past it the leg times out", Set: millis(&o.ReadIdleTimeout)},
		{Env: "DYN_PD_BODY_READ_TIMEOUT_MS", Flag: "body-read-timeout-ms", Default: "30000", Help: "deadline for a P/D client's body to arrive (408 past it)", Set: millis(&o.BodyReadTimeout)},
		{Env: "DYN_PD_DIAL_TIMEOUT_MS", Flag: "dial-timeout-ms", Default: "10000", Help: "deadline for connecting to an engine",
			Overrides: []envconf.Override{{Env: "DYN_SIDECAR_CONNECT_TIMEOUT_MS"}}, Set: millis(&o.DialTimeout)},
		{Env: "DYN_SIDECAR_DRAIN_TIMEOUT_MS", Flag: "drain-timeout-ms", Default: "30000", Help: "on SIGTERM, how long requests in flight may finish before their streams are cut", Set: millis(&c.drainTimeout)},
		{Env: "DYN_PD_MAX_BODY_BYTES", Flag: "max-body-bytes", Default: "8388608", Help: "largest client request body (413 past it)", Set: bytesIn(&o.MaxRequestBytes)},
		{Env: "DYN_PD_MAX_PREFILL_RESPONSE_BYTES", Flag: "max-prefill-response-bytes", Default: "1048576", Help: "largest prefill answer read (502 past it)", Set: bytesIn(&o.MaxPrefillResponseBytes)},
		{Env: "DYN_PD_SGLANG_BOOTSTRAP_PORT", Flag: "sglang-bootstrap-port", Default: strconv.Itoa(sidecar.DefaultSGLangBootstrapPort), Help: "prefill engines' SGLang bootstrap port (their --disaggregation-bootstrap-port)", Set: func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 65535 {
				return errors.New("not a port in [1, 65535]")
			}
			o.SGLangBootstrapPort = n
			return nil
		}},
		{Env: "DYN_PD_PREFILL_ALLOW_CIDRS", Flag: "prefill-allow-cidrs", Help: "comma-separated CIDRs prefill hints must point into (unset: any routable address)", Set: func(v string) error {
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
		{Env: "DYN_PD_HINT_KEY", Flag: "hint-key", Help: "key of signed hints: `file:<path>` or an absolute path names a regular file of at most " + strconv.Itoa(pdhint.MaxKeyFileBytes) + " bytes, anything else is the key itself (unset: hints are not signed)", Set: func(v string) error {
			key, err := pdhint.LoadKey(v)
			o.HintKey = key
			return err
		}},
		{Env: "DYN_PD_HINT_AUDIENCE", Flag: "hint-audience", Help: "this sidecar's endpoint as the EPP routes requests to it (`ip:port`): a signed hint must name it among its destinations (unset: the local address each connection arrived on)", Set: func(v string) error {
			ap, err := netip.ParseAddrPort(v)
			if err != nil || ap.Addr().Zone() != "" || ap.Port() == 0 {
				return errors.New("not an IP address and a port")
			}
			o.HintAudience = ap
			return nil
		}},
		{Env: "DYN_PD_HINT_MAX_LIFETIME_MS", Flag: "hint-max-lifetime-ms", Default: "300000", Help: "signed hints expiring further away are refused", Set: millis(&o.HintMaxLifetime)},
		{Env: "DYN_PD_HINT_REPLAY_CACHE", Flag: "hint-replay-cache", Default: "65536", Help: "most hint nonces remembered (replay protection)", Set: func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 1<<24 {
				return errors.New("not an integer in [1, 16777216]")
			}
			o.HintReplayCache = n
			return nil
		}},
		{Env: "DYN_PD_LOG_LEVEL", Flag: "log-level", Default: "info", Help: "`debug`, `info`, `warn` or `error`", Set: func(v string) error {
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

// dynamoBackend converts Dynamo's DYN_SIDECAR_PD_BACKEND into a protocol:
// "sglang" is SGLang's; "unavailable", Dynamo's default that answers 501 to
// every P/D request, has no equivalent here and is refused.
func dynamoBackend(v string) (string, error) {
	switch v {
	case "sglang":
		return string(sidecar.ProtocolSGLang), nil
	case "unavailable":
		return "", errors.New("unavailable (P/D off) has no equivalent: this sidecar always runs P/D; leave it unset and set DYN_PD_PROTOCOL")
	}
	return "", fmt.Errorf("%q is neither sglang nor unavailable", v)
}

// portInto converts a port (Dynamo's form of an address) into format's
// address.
func portInto(format string) func(string) (string, error) {
	return func(v string) (string, error) {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 65535 {
			return "", errors.New("not a port in [1, 65535]")
		}
		return fmt.Sprintf(format, n), nil
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

// loadConfig reads each setting from its flag, else the environment (Dynamo's
// name first), else its default, and returns one error naming every variable
// whose value is invalid.
func loadConfig(fs *flag.FlagSet, args []string, getenv func(string) string) (*config, error) {
	c := &config{}
	var problems []error
	vars := c.variables()
	if err := envconf.Load(fs, args, getenv, vars); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		problems = append(problems, err)
	}
	c.conflicts = envconf.Conflicts(fs, getenv, vars)
	if len(problems) > 0 {
		return nil, fmt.Errorf("%w:\n  %w", errConfig, errors.Join(problems...))
	}
	return c, nil
}

// envTable renders the contract as a Markdown table (docs/SIDECAR.md).
func envTable() string {
	return envconf.Table(new(config).variables())
}
