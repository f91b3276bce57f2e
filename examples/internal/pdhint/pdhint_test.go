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

// claim is the claim of the tests' request: prefill at endpoint, routed to
// 10.0.0.1:8000 (fallback 10.0.0.2:8000), /v1/completions, body.
var claim = Claim{Prefiller: endpoint, Destinations: []string{"10.0.0.1:8000", "10.0.0.2:8000"}, Path: "/v1/completions", Body: body}

// with returns claim changed by f (on a copy of its destinations).
func with(f func(*Claim)) Claim {
	c := claim
	c.Destinations = append([]string(nil), claim.Destinations...)
	f(&c)
	return c
}

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
	val, err := Sign(testKey, claim, clock.Now(), exp, nonce(1))
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(val, "v2.1700000000.1700000030."), val)

	require.NoError(t, v.Verify(val, claim))
	require.Equal(t, 1, v.Remembered())
	require.ErrorIs(t, v.Verify(val, claim), ErrReplayed, "a nonce is good once")
}

func TestVerifyRefusals(t *testing.T) {
	clock := clocktest.New(time.Unix(1_700_000_000, 0))
	now := clock.Now()
	exp := now.Add(30 * time.Second)
	good, err := Sign(testKey, claim, now, exp, nonce(2))
	require.NoError(t, err)
	otherKey, err := Sign(bytes.Repeat([]byte("x"), MinKeyLen), claim, now, exp, nonce(2))
	require.NoError(t, err)
	flipped := []byte(good)
	first := bytes.LastIndexByte(flipped, '.') + 1 // the MAC's first character: still base64url, another MAC
	if flipped[first] == 'A' {
		flipped[first] = 'B'
	} else {
		flipped[first] = 'A'
	}
	long, err := Sign(testKey, claim, now, now.Add(time.Hour), nonce(3))
	require.NoError(t, err)
	past, err := Sign(testKey, claim, now.Add(-time.Minute), now.Add(-time.Second), nonce(4))
	require.NoError(t, err)
	atNow, err := Sign(testKey, claim, now.Add(-time.Minute), now, nonce(5))
	require.NoError(t, err)
	early, err := Sign(testKey, claim, now.Add(-2*time.Second), exp, nonce(6))
	require.NoError(t, err)

	for _, tc := range []struct {
		name      string
		value     string
		claim     Claim
		notBefore time.Time
		want      error
	}{
		{"unsigned", "", claim, time.Time{}, ErrMissing},
		{"garbage", "nope", claim, time.Time{}, ErrMalformed},
		{"other body", good, with(func(c *Claim) { c.Body = []byte(`{"prompt":"evil"}`) }), time.Time{}, ErrForged},
		{"other prefill endpoint", good, with(func(c *Claim) { c.Prefiller = "10.0.0.8:8000" }), time.Time{}, ErrForged},
		{"another sidecar", good, with(func(c *Claim) { c.Destinations = []string{"10.0.0.3:8000"} }), time.Time{}, ErrForged},
		{"the fallback alone", good, with(func(c *Claim) { c.Destinations = c.Destinations[1:] }), time.Time{}, ErrForged},
		{"destinations reordered", good, with(func(c *Claim) { c.Destinations[0], c.Destinations[1] = c.Destinations[1], c.Destinations[0] }), time.Time{}, ErrForged},
		{"destinations joined", good, with(func(c *Claim) { c.Destinations = []string{"10.0.0.1:8000,10.0.0.2:8000"} }), time.Time{}, ErrForged},
		{"other path", good, with(func(c *Claim) { c.Path = "/v1/chat/completions" }), time.Time{}, ErrForged},
		{"other key", otherKey, claim, time.Time{}, ErrForged},
		{"flipped mac", string(flipped), claim, time.Time{}, ErrForged},
		{"expired", past, claim, time.Time{}, ErrExpired},
		{"expires now", atNow, claim, time.Time{}, ErrExpired},
		{"too long-lived", long, claim, time.Time{}, ErrTooLong},
		{"issued before the verifier started", early, claim, now.Add(-time.Second), ErrStale},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := newVerifier(t, clock, VerifierOptions{NotBefore: tc.notBefore})
			err := v.Verify(tc.value, tc.claim)
			require.ErrorIs(t, err, tc.want)
			require.Zero(t, v.Remembered(), "a refused value leaves no nonce")
			// The good value still passes afterwards: nothing was poisoned.
			require.NoError(t, v.Verify(good, claim))
		})
	}
}

