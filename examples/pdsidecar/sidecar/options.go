package sidecar

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"time"

	"github.com/kvselect/kvselect/examples/internal/pdhint"
)

// ErrInvalidOptions: New was given options that fail validation. The message
// names every problem.
var ErrInvalidOptions = errors.New("sidecar: invalid options")

// Protocol is the P/D wire protocol the engines speak.
type Protocol string

const (
	// ProtocolVLLMNIXL is vLLM's NIXL connector in pull mode: prefill first
	// (kv_transfer_params.do_remote_decode, one token, not streamed), then the
	// decode with the kv_transfer_params the prefill answered. Default.
	ProtocolVLLMNIXL Protocol = "vllm-nixl"
	// ProtocolSGLang is SGLang's bootstrap protocol: prefill and decode sent at
	// once with the same bootstrap_host, bootstrap_port and bootstrap_room.
	ProtocolSGLang Protocol = "sglang"
	// ProtocolTRTLLM is TensorRT-LLM's disaggregated serving: a context_only
	// request, then a generation_only one with the disaggregated_params the
	// context server answered.
	ProtocolTRTLLM Protocol = "trtllm"
)

// Protocols lists the protocols, default first.
var Protocols = []Protocol{ProtocolVLLMNIXL, ProtocolSGLang, ProtocolTRTLLM}

// ParseProtocol reads a protocol name.
func ParseProtocol(s string) (Protocol, error) {
	for _, p := range Protocols {
		if string(p) == s {
			return p, nil
		}
	}
	return "", fmt.Errorf("unknown protocol %q (want vllm-nixl, sglang or trtllm)", s)
}

// Fallback is what happens when the prefill leg fails or times out.
type Fallback string

const (
	// FallbackFail answers 502 with an OpenAI error naming the failure. Default.
	FallbackFail Fallback = "fail"
	// FallbackLocal sends the original request, unchanged, to the decode engine,
	// which then prefills locally. (SGLang's decode mode cannot serve a request
	// without bootstrap fields: keep FallbackFail with SGLang engines.)
	FallbackLocal Fallback = "local"
)

// ParseFallback reads a fallback name.
func ParseFallback(s string) (Fallback, error) {
	switch Fallback(s) {
	case FallbackFail, FallbackLocal:
		return Fallback(s), nil
	}
	return "", fmt.Errorf("unknown fallback %q (want fail or local)", s)
}

// Defaults applied by New to zero-valued fields.
const (
	DefaultDecodeURL               = "http://127.0.0.1:8001"
	DefaultPrefillTimeout          = 30 * time.Second
	DefaultDecodeTimeout           = 10 * time.Minute
	DefaultBodyReadTimeout         = 30 * time.Second
	DefaultDialTimeout             = 10 * time.Second
	DefaultReadIdleTimeout         = 5 * time.Minute // Dynamo's sidecar's read timeout
	DefaultMaxRequestBytes         = 8 << 20
	DefaultMaxPrefillResponseBytes = 1 << 20
	// DefaultSGLangBootstrapPort is SGLang's --disaggregation-bootstrap-port
	// default (server_args.py).
	DefaultSGLangBootstrapPort = 8998
)

