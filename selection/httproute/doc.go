// Package httproute embeds kvselect in a plain Go HTTP gateway: a Router is an
// http.Handler that books the best worker for each OpenAI completion request
// with the selection service and proxies the request there through
// net/http/httputil.ReverseProxy, settling the booking as the answer streams.
//
//	router, err := httproute.New(httproute.Options{Service: httproute.Single(svc), Tokenizer: cache})
//	mux.Handle("POST /v1/chat/completions", router)
//
// # Request path
//
//  1. The request takes one of Options.MaxInflight slots (1024; 503 at once
//     past it), which it holds until it is booked: reading, tokenizing and
//     booking are bounded, proxying is not.
//  2. The body is read whole, at most Options.MaxBodyBytes (413 past it),
//     within Options.BodyTimeout (30 s, a read deadline on the connection;
//     408 past it), into a buffer that grows with the bytes that arrive (at
//     most 16 KiB before any, whatever the Content-Length declares), and sent
//     upstream from memory (a proxy that streams the inbound body through can
//     have its upstream connection torn down as the answer starts: an HTTP/1
//     server closes the inbound body when the response begins,
//     golang/go#40747). A request refused before its body was read to its
//     end is answered with Connection: close, so that net/http does not read
//     the rest of it after the Router has answered.
//  3. ParseRequest reads the model, SGLang's lora_path, vLLM's cache_salt and
//     the session id; the body must be a JSON object (400 otherwise).
//  4. The Tokenizer turns the request into the engine's token ids
//     (tokenize.Request{Path, Body, Model}), at most Options.MaxPromptTokens
//     of them (413 past it, tokenize.ErrPromptTooLong; a tokenize.Client
//     given the same bound refuses them before it stores them).
//     When the Tokenizer fails (unreachable, a timeout, an upstream error),
//     the request is routed on load alone instead (the degraded mode:
//     selection.Request.ISL estimated from the body, no prefix reuse;
//     Stats.Degraded, a WARN at most every 10 s); Options.NoDegrade answers
//     503/504 instead. Give it a tokenize.Pool of several endpoints so that
//     one tokenizer down costs nothing.
//  5. A selection.Request is built (Model: Options.Model, else the body's
//     "model"; Tokens; CacheSalt; LoRAName; ExpectedOutputTokens), adjusted by
//     Options.Prepare, and booked with Service.Book: Single books one worker
//     of a selection service, Pairs a prefill/decode plan of a
//     roles.PairBooker (one worker in aggregated mode).
//  6. The ReverseProxy's Rewrite points the request at the booking's
//     Endpoint (Options.Scheme), sets X-Forwarded-For/-Host/-Proto, and
//     removes the hop-by-hop headers and the routing headers a client could
//     forge (x-gateway-destination-endpoint and its subset, served and scores
//     forms, x-prefiller-host-port, Dynamo's worker and rank headers, ...). A
//     plan's prefill worker then goes to the destination as
//     x-prefiller-host-port, for the decode sidecar in front of it
//     (examples/pdsidecar), which runs the prefill leg there. The hint is not
//     signed: a sidecar that requires signed hints takes them from the
//     reference EPP only.
//  7. The answer is streamed back; server-sent events and answers without a
//     length are flushed chunk by chunk (the ReverseProxy's rule).
//
// Errors before step 6 are answered with an OpenAI error object,
// {"error": {"message", "type", "code"}}, code being the HTTP status, mapped
// as the reference EPP does (HTTPStatus: the tokenizer's classes first, then
// selection's). A 4xx message says what is wrong with the request; a 5xx one
// is a fixed phrase, the details (worker names, reasons, the tokenizer's
// answer) going to the Logger; a 503 for want of a worker names its reason
// (selection.RefusalReason: unknown_model, no_schedulable_worker:<code>,
// none_eligible, overloaded, closed). Every refusal with such a reason also
// names it in llm-d's x-llm-d-request-dropped-reason header; an overload or
// admission refusal (429, or 529 with Options.OverloadStatus: a full queue,
// a policy class's limit, a deadline passed in the queue) carries
// Retry-After: 1. A request's policy class (selection.Request.Class) is its
// x-dynamo-meta-policy-class header, else its x-gateway-inference-objective.
// A refusal past a bound (MaxInflight,
// BodyTimeout, MaxBodyBytes, MaxPromptTokens) is counted in Stats under its
// reason and logged at WARN, at most once per reason every 10 s with the count
// in between. An upstream answer is passed through as it is, error statuses
// included; a transport error is 502 (504 for a timeout). The Router does not
// retry on another worker.
//
// # Settling a booking
//
// The booking's Handle is driven by a lifecycle.Follower, as the reference
// EPP drives its plans. The response body is wrapped when the upstream's
// headers arrive (ModifyResponse), and the wrapper's reads settle the
// booking:
//
//   - PrefillComplete at the first Read that returns bytes, for a 2xx answer
//     only (an error answer is no first output, and must not feed the
//     service's token-parity check). Not at the response headers: an SSE
//     engine sends them before its prefill is done.
//   - Done at the end of the body: when as many bytes as the Content-Length
//     have been read (before they are passed on) or at io.EOF. A client that
//     has read the whole answer therefore finds its booking done.
//
// From the booking until it is settled, a timer renews the lease every
// Options.RenewInterval (10 s) while the request makes progress: before the
// first body byte (a long prefill, or a long answer that is not streamed,
// whose first byte comes at its end), and afterwards when body bytes came
// since the last tick. A long stream therefore outlives the service's lease
// (ActiveRequestExpiry) without being released as an orphan, while a stream
// that went silent for longer than the lease is released (Stats.Stalls), as
// is the booking of a gateway that died with its timers.
//
// With Options.OutputGrowth, a 2xx event stream (text/event-stream) grows its
// booking as it runs: each data line is one generated token
// (Handle.Generated), so the worker's active blocks, and its decode cost,
// follow a long generation.
//
// Done is also called when the client goes away (the request context's
// AfterFunc, at once, wherever the exchange stands), in the ReverseProxy's
// ErrorHandler (connection refused or reset, timeout, cancel before the
// headers), when the body's read fails or the proxy closes it early, when the
// proxy path panics (a deferred recover settles, then panics again with the
// same value, so net/http still aborts the response: silently for
// http.ErrAbortHandler, which the ReverseProxy raises when a copy fails, and
// logging anything else), and, failing all of these, when ServeHTTP returns.
// A booking is never freed in ModifyResponse while a body is still to come:
// that runs before the body is streamed; an answer declared empty
// (Content-Length 0) is settled there.
//
// # Failure feedback
//
// A transport error while the client is still there (the connection refused
// or reset, the answer cut short) and an upstream status for which
// Options.FailureStatus is true (lifecycle.FailureStatus: 5xx except 501 and
// 505) mark the worker failed (Handle.MarkFailed), at most once per request: the
// service stops picking it for its FailureEjection time and forgets the
// approximate affinity that would pull requests back to it. A client's cancel
// or an expired deadline never marks a worker.
//
// # Session ids
//
// SessionID reads the x-session-id header, then Dynamo's x-dynamo-session-id,
// then the body's prompt_cache_key. The Router books the request with it
// (selection.Request.SessionID: the service's session affinity pins the
// session to a worker) and passes it to Options.Prepare in
// RequestInfo.SessionID; a session header over selection.MaxSessionIDLen
// bytes is answered 400. "user" and "safety_identifier" are not session ids
// (see RequestInfo).
//
// # Concurrency
//
// A Router is safe for concurrent use. New starts nothing, and the Router
// starts no goroutine of its own but two kinds of short callbacks, each owned
// by one request: the context AfterFunc that settles the request when its
// client leaves, and the renewal timer's ticks, which the settle stops.
// Everything else of a request runs on the goroutine net/http calls ServeHTTP
// on: the ReverseProxy calls Rewrite, ModifyResponse, ErrorHandler and the
// body's Read and Close there, so that state needs no lock. The settle (which
// the AfterFunc may run) and the renewals are guarded by a sync.Once, an
// atomic flag and a mutex; a Handle is safe for concurrent use.
// The transport the Router makes keeps idle connections, which
// CloseIdleConnections releases. Options.Prepare and the Service are called
// concurrently. The in-flight slots are an atomic count and the refusal log's
// limiter a mutex.
//
// # Invariants
//
//   - Every booking is Done exactly once, on every path: end of the answer,
//     client cancel, upstream error, panic. Once no request is in flight,
//     Stats.Booked == Stats.Done, and the service's loads are back to zero.
//   - PrefillComplete is called at most once per booking, never before the
//     first body byte of a 2xx answer has been read from the worker.
//   - MarkFailed is called at most once per request, never for a request the
//     client abandoned.
//   - At most Options.MaxInflight requests are being read, tokenized or
//     booked; a slot is left on every path, panics included. A body buffer
//     holds at most 16 KiB before bytes arrive, then at most about twice the
//     bytes received.
//   - No request reaches a worker with a routing header the client set.
package httproute