// A verifier that started (NotBefore) takes signatures issued in its start's
// second and later, and refuses earlier ones, even unseen.
func TestNotBefore(t *testing.T) {
	clock := clocktest.New(time.Unix(1_700_000_000, 0).Add(700 * time.Millisecond))
	v := newVerifier(t, clock, VerifierOptions{NotBefore: clock.Now()})
	sign := func(b byte, issued time.Time) string {
		val, err := Sign(testKey, claim, issued, clock.Now().Add(30*time.Second), nonce(b))
		require.NoError(t, err)
		return val
	}
	require.NoError(t, v.Verify(sign(1, clock.Now()), claim), "issued in the start's second (truncated below it)")
	require.NoError(t, v.Verify(sign(2, clock.Now().Add(-600*time.Millisecond)), claim), "the same second")
	require.ErrorIs(t, v.Verify(sign(3, clock.Now().Add(-time.Second)), claim), ErrStale)
	require.Equal(t, 2, v.Remembered())
}

func TestReplayCacheBoundAndExpiry(t *testing.T) {
	clock := clocktest.New(time.Unix(1_700_000_000, 0))
	v := newVerifier(t, clock, VerifierOptions{MaxNonces: 2, MaxLifetime: time.Minute})
	sign := func(b byte, ttl time.Duration) string {
		val, err := Sign(testKey, claim, clock.Now(), clock.Now().Add(ttl), nonce(b))
		require.NoError(t, err)
		return val
	}
	first := sign(1, 10*time.Second)
	require.NoError(t, v.Verify(first, claim))
	require.NoError(t, v.Verify(sign(2, 50*time.Second), claim))
	third := sign(3, 50*time.Second)
	require.ErrorIs(t, v.Verify(third, claim), ErrCacheFull, "full of live nonces: refuse, never forget")

	clock.Advance(10 * time.Second) // the first expires, its slot frees
	require.NoError(t, v.Verify(third, claim))
	require.Equal(t, 2, v.Remembered())
	require.ErrorIs(t, v.Verify(first, claim), ErrExpired, "an expired nonce left the cache, its value is still refused")
	clock.Advance(time.Minute)
	require.NoError(t, v.Verify(sign(4, time.Second), claim))
	require.Equal(t, 1, v.Remembered())
}

func TestParseStrict(t *testing.T) {
	clock := clocktest.New(time.Unix(1_700_000_000, 0))
	good, err := Sign(testKey, claim, clock.Now(), clock.Now().Add(time.Minute), nonce(9))
	require.NoError(t, err)
	s, err := Parse(good)
	require.NoError(t, err)
	require.Equal(t, good, s.String())
	require.Equal(t, clock.Now(), s.Issued)
	require.Equal(t, clock.Now().Add(time.Minute), s.Expiry)
	parts := strings.Split(good, ".")
	join := func(p ...string) string { return strings.Join(p, ".") }
	for _, bad := range []string{
		"",
		join(append([]string{"v1"}, parts[1:]...)...),
		join("v1", parts[2], parts[3], parts[4]), // a v1 value
		join("v3", parts[1], parts[2], parts[3], parts[4]),
		join("v2", "0"+parts[1], parts[2], parts[3], parts[4]), // leading zero
		join("v2", parts[1], "0"+parts[2], parts[3], parts[4]),
		join("v2", "-5", parts[2], parts[3], parts[4]),
		join("v2", parts[1], "+5", parts[3], parts[4]),
		join("v2", "99999999999999999999", parts[2], parts[3], parts[4]),
		join("v2", parts[2], parts[1], parts[3], parts[4]),     // expiry before the issue time
		join("v2", parts[1], parts[2], parts[3]+"=", parts[4]), // padding
		join("v2", parts[1], parts[2], "AAAA", parts[4]),       // short nonce
		join("v2", parts[1], parts[2], parts[3], parts[4][:40]),
		good + ".x",
		" " + good,
		strings.Repeat("a", maxValueLen+1),
	} {
		_, err := Parse(bad)
		require.ErrorIs(t, err, ErrMalformed, "%q", bad)
	}
}

