package zmtpguard

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// ZMTP 3.x wire constants (RFC 23 and 37).
const (
	greetingLen  = 64
	flagMore     = 0x01
	flagLong     = 0x02
	flagCommand  = 0x04
	flagReserved = ^byte(flagMore | flagLong | flagCommand)

	rawSize = 32 << 10 // read-ahead buffer of one connection
)

var nullMechanism = [20]byte{'N', 'U', 'L', 'L'}

// serverGreeting is the greeting a guarded listener sends: ZMTP 3.0, NULL, as-server
// 0 (RFC 23: NULL defines no client/server topology), byte for byte what zmq4 sends.
var serverGreeting = func() [greetingLen]byte {
	var g [greetingLen]byte
	g[0], g[9] = 0xFF, 0x7F
	g[10], g[11] = 3, 0
	copy(g[12:32], nullMechanism[:])
	return g
}()

// conn is a guarded connection. Reads hand zmq4 only validated bytes; writes pass
// through, except that on an accepted connection zmq4's own greeting is swallowed
// (the listener already sent one). zmq4 reads a connection from one goroutine at a
// time and serialises its writes; the mutexes make that an invariant, not a hope.
type conn struct {
	nc      net.Conn
	t       *Transport
	remote  net.Addr
	server  bool
	onClose func()
	stop    atomic.Pointer[func() bool] // unhooks the socket context (dialed connections); set after the hook may already run

	failed    atomic.Pointer[RefusedError] // set once, by the first refusal
	closed    atomic.Bool                  // Close was called (by zmq4, the listener or a refusal)
	closeOnce sync.Once
	closeErr  error

	types struct { // Socket-Type of each side, checked once both are known
		sync.Mutex
		peer, local string
		checked     bool
	}

	rmu sync.Mutex
	in  inbound

	wmu sync.Mutex
	out outbound
}

func newConn(t *Transport, nc net.Conn, server bool, onClose func()) *conn {
	c := &conn{nc: nc, t: t, remote: nc.RemoteAddr(), server: server, onClose: onClose}
	c.in = inbound{c: c, lim: &t.lim, raw: make([]byte, rawSize)}
	if server {
		c.out.swallow = greetingLen
	}
	return c
}

// refuse records the first refusal, closes the connection and returns the error
// that Read and Write return from then on.
func (c *conn) refuse(r Reason, format string, args ...any) error {
	e := &RefusedError{Reason: r, Remote: c.remote, Detail: fmt.Sprintf(format, args...)}
	if !c.failed.CompareAndSwap(nil, e) {
		return c.failed.Load()
	}
	_ = c.Close()
	c.t.refused(r, c.remote, e)
	return e
}

// serverHandshake sends the listener's greeting and reads and validates the peer's
// greeting and READY under HandshakeTimeout, keeping them for zmq4 to read.
func (c *conn) serverHandshake() error {
	if err := c.nc.SetDeadline(time.Now().Add(c.t.lim.HandshakeTimeout)); err != nil {
		return err
	}
	if _, err := c.nc.Write(serverGreeting[:]); err != nil {
		return c.ioErr(err)
	}
	c.rmu.Lock()
	defer c.rmu.Unlock()
	for !c.in.handshook {
		if err := c.in.next(); err != nil {
			return err
		}
	}
	return c.nc.SetDeadline(time.Time{})
}

// Read hands out validated bytes only.
func (c *conn) Read(p []byte) (int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	return c.in.read(p)
}

