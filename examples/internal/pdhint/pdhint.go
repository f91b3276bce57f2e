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
	"strconv"
	"strings"
	"sync"
	"time"
)

// Header is the request header that carries the signature.
const Header = "x-kvselect-prefiller-signature"

// Version is the only version this package writes and reads.
const Version = "v1"

// Limits of the wire format.
const (
	// MinKeyLen is the shortest key Sign and NewVerifier accept (256 bits).
	MinKeyLen = 32
	// MinNonceLen and MaxNonceLen bound a nonce; NewNonce makes NonceLen bytes.
	MinNonceLen = 8
	MaxNonceLen = 64
	NonceLen    = 16
	// MaxEndpointLen bounds the signed endpoint.
	MaxEndpointLen = 1024
	// maxValueLen bounds a header value: version, 19 digits, the two fields, dots.
	maxValueLen = 2 + 1 + 19 + 1 + 86 + 1 + 43
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
	// ErrMalformed: the value is not a v1 signature.
	ErrMalformed = errors.New("pdhint: malformed signature")
	// ErrForged: the MAC does not match the endpoint, body, expiry and nonce.
	ErrForged = errors.New("pdhint: signature does not match")
	// ErrExpired: the signature's expiry has passed.
	ErrExpired = errors.New("pdhint: signature expired")
	// ErrTooLong: the expiry is further away than the verifier's MaxLifetime.
	ErrTooLong = errors.New("pdhint: signature lives too long")
	// ErrReplayed: the nonce was accepted before.
	ErrReplayed = errors.New("pdhint: nonce replayed")
	// ErrCacheFull: the replay cache holds MaxNonces live nonces.
	ErrCacheFull = errors.New("pdhint: replay cache full")

	// ErrInvalidArgument: Sign was given a short key, a bad nonce, an empty or
	// long endpoint or an expiry before 1970.
	ErrInvalidArgument = errors.New("pdhint: invalid argument")
	// ErrInvalidOptions: NewVerifier was given options that fail validation.
	ErrInvalidOptions = errors.New("pdhint: invalid options")
)

var b64 = base64.RawURLEncoding.Strict()

// Signature is a parsed header value.
type Signature struct {
	Expiry time.Time // whole seconds
	Nonce  []byte
	MAC    [macLen]byte
}

// String returns the header value of s.
func (s Signature) String() string {
	return Version + "." + strconv.FormatInt(s.Expiry.Unix(), 10) + "." +
		b64.EncodeToString(s.Nonce) + "." + b64.EncodeToString(s.MAC[:])
}

