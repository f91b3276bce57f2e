package pdhint

import (
	"container/heap"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvselect/kvselect/gaie"
)

// Header is the request header that carries the signature.
const Header = gaie.HeaderPrefillerSignature

// Version is the only version this package writes and reads. v1 signatures,
// which bound neither the destination, the path nor the issue time, are
// refused as malformed.
const Version = "v2"

// Limits of the wire format.
const (
	// MinKeyLen is the shortest key Sign and NewVerifier accept (256 bits).
	MinKeyLen = 32
	// MinNonceLen and MaxNonceLen bound a nonce; NewNonce makes NonceLen bytes.
	MinNonceLen = 8
	MaxNonceLen = 64
	NonceLen    = 16
	// MaxEndpointLen bounds the signed prefill endpoint and each destination.
	MaxEndpointLen = 1024
	// MaxDestinations bounds Claim.Destinations (a chosen endpoint and its
	// fallbacks).
	MaxDestinations = 32
	// MaxPathLen bounds Claim.Path.
	MaxPathLen = 1024
	// maxValueLen bounds a header value: version, two times of 19 digits, the
	// nonce and the MAC, dots.
	maxValueLen = 2 + 1 + 19 + 1 + 19 + 1 + 86 + 1 + 43
	macLen      = sha256.Size
)

// Defaults of VerifierOptions.
const (
	DefaultMaxLifetime = 5 * time.Minute
	DefaultMaxNonces   = 65536
)

// Errors. Verify returns one of the refusal errors, wrapped with detail; test
// with errors.Is.
var (
	// ErrMissing: no signature came with the hint.
	ErrMissing = errors.New("pdhint: hint not signed")
	// ErrMalformed: the value is not a v2 signature.
	ErrMalformed = errors.New("pdhint: malformed signature")
	// ErrForged: the MAC does not match the claim (prefill endpoint,
	// destinations, path, body), the times and the nonce.
	ErrForged = errors.New("pdhint: signature does not match")
	// ErrExpired: the signature's expiry has passed.
	ErrExpired = errors.New("pdhint: signature expired")
	// ErrTooLong: the expiry is further away than the verifier's MaxLifetime.
	ErrTooLong = errors.New("pdhint: signature lives too long")
	// ErrStale: the signature was issued before the verifier's NotBefore (a
	// hint captured before the sidecar restarted).
	ErrStale = errors.New("pdhint: signature issued before the verifier started")
	// ErrReplayed: the nonce was accepted before.
	ErrReplayed = errors.New("pdhint: nonce replayed")
	// ErrCacheFull: the replay cache holds MaxNonces live nonces.
	ErrCacheFull = errors.New("pdhint: replay cache full")

	// ErrInvalidArgument: Sign was given a short key, a bad nonce, a claim
	// whose fields are empty or too long, or times before 1970 or out of order.
	ErrInvalidArgument = errors.New("pdhint: invalid argument")
	// ErrInvalidOptions: NewVerifier was given options that fail validation.
	ErrInvalidOptions = errors.New("pdhint: invalid options")
)

var b64 = base64.RawURLEncoding.Strict()

// Claim is what a signature vouches for: a request as the EPP routed it. The
// sidecar rebuilds it from what it receives and what it is.
type Claim struct {
	// Prefiller is the x-prefiller-host-port value, exactly as sent.
	Prefiller string
	// Destinations are the decode endpoints the EPP routed the request to,
	// exactly as it sends them in x-gateway-destination-endpoint: the chosen
	// one, then its fallbacks. A sidecar runs the exchange only when it is one
	// of them, so a hint captured on its way to one sidecar is worth nothing at
	// another.
	Destinations []string
	// Path is the request's path without the query, as net/http parses it
	// (url.URL.Path): /v1/chat/completions or /v1/completions.
	Path string
	// Body is the request body the sidecar receives.
	Body []byte
}

