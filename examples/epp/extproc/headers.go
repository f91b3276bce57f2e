package extproc

import (
	"fmt"
	"net"
	"net/netip"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvselect/kvselect/gaie"
	"github.com/kvselect/kvselect/selection/httproute"
)

// Names of the GAIE Endpoint Picker protocol and the disaggregated-serving
// contract, as package gaie defines them.
const (
	// HeaderDestination carries the chosen host:port to the gateway; it is
	// also the key of the destination in the MetadataNamespace.
	HeaderDestination = gaie.HeaderDestination
	// HeaderPrefiller carries the prefill worker's host:port to the decode
	// worker's sidecar in disaggregated mode.
	HeaderPrefiller = gaie.HeaderPrefiller
	// HeaderPrefillerSignature carries the EPP's signature of the prefiller
	// hint (package pdhint) when hints are signed; the sidecar checks it.
	HeaderPrefillerSignature = gaie.HeaderPrefillerSignature
	// MetadataNamespace is the dynamic-metadata namespace of the destination
	// (EPP to gateway) and of the served endpoint (gateway to EPP).
	MetadataNamespace = gaie.MetadataNamespace
	// SubsetNamespace is the request filter-metadata namespace of the subset
	// hint.
	SubsetNamespace = gaie.SubsetNamespace
	// SubsetKey is the key of the subset hint in SubsetNamespace.
	SubsetKey = gaie.HeaderDestinationSubset
	// ServedKey is the key, in MetadataNamespace of the response metadata,
	// of the endpoint that really served the request.
	ServedKey = gaie.HeaderDestinationServed
	// HeaderDebug is the response header of Pick.Debug.
	HeaderDebug = "x-kvselect-debug"
)

// MaxSignatureLen bounds Pick.PrefillerSignature (a pdhint value is at most
// 155 bytes).
const MaxSignatureLen = 256

// MaxSubsetEntries caps the subset hint; later entries are ignored, which can
// only narrow the choice.
const MaxSubsetEntries = 1024

// routingHeaders are headers a client could use to choose the destination, the
// prefill target or the candidate set, or to fake a gateway report (the list a
// gateway embedding kvselect strips too). They are removed from the forwarded
// request and never shown to the Picker.
var routingHeaders = httproute.ControlHeaders()

// inputHeaders are EPP inputs (objective, fairness, model rewrite, SLOs): the
// Picker sees them, the model server does not.
var inputHeaders = []string{
	"x-gateway-inference-fairness-id",
	"x-gateway-inference-objective",
	"x-gateway-model-name-rewrite",
	"x-llm-d-inference-fairness-id",
	"x-llm-d-inference-objective",
	"x-llm-d-model-name-rewrite",
	"x-llm-d-slo-ttft-ms",
	"x-llm-d-slo-tpot-ms",
	"x-slo-ttft-ms",
	"x-slo-tpot-ms",
}

const (
	hdrRouting = 1
	hdrInput   = 2
)

var controlSet = func() map[string]int {
	m := make(map[string]int, len(routingHeaders)+len(inputHeaders))
	for _, h := range routingHeaders {
		m[h] = hdrRouting
	}
	for _, h := range inputHeaders {
		m[h] = hdrInput
	}
	return m
}()

// ControlHeaders returns the request headers the server removes from every
// forwarded request (a new slice each call). The routing ones (destination,
// subset, served, scores, prefiller and its signature, dropped-reason, the conformance
// selection header and Dynamo's worker-id headers) are also hidden from the
// Picker; the input ones (objective, fairness id, model-name rewrite, SLO
// hints) are passed to the Picker, which is their consumer.
func ControlHeaders() []string {
	out := make([]string, 0, len(routingHeaders)+len(inputHeaders))
	out = append(out, routingHeaders...)
	return append(out, inputHeaders...)
}

// requestHeaders is what the server keeps of the request headers.
type requestHeaders struct {
	method, path, requestID string
	picker                  map[string]string // for PickRequest.Headers
	remove                  []string          // control headers present, to remove
	testSelection           string            // the conformance suite's selection header, hidden and removed
}

func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}

// readRequestHeaders splits Envoy's header map into pseudo-headers, control
// headers (recorded for removal) and the headers the Picker may see.
func readRequestHeaders(hm *corev3.HeaderMap) requestHeaders {
	hs := hm.GetHeaders()
	rh := requestHeaders{picker: make(map[string]string, len(hs))}
	for _, h := range hs {
		k := strings.ToLower(h.GetKey())
		v := headerValue(h)
		switch {
		case k == ":method":
			rh.method = v
			continue
		case k == ":path":
			rh.path = v
			continue
		case strings.HasPrefix(k, ":"):
			continue
		}
		if class := controlSet[k]; class != 0 {
			if !contains(rh.remove, k) {
				rh.remove = append(rh.remove, k)
			}
			if k == gaie.HeaderTestSelection {
				rh.testSelection = v
			}
			if class == hdrRouting {
				continue
			}
		}
		if k == "x-request-id" {
			rh.requestID = v
		}
		if old, ok := rh.picker[k]; ok {
			v = old + "," + v
		}
		rh.picker[k] = v
	}
	return rh
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// CanonicalEndpoint validates an "ip:port" endpoint and returns it in
// canonical form (IPv6 in brackets, no leading zeros in the port). The host
// must be an IP literal without a zone (no DNS names), the port decimal
// 1-65535, and the whole string free of spaces and control characters. It
// returns an error wrapping ErrInvalidEndpoint otherwise.
func CanonicalEndpoint(s string) (string, error) {
	ap, err := parseEndpoint(s)
	if err != nil {
		return "", err
	}
	return ap.String(), nil
}

func parseEndpoint(s string) (netip.AddrPort, error) {
	if len(s) == 0 || len(s) > 64 {
		return netip.AddrPort{}, fmt.Errorf("%w: %q: empty or too long", ErrInvalidEndpoint, s)
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("%w: %q: %v", ErrInvalidEndpoint, s, err)
	}
	addr, err := parseIP(host)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("%w: %q: %v", ErrInvalidEndpoint, s, err)
	}
	if addr.Is4() && strings.HasPrefix(s, "[") {
		return netip.AddrPort{}, fmt.Errorf("%w: %q: bracketed IPv4", ErrInvalidEndpoint, s)
	}
	p, ok := parsePort(port)
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("%w: %q: port must be 1-65535", ErrInvalidEndpoint, s)
	}
	return netip.AddrPortFrom(addr, p), nil
}