// Write passes zmq4's bytes on, after swallowing its greeting on accepted
// connections; it watches zmq4's first command (its READY) to learn the local
// Socket-Type.
func (c *conn) Write(p []byte) (int, error) {
	if f := c.failed.Load(); f != nil {
		return 0, f
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.nc.SetWriteDeadline(time.Now().Add(c.t.lim.WriteTimeout)); err != nil {
		return 0, c.ioErr(err)
	}
	var (
		n   int
		err error
	)
	if c.out.done {
		n, err = c.nc.Write(p)
	} else {
		n, err = c.out.write(c, p)
	}
	var ne net.Error
	if err != nil && errors.As(err, &ne) && ne.Timeout() {
		return n, c.refuse(ReasonWriteTimeout, "write of %d bytes not taken in %v", len(p), c.t.lim.WriteTimeout)
	}
	return n, err
}

// Close closes the TCP connection once and releases its listener slot.
func (c *conn) Close() error {
	c.closeOnce.Do(func() {
		c.closed.Store(true)
		if stop := c.stop.Load(); stop != nil {
			(*stop)()
		}
		c.closeErr = c.nc.Close()
		c.t.c.open.Add(-1)
		if c.onClose != nil {
			c.onClose()
		}
	})
	return c.closeErr
}

func (c *conn) LocalAddr() net.Addr                { return c.nc.LocalAddr() }
func (c *conn) RemoteAddr() net.Addr               { return c.remote }
func (c *conn) SetDeadline(t time.Time) error      { return c.nc.SetDeadline(t) }
func (c *conn) SetReadDeadline(t time.Time) error  { return c.nc.SetReadDeadline(t) }
func (c *conn) SetWriteDeadline(t time.Time) error { return c.nc.SetWriteDeadline(t) }

// setType records one side's Socket-Type and, once both are known, refuses peers
// zmq4 would reject: zmq4 leaves the connection open when its own check fails.
func (c *conn) setType(peer bool, typ string) error {
	c.types.Lock()
	if peer {
		c.types.peer = typ
	} else {
		c.types.local = typ
	}
	p, l := c.types.peer, c.types.local
	ready := p != "" && l != "" && !c.types.checked
	if ready {
		c.types.checked = true
	}
	c.types.Unlock()
	if ready && !zmq4.SocketType(p).IsCompatible(zmq4.SocketType(l)) {
		return c.refuse(ReasonIncompatible, "peer Socket-Type %q cannot talk to %q", p, l)
	}
	return nil
}

// ioErr maps an error of the TCP connection.
func (c *conn) ioErr(err error) error {
	if f := c.failed.Load(); f != nil {
		return f
	}
	if c.in.handshook || c.closed.Load() {
		return err // a closed connection is our side's doing, not the peer's
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return c.refuse(ReasonHandshakeTimeout, "greeting and READY not received within %v", c.t.lim.HandshakeTimeout)
	}
	return c.refuse(ReasonHandshakeIO, "%v", err)
}

// outbound follows zmq4's writes until its READY is through.
type outbound struct {
	swallow int // bytes of zmq4's greeting still to swallow (accepted connections)
	greet   int // bytes of zmq4's greeting seen
	hdr     [9]byte
	hn      int  // header bytes seen
	hdrDone bool // header complete, size known
	size    int  // READY body length
	body    []byte
	done    bool
}

func (o *outbound) write(c *conn, p []byte) (int, error) {
	n := 0
	if o.greet < greetingLen {
		k := min(len(p), greetingLen-o.greet)
		g := p[:k]
		if o.greet == 0 && k >= 32 && !bytes.Equal(g[12:32], nullMechanism[:]) {
			// zmq4 was configured with a mechanism other than NULL.
			return 0, c.refuse(ReasonBadMechanism, "local socket does not use the NULL mechanism")
		}
		o.greet += k
		if o.swallow > 0 {
			o.swallow -= k
			n += k
		} else {
			w, err := c.nc.Write(g)
			n += w
			if err != nil {
				return n, err
			}
		}
		p = p[k:]
		if len(p) == 0 {
			return n, nil
		}
	}
	// Everything from here on goes out as written; it is only watched.
	w, err := c.nc.Write(p)
	o.watch(c, p[:w])
	return n + w, err
}

// watch parses zmq4's first command frame, its READY, for its Socket-Type.
func (o *outbound) watch(c *conn, p []byte) {
	for !o.done && len(p) > 0 {
		if !o.hdrDone {
			o.hdr[o.hn] = p[0]
			o.hn++
			p = p[1:]
			need := 2
			if o.hdr[0]&flagLong != 0 {
				need = 9
			}
			if o.hn < need {
				continue
			}
			size := uint64(o.hdr[1])
			if need == 9 {
				size = binary.BigEndian.Uint64(o.hdr[1:])
			}
			if o.hdr[0]&flagCommand == 0 || size > uint64(c.t.lim.MaxCommand) {
				o.done = true // not a READY we can check; stop watching
				return
			}
			o.size, o.hdrDone = int(size), true
			o.body = make([]byte, 0, o.size)
		}
		k := min(len(p), o.size-len(o.body))
		o.body = append(o.body, p[:k]...)
		p = p[k:]
		if len(o.body) == o.size {
			o.done = true
			if typ, err := parseReady(o.body); err == nil {
				_ = c.setType(false, typ)
			}
			o.body = nil
		}
	}
}