// problems lists what makes c unsignable.
func (c Claim) problems() []string {
	var p []string
	if c.Prefiller == "" || len(c.Prefiller) > MaxEndpointLen {
		p = append(p, fmt.Sprintf("prefiller of %d bytes, want 1 to %d", len(c.Prefiller), MaxEndpointLen))
	}
	if len(c.Destinations) == 0 || len(c.Destinations) > MaxDestinations {
		p = append(p, fmt.Sprintf("%d destinations, want 1 to %d", len(c.Destinations), MaxDestinations))
	}
	for i, d := range c.Destinations {
		if d == "" || len(d) > MaxEndpointLen {
			p = append(p, fmt.Sprintf("destination %d of %d bytes, want 1 to %d", i, len(d), MaxEndpointLen))
		}
	}
	if c.Path == "" || len(c.Path) > MaxPathLen {
		p = append(p, fmt.Sprintf("path of %d bytes, want 1 to %d", len(c.Path), MaxPathLen))
	}
	return p
}

// Signature is a parsed header value.
type Signature struct {
	Issued time.Time // whole seconds
	Expiry time.Time // whole seconds, not before Issued
	Nonce  []byte
	MAC    [macLen]byte
}

// String returns the header value of s.
func (s Signature) String() string {
	return Version + "." + strconv.FormatInt(s.Issued.Unix(), 10) + "." + strconv.FormatInt(s.Expiry.Unix(), 10) + "." +
		b64.EncodeToString(s.Nonce) + "." + b64.EncodeToString(s.MAC[:])
}

// Parse reads a header value. It accepts exactly what String writes (with an
// expiry not before the issue time) and returns an error wrapping ErrMalformed
// otherwise; it never panics.
func Parse(value string) (Signature, error) {
	var s Signature
	if len(value) > maxValueLen {
		return s, fmt.Errorf("%w: %d bytes", ErrMalformed, len(value))
	}
	parts := strings.Split(value, ".")
	if len(parts) != 5 {
		return s, fmt.Errorf("%w: want 5 dot-separated fields, got %d", ErrMalformed, len(parts))
	}
	if parts[0] != Version {
		return s, fmt.Errorf("%w: version %q", ErrMalformed, parts[0])
	}
	issued, ok := parseUnix(parts[1])
	if !ok {
		return s, fmt.Errorf("%w: issue time %q", ErrMalformed, parts[1])
	}
	exp, ok := parseUnix(parts[2])
	if !ok || exp < issued {
		return s, fmt.Errorf("%w: expiry %q", ErrMalformed, parts[2])
	}
	// The base64 decoder skips CR and LF; a field must be its own canonical
	// encoding, byte for byte.
	nonce, err := b64.DecodeString(parts[3])
	if err != nil || len(nonce) < MinNonceLen || len(nonce) > MaxNonceLen || b64.EncodeToString(nonce) != parts[3] {
		return s, fmt.Errorf("%w: nonce", ErrMalformed)
	}
	mac, err := b64.DecodeString(parts[4])
	if err != nil || len(mac) != macLen || b64.EncodeToString(mac) != parts[4] {
		return s, fmt.Errorf("%w: mac", ErrMalformed)
	}
	s.Issued, s.Expiry, s.Nonce = time.Unix(issued, 0), time.Unix(exp, 0), nonce
	copy(s.MAC[:], mac)
	return s, nil
}

// parseUnix reads a positive decimal without sign or leading zero.
func parseUnix(v string) (int64, bool) {
	if v == "" || v[0] == '0' || len(v) > 19 {
		return 0, false
	}
	for i := 0; i < len(v); i++ {
		if v[i] < '0' || v[i] > '9' {
			return 0, false
		}
	}
	n, err := strconv.ParseInt(v, 10, 64)
	return n, err == nil
}

