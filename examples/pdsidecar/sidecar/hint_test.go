package sidecar

import (
	"net/http"
	"net/netip"
	"testing"

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

	s, err = New(Options{AllowedPrefillPrefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
	require.NoError(t, err)
	_, reason = s.parseHint([]string{"[::ffff:10.0.0.1]:80"})
	require.Empty(t, reason)
	_, reason = s.parseHint([]string{"11.0.0.1:80"})
	require.Equal(t, HintNotAllowed, reason)
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
