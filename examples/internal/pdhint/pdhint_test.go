package pdhint

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/clocktest"
)

var testKey = bytes.Repeat([]byte("k"), MinKeyLen)

const endpoint = "10.0.0.7:8000"

var body = []byte(`{"model":"m","prompt":"hello"}`)

func newVerifier(t *testing.T, clock *clocktest.Clock, o VerifierOptions) *Verifier {
	t.Helper()
	if o.Key == nil {
		o.Key = testKey
	}
	o.Now = clock.Now
	v, err := NewVerifier(o)
	require.NoError(t, err)
	return v
}

func nonce(b byte) []byte { return bytes.Repeat([]byte{b}, NonceLen) }

func TestSignVerify(t *testing.T) {
	clock := clocktest.New(time.Unix(1_700_000_000, 0))
	v := newVerifier(t, clock, VerifierOptions{})
	exp := clock.Now().Add(30 * time.Second)
	val, err := Sign(testKey, endpoint, body, exp, nonce(1))
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(val, "v1.1700000030."), val)

	require.NoError(t, v.Verify(val, endpoint, body))
	require.Equal(t, 1, v.Remembered())
	require.ErrorIs(t, v.Verify(val, endpoint, body), ErrReplayed, "a nonce is good once")
}

func TestVerifyRefusals(t *testing.T) {
	clock := clocktest.New(time.Unix(1_700_000_000, 0))
	exp := clock.Now().Add(30 * time.Second)
	good, err := Sign(testKey, endpoint, body, exp, nonce(2))
	require.NoError(t, err)
	otherKey, err := Sign(bytes.Repeat([]byte("x"), MinKeyLen), endpoint, body, exp, nonce(2))
	require.NoError(t, err)
	flipped := []byte(good)
	first := bytes.LastIndexByte(flipped, '.') + 1 // the MAC's first character: still base64url, another MAC
	if flipped[first] == 'A' {
		flipped[first] = 'B'
	} else {
		flipped[first] = 'A'
	}
	long, err := Sign(testKey, endpoint, body, clock.Now().Add(time.Hour), nonce(3))
	require.NoError(t, err)
	past, err := Sign(testKey, endpoint, body, clock.Now().Add(-time.Second), nonce(4))
	require.NoError(t, err)
	atNow, err := Sign(testKey, endpoint, body, clock.Now(), nonce(5))
	require.NoError(t, err)

	for _, tc := range []struct {
		name               string
		value, endpoint    string
		body               []byte
		want               error
		thenCacheUnchanged bool
	}{
		{"unsigned", "", endpoint, body, ErrMissing, true},
		{"garbage", "nope", endpoint, body, ErrMalformed, true},
		{"other body", good, endpoint, []byte(`{"prompt":"evil"}`), ErrForged, true},
		{"other endpoint", good, "10.0.0.8:8000", body, ErrForged, true},
		{"other key", otherKey, endpoint, body, ErrForged, true},
		{"flipped mac", string(flipped), endpoint, body, ErrForged, true},
		{"expired", past, endpoint, body, ErrExpired, true},
		{"expires now", atNow, endpoint, body, ErrExpired, true},
		{"too long-lived", long, endpoint, body, ErrTooLong, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := newVerifier(t, clock, VerifierOptions{})
			err := v.Verify(tc.value, tc.endpoint, tc.body)
			require.ErrorIs(t, err, tc.want)
			require.Zero(t, v.Remembered(), "a refused value leaves no nonce")
			// The good value still passes afterwards: nothing was poisoned.
			require.NoError(t, v.Verify(good, endpoint, body))
		})
	}
}

func TestReplayCacheBoundAndExpiry(t *testing.T) {
	clock := clocktest.New(time.Unix(1_700_000_000, 0))
	v := newVerifier(t, clock, VerifierOptions{MaxNonces: 2, MaxLifetime: time.Minute})
	sign := func(b byte, ttl time.Duration) string {
		val, err := Sign(testKey, endpoint, body, clock.Now().Add(ttl), nonce(b))
		require.NoError(t, err)
		return val
	}
	first := sign(1, 10*time.Second)
	require.NoError(t, v.Verify(first, endpoint, body))
	require.NoError(t, v.Verify(sign(2, 50*time.Second), endpoint, body))
	third := sign(3, 50*time.Second)
	require.ErrorIs(t, v.Verify(third, endpoint, body), ErrCacheFull, "full of live nonces: refuse, never forget")

	clock.Advance(10 * time.Second) // the first expires, its slot frees
	require.NoError(t, v.Verify(third, endpoint, body))
	require.Equal(t, 2, v.Remembered())
	require.ErrorIs(t, v.Verify(first, endpoint, body), ErrExpired, "an expired nonce left the cache, its value is still refused")
	clock.Advance(time.Minute)
	require.NoError(t, v.Verify(sign(4, time.Second), endpoint, body))
	require.Equal(t, 1, v.Remembered())
}

