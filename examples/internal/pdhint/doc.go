// Package pdhint signs and verifies the prefill hint an Endpoint Picker gives a
// decode sidecar, so that the sidecar runs a P/D exchange only against a
// prefill endpoint the EPP chose, for that request and that sidecar, recently,
// once.
//
// The hint is the x-prefiller-host-port header (host:port of the prefill
// worker). Anyone who can send a request to the sidecar can set that header and
// make the sidecar POST the prompt to an address of their choosing (the SSRF
// reported against llm-d's routing sidecar). Signing binds the header to the
// request: the EPP sends, next to it, Header with a value made by Sign over a
// Claim, and the sidecar's Verifier refuses a request whose signature is
// missing, malformed, forged, expired, too long-lived, issued before the
// sidecar started, or seen before.
//
// The Claim binds the hint to the request as the EPP routed it: the prefill
// endpoint, the decode endpoints it routed the request to (the chosen one and
// its fallbacks, the value of x-gateway-destination-endpoint), the request's
// path and its body. A sidecar verifies with its own endpoint among the
// destinations, so a hint captured on its way to one sidecar is refused by
// every other sidecar sharing the key; a nonce is good once per sidecar, and
// the issue time (VerifierOptions.NotBefore) keeps a sidecar that restarted,
// with an empty replay cache, from accepting a hint captured before.
//
// # Wire format
//
// The header value is "v2.<issued>.<expiry>.<nonce>.<mac>": the version, the
// issue time and the expiry in Unix seconds (decimal, no sign, no leading zero,
// the expiry not before the issue time), the nonce (8 to 64 bytes) and the MAC
// (32 bytes), both in unpadded base64url. The MAC is HMAC-SHA256 under the
// shared key of a versioned, length-prefixed encoding of:
//
//	"kvselect-pd-hint" 0x00 "v2" 0x00
//	uint32 len(prefiller) || prefiller      the x-prefiller-host-port value, as sent
//	uint32 count(destinations)
//	  uint32 len(d) || d                    each destination, in order, as sent
//	uint32 len(path) || path                the request path, without the query
//	SHA-256(body)                           the request body the sidecar receives
//	int64 issued                            Unix seconds
//	int64 expiry                            Unix seconds
//	uint32 len(nonce) || nonce
//
// (integers big-endian). Parse accepts exactly the values String writes, so a
// signature has one spelling. The key is at least MinKeyLen bytes. Version v1
// (no destinations, path or issue time) is refused as malformed: upgrade the
// EPP and its sidecars together.
//
// # Concurrency
//
// Sign, Parse and NewNonce are pure functions (NewNonce reads crypto/rand);
// LoadKey, which reads the key setting both ends share, may read a file
// (a regular one of at most MaxKeyFileBytes, nothing else). A
// Verifier is safe for concurrent use: its replay cache has its own mutex, and
// Verify does the MAC check (constant time) before taking it. Nothing in the
// package starts a goroutine.
//
// # Invariants
//
//   - Verify accepts a value only when its MAC matches the claim it is given,
//     now is before its expiry, its expiry is at most MaxLifetime away, it was
//     issued no earlier than NotBefore, and its nonce is not in the cache; it
//     then records the nonce until that expiry.
//   - The replay cache never holds more than MaxNonces nonces, and drops each
//     one when it expires. When it is full of live nonces Verify refuses
//     (ErrCacheFull) rather than forget one: a replay is never let through.
//   - A forged value never enters the cache.
//
// The package imports only the standard library, so an EPP can import it.
package pdhint
