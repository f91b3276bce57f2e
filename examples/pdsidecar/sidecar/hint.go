package sidecar

import (
	"errors"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/kvselect/kvselect/examples/internal/pdhint"
)

// Request headers the EPP sets for the sidecar.
const (
	// HeaderPrefiller carries the prefill endpoint, host:port with an IP
	// literal (IPv6 in brackets).
	HeaderPrefiller = "x-prefiller-host-port"
	// HeaderSignature carries the hint's signature (see pdhint).
	HeaderSignature = pdhint.Header
)

// Reasons a hint is refused (Stats.BadHints, the log line's reason). Each one
// is answered 502 with the OpenAI error code invalid_epp_metadata.
const (
	HintEmpty             = "empty"              // the header is empty or blank
	HintRepeated          = "repeated"           // the header came more than once
	HintList              = "list"               // a comma-separated list
	HintMalformed         = "malformed"          // not host:port, or not in canonical form
	HintHostname          = "hostname"           // a name, not an IP literal
	HintZone              = "zone"               // an IPv6 zone
	HintPort              = "port"               // port 0, out of range or not canonical
	HintForbiddenAddress  = "forbidden_address"  // unspecified, multicast, link-local, broadcast
	HintNotAllowed        = "not_allowed"        // outside AllowedPrefillPrefixes
	HintUnsigned          = "unsigned"           // a key is set and no signature came
	HintSignatureRepeated = "signature_repeated" // the signature header came more than once
	HintSignatureBad      = "signature_malformed"
	HintForged            = "forged"
	HintExpired           = "expired"
	HintTooLongLived      = "too_long_lived"
	HintReplayed          = "replayed"
	HintReplayCacheFull   = "replay_cache_full"
)

// hintReasons lists every hint refusal, for the counters.
var hintReasons = []string{
	HintEmpty, HintRepeated, HintList, HintMalformed, HintHostname, HintZone, HintPort,
	HintForbiddenAddress, HintNotAllowed, HintUnsigned, HintSignatureRepeated, HintSignatureBad,
	HintForged, HintExpired, HintTooLongLived, HintReplayed, HintReplayCacheFull,
}

// maxHintLen bounds a hint: "[" + the longest IPv6 text + "]:65535".
const maxHintLen = 1 + 45 + 1 + 6