func TestParseStrict(t *testing.T) {
	clock := clocktest.New(time.Unix(1_700_000_000, 0))
	good, err := Sign(testKey, endpoint, body, clock.Now().Add(time.Minute), nonce(9))
	require.NoError(t, err)
	s, err := Parse(good)
	require.NoError(t, err)
	require.Equal(t, good, s.String())
	parts := strings.Split(good, ".")
	for _, bad := range []string{
		"",
		"v2." + strings.Join(parts[1:], "."),
		"v1." + "0" + parts[1] + "." + parts[2] + "." + parts[3], // leading zero
		"v1.-5." + parts[2] + "." + parts[3],
		"v1.+5." + parts[2] + "." + parts[3],
		"v1.99999999999999999999." + parts[2] + "." + parts[3],
		"v1." + parts[1] + "." + parts[2] + "=." + parts[3], // padding
		"v1." + parts[1] + ".AAAA." + parts[3],              // short nonce
		"v1." + parts[1] + "." + parts[2] + "." + parts[3][:40],
		good + ".x",
		" " + good,
		strings.Repeat("a", maxValueLen+1),
	} {
		_, err := Parse(bad)
		require.ErrorIs(t, err, ErrMalformed, "%q", bad)
	}
}

func TestSignArguments(t *testing.T) {
	exp := time.Unix(1_700_000_000, 0)
	for _, tc := range []struct {
		key      []byte
		endpoint string
		expiry   time.Time
		nonce    []byte
	}{
		{testKey[:MinKeyLen-1], endpoint, exp, nonce(1)},
		{testKey, "", exp, nonce(1)},
		{testKey, strings.Repeat("e", MaxEndpointLen+1), exp, nonce(1)},
		{testKey, endpoint, time.Unix(0, 0), nonce(1)},
		{testKey, endpoint, exp, []byte("short")},
		{testKey, endpoint, exp, bytes.Repeat([]byte{1}, MaxNonceLen+1)},
	} {
		_, err := Sign(tc.key, tc.endpoint, body, tc.expiry, tc.nonce)
		require.ErrorIs(t, err, ErrInvalidArgument)
	}
	require.Len(t, NewNonce(), NonceLen)
	require.NotEqual(t, NewNonce(), NewNonce())
}

func TestVerifierOptions(t *testing.T) {
	_, err := NewVerifier(VerifierOptions{Key: []byte("short"), MaxLifetime: -1, MaxNonces: -1})
	require.ErrorIs(t, err, ErrInvalidOptions)
	for _, want := range []string{"Key", "MaxLifetime", "MaxNonces"} {
		require.Contains(t, err.Error(), want)
	}
	// The verifier keeps its own copy of the key.
	key := bytes.Clone(testKey)
	v, err := NewVerifier(VerifierOptions{Key: key})
	require.NoError(t, err)
	key[0] ^= 0xff
	val, err := Sign(testKey, endpoint, body, time.Now().Add(time.Minute), NewNonce())
	require.NoError(t, err)
	require.NoError(t, v.Verify(val, endpoint, body))
}

// FuzzParse: Parse never panics, accepts only canonical values, and Verify
// refuses anything not signed with the key with one of its sentinels.
func FuzzParse(f *testing.F) {
	good, err := Sign(testKey, endpoint, body, time.Unix(1_700_000_060, 0), nonce(7))
	if err != nil {
		f.Fatal(err)
	}
	for _, seed := range []string{good, "", "v1", "v1....", "v1.1.AAAAAAAAAAA.AAAA", good + "=", strings.ToUpper(good)} {
		f.Add(seed)
	}
	clock := clocktest.New(time.Unix(1_700_000_000, 0))
	v, err := NewVerifier(VerifierOptions{Key: testKey, Now: clock.Now})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, value string) {
		s, err := Parse(value)
		if err == nil && s.String() != value {
			t.Fatalf("Parse(%q) accepted a non-canonical value (%q)", value, s.String())
		}
		if err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatalf("Parse(%q): %v does not wrap ErrMalformed", value, err)
		}
		err = v.Verify(value, endpoint, []byte(value))
		for _, known := range []error{ErrMissing, ErrMalformed, ErrForged, ErrExpired, ErrTooLong, ErrReplayed, ErrCacheFull} {
			if errors.Is(err, known) {
				return
			}
		}
		if err == nil {
			t.Fatalf("Verify accepted %q, which the fuzzer could not sign", value)
		}
		t.Fatalf("Verify(%q): unexpected error %v", value, err)
	})
}