// mac computes the MAC of the canonical encoding (see the package doc).
func mac(key []byte, c Claim, issued, expiry int64, nonce []byte) [macLen]byte {
	bodySum := sha256.Sum256(c.Body)
	h := hmac.New(sha256.New, key)
	var n [8]byte
	u32 := func(v int) {
		binary.BigEndian.PutUint32(n[:4], uint32(v))
		h.Write(n[:4])
	}
	field := func(b []byte) {
		u32(len(b))
		h.Write(b)
	}
	i64 := func(v int64) {
		binary.BigEndian.PutUint64(n[:], uint64(v))
		h.Write(n[:])
	}
	h.Write([]byte("kvselect-pd-hint\x00" + Version + "\x00"))
	field([]byte(c.Prefiller))
	u32(len(c.Destinations))
	for _, d := range c.Destinations {
		field([]byte(d))
	}
	field([]byte(c.Path))
	h.Write(bodySum[:])
	i64(issued)
	i64(expiry)
	field(nonce)
	var out [macLen]byte
	h.Sum(out[:0])
	return out
}

// Sign returns the header value that vouches for claim c from issued until
// expiry (both truncated to the second), under key. Each signed request needs
// a fresh nonce (NewNonce). It returns an error wrapping ErrInvalidArgument
// when the key is shorter than MinKeyLen, the nonce is not MinNonceLen to
// MaxNonceLen bytes, a field of c is empty or too long (MaxEndpointLen,
// MaxDestinations, MaxPathLen), issued is not after 1970, or expiry is before
// issued.
func Sign(key []byte, c Claim, issued, expiry time.Time, nonce []byte) (string, error) {
	var problems []string
	if len(key) < MinKeyLen {
		problems = append(problems, fmt.Sprintf("key of %d bytes, want >= %d", len(key), MinKeyLen))
	}
	if len(nonce) < MinNonceLen || len(nonce) > MaxNonceLen {
		problems = append(problems, fmt.Sprintf("nonce of %d bytes, want %d to %d", len(nonce), MinNonceLen, MaxNonceLen))
	}
	problems = append(problems, c.problems()...)
	if issued.Unix() < 1 {
		problems = append(problems, fmt.Sprintf("issue time %v is not after 1970", issued))
	}
	if expiry.Unix() < issued.Unix() {
		problems = append(problems, fmt.Sprintf("expiry %v is before the issue time %v", expiry, issued))
	}
	if len(problems) > 0 {
		return "", fmt.Errorf("%w: %s", ErrInvalidArgument, strings.Join(problems, "; "))
	}
	s := Signature{Issued: time.Unix(issued.Unix(), 0), Expiry: time.Unix(expiry.Unix(), 0), Nonce: nonce}
	s.MAC = mac(key, c, issued.Unix(), expiry.Unix(), nonce)
	return s.String(), nil
}

// NewNonce returns NonceLen random bytes.
func NewNonce() []byte {
	b := make([]byte, NonceLen)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (it aborts the program instead)
	return b
}

// VerifierOptions configures a Verifier. NewVerifier copies them.
type VerifierOptions struct {
	// Key is the key shared with the signer; at least MinKeyLen bytes. Required.
	Key []byte
	// Now is the clock. Default time.Now.
	Now func() time.Time
	// MaxLifetime refuses signatures whose expiry is further away (it also
	// bounds how long a nonce stays in the cache). Default 5 minutes; must be
	// >= 0 (0 means the default).
	MaxLifetime time.Duration
	// MaxNonces bounds the replay cache. Default 65536; must be >= 0 (0 means
	// the default).
	MaxNonces int
	// NotBefore refuses signatures issued before it (ErrStale), compared in
	// whole seconds. A sidecar sets it to its start time: a hint captured
	// before a restart, whose nonce the new replay cache has never seen, is
	// not accepted again. Default: the zero time, no such refusal.
	NotBefore time.Time
}

// Verifier checks signatures and remembers their nonces until they expire.
// Create it with NewVerifier; it is safe for concurrent use.
type Verifier struct {
	key         []byte
	now         func() time.Time
	maxLifetime time.Duration
	maxNonces   int
	notBefore   int64 // Unix seconds; math.MinInt64 for none

	mu   sync.Mutex
	seen map[string]struct{} // nonces of accepted signatures, until their expiry
	byTS expiryHeap          // the same nonces, soonest expiry first
}

