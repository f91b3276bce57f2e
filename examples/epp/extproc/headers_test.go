package extproc

import (
	"net/netip"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"
)

func headerMapOf(kv ...string) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{}
	for i := 0; i < len(kv); i += 2 {
		hv := &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])}
		if i%4 == 2 {
			hv = &corev3.HeaderValue{Key: kv[i], Value: kv[i+1]} // both encodings
		}
		hm.Headers = append(hm.Headers, hv)
	}
	return hm
}

func TestCanonicalEndpoint(t *testing.T) {
	ok := map[string]string{
		"10.0.0.1:8000":         "10.0.0.1:8000",
		"10.0.0.1:1":            "10.0.0.1:1",
		"10.0.0.1:65535":        "10.0.0.1:65535",
		"10.0.0.1:08000":        "10.0.0.1:8000",
		"[fd00::1]:8000":        "[fd00::1]:8000",
		"[FD00:0::0001]:8000":   "[fd00::1]:8000",
		"[::ffff:1.2.3.4]:8000": "[::ffff:1.2.3.4]:8000",
	}
	for in, want := range ok {
		got, err := CanonicalEndpoint(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{
		"", "10.0.0.1", "10.0.0.1:", "10.0.0.1:0", "10.0.0.1:65536", "10.0.0.1:-1", "10.0.0.1:+80",
		"10.0.0.1:8o", "host.example:80", "fd00::1:8000", "[fd00::1%eth0]:80", "[10.0.0.1]:80",
		" 10.0.0.1:80", "10.0.0.1:80 ", "10.0.0.1:80\n", "10.0.0.1:80,10.0.0.2:80", "[::1]:80]",
		strings.Repeat("1", 70) + ":80", "256.0.0.1:80", "1.2.3:80",
	} {
		_, err := CanonicalEndpoint(in)
		require.ErrorIs(t, err, ErrInvalidEndpoint, "%q", in)
	}
}

func subsetMD(v *structpb.Value) *corev3.Metadata {
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		SubsetNamespace: {Fields: map[string]*structpb.Value{SubsetKey: v}},
	}}
}

func TestReadSubset(t *testing.T) {
	list := func(items ...*structpb.Value) *structpb.Value {
		return structpb.NewListValue(&structpb.ListValue{Values: items})
	}
	s := structpb.NewStringValue
	cases := []struct {
		name    string
		md      *corev3.Metadata
		want    []string
		present bool
		dropped int
	}{
		{"nil metadata", nil, nil, false, 0},
		{"other namespace", &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb": {}}}, nil, false, 0},
		{"namespace without key", &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{SubsetNamespace: {}}},
			nil, false, 0},
		{"empty list", subsetMD(list()), []string{}, true, 0},
		{"list", subsetMD(list(s("1.1.1.1:80"), s("[::1]:81"))), []string{"1.1.1.1:80", "[::1]:81"}, true, 0},
		{"non-string item", subsetMD(list(s("1.1.1.1:80"), structpb.NewNumberValue(3))), []string{"1.1.1.1:80"}, true, 1},
		{"number", subsetMD(structpb.NewNumberValue(3)), []string{}, true, 1},
		{"null", subsetMD(structpb.NewNullValue()), []string{}, true, 1},
		{"string with spaces", subsetMD(s(" 1.1.1.1:80 ,\t2.2.2.2:80,")), []string{"1.1.1.1:80", "2.2.2.2:80"}, true, 0},
		{"bad items", subsetMD(s("a.b:1,1.1.1.1:80,[1.1.1.1],[fe80::1%eth0]")), []string{"1.1.1.1:80"}, true, 3},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, present, dropped := readSubset(tc.md)
			require.Equal(t, tc.want, got)
			require.Equal(t, tc.present, present)
			require.Equal(t, tc.dropped, dropped)
		})
	}
}

func TestReadSubsetCapsEntries(t *testing.T) {
	var b strings.Builder
	for i := range MaxSubsetEntries + 10 {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 1}), 80).String())
	}
	got, present, dropped := readSubset(subsetMD(structpb.NewStringValue(b.String())))
	require.True(t, present)
	require.Len(t, got, MaxSubsetEntries)
	require.Equal(t, 10, dropped)
}

func TestSameEndpoint(t *testing.T) {
	require.True(t, sameEndpoint("10.0.0.1:80", "10.0.0.1:80"))
	require.True(t, sameEndpoint("[FD00::1]:80", "[fd00::1]:80"))
	require.False(t, sameEndpoint("10.0.0.2:80", "10.0.0.1:80"))
	require.False(t, sameEndpoint("garbage", "10.0.0.1:80"))
}

func FuzzCanonicalEndpoint(f *testing.F) {
	for _, s := range []string{"10.0.0.1:8000", "[fd00::1]:80", "a:b", "[::1%x]:1", "1.2.3.4:65536"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		c, err := CanonicalEndpoint(s)
		if err != nil {
			return
		}
		// A canonical endpoint is a fixed point and safe to emit as a header.
		again, err := CanonicalEndpoint(c)
		if err != nil || again != c {
			t.Fatalf("%q -> %q -> %q, %v", s, c, again, err)
		}
		if strings.ContainsAny(c, " \t\r\n,%") {
			t.Fatalf("%q -> %q contains a forbidden character", s, c)
		}
		if _, err := netip.ParseAddrPort(c); err != nil {
			t.Fatalf("%q -> %q: %v", s, c, err)
		}
	})
}

func FuzzReadSubset(f *testing.F) {
	f.Add("10.0.0.1:8000,[fd00::1]:8000", true)
	f.Add(" , ,x", false)
	f.Fuzz(func(t *testing.T, s string, asList bool) {
		v := structpb.NewStringValue(s)
		if asList {
			v = structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{v, v}})
		}
		got, present, _ := readSubset(subsetMD(v))
		if !present || got == nil {
			t.Fatalf("present hint must give a non-nil subset")
		}
		if len(got) > MaxSubsetEntries {
			t.Fatalf("%d entries", len(got))
		}
		for _, e := range got {
			if _, err := netip.ParseAddrPort(e); err == nil {
				continue
			}
			if _, err := netip.ParseAddr(e); err != nil {
				t.Fatalf("entry %q is neither ip:port nor ip", e)
			}
		}
	})
}
