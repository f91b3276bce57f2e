// Package attacktest attacks the gateway binary (examples/gateway) from the
// network and checks that it holds. It holds only tests, on Linux (they read
// the process's memory from /proc): TestMain builds the binary once (with
// -race when the tests run with it, and a race it reports fails the test),
// and each test runs it as a subprocess on loopback with a static workers
// file, approximate mode (no KV events) and a tokenizer nobody answers for.
//
// The attack: a thousand connections, each declaring an 8 MB body and sending
// 80 bytes of it. The gateway must stay under 400 MB of resident memory
// (VmHWM, its peak) and answer every one 408 and close it within its body
// deadline (GATEWAY_BODY_TIMEOUT, 2 s here) plus slack.
//
// Everything listens on 127.0.0.1 port 0 (the gateway logs the address it
// bound), every wait is bounded, and the process and every connection a test
// opens are closed in its cleanup; the kernel kills the gateway if the test
// process dies first.
package attacktest