// Options configures a Sidecar. The zero value is valid: vLLM NIXL in front of
// http://127.0.0.1:8001, no hint signing. New copies the options and never
// modifies the caller's value.
type Options struct {
	// Protocol of the engines. Default ProtocolVLLMNIXL.
	Protocol Protocol
	// DecodeURL is the local decode engine's base URL (http or https, with an
	// optional path prefix). Default "http://127.0.0.1:8001".
	DecodeURL string
	// Fallback when the prefill leg fails or times out. Default FallbackFail.
	Fallback Fallback

	// PrefillTimeout bounds the prefill leg, from sending it to its whole
	// answer. Default 30s; must be >= 0 (0 means the default).
	PrefillTimeout time.Duration
	// DecodeTimeout bounds a decode (or pass-through) leg, its whole streamed
	// answer included. Default 10 minutes; must be >= 0 (0 means the default).
	DecodeTimeout time.Duration
	// BodyReadTimeout bounds reading the client's body on the P/D path (408
	// past it). Default 30s; must be >= 0 (0 means the default).
	BodyReadTimeout time.Duration
	// ReadIdleTimeout bounds how long a decode or pass-through leg waits for
	// the engine's next bytes: its answer's headers, then each read of its
	// body. Past it the leg ends as timed out (an answer already started is
	// aborted, as past DecodeTimeout), so a stalled stream does not hold a
	// slot until DecodeTimeout. With SGLang the decode answer waits unread
	// until the prefill leg succeeds: keep it above PrefillTimeout. Default 5
	// minutes; must be >= 0 (0 means the default).
	ReadIdleTimeout time.Duration
	// DialTimeout bounds connecting to an engine (with the default transport).
	// Default 10s; must be >= 0 (0 means the default).
	DialTimeout time.Duration
	// MaxRequestBytes bounds a client's request body (413 past it). Default
	// 8 MiB; must be >= 0 (0 means the default).
	MaxRequestBytes int64
	// MaxPrefillResponseBytes bounds the prefill leg's answer, after
	// decompression. Default 1 MiB; must be >= 0 (0 means the default).
	MaxPrefillResponseBytes int64

	// SGLangBootstrapPort is the prefill engines' bootstrap port, sent as
	// bootstrap_port (SGLang). Default 8998; must be in [0, 65535] (0 means the
	// default).
	SGLangBootstrapPort int

	// AllowedPrefillPrefixes, when not empty, are the only networks a prefill
	// hint may point into. Whatever it holds, the addresses catalog.NotRoutable
	// refuses (unspecified, multicast, link-local, broadcast, cloud metadata
	// services, and IPv6 addresses carrying one) are refused.
	AllowedPrefillPrefixes []netip.Prefix
	// HintKey, when set, makes every hint need a valid signature (pdhint) under
	// this key: unsigned, forged, expired, replayed hints, hints signed for
	// another sidecar or path, and hints issued before this sidecar started
	// (a second of clock skew allowed) are refused. At least pdhint.MinKeyLen
	// bytes. Default: no signing.
	HintKey []byte
	// HintAudience is this sidecar's endpoint as the EPP routes requests to
	// it (an IP literal and a port): a signed hint must name it among its
	// destinations. Default: the local address each connection arrived on,
	// which is that endpoint when the gateway dials the pod directly; set it
	// when something in between (a proxy in the pod, a port mapping) makes
	// the two differ.
	HintAudience netip.AddrPort
	// HintMaxLifetime refuses signatures that expire further away. Default
	// pdhint.DefaultMaxLifetime; must be >= 0 (0 means the default).
	HintMaxLifetime time.Duration
	// HintReplayCache bounds the nonces remembered. Default
	// pdhint.DefaultMaxNonces; must be >= 0 (0 means the default).
	HintReplayCache int

	// Transport sends every leg. Default: the sidecar's own transport (no
	// proxy from the environment, DialTimeout), whose idle connections Close
	// closes. Redirects are never followed.
	Transport http.RoundTripper
	// Logger receives a line per refusal and per failed leg. Default: discard.
	Logger *slog.Logger
	// Now is the clock hint signatures are checked against. Default time.Now.
	Now func() time.Time
	// Rand is the source of SGLang bootstrap rooms. Default crypto/rand.Reader.
	Rand io.Reader
}