// NewVerifier validates o and returns a Verifier. It returns an error wrapping
// ErrInvalidOptions that names every problem.
func NewVerifier(o VerifierOptions) (*Verifier, error) {
	var problems []string
	if len(o.Key) < MinKeyLen {
		problems = append(problems, fmt.Sprintf("Key of %d bytes, want >= %d", len(o.Key), MinKeyLen))
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.MaxLifetime == 0 {
		o.MaxLifetime = DefaultMaxLifetime
	} else if o.MaxLifetime < 0 {
		problems = append(problems, fmt.Sprintf("MaxLifetime %v < 0", o.MaxLifetime))
	}
	if o.MaxNonces == 0 {
		o.MaxNonces = DefaultMaxNonces
	} else if o.MaxNonces < 0 {
		problems = append(problems, fmt.Sprintf("MaxNonces %d < 0", o.MaxNonces))
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
	}
	v := &Verifier{
		key:         append([]byte(nil), o.Key...),
		now:         o.Now,
		maxLifetime: o.MaxLifetime,
		maxNonces:   o.MaxNonces,
		notBefore:   math.MinInt64,
		seen:        map[string]struct{}{},
	}
	if !o.NotBefore.IsZero() {
		v.notBefore = o.NotBefore.Unix()
	}
	return v, nil
}

// Verify checks value (the Header value; "" when the request had none)
// against the claim rebuilt from the request, and records its nonce. It
// returns nil or an error wrapping ErrMissing, ErrMalformed, ErrForged,
// ErrExpired, ErrTooLong, ErrStale, ErrReplayed or ErrCacheFull, checked in
// that order.
func (v *Verifier) Verify(value string, c Claim) error {
	if value == "" {
		return ErrMissing
	}
	s, err := Parse(value)
	if err != nil {
		return err
	}
	want := mac(v.key, c, s.Issued.Unix(), s.Expiry.Unix(), s.Nonce)
	if !hmac.Equal(want[:], s.MAC[:]) {
		return ErrForged
	}
	now := v.now()
	switch {
	case !now.Before(s.Expiry):
		return fmt.Errorf("%w: at %v, %v ago", ErrExpired, s.Expiry.UTC(), now.Sub(s.Expiry))
	case s.Expiry.Sub(now) > v.maxLifetime:
		return fmt.Errorf("%w: expires in %v, at most %v", ErrTooLong, s.Expiry.Sub(now), v.maxLifetime)
	case s.Issued.Unix() < v.notBefore:
		return fmt.Errorf("%w: issued at %v, before %v", ErrStale, s.Issued.UTC(), time.Unix(v.notBefore, 0).UTC())
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	for len(v.byTS) > 0 && !now.Before(v.byTS[0].expiry) {
		delete(v.seen, heap.Pop(&v.byTS).(seenNonce).nonce)
	}
	key := string(s.Nonce)
	if _, dup := v.seen[key]; dup {
		return ErrReplayed
	}
	if len(v.seen) >= v.maxNonces {
		return fmt.Errorf("%w: %d live nonces", ErrCacheFull, len(v.seen))
	}
	v.seen[key] = struct{}{}
	heap.Push(&v.byTS, seenNonce{nonce: key, expiry: s.Expiry})
	return nil
}

// Remembered returns the number of nonces in the replay cache.
func (v *Verifier) Remembered() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.seen)
}

type seenNonce struct {
	nonce  string
	expiry time.Time
}

// expiryHeap is a min-heap of nonces by expiry (container/heap).
type expiryHeap []seenNonce

func (h expiryHeap) Len() int           { return len(h) }
func (h expiryHeap) Less(i, j int) bool { return h[i].expiry.Before(h[j].expiry) }
func (h expiryHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *expiryHeap) Push(x any)        { *h = append(*h, x.(seenNonce)) }
func (h *expiryHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