func TestSignArguments(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	exp := now.Add(time.Minute)
	long := strings.Repeat("e", MaxEndpointLen+1)
	for name, tc := range map[string]struct {
		key            []byte
		claim          Claim
		issued, expiry time.Time
		nonce          []byte
	}{
		"short key":            {testKey[:MinKeyLen-1], claim, now, exp, nonce(1)},
		"no prefiller":         {testKey, with(func(c *Claim) { c.Prefiller = "" }), now, exp, nonce(1)},
		"long prefiller":       {testKey, with(func(c *Claim) { c.Prefiller = long }), now, exp, nonce(1)},
		"no destination":       {testKey, with(func(c *Claim) { c.Destinations = nil }), now, exp, nonce(1)},
		"empty destination":    {testKey, with(func(c *Claim) { c.Destinations = []string{""} }), now, exp, nonce(1)},
		"long destination":     {testKey, with(func(c *Claim) { c.Destinations = []string{long} }), now, exp, nonce(1)},
		"too many":             {testKey, with(func(c *Claim) { c.Destinations = make([]string, MaxDestinations+1) }), now, exp, nonce(1)},
		"no path":              {testKey, with(func(c *Claim) { c.Path = "" }), now, exp, nonce(1)},
		"long path":            {testKey, with(func(c *Claim) { c.Path = "/" + strings.Repeat("p", MaxPathLen) }), now, exp, nonce(1)},
		"issued in 1970":       {testKey, claim, time.Unix(0, 0), exp, nonce(1)},
		"expiry before issued": {testKey, claim, now, now.Add(-time.Second), nonce(1)},
		"short nonce":          {testKey, claim, now, exp, []byte("short")},
		"long nonce":           {testKey, claim, now, exp, bytes.Repeat([]byte{1}, MaxNonceLen+1)},
	} {
		_, err := Sign(tc.key, tc.claim, tc.issued, tc.expiry, tc.nonce)
		require.ErrorIs(t, err, ErrInvalidArgument, name)
	}
	_, err := Sign(testKey, claim, now, now, nonce(1))
	require.NoError(t, err, "a signature may expire when it is issued")
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
	val, err := Sign(testKey, claim, time.Now(), time.Now().Add(time.Minute), NewNonce())
	require.NoError(t, err)
	require.NoError(t, v.Verify(val, claim))
}

// FuzzParse: Parse never panics, accepts only canonical values, and Verify
// refuses anything not signed with the key with one of its sentinels.
func FuzzParse(f *testing.F) {
	good, err := Sign(testKey, claim, time.Unix(1_700_000_000, 0), time.Unix(1_700_000_060, 0), nonce(7))
	if err != nil {
		f.Fatal(err)
	}
	for _, seed := range []string{good, "", "v2", "v2.....", "v2.1.1.AAAAAAAAAAA.AAAA", good + "=", strings.ToUpper(good)} {
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
		err = v.Verify(value, with(func(c *Claim) { c.Body = []byte(value) }))
		for _, known := range []error{ErrMissing, ErrMalformed, ErrForged, ErrExpired, ErrTooLong, ErrStale, ErrReplayed, ErrCacheFull} {
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
