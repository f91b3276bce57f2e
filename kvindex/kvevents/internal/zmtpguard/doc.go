// Package zmtpguard is a zmq4 (github.com/go-zeromq/zmq4 v0.17.0) transport that
// validates every inbound byte as ZMTP 3.x before zmq4 sees it.
//
// # Why
//
// zmq4 trusts its peers. It allocates each frame from the size the peer declares
// (make([]byte, size), checked only against 2^63), slices past the end of a short
// READY property, and runs each accepted connection's handshake inline in its accept
// loop without a deadline. A few dozen bytes from any TCP peer therefore end the
// process (a panic or a fatal out-of-memory in a goroutine nobody can recover), and
// one silent connection stops a listening socket from accepting anyone else.
//
// # Job
//
// Register returns a Transport registered with zmq4 under a fresh scheme
// ("kvtcp1", ...). Sockets dial and listen on the endpoints Endpoint maps
// "tcp://" ones to, and otherwise behave as with zmq4's "tcp"; a listener's Addr
// is the real bound address. Every connection, dialed or accepted, reads through a
// pull parser (RFC 23 and 37) that releases bytes to zmq4 only once they are checked:
//
//   - the greeting: signature 0xFF..0x7F, major version 3, mechanism NULL, as-server
//     0 or 1; non-ZMTP bytes are refused at the first byte that proves it;
//   - every frame header before any of its frame: reserved flag bits clear, data
//     frames at most MaxFrame, messages at most MaxMessage bytes and MaxParts
//     frames, commands at most MaxCommand, no MORE on a command, no command inside a
//     message;
//   - commands are buffered whole and their structure checked; the first must be a
//     READY whose properties fill it exactly and name exactly one known Socket-Type,
//     compatible with the local socket's (zmq4 leaks the connection when its own
//     check fails). Later commands (PING, SUBSCRIBE, ...) are checked and dropped:
//     zmq4 acts on none of them and would hand them to the application;
//   - data frame bodies then stream through without copying into a buffer. With
//     Policy.Message set, a message's first frame (at most MaxTopic) is buffered and
//     shown to it; a refusal drops the whole message and keeps the connection.
//
// Every write has a deadline (Limits.WriteTimeout): zmq4 writes under its
// socket's lock, so a peer that stops reading would otherwise stall the socket.
//
// Any other violation closes the connection, is counted by Reason (Stats) and
// reported to Policy.Refused. zmq4 never sees the offending bytes: its next Read
// returns a *RefusedError (wrapping ErrRefused), a net.Error that is not a timeout,
// which zmq4 treats as a closed connection (a socket's Recv returns it once, as it
// does any lost connection's error).
//
// # Accepting
//
// A guarded listener owns an accept goroutine and one handshake goroutine per
// connection. A new connection beyond MaxConns (counting those in handshake and
// those zmq4 holds) or refused by Policy.Admit is closed at once. Otherwise its
// goroutine does the server side of the handshake: it sends a greeting (ZMTP 3.0,
// NULL, as-server 0, byte for byte what zmq4 sends; RFC 23 wants 0 for NULL) and
// reads and validates the peer's greeting and READY under HandshakeTimeout. Only
// then does Accept hand the connection to zmq4, whose inline handshake completes at
// once: Read replays the buffered greeting and READY, and Write swallows zmq4's own
// greeting (its first 64 bytes) and passes its READY through, watching it for the
// local Socket-Type. So a silent or slow peer holds a slot and a goroutine for at
// most HandshakeTimeout, and never zmq4's accept loop.
//
// This relies on zmq4 v0.17.0's NULL handshake (conn.go greet, null_security.go):
// it writes its 64-byte greeting in one Write, reads 64 bytes, writes its READY
// (header, then body), reads the peer's READY. And it relies on a ZMTP client
// sending its READY without waiting for the server's, which libzmq, JeroMQ and zmq4
// do for NULL. The local READY is sent by zmq4 itself, so its Identity and
// Socket-Type are exactly zmq4's. Only the NULL mechanism is supported: a socket
// configured with another is refused (ReasonBadMechanism).
//
// # Dialing
//
// A dialed connection reads through the same parser, under a read deadline of
// HandshakeTimeout that is lifted once the peer's READY validated, and closes when
// the socket's context ends (even mid-handshake, so Dial cannot hang on a peer that
// accepts TCP and never answers). Nothing is swallowed.
//
// # Concurrency and ownership
//
// Transport and its Stats are safe for concurrent use; counters are atomics. A
// connection is read by one goroutine at a time (zmq4's) and its writes are
// serialised; both sides hold their own mutex. A listener's Close stops its accept
// goroutine, closes the connections still in handshake and waits for all its
// goroutines; connections already accepted belong to zmq4, which closes them. The
// Policy functions run on those goroutines and must not block; Admit runs on the
// accept goroutine.
//
// # Invariants
//
//   - No byte of a frame reaches zmq4 before the frame's header passed the limits;
//     no byte of a command or topic frame before the whole frame passed.
//   - A connection holds at most a fixed 32 KiB read-ahead, one command or topic
//     buffer (MaxCommand) and one greeting plus READY; zmq4 behind it allocates at
//     most MaxFrame per frame and MaxMessage per message.
//   - Nothing read from the wire makes the guard panic (FuzzInbound drives the
//     parser and a real zmq4.Conn behind it with arbitrary input).
//
// zmq4 cannot unregister a transport: register once per configuration.
package zmtpguard
