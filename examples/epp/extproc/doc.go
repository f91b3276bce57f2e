// Package extproc is the Envoy external-processing (ext_proc v3) server of the
// kvselect Endpoint Picker. Envoy, or any GAIE-conformant gateway, opens one
// bidirectional stream per HTTP request; the server buffers the request body
// to its end, asks a Picker for a destination, and answers with the
// destination as the x-gateway-destination-endpoint request header and as
// envoy.lb dynamic metadata (the same value), clears the route cache, and
// re-sends the body. A pick with fallbacks goes out as the GAIE protocol's
// comma-separated list (primary first, the same value in header and
// metadata), which the gateway tries in order. On the response path it
// reports the first non-empty body chunk and the end of the exchange to the
// Settler that came with the pick, so the booking behind the pick is released
// exactly once whatever happens to the stream; a Settler that is also a
// Follower sees the response as it passes (the endpoint the gateway reports
// as served when it is not the primary, the status and content type, every
// body chunk), which is how the EPP renews leases, counts output and moves a
// booking to the worker that served. A pick's Debug value is returned to the
// client as the x-kvselect-debug response header.
//
// # Body modes
//
// FULL_DUPLEX_STREAMED (what GAIE requires) and BUFFERED are supported for the
// request body. In full-duplex mode the reply to the request headers is held
// back until the body has ended, then the headers reply (with the routing
// mutations) is followed by the body in chunks of at most Options.ChunkSize
// bytes, the last one marked end of stream; response body chunks are echoed
// back at once. In buffered mode the headers are answered at once (stripping
// control headers) and the routing mutations ride on the body reply. Requests
// without a body are picked on their headers with a nil Body. Other request
// body modes fail the stream with FAILED_PRECONDITION when a body follows.
//
// # Security
//
// Routing headers a client may forge (the destination, the subset, the served
// endpoint, the prefill target, its signature and the rest of ControlHeaders)
// are removed from the forwarded request and never reach the Picker; the
// destination is always overwritten; the subset hint is read only from gateway
// metadata; every host:port is validated (IP literal, port 1-65535) before it
// is emitted, and a prefiller signature only goes out with the prefiller it
// signs, exactly as signed. The one exception is a test hook:
// Options.ConformanceTestHooks (off by default) makes the conformance
// suite's test-epp-endpoint-selection header the subset hint and echoes the
// gateway's served endpoint as x-conformance-test-served-endpoint, as GAIE's
// test picker does; the health service answers "inference-extension" too,
// following readiness.
// Errors are answered with an ImmediateResponse carrying a short fixed body,
// with Options.Reason's token when it names one ("no endpoint available
// (unknown_model)"), also in llm-d's x-llm-d-request-dropped-reason header;
// an overload (429, or 529 where Options.Status maps to it) carries
// Retry-After: 1. Details go to the log only.
//
// # Concurrency
//
// A Server is safe for concurrent use: gRPC runs Process once per stream on
// its own goroutine and the server keeps no per-request state outside that
// call. The Picker is called on the stream's goroutine with the stream's
// context, which is cancelled when Envoy or the client goes away.
//
// # Invariants
//
// For every successful Pick, Settler.Done is called exactly once (on response
// end of stream, on an error after the pick, on stream EOF, reset or client
// cancel) and Settler.FirstByte at most once, before Done; a Follower's calls
// all come before Done, Served at most once. No request is forwarded with a
// destination the Picker did not return.
package extproc
