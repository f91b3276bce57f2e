package sidecar

import (
	"errors"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/internal/pdhint"
	"github.com/kvselect/kvselect/gaie"
)

// Request headers the EPP sets for the sidecar.
const (
	// HeaderPrefiller carries the prefill endpoint, host:port with an IP
	// literal (IPv6 in brackets).
	HeaderPrefiller = gaie.HeaderPrefiller
	// HeaderSignature carries the hint's signature (see pdhint).
	HeaderSignature = gaie.HeaderPrefillerSignature
	// HeaderDestination carries the decode endpoints the EPP routed the
	// request to (GAIE's destination list: the chosen one, then its
	// fallbacks). A signature covers it; without it a signed hint must have
	// been signed for this sidecar alone.
	HeaderDestination = gaie.HeaderDestination
)

// Reasons a hint is refused (Stats.BadHints, the log line's reason). Each one
// is answered 502 with the OpenAI error code invalid_epp_metadata.
const (
	HintEmpty             = "empty"               // the header is empty or blank
	HintRepeated          = "repeated"            // the header came more than once
	HintList              = "list"                // a comma-separated list
	HintMalformed         = "malformed"           // not host:port, or not in canonical form
	HintHostname          = "hostname"            // a name, not an IP literal
	HintZone              = "zone"                // an IPv6 zone
	HintPort              = "port"                // port 0, out of range or not canonical
	HintForbiddenAddress  = "forbidden_address"   // catalog.NotRoutable: unspecified, link-local, multicast, broadcast, cloud metadata
	HintNotAllowed        = "not_allowed"         // outside AllowedPrefillPrefixes
	HintUnsigned          = "unsigned"            // a key is set and no signature came
	HintSignatureRepeated = "signature_repeated"  // the signature header came more than once
	HintWrongDestination  = "wrong_destination"   // the destinations the request was routed to do not name this sidecar
	HintSignatureBad      = "signature_malformed" // not a v2 signature
	HintForged            = "forged"              // the MAC does not match the hint, destinations, path and body
	HintExpired           = "expired"             // past its expiry
	HintTooLongLived      = "too_long_lived"      // expiring further away than HintMaxLifetime
	HintStale             = "stale"               // issued over a second before this sidecar started
	HintReplayed          = "replayed"            // its nonce was accepted before
	HintReplayCacheFull   = "replay_cache_full"   // HintReplayCache live nonces remembered
)

// hintReasons lists every hint refusal, for the counters.
var hintReasons = []string{
	HintEmpty, HintRepeated, HintList, HintMalformed, HintHostname, HintZone, HintPort,
	HintForbiddenAddress, HintNotAllowed, HintUnsigned, HintSignatureRepeated, HintWrongDestination,
	HintSignatureBad, HintForged, HintExpired, HintTooLongLived, HintStale, HintReplayed, HintReplayCacheFull,
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
	if catalog.NotRoutable(a) {
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

// checkSignature verifies the hint's signature when a key is set, over the
// hint, the destinations, the path and the body; it returns the reason it is
// refused, or "".
func (s *Sidecar) checkSignature(r *http.Request, hint string, body []byte) string {
	if s.verifier == nil {
		return ""
	}
	sigs := r.Header.Values(HeaderSignature)
	switch len(sigs) {
	case 0:
		return HintUnsigned
	case 1:
	default:
		return HintSignatureRepeated
	}
	dests, ok := s.destinations(r)
	if !ok {
		return HintWrongDestination
	}
	err := s.verifier.Verify(sigs[0], pdhint.Claim{Prefiller: hint, Destinations: dests, Path: r.URL.Path, Body: body})
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
	case errors.Is(err, pdhint.ErrStale):
		return HintStale
	case errors.Is(err, pdhint.ErrReplayed):
		return HintReplayed
	case errors.Is(err, pdhint.ErrCacheFull):
		return HintReplayCacheFull
	default:
		return HintSignatureBad
	}
}

// destinations are the signed destinations of r as this sidecar sees them:
// the HeaderDestination list as it came, which must name this sidecar, or
// this sidecar alone when the request carries none. It reports false when the
// list does not name this sidecar, came more than once or is longer than
// pdhint allows, or when the sidecar cannot tell its own endpoint.
func (s *Sidecar) destinations(r *http.Request) ([]string, bool) {
	self, ok := s.self(r)
	if !ok {
		return nil, false
	}
	values := r.Header.Values(HeaderDestination)
	switch {
	case len(values) == 0:
		return []string{self.String()}, true
	case len(values) > 1 || strings.Count(values[0], ",") >= pdhint.MaxDestinations:
		return nil, false
	}
	list := strings.Split(values[0], ",")
	for _, d := range list {
		if ap, err := netip.ParseAddrPort(d); err == nil && unmapped(ap) == self {
			return list, true
		}
	}
	return nil, false
}

// self is this sidecar's endpoint: Options.HintAudience, else the local
// address the request's connection arrived on.
func (s *Sidecar) self(r *http.Request) (netip.AddrPort, bool) {
	if s.opts.HintAudience.IsValid() {
		return s.opts.HintAudience, true
	}
	var ap netip.AddrPort
	switch a := r.Context().Value(http.LocalAddrContextKey).(type) {
	case *net.TCPAddr:
		ap = a.AddrPort()
	case net.Addr:
		ap, _ = netip.ParseAddrPort(a.String())
	}
	return unmapped(ap), ap.IsValid()
}

// unmapped is ap with an IPv4-mapped address unmapped (a dual-stack listener
// reports ::ffff:10.0.0.5).
func unmapped(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// hopByHop are the headers of one connection, never forwarded (RFC 9110 7.6.1).
var hopByHop = []string{
	"Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization",
	"Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// isOrchestration reports whether a request header is the gateway's or the
// EPP's business, never an engine's (gaie.IsControlHeader: the hint and its
// signature, the EPP's other routing headers, the model rewrite, Dynamo's
// routing headers and anything x-kvselect-*).
func isOrchestration(name string) bool { return gaie.IsControlHeader(name) }

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
// the hop-by-hop ones and the routing layer's (gaie.IsControlHeader): an
// engine cannot speak for the sidecar (gaie.HeaderFailedLeg) to the picker.
func copyResponseHeader(dst, src http.Header) {
	for k, vv := range src {
		if slices.Contains(hopByHop, k) || gaie.IsControlHeader(k) {
			continue
		}
		dst[k] = slices.Clone(vv)
	}
}