// Parse reads a header value. It accepts exactly what String writes and
// returns an error wrapping ErrMalformed otherwise; it never panics.
func Parse(value string) (Signature, error) {
	var s Signature
	if len(value) > maxValueLen {
		return s, fmt.Errorf("%w: %d bytes", ErrMalformed, len(value))
	}
	parts := strings.Split(value, ".")
	if len(parts) != 4 {
		return s, fmt.Errorf("%w: want 4 dot-separated fields, got %d", ErrMalformed, len(parts))
	}
	if parts[0] != Version {
		return s, fmt.Errorf("%w: version %q", ErrMalformed, parts[0])
	}
	exp, ok := parseUnix(parts[1])
	if !ok {
		return s, fmt.Errorf("%w: expiry %q", ErrMalformed, parts[1])
	}
	// The base64 decoder skips CR and LF; a field must be its own canonical
	// encoding, byte for byte.
	nonce, err := b64.DecodeString(parts[2])
	if err != nil || len(nonce) < MinNonceLen || len(nonce) > MaxNonceLen || b64.EncodeToString(nonce) != parts[2] {
		return s, fmt.Errorf("%w: nonce", ErrMalformed)
	}
	mac, err := b64.DecodeString(parts[3])
	if err != nil || len(mac) != macLen || b64.EncodeToString(mac) != parts[3] {
		return s, fmt.Errorf("%w: mac", ErrMalformed)
	}
	s.Expiry, s.Nonce = time.Unix(exp, 0), nonce
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
func mac(key []byte, endpoint string, body []byte, expiry int64, nonce []byte) [macLen]byte {
	bodySum := sha256.Sum256(body)
	h := hmac.New(sha256.New, key)
	var n [8]byte
	h.Write([]byte("kvselect-pd-hint\x00" + Version + "\x00"))
	binary.BigEndian.PutUint32(n[:4], uint32(len(endpoint)))
	h.Write(n[:4])
	h.Write([]byte(endpoint))
	h.Write(bodySum[:])
	binary.BigEndian.PutUint64(n[:], uint64(expiry))
	h.Write(n[:])
	binary.BigEndian.PutUint32(n[:4], uint32(len(nonce)))
	h.Write(n[:4])
	h.Write(nonce)
	var out [macLen]byte
	h.Sum(out[:0])
	return out
}

// Sign returns the header value that vouches for endpoint (the exact
// x-prefiller-host-port value) on a request with this body, until expiry
// (truncated to the second), under key. Each signed request needs a fresh
// nonce (NewNonce). It returns an error wrapping ErrInvalidArgument when the key
// is shorter than MinKeyLen, the nonce is not MinNonceLen to MaxNonceLen bytes,
// the endpoint is empty or longer than MaxEndpointLen, or expiry is not after
// 1970.
func Sign(key []byte, endpoint string, body []byte, expiry time.Time, nonce []byte) (string, error) {
	var problems []string
	if len(key) < MinKeyLen {
		problems = append(problems, fmt.Sprintf("key of %d bytes, want >= %d", len(key), MinKeyLen))
	}
	if len(nonce) < MinNonceLen || len(nonce) > MaxNonceLen {
		problems = append(problems, fmt.Sprintf("nonce of %d bytes, want %d to %d", len(nonce), MinNonceLen, MaxNonceLen))
	}
	if endpoint == "" || len(endpoint) > MaxEndpointLen {
		problems = append(problems, fmt.Sprintf("endpoint of %d bytes, want 1 to %d", len(endpoint), MaxEndpointLen))
	}
	if expiry.Unix() < 1 {
		problems = append(problems, fmt.Sprintf("expiry %v is not after 1970", expiry))
	}
	if len(problems) > 0 {
		return "", fmt.Errorf("%w: %s", ErrInvalidArgument, strings.Join(problems, "; "))
	}
	s := Signature{Expiry: time.Unix(expiry.Unix(), 0), Nonce: nonce}
	s.MAC = mac(key, endpoint, body, expiry.Unix(), nonce)
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
}

// Verifier checks signatures and remembers their nonces until they expire.
// Create it with NewVerifier; it is safe for concurrent use.
type Verifier struct {
	key         []byte
	now         func() time.Time
	maxLifetime time.Duration
	maxNonces   int

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
	return &Verifier{
		key:         append([]byte(nil), o.Key...),
		now:         o.Now,
		maxLifetime: o.MaxLifetime,
		maxNonces:   o.MaxNonces,
		seen:        map[string]struct{}{},
	}, nil
}

// Verify checks value (the Header value; "" when the request had none) against
// the endpoint and body it came with, and records its nonce. It returns nil or
// an error wrapping ErrMissing, ErrMalformed, ErrForged, ErrExpired,
// ErrTooLong, ErrReplayed or ErrCacheFull, checked in that order.
func (v *Verifier) Verify(value, endpoint string, body []byte) error {
	if value == "" {
		return ErrMissing
	}
	s, err := Parse(value)
	if err != nil {
		return err
	}
	want := mac(v.key, endpoint, body, s.Expiry.Unix(), s.Nonce)
	if !hmac.Equal(want[:], s.MAC[:]) {
		return ErrForged
	}
	now := v.now()
	switch {
	case !now.Before(s.Expiry):
		return fmt.Errorf("%w: at %v, %v ago", ErrExpired, s.Expiry.UTC(), now.Sub(s.Expiry))
	case s.Expiry.Sub(now) > v.maxLifetime:
		return fmt.Errorf("%w: expires in %v, at most %v", ErrTooLong, s.Expiry.Sub(now), v.maxLifetime)
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
