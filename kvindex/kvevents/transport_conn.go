package kvevents

import (
	"bufio"
	"context"
	"net"
	"strings"
	"sync"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// dialScheme is the go-zeromq transport the feed dials TCP endpoints with. It differs
// from go-zeromq's own "tcp" transport in two ways:
//
//   - a connection closes when its socket's context ends, even in the middle of the
//     ZMTP handshake (go-zeromq reads the peer's greeting without a deadline, so a
//     peer that accepts TCP and never answers would otherwise block Dial, and with it
//     RemoveSource and Run's shutdown, until the peer went away);
//   - reads are buffered (go-zeromq reads every frame header and body with separate
//     calls, several system calls per message otherwise).
//
// It is registered once, the first time a feed is created; if the name were taken,
// the feed falls back to plain "tcp".
const dialScheme = "kvevents-tcp"

var (
	registerOnce sync.Once
	registered   bool
)

func registerDialTransport() {
	registerOnce.Do(func() {
		registered = zmq4.RegisterTransport(dialScheme, dialTransport{}) == nil
	})
}

// dialEndpoint maps a validated tcp:// endpoint to the feed's dial transport.
func dialEndpoint(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok && registered {
		return dialScheme + "://" + rest
	}
	return ep
}

// readBufSize is the read buffer of a dialed connection: a few typical batches.
const readBufSize = 64 << 10

type dialTransport struct{}

// Dial connects and ties the connection's life to ctx, the socket's context.
func (dialTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	bc := &bufConn{Conn: c, r: bufio.NewReaderSize(c, readBufSize)}
	bc.stop = context.AfterFunc(ctx, func() { _ = c.Close() })
	return bc, nil
}

// Listen is plain TCP; the feed binds with go-zeromq's own "tcp" transport anyway.
func (dialTransport) Listen(_ context.Context, addr string) (net.Listener, error) {
	return net.Listen("tcp", addr)
}

// Addr normalises "host:port" the way go-zeromq's tcp transport does.
func (dialTransport) Addr(ep string) (string, error) {
	host, port, err := net.SplitHostPort(ep)
	if err != nil {
		return "", err
	}
	switch port {
	case "", "*":
		port = "0"
	}
	switch host {
	case "", "*":
		host = "0.0.0.0"
	}
	return net.JoinHostPort(host, port), nil
}

// bufConn is a TCP connection with buffered reads. go-zeromq reads a connection from
// one goroutine at a time (the dialer during the handshake, then the socket's reader),
// so the unsynchronised bufio.Reader is safe.
type bufConn struct {
	net.Conn
	r    *bufio.Reader
	stop func() bool
}

func (c *bufConn) Read(p []byte) (int, error) { return c.r.Read(p) }

func (c *bufConn) Close() error {
	c.stop()
	return c.Conn.Close()
}