func parseIP(host string) (netip.Addr, error) {
	addr, err := netip.ParseAddr(host)
	if err != nil {
		return netip.Addr{}, err
	}
	if addr.Zone() != "" {
		return netip.Addr{}, fmt.Errorf("zoned address")
	}
	return addr, nil
}

func parsePort(s string) (uint16, bool) {
	if len(s) == 0 || len(s) > 5 {
		return 0, false
	}
	n := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	if n < 1 || n > 65535 {
		return 0, false
	}
	return uint16(n), true
}

// checkSignature validates a Pick's prefiller signature before it is emitted:
// it needs the prefiller it signs, sent exactly as the Picker gave it
// (canonical), and a value that is safe as a header (visible ASCII, bounded).
func checkSignature(sig, picked, canonical string) error {
	switch {
	case picked == "":
		return fmt.Errorf("%w: a signature without a prefiller", ErrInvalidSignature)
	case picked != canonical:
		return fmt.Errorf("%w: it signs %q, which is sent as %q", ErrInvalidSignature, picked, canonical)
	case len(sig) > MaxSignatureLen:
		return fmt.Errorf("%w: %d bytes, at most %d", ErrInvalidSignature, len(sig), MaxSignatureLen)
	}
	for i := 0; i < len(sig); i++ {
		if sig[i] <= ' ' || sig[i] > '~' {
			return fmt.Errorf("%w: byte %d is not visible ASCII", ErrInvalidSignature, i)
		}
	}
	return nil
}

// readSubset reads the subset hint from request metadata. present reports
// whether the key was there; subset then holds the canonical entries ("ip:port"
// or a bare IP), possibly none; dropped counts unusable entries.
func readSubset(md *corev3.Metadata) (subset []string, present bool, dropped int) {
	ns := md.GetFilterMetadata()[SubsetNamespace]
	if ns == nil {
		return nil, false, 0
	}
	v, ok := ns.GetFields()[SubsetKey]
	if !ok {
		return nil, false, 0
	}
	subset = make([]string, 0, 4)
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		subset, dropped = appendSubsetItems(subset, k.StringValue, dropped)
	case *structpb.Value_ListValue:
		for _, item := range k.ListValue.GetValues() {
			s, ok := item.GetKind().(*structpb.Value_StringValue)
			if !ok {
				dropped++
				continue
			}
			subset, dropped = appendSubsetItems(subset, s.StringValue, dropped)
		}
	default:
		dropped++
	}
	return subset, true, dropped
}

// appendSubsetItems appends the comma-separated entries of s.
func appendSubsetItems(subset []string, s string, dropped int) ([]string, int) {
	for item := range strings.SplitSeq(s, ",") {
		item = strings.Trim(item, " \t")
		if item == "" {
			continue
		}
		if len(subset) >= MaxSubsetEntries {
			dropped++
			continue
		}
		c, ok := canonicalSubsetItem(item)
		if !ok {
			dropped++
			continue
		}
		if !contains(subset, c) {
			subset = append(subset, c)
		}
	}
	return subset, dropped
}

// canonicalSubsetItem accepts "ip:port", a bare IP, or a bracketed bare IPv6.
func canonicalSubsetItem(item string) (string, bool) {
	if ap, err := parseEndpoint(item); err == nil {
		return ap.String(), true
	}
	host := item
	if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
		host = host[1 : len(host)-1]
		if !strings.Contains(host, ":") {
			return "", false
		}
	}
	addr, err := parseIP(host)
	if err != nil {
		return "", false
	}
	return addr.String(), true
}

// readServed returns the served endpoint reported in response metadata, or "".
func readServed(md *corev3.Metadata) string {
	ns := md.GetFilterMetadata()[MetadataNamespace]
	if ns == nil {
		return ""
	}
	return ns.GetFields()[ServedKey].GetStringValue()
}

// sameEndpoint compares a reported endpoint with a canonical one.
func sameEndpoint(reported, canonical string) bool {
	if reported == canonical {
		return true
	}
	c, err := CanonicalEndpoint(strings.TrimSpace(reported))
	return err == nil && c == canonical
}