// parseHint reads the prefiller header's values. It returns the endpoint, or
// the reason it is refused.
func (s *Sidecar) parseHint(values []string) (netip.AddrPort, string) {
	if len(values) > 1 {
		return netip.AddrPort{}, HintRepeated
	}
	v := values[0]
	switch {
	case strings.TrimSpace(v) == "":
		return netip.AddrPort{}, HintEmpty
	case strings.Contains(v, ","):
		return netip.AddrPort{}, HintList
	case strings.Contains(v, "%"):
		return netip.AddrPort{}, HintZone
	case len(v) > maxHintLen:
		return netip.AddrPort{}, HintMalformed
	}
	host, port, err := net.SplitHostPort(v)
	if err != nil {
		return netip.AddrPort{}, HintMalformed
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		if looksLikeName(host) {
			return netip.AddrPort{}, HintHostname
		}
		return netip.AddrPort{}, HintMalformed
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 || strconv.FormatUint(n, 10) != port {
		return netip.AddrPort{}, HintPort
	}
	ap := netip.AddrPortFrom(addr, uint16(n))
	if ap.String() != v {
		return netip.AddrPort{}, HintMalformed // [10.0.0.1]:80, upper-case or uncompressed IPv6, ...
	}
	a := addr.Unmap()
	if a.IsUnspecified() || a.IsMulticast() || a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast() ||
		a.IsInterfaceLocalMulticast() || a == netip.AddrFrom4([4]byte{255, 255, 255, 255}) {
		return netip.AddrPort{}, HintForbiddenAddress
	}
	if len(s.opts.AllowedPrefillPrefixes) > 0 && !slices.ContainsFunc(s.opts.AllowedPrefillPrefixes,
		func(p netip.Prefix) bool { return p.Contains(a) }) {
		return netip.AddrPort{}, HintNotAllowed
	}
	return ap, ""
}

// looksLikeName tells a host name from a broken address.
func looksLikeName(host string) bool {
	if host == "" || strings.Contains(host, ":") {
		return false
	}
	for _, c := range host {
		if (c < 'a' || c > 'z') && (c < 'A' || c > 'Z') && (c < '0' || c > '9') && c != '-' && c != '.' {
			return false
		}
	}
	return strings.ContainsFunc(host, func(c rune) bool { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') })
}

// checkSignature verifies the hint's signature when a key is set; it returns
// the reason it is refused, or "".
func (s *Sidecar) checkSignature(sigs []string, hint string, body []byte) string {
	if s.verifier == nil {
		return ""
	}
	switch len(sigs) {
	case 0:
		return HintUnsigned
	case 1:
	default:
		return HintSignatureRepeated
	}
	err := s.verifier.Verify(sigs[0], hint, body)
	switch {
	case err == nil:
		return ""
	case errors.Is(err, pdhint.ErrMissing):
		return HintUnsigned
	case errors.Is(err, pdhint.ErrForged):
		return HintForged
	case errors.Is(err, pdhint.ErrExpired):
		return HintExpired
	case errors.Is(err, pdhint.ErrTooLong):
		return HintTooLongLived
	case errors.Is(err, pdhint.ErrReplayed):
		return HintReplayed
	case errors.Is(err, pdhint.ErrCacheFull):
		return HintReplayCacheFull
	default:
		return HintSignatureBad
	}
}

// hopByHop are the headers of one connection, never forwarded (RFC 9110 7.6.1).
var hopByHop = []string{
	"Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization",
	"Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// isOrchestration reports whether a request header is the gateway's or the
// EPP's business, never an engine's: the hint and its signature, the EPP's
// other routing headers (x-gateway-destination-endpoint*, x-gateway-inference-*,
// the model rewrite, Dynamo's routing headers) and anything x-kvselect-*.
func isOrchestration(name string) bool {
	n := strings.ToLower(name)
	switch {
	case n == HeaderPrefiller, n == "x-gateway-model-name-rewrite":
		return true
	case strings.HasPrefix(n, "x-kvselect-"),
		strings.HasPrefix(n, "x-gateway-destination-endpoint"),
		strings.HasPrefix(n, "x-gateway-inference-"):
		return true
	}
	switch n {
	case "x-dynamo-worker-instance-id", "x-dynamo-prefill-instance-id", "x-dynamo-dp-rank",
		"x-dynamo-prefill-dp-rank", "x-dynamo-routing-mode":
		return true
	}
	return false
}

// outboundHeader is what an engine gets of the client's headers: all but the
// hop-by-hop ones (and those the Connection header names), the orchestration
// ones, Host, Content-Length and Expect.
func outboundHeader(in http.Header) http.Header {
	out := make(http.Header, len(in))
	var named []string
	for _, v := range in.Values("Connection") {
		for _, f := range strings.Split(v, ",") {
			if f = strings.TrimSpace(f); f != "" {
				named = append(named, http.CanonicalHeaderKey(f))
			}
		}
	}
	for k, vv := range in {
		if slices.Contains(hopByHop, k) || slices.Contains(named, k) || isOrchestration(k) ||
			k == "Host" || k == "Content-Length" || k == "Expect" {
			continue
		}
		out[k] = slices.Clone(vv)
	}
	return out
}

// copyResponseHeader copies an engine's answer headers for the client, less
// the hop-by-hop ones.
func copyResponseHeader(dst, src http.Header) {
	for k, vv := range src {
		if slices.Contains(hopByHop, k) {
			continue
		}
		dst[k] = slices.Clone(vv)
	}
}
