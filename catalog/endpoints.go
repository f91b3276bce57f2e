package catalog

import (
	"net"
	"net/netip"
	"slices"
	"strings"
)

// EndpointPolicy says which addresses a worker may be routed to and its KV
// events read from. Discovery hands the catalog whatever the cluster says; an
// address the gateway cannot or must not reach (a hostname it cannot resolve
// the same way, a link-local or cloud metadata address, a broadcast or
// multicast group, a local socket file) must not become a route, and the
// catalog says so by name (see Requirements and NotRoutable). The zero value
// is the safe default.
type EndpointPolicy struct {
	// AllowHostnames accepts endpoints that name a host instead of an IP
	// literal (ReasonEndpointHostname otherwise). Routing then depends on the
	// gateway resolving the name as the catalog's owner would.
	AllowHostnames bool
	// AllowIPC accepts ipc:// KV-event and replay endpoints (an engine on the
	// router's own host); otherwise ReasonEventEndpointScheme.
	AllowIPC bool
	// Allow lists address ranges accepted even though NotRoutable refuses
	// them (link-local, multicast, unspecified, broadcast, a metadata
	// service's address), for networks that really route them. An address is
	// matched as written (IPv4-mapped ones unmapped), not by the IPv4 address
	// a NAT64 or 6to4 address carries.
	Allow []netip.Prefix
}

// Reasons for an address the policy refuses; a KV-event endpoint's carry its
// rank (":rank=N"), the replay endpoint's the suffix ":replay".
const (
	// ReasonEndpointHostname: the endpoint names a host, not an IP address.
	ReasonEndpointHostname Reason = "endpoint_hostname"
	// ReasonEndpointNotRoutable: the address is one NotRoutable refuses
	// (unspecified, link-local, multicast, broadcast, a cloud metadata
	// service, or an IPv6 address carrying one of these), or a zoned IPv6
	// address.
	ReasonEndpointNotRoutable Reason = "endpoint_not_routable"
	// ReasonEventEndpointScheme: an ipc:// event endpoint without AllowIPC.
	ReasonEventEndpointScheme Reason = "kv_event_endpoint_scheme"
)

// hostProblem says why host (of a host:port) breaks p, or "".
func (p EndpointPolicy) hostProblem(host string) Reason {
	if i := strings.IndexByte(host, '%'); i >= 0 {
		// A zoned IPv6 address names an interface of the catalog owner's host:
		// meaningless to a gateway elsewhere, and always link-local.
		return ReasonEndpointNotRoutable
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		if p.AllowHostnames {
			return ""
		}
		return ReasonEndpointHostname
	}
	addr = addr.Unmap()
	for _, pre := range p.Allow {
		if pre.Contains(addr) {
			return ""
		}
	}
	if NotRoutable(addr) {
		return ReasonEndpointNotRoutable
	}
	return ""
}

// metadataServices are the addresses of cloud metadata and host services
// outside 169.254.0.0/16 (which holds AWS's, GCP's, Azure's, Oracle Cloud's
// and most others' IPv4 ones, and is link-local).
var metadataServices = []netip.Addr{
	netip.MustParseAddr("fd00:ec2::254"),   // AWS instance metadata (IMDS) over IPv6
	netip.MustParseAddr("fd20:ce::254"),    // Google Cloud metadata server over IPv6
	netip.MustParseAddr("100.100.100.200"), // Alibaba Cloud metadata
	netip.MustParseAddr("168.63.129.16"),   // Azure WireServer (host agent, health probes, DNS)
	netip.MustParseAddr("192.0.0.192"),     // Oracle Cloud's older metadata address
}

// Prefixes of IPv6 addresses that carry an IPv4 address (besides IPv4-mapped
// ::ffff:0:0/96, which netip.Addr.Unmap handles).
var (
	nat64WellKnown = netip.MustParsePrefix("64:ff9b::/96") // RFC 6052: the IPv4 address in the last 32 bits
	sixToFour      = netip.MustParsePrefix("2002::/16")    // RFC 3056: the IPv4 address in bits 16 to 47
)

// NotRoutable reports whether addr is an address that no endpoint a gateway
// dials may name, whatever the network: the unspecified addresses (0.0.0.0,
// ::), link-local ones (169.254.0.0/16, which holds most clouds' metadata
// services, and fe80::/10), multicast ones, the IPv4 broadcast address, the
// cloud metadata services outside 169.254.0.0/16 (AWS's fd00:ec2::254,
// Google Cloud's fd20:ce::254, Alibaba Cloud's 100.100.100.200, Azure's
// 168.63.129.16, Oracle Cloud's 192.0.0.192), any zoned address, and the
// invalid zero Addr. An IPv6 address that carries an IPv4 one is judged by
// that IPv4 address too: IPv4-mapped (::ffff:a.b.c.d), NAT64's well-known
// prefix (64:ff9b::/96) and 6to4 (2002::/16), so 64:ff9b::a9fe:a9fe is
// 169.254.169.254. Loopback and private addresses are routable.
//
// The catalog refuses such endpoints with ReasonEndpointNotRoutable unless
// EndpointPolicy.Allow lists them; the decode sidecar (examples/pdsidecar)
// refuses prefill hints naming them.
func NotRoutable(addr netip.Addr) bool {
	if !addr.IsValid() || addr.Zone() != "" {
		return true
	}
	addr = addr.Unmap()
	if refusedKind(addr) {
		return true
	}
	if v4, ok := carriedIPv4(addr); ok {
		return refusedKind(v4)
	}
	return false
}

// refusedKind reports whether addr, taken as it is, is of a kind NotRoutable
// refuses.
func refusedKind(a netip.Addr) bool {
	return a.IsUnspecified() || a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast() ||
		a.IsInterfaceLocalMulticast() || a.IsMulticast() || a == netip.AddrFrom4([4]byte{255, 255, 255, 255}) ||
		slices.Contains(metadataServices, a)
}

// carriedIPv4 returns the IPv4 address a NAT64 (well-known prefix) or 6to4
// IPv6 address carries.
func carriedIPv4(a netip.Addr) (netip.Addr, bool) {
	b := a.As16()
	switch {
	case nat64WellKnown.Contains(a):
		return netip.AddrFrom4([4]byte(b[12:16])), true
	case sixToFour.Contains(a):
		return netip.AddrFrom4([4]byte(b[2:6])), true
	}
	return netip.Addr{}, false
}

// endpointProblem judges a host:port endpoint.
func (p EndpointPolicy) endpointProblem(ep string) Reason {
	host, _, err := net.SplitHostPort(ep)
	if err != nil {
		return ReasonEndpointNotRoutable // Validate reports the syntax
	}
	return p.hostProblem(host)
}

// zmqProblem judges a tcp:// or ipc:// event endpoint.
func (p EndpointPolicy) zmqProblem(ep string) Reason {
	scheme, rest, _ := strings.Cut(ep, "://")
	if scheme != "tcp" {
		if p.AllowIPC && scheme == "ipc" {
			return ""
		}
		return ReasonEventEndpointScheme
	}
	return p.endpointProblem(rest)
}
