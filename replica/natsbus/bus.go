package natsbus

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/nats-io/nats.go"

	"github.com/kvselect/kvselect/replica"
)

// Bus is a replica.Bus and replica.ConnWatcher over one NATS connection. It
// does not own the connection: the caller connects it (see the package doc
// for the options replicas want) and closes it after the Replicator.
type Bus struct {
	nc             *nats.Conn
	logger         *slog.Logger // nil: discard
	refusedReplies atomic.Uint64
}

var (
	_ replica.Bus            = (*Bus)(nil)
	_ replica.ConnWatcher    = (*Bus)(nil)
	_ replica.PayloadLimiter = (*Bus)(nil)
)

// ErrNilConn is New's error for a nil connection.
var ErrNilConn = errors.New("natsbus: nil connection")

// New returns a Bus over nc.
func New(nc *nats.Conn) (*Bus, error) {
	if nc == nil {
		return nil, ErrNilConn
	}
	return &Bus{nc: nc}, nil
}

// MaxPayload is the server's max_payload as the client learnt it on its
// last connection; 0 before the first (replica.PayloadLimiter).
func (b *Bus) MaxPayload() int { return int(b.nc.MaxPayload()) }

// Conn returns the connection.
func (b *Bus) Conn() *nats.Conn { return b.nc }

// Publish publishes data on subject; NATS copies it before returning. While
// the connection is reconnecting, NATS buffers publishes (nats.ReconnectBufSize)
// and sends them on reconnection.
func (b *Bus) Publish(subject string, data []byte) error {
	return b.nc.Publish(subject, data)
}

// Subscribe calls fn with the subject and data of every message on subject
// (a NATS subject, wildcards included), one message at a time, in the order
// NATS delivers them. The subscription reaches the server
// asynchronously: messages published just after Subscribe returns may be
// missed (a Replicator sees that as a gap). After unsubscribe returns, fn is
// not called again and no call is running.
func (b *Bus) Subscribe(subject string, fn func(subject string, data []byte)) (func(), error) {
	return b.guarded(subject, func(m *nats.Msg) { fn(m.Subject, m.Data) })
}

// guarded subscribes fn to subject and returns the stop function both
// Subscribe and Respond promise: once it returns, fn is not called again and
// no call is running.
func (b *Bus) guarded(subject string, fn func(m *nats.Msg)) (func(), error) {
	g := &guard{}
	sub, err := b.nc.Subscribe(subject, func(m *nats.Msg) { g.run(func() { fn(m) }) })
	if err != nil {
		return nil, err
	}
	return func() {
		_ = sub.Unsubscribe()
		g.close()
	}, nil
}

// Request sends data on subject and returns the first reply, or an error:
// nats.ErrNoResponders, ctx's error, or the connection's.
func (b *Bus) Request(ctx context.Context, subject string, data []byte) ([]byte, error) {
	m, err := b.nc.RequestWithContext(ctx, subject, data)
	if err != nil {
		return nil, err
	}
	return m.Data, nil
}

// Respond answers every request on subject with fn's result (none when it
// returns nil), and only to a reply subject under the requester's inbox
// prefix ("_INBOX.", or this connection's own): a request whose reply
// subject is anything else (the booking stream, another replica's subject)
// would make this replica publish its answer there, so it is not answered
// (RefusedReplies). After stop returns, fn is not called again and no call
// is running.
func (b *Bus) Respond(subject string, fn func(req []byte) []byte) (func(), error) {
	return b.guarded(subject, func(m *nats.Msg) {
		if !b.inbox(m.Reply) {
			// The first refusal is logged, then one in 1,024.
			if n := b.refusedReplies.Add(1); n%1024 == 1 {
				b.log().Warn("natsbus: refused to answer a request whose reply subject is not an inbox",
					"subject", m.Subject, "reply", m.Reply, "refused_total", n)
			}
			return
		}
		if resp := fn(m.Data); resp != nil {
			_ = m.Respond(resp)
		}
	})
}

// inbox reports whether reply is a request's private reply subject.
func (b *Bus) inbox(reply string) bool {
	if reply == "" {
		return false
	}
	if strings.HasPrefix(reply, nats.InboxPrefix) {
		return true
	}
	own := b.nc.Opts.InboxPrefix
	return own != "" && strings.HasPrefix(reply, own+".")
}

// RefusedReplies counts the requests Respond did not answer because their
// reply subject was not an inbox.
func (b *Bus) RefusedReplies() uint64 { return b.refusedReplies.Load() }

func (b *Bus) log() *slog.Logger {
	if b.logger != nil {
		return b.logger
	}
	return slog.New(slog.DiscardHandler)
}

// WatchConn reports the connection's losses (fn(false): disconnected,
// reconnecting or closed) and returns (fn(true)), from a goroutine of its
// own that stop ends and waits for.
func (b *Bus) WatchConn(fn func(connected bool)) (func(), error) {
	ch := b.nc.StatusChanged(nats.CONNECTED, nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED)
	done := make(chan struct{})
	up := b.nc.IsConnected()
	go func() {
		defer close(done)
		if !up {
			fn(false)
		}
		for st := range ch {
			now := st == nats.CONNECTED
			if now != up {
				up = now
				fn(up)
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			b.nc.RemoveStatusListener(ch)
			<-done
		})
	}, nil
}

// guard runs callbacks until closed; close waits for the one running.
type guard struct {
	mu     sync.Mutex
	closed bool
}

func (g *guard) run(f func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.closed {
		f()
	}
}

func (g *guard) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}
