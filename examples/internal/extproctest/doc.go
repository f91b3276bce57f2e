// Package extproctest plays Envoy for tests of ext_proc servers (the kvselect
// Endpoint Picker). A Client opens one ext_proc v3 stream per HTTP request and
// behaves like Envoy's ext_proc filter in FULL_DUPLEX_STREAMED mode (what GAIE
// requires) or BUFFERED mode:
//
//   - the first message carries the protocol configuration; request headers
//     (lower-cased, raw_value, pseudo-headers included) carry the subset hint
//     in metadata_context (namespace envoy.lb.subset_hint) when asked;
//   - in full duplex the body follows in chunks without waiting for any
//     reply, the last chunk marked end of stream; the server's reply to the
//     headers must come first, then the body it sends back (streamed_response
//     chunks) is what goes upstream;
//   - in buffered mode Envoy waits for the headers reply, then sends the
//     whole body in one message;
//   - header mutations follow Envoy: removals first, then sets; value and
//     raw_value both set rejects the mutation; pseudo-headers, host and
//     x-envoy-* cannot be changed; append_action is honoured (the deprecated
//     append flag wins when present);
//   - Roundtrip then forwards the request over real HTTP to the chosen
//     host:port, and streams the response back through the same stream:
//     headers (with the served endpoint in envoy.lb metadata), body chunks as
//     they arrive, end of stream; the client receives the body the server
//     echoes. It can also interrupt the exchange like a client disconnect
//     (the stream is reset) or like a data plane that ends the stream early
//     (half-close without end of stream).
//
// # Concurrency
//
// A Client is safe for concurrent use; each call uses its own stream. Do and
// Roundtrip start at most one goroutine (the stream reader) and wait for it
// before returning.
package extproctest