// withDefaults returns a validated copy of o with defaults applied, and the
// parsed decode URL.
func (o Options) withDefaults() (Options, *url.URL, error) {
	var problems []string
	if o.Protocol == "" {
		o.Protocol = ProtocolVLLMNIXL
	} else if _, err := ParseProtocol(string(o.Protocol)); err != nil {
		problems = append(problems, "Protocol: "+err.Error())
	}
	if o.Fallback == "" {
		o.Fallback = FallbackFail
	} else if _, err := ParseFallback(string(o.Fallback)); err != nil {
		problems = append(problems, "Fallback: "+err.Error())
	}
	if o.DecodeURL == "" {
		o.DecodeURL = DefaultDecodeURL
	}
	decode, err := url.Parse(o.DecodeURL)
	if err != nil || (decode.Scheme != "http" && decode.Scheme != "https") || decode.Host == "" ||
		decode.User != nil || decode.RawQuery != "" || decode.Fragment != "" {
		problems = append(problems, fmt.Sprintf("DecodeURL %q is not an http(s) base URL", o.DecodeURL))
	}
	durations := []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"PrefillTimeout", &o.PrefillTimeout, DefaultPrefillTimeout},
		{"DecodeTimeout", &o.DecodeTimeout, DefaultDecodeTimeout},
		{"ReadIdleTimeout", &o.ReadIdleTimeout, DefaultReadIdleTimeout},
		{"BodyReadTimeout", &o.BodyReadTimeout, DefaultBodyReadTimeout},
		{"DialTimeout", &o.DialTimeout, DefaultDialTimeout},
		{"HintMaxLifetime", &o.HintMaxLifetime, pdhint.DefaultMaxLifetime},
	}
	for _, d := range durations {
		if *d.v == 0 {
			*d.v = d.def
		} else if *d.v < 0 {
			problems = append(problems, fmt.Sprintf("%s %v < 0", d.name, *d.v))
		}
	}
	sizes := []struct {
		name string
		v    *int64
		def  int64
	}{
		{"MaxRequestBytes", &o.MaxRequestBytes, DefaultMaxRequestBytes},
		{"MaxPrefillResponseBytes", &o.MaxPrefillResponseBytes, DefaultMaxPrefillResponseBytes},
	}
	for _, s := range sizes {
		if *s.v == 0 {
			*s.v = s.def
		} else if *s.v < 0 {
			problems = append(problems, fmt.Sprintf("%s %d < 0", s.name, *s.v))
		}
	}
	if o.SGLangBootstrapPort == 0 {
		o.SGLangBootstrapPort = DefaultSGLangBootstrapPort
	} else if o.SGLangBootstrapPort < 0 || o.SGLangBootstrapPort > 65535 {
		problems = append(problems, fmt.Sprintf("SGLangBootstrapPort %d is not in [1, 65535]", o.SGLangBootstrapPort))
	}
	for i, p := range o.AllowedPrefillPrefixes {
		if !p.IsValid() {
			problems = append(problems, fmt.Sprintf("AllowedPrefillPrefixes[%d] is not a valid prefix", i))
		}
	}
	o.AllowedPrefillPrefixes = append([]netip.Prefix(nil), o.AllowedPrefillPrefixes...)
	if o.HintAudience != (netip.AddrPort{}) {
		if a := o.HintAudience.Addr(); !a.IsValid() || a.Zone() != "" || o.HintAudience.Port() == 0 {
			problems = append(problems, fmt.Sprintf("HintAudience %v is not an IP address and a port", o.HintAudience))
		}
		o.HintAudience = unmapped(o.HintAudience)
	}
	if o.HintKey != nil && len(o.HintKey) < pdhint.MinKeyLen {
		problems = append(problems, fmt.Sprintf("HintKey of %d bytes, want >= %d", len(o.HintKey), pdhint.MinKeyLen))
	}
	if o.HintReplayCache == 0 {
		o.HintReplayCache = pdhint.DefaultMaxNonces
	} else if o.HintReplayCache < 0 {
		problems = append(problems, fmt.Sprintf("HintReplayCache %d < 0", o.HintReplayCache))
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Rand == nil {
		o.Rand = rand.Reader
	}
	if len(problems) > 0 {
		return Options{}, nil, fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
	}
	return o, decode, nil
}
