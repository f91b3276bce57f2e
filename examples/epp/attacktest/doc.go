// Package attacktest attacks the reference EPP binary (examples/epp) from the
// network and checks that it survives. It holds only tests: TestMain builds the
// binary once, and each test runs it as a subprocess with static discovery on
// loopback, fake engines (internal/fakeengine) as the legitimate workers and a
// fake engine's HTTP API (or a hanging server) as the tokenizer.
//
// Every attack asserts the same three things: the process is still running and
// answers /metrics; the counter that names the refusal or skip moved; and a
// legitimate engine's KV events are still applied afterwards
// (kvselect_kv_events_applied_total grows). The attacks:
//
//   - bind listener (DYN_EPP_KV_EVENT_BIND): a frame header declaring 2^62 or
//     2^40 bytes, a command of 2^62 bytes, a READY whose property runs past
//     its end;
//   - dial side: a "worker" whose KV-event endpoint answers with the same
//     bytes;
//   - silent connections holding the bind port while real engines dial in;
//   - forged publishers: from an address that is no worker's (not_admitted),
//     from another worker's address (topic_refused), and, with
//     DYN_EPP_KV_EVENT_BIND_ANY_PEER, a batch numbered a million ahead
//     (suspect, not lost, not a restart, the index kept);
//   - made-up data-parallel ranks and stores far beyond a worker's capacity
//     (unknown_rank, rank_full, bounded RSS);
//   - a tokenizer that accepts and never answers, under a small
//     DYN_EPP_MAX_INFLIGHT_REQUESTS (503s, bounded goroutines and heap);
//   - a workers file of 500 workers x dp_size 4096, at start (a named
//     configuration error) and hot-reloaded into a running EPP (refused, the
//     last good set kept);
//   - a rogue NATS server the EPP routes to (no replica secret) carrying a
//     "replica" that books 20 MiB of valid bookings on the EPP's workers:
//     held up to the per-peer bound (peer_full), RSS bounded.
//
// Under -race the EPP binary is built with -race too, and a race it reports
// fails the test.
//
// Everything listens on 127.0.0.1 (the forged peers dial from 127.0.0.2 and
// 127.0.0.9, also loopback on Linux), every wait is bounded by a deadline and
// polls /metrics or the EPP's log instead of sleeping, and every process and
// socket a test starts is stopped in its cleanup.
package attacktest
