package catalog

import (
	"net"
	"net/netip"
	"strings"
)

// EndpointPolicy says which addresses a worker may be routed to and its KV
// events read from. Discovery hands the catalog whatever the cluster says; an
// address the gateway cannot or must not reach (a hostname it cannot resolve
// the same way, a link-local or cloud metadata address, a broadcast or
// multicast group, a local socket file) must not become a route, and the
// catalog says so by name (see Requirements). The zero value is the safe
// default.
type EndpointPolicy struct {
	// AllowHostnames accepts endpoints that name a host instead of an IP
	// literal (ReasonEndpointHostname otherwise). Routing then depends on the
	// gateway resolving the name as the catalog's owner would.
	AllowHostnames bool
	// AllowIPC accepts ipc:// KV-event and replay endpoints (an engine on the
	// router's own host); otherwise ReasonEventEndpointScheme.
	AllowIPC bool
	// Allow lists address ranges accepted even though their kind is refused
	// (link-local, multicast, unspecified, broadcast), for networks that really
	// route them.
	Allow []netip.Prefix
}

// Reasons for an address the policy refuses; a KV-event endpoint's carry its
// rank (":rank=N"), the replay endpoint's the suffix ":replay".
const (
	// ReasonEndpointHostname: the endpoint names a host, not an IP address.
	ReasonEndpointHostname Reason = "endpoint_hostname"
	// ReasonEndpointNotRoutable: the address is unspecified (0.0.0.0, ::),
	// link-local (169.254.0.0/16, which holds cloud metadata services, or
	// fe80::/10, zoned or not), multicast, or the IPv4 broadcast address.
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
	if addr.IsUnspecified() || addr.IsLinkLocalUnicast() || addr.IsLinkLocalMulticast() ||
		addr.IsInterfaceLocalMulticast() || addr.IsMulticast() || addr == netip.AddrFrom4([4]byte{255, 255, 255, 255}) {
		return ReasonEndpointNotRoutable
	}
	return ""
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
