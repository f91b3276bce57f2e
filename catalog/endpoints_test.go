package catalog_test

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
)

// Cloud metadata services are never an endpoint, however they are spelled;
// private and loopback addresses are.
func ExampleNotRoutable() {
	for _, s := range []string{
		"10.0.0.7",
		"169.254.169.254",        // AWS, GCP, Azure, ... metadata
		"fd00:ec2::254",          // AWS metadata over IPv6
		"100.100.100.200",        // Alibaba Cloud metadata
		"64:ff9b::a9fe:a9fe",     // 169.254.169.254 through NAT64
		"2002:a9fe:a9fe::1",      // 169.254.169.254 through 6to4
		"::ffff:169.254.169.254", // IPv4-mapped
		"::1",
	} {
		fmt.Println(s, catalog.NotRoutable(netip.MustParseAddr(s)))
	}
	// Output:
	// 10.0.0.7 false
	// 169.254.169.254 true
	// fd00:ec2::254 true
	// 100.100.100.200 true
	// 64:ff9b::a9fe:a9fe true
	// 2002:a9fe:a9fe::1 true
	// ::ffff:169.254.169.254 true
	// ::1 false
}

func TestNotRoutable(t *testing.T) {
	refused := []string{
		"0.0.0.0", "::", "169.254.0.1", "169.254.169.254", "fe80::1", "fe80::a9fe:a9fe", "fe80::1%eth0",
		"224.0.0.1", "239.1.2.3", "ff02::1", "ff01::1", "ff0e::1", "255.255.255.255",
		"fd00:ec2::254", "fd20:ce::254", "100.100.100.200", "168.63.129.16", "192.0.0.192",
		"::ffff:169.254.169.254", "::ffff:100.100.100.200", "::ffff:0.0.0.0", "::ffff:255.255.255.255",
		// NAT64 (well-known prefix) and 6to4 carry an IPv4 address judged as one.
		"64:ff9b::a9fe:a9fe", "64:ff9b::169.254.169.254", "64:ff9b::6464:64c8", "64:ff9b::a83f:8110",
		"64:ff9b::e000:1", "64:ff9b::", "64:ff9b::ffff:ffff",
		"2002:a9fe:a9fe::", "2002:a9fe:a9fe:1::5", "2002:6464:64c8::1", "2002::1", "2002:e000:1::1",
	}
	for _, s := range refused {
		require.True(t, catalog.NotRoutable(netip.MustParseAddr(s)), s)
	}
	require.True(t, catalog.NotRoutable(netip.Addr{}), "the zero Addr")
	for _, s := range []string{
		"10.0.0.7", "127.0.0.1", "192.168.1.1", "100.64.0.1", "8.8.8.8", "::1", "2001:db8::1", "fd00::1",
		"fd00:ec2::253", "fd00:10:244::5", "::ffff:10.0.0.1",
		"64:ff9b::a00:7", "64:ff9b::808:808", "2002:a00:7::1", "2002:808:808::",
		"64:ff9b:1::a9fe:a9fe", // the local-use prefix: where it carries an IPv4 address depends on its length
	} {
		require.False(t, catalog.NotRoutable(netip.MustParseAddr(s)), s)
	}
}

// The endpoint policy refuses what NotRoutable refuses, through every
// spelling, unless Allow lists it as written.
func TestEndpointPolicyRefusesMetadataSpellings(t *testing.T) {
	worker := func(ep string) catalog.Worker {
		return catalog.Worker{ID: "w", Model: "m", Endpoint: ep, DPSize: 1, BlockSize: 16}
	}
	for _, ep := range []string{
		"[fd00:ec2::254]:80", "100.100.100.200:80", "[64:ff9b::a9fe:a9fe]:80", "[2002:a9fe:a9fe::1]:80",
		"[::ffff:100.100.100.200]:80", "168.63.129.16:80", "[fd20:ce::254]:80",
	} {
		rec, err := catalog.New(catalog.Options{}).Upsert(worker(ep))
		require.NoError(t, err, ep)
		require.Equal(t, catalog.Incomplete, rec.Lifecycle, ep)
		require.Equal(t, []catalog.Reason{catalog.ReasonEndpointNotRoutable}, rec.Reasons, ep)
	}
	allow := catalog.EndpointPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("100.100.100.200/32")}}
	rec, err := catalog.New(catalog.Options{Requirements: catalog.Requirements{Endpoints: allow}}).Upsert(worker("100.100.100.200:80"))
	require.NoError(t, err)
	require.Equal(t, catalog.Schedulable, rec.Lifecycle, rec.Reasons)
}
