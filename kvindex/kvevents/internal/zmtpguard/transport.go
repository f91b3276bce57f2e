package zmtpguard

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4/transport"
)

// zmqTransport is what zmq4 sees of a Transport.
type zmqTransport struct{ t *Transport }

var _ transport.Transport = zmqTransport{}

// Dial connects over TCP and wraps the connection: inbound bytes are validated, the
// peer's greeting and READY must arrive within HandshakeTimeout, and the connection
// closes when ctx (the zmq4 socket's context) ends, even mid-handshake.
func (z zmqTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	t := z.t
	t.c.dialed.Add(1)
	t.c.open.Add(1)
	c := newConn(t, nc, false, nil)
	if err := nc.SetReadDeadline(time.Now().Add(t.lim.HandshakeTimeout)); err != nil {
		_ = c.Close()
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { _ = c.Close() })
	c.stop.Store(&stop)
	return c, nil
}

// Listen binds TCP and returns a listener whose Accept hands out only connections
// whose peer greeting and READY already arrived and validated.
func (z zmqTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	l := &listener{
		t:       z.t,
		ln:      ln,
		ready:   make(chan *conn),
		done:    make(chan struct{}),
		pending: make(map[*conn]struct{}),
	}
	l.wg.Add(1)
	go l.acceptLoop()
	stop := context.AfterFunc(ctx, func() { _ = l.Close() })
	l.stop.Store(&stop)
	return l, nil
}

// Addr normalises "host:port" the way zmq4's tcp transport does.
func (zmqTransport) Addr(ep string) (string, error) {
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

// listener is a guarded TCP listener. It owns the accept goroutine and one handshake
// goroutine per connection being handshaken; Close stops and waits for all of them.
type listener struct {
	t     *Transport
	ln    net.Listener
	ready chan *conn                  // handshaken connections, taken by Accept
	done  chan struct{}               // closed by Close
	stop  atomic.Pointer[func() bool] // unhooks the context; set after the hook may already run

	wg        sync.WaitGroup
	closeOnce sync.Once

	mu      sync.Mutex
	closed  bool
	pending map[*conn]struct{} // connections in handshake, closed by Close
	open    int                // accepted connections not yet closed
}

// Accept returns the next connection whose handshake with the guard succeeded, or
// net.ErrClosed once the listener is closed.
func (l *listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ready:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close stops accepting, closes the connections still in handshake and waits for
// the listener's goroutines. Connections already handed out belong to their taker.
func (l *listener) Close() error {
	var err error
	l.closeOnce.Do(func() {
		if stop := l.stop.Load(); stop != nil {
			(*stop)()
		}
		close(l.done)
		err = l.ln.Close()
		l.mu.Lock()
		l.closed = true
		pending := make([]*conn, 0, len(l.pending))
		for c := range l.pending {
			pending = append(pending, c)
		}
		l.mu.Unlock()
		for _, c := range pending { // outside mu: Close releases the slot under it
			_ = c.Close()
		}
		l.wg.Wait()
	})
	return err
}

// Addr returns the bound TCP address (the real port when bound to port 0).
func (l *listener) Addr() net.Addr { return l.ln.Addr() }

func (l *listener) acceptLoop() {
	defer l.wg.Done()
	var delay time.Duration
	for {
		nc, err := l.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// A resource error such as EMFILE: back off instead of spinning.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			t := time.NewTimer(delay)
			select {
			case <-l.done:
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		delay = 0
		l.admit(nc)
	}
}

// admit applies MaxConns and Policy.Admit to a fresh TCP connection and starts its
// handshake goroutine.
func (l *listener) admit(nc net.Conn) {
	t := l.t
	t.c.accepted.Add(1)
	remote := nc.RemoteAddr()
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		_ = nc.Close()
		return
	}
	if l.open >= t.lim.MaxConns {
		l.mu.Unlock()
		_ = nc.Close()
		t.refused(ReasonTooManyConns, remote, &RefusedError{Reason: ReasonTooManyConns, Remote: remote,
			Detail: "listener already holds MaxConns connections"})
		return
	}
	l.open++
	l.mu.Unlock()

	if t.pol.Admit != nil {
		if err := t.pol.Admit(remote); err != nil {
			l.release()
			_ = nc.Close()
			t.refused(ReasonNotAdmitted, remote, &RefusedError{Reason: ReasonNotAdmitted, Remote: remote,
				Detail: err.Error()})
			return
		}
	}
	t.c.open.Add(1)
	c := newConn(t, nc, true, l.release)
	l.mu.Lock()
	if l.closed { // Close ran since the check above
		l.mu.Unlock()
		_ = c.Close()
		return
	}
	l.pending[c] = struct{}{}
	l.mu.Unlock()
	l.wg.Add(1)
	go l.handshake(c)
}

func (l *listener) release() {
	l.mu.Lock()
	l.open--
	l.mu.Unlock()
}

// handshake runs the server side of the ZMTP handshake on c, then waits for Accept
// to take it (or for Close).
func (l *listener) handshake(c *conn) {
	defer l.wg.Done()
	err := c.serverHandshake()
	l.mu.Lock()
	delete(l.pending, c)
	closed := l.closed
	l.mu.Unlock()
	if err != nil || closed {
		_ = c.Close()
		return
	}
	select {
	case l.ready <- c:
	case <-l.done:
		_ = c.Close()
	}
}
