package sidecar

import (
	"net/http"
	"net/netip"
	"testing"

	"github.com/kvselect/kvselect/gaie"
	"github.com/stretchr/testify/require"
)

func TestParseHintAccepts(t *testing.T) {
	s, err := New(Options{})
	require.NoError(t, err)
	for _, v := range []string{"10.0.0.7:8000", "127.0.0.1:1", "[2001:db8::1]:8000", "[::1]:65535", "[::ffff:10.0.0.1]:80"} {
		ap, reason := s.parseHint([]string{v})
		require.Empty(t, reason, v)
		require.Equal(t, v, ap.String())
	}
	// Whitespace never survives net/http's parsing, but a direct caller may pass it.
	for _, v := range []string{" 10.0.0.7:8000", "10.0.0.7:8000 ", "\t"} {
		_, reason := s.parseHint([]string{v})
		require.NotEmpty(t, reason, "%q", v)
	}
	_, reason := s.parseHint([]string{"[::ffff:169.254.169.254]:80"})
	require.Equal(t, HintForbiddenAddress, reason, "a mapped address is judged unmapped")
	// Cloud metadata services outside 169.254.0.0/16, and 169.254.169.254
	// carried by NAT64 and 6to4 addresses (catalog.NotRoutable).
	for _, v := range []string{"[fd00:ec2::254]:80", "100.100.100.200:80", "[::ffff:100.100.100.200]:80", "168.63.129.16:80",
		"[fd20:ce::254]:80", "[64:ff9b::a9fe:a9fe]:80", "[2002:a9fe:a9fe::1]:80", "[2002:a9fe:a9fe::]:80", "[64:ff9b::e000:1]:80"} {
		_, reason := s.parseHint([]string{v})
		require.Equal(t, HintForbiddenAddress, reason, v)
	}

	s, err = New(Options{AllowedPrefillPrefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
	require.NoError(t, err)
	_, reason = s.parseHint([]string{"[::ffff:10.0.0.1]:80"})
	require.Empty(t, reason)
	_, reason = s.parseHint([]string{"11.0.0.1:80"})
	require.Equal(t, HintNotAllowed, reason)

	// An allow list never lifts the refusal: 100.64.0.0/10 holds Alibaba
	// Cloud's metadata service.
	s, err = New(Options{AllowedPrefillPrefixes: []netip.Prefix{netip.MustParsePrefix("100.64.0.0/10"), netip.MustParsePrefix("::/0")}})
	require.NoError(t, err)
	for _, v := range []string{"100.100.100.200:80", "[fd00:ec2::254]:80", "[64:ff9b::a9fe:a9fe]:80"} {
		_, reason = s.parseHint([]string{v})
		require.Equal(t, HintForbiddenAddress, reason, v)
	}
	_, reason = s.parseHint([]string{"100.100.100.201:80"})
	require.Empty(t, reason)
}

func TestOutboundHeader(t *testing.T) {
	in := http.Header{
		"Authorization":                  {"Bearer k"},
		"X-Request-Id":                   {"r"},
		"Connection":                     {"keep-alive, X-Hop"},
		"X-Hop":                          {"1"},
		"Te":                             {"trailers"},
		"Expect":                         {"100-continue"},
		"Content-Length":                 {"12"},
		"X-Prefiller-Host-Port":          {"10.0.0.1:80"},
		"X-Kvselect-Prefiller-Signature": {"v1..."},
		"X-Kvselect-Anything":            {"x"},
		"X-Gateway-Destination-Endpoint": {"10.0.0.2:80"},
		"X-Gateway-Model-Name-Rewrite":   {"m"},
		"X-Dynamo-Routing-Mode":          {"kv"},
	}
	out := outboundHeader(in)
	require.Equal(t, http.Header{"Authorization": {"Bearer k"}, "X-Request-Id": {"r"}}, out)
}

// An engine's answer reaches the client without hop-by-hop headers and
// without the routing layer's: an engine cannot tell the picker, in the
// sidecar's name, that another worker failed.
func TestCopyResponseHeaderLeavesOutControlHeaders(t *testing.T) {
	src := http.Header{}
	src.Set("Content-Type", "text/event-stream")
	src.Set("Connection", "close")
	src.Set(gaie.HeaderFailedLeg, gaie.FailedLegPrefill)
	src.Set("X-Kvselect-Anything", "x")
	dst := http.Header{}
	copyResponseHeader(dst, src)
	require.Equal(t, http.Header{"Content-Type": {"text/event-stream"}}, dst)
}
