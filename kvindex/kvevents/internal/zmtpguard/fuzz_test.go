package zmtpguard

import (
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// memConn is a net.Conn that reads a fixed byte string in chunks and discards
// writes.
type memConn struct {
	r     *bytes.Reader
	chunk int
}

func (m *memConn) Read(p []byte) (int, error) {
	if len(p) > m.chunk {
		p = p[:m.chunk]
	}
	return m.r.Read(p)
}
func (m *memConn) Write(p []byte) (int, error)      { return len(p), nil }
func (m *memConn) Close() error                     { return nil }
func (m *memConn) LocalAddr() net.Addr              { return fuzzAddr }
func (m *memConn) RemoteAddr() net.Addr             { return fuzzAddr }
func (m *memConn) SetDeadline(time.Time) error      { return nil }
func (m *memConn) SetReadDeadline(time.Time) error  { return nil }
func (m *memConn) SetWriteDeadline(time.Time) error { return nil }

var fuzzAddr = &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}

var fuzzLimits = Limits{MaxFrame: 4 << 10, MaxMessage: 6 << 10, MaxParts: 8, MaxCommand: 512, MaxTopic: 16}

var (
	fuzzOnce sync.Once
	fuzzTr   *Transport
)

// fuzzTransport is registered once: zmq4 cannot unregister transports.
func fuzzTransport(t testing.TB) *Transport {
	fuzzOnce.Do(func() {
		var err error
		fuzzTr, err = Register(fuzzLimits, Policy{
			Message: func(_ net.Addr, topic []byte) error {
				if bytes.HasPrefix(topic, []byte("x")) {
					return errors.New("x topics refused")
				}
				return nil
			},
		})
		if err != nil {
			t.Fatal(err)
		}
	})
	return fuzzTr
}

// FuzzInbound feeds arbitrary bytes, in arbitrary chunks, through the guard into a
// real zmq4.Conn (SUB side), either as dialer or as listener. It must never panic
// (neither the guard nor zmq4 behind it), keep its buffers within the limits, hand
// zmq4 only messages within the limits and end either at the end of the input or
// with a refusal.
func FuzzInbound(f *testing.F) {
	hs := peerHandshake("PUB")
	seeds := [][]byte{
		hs,
		cat(hs, frameBytes(flagMore, []byte("topic")), frameBytes(flagMore, []byte{0, 0, 0, 1}), frameBytes(0, []byte("payload"))),
		cat(hs, frameBytes(flagMore, []byte("xbad")), frameBytes(0, make([]byte, 300)), frameBytes(0, []byte("ok"))),
		cat(hs, commandBytes("PING", []byte{0, 10}), frameBytes(0, []byte("after ping"))),
		cat(hs, frameBytes(0, make([]byte, 4<<10))),
	}
	for _, a := range attacks("PUB") {
		seeds = append(seeds, a.bytes)
	}
	for _, s := range seeds {
		f.Add(s, uint16(1), false)
		f.Add(s, uint16(7), true)
		f.Add(s, uint16(4096), false)
	}
	f.Fuzz(func(t *testing.T, data []byte, chunk uint16, server bool) {
		tr := fuzzTransport(t)
		mc := &memConn{r: bytes.NewReader(data), chunk: max(int(chunk), 1)}
		c := newConn(tr, mc, server, nil)
		t.Cleanup(func() { _ = c.Close() })
		if server {
			if err := c.serverHandshake(); err != nil {
				checkEnd(t, c, mc, err)
				return
			}
		}
		zc, err := zmq4.Open(c, null.Security(), zmq4.Sub, zmq4.SocketIdentity("fuzz"), server, nil)
		if err != nil {
			checkEnd(t, c, mc, err)
			return
		}
		for {
			msg, err := zc.RecvMsg()
			checkBuffers(t, c)
			if err != nil {
				checkEnd(t, c, mc, err)
				return
			}
			if msg.Type == zmq4.CmdMsg {
				t.Fatalf("zmq4 saw a command after the handshake: %q", msg.Frames)
			}
			if len(msg.Frames) > fuzzLimits.MaxParts {
				t.Fatalf("message of %d frames", len(msg.Frames))
			}
			var total int
			for _, fr := range msg.Frames {
				if int64(len(fr)) > fuzzLimits.MaxFrame {
					t.Fatalf("frame of %d bytes", len(fr))
				}
				total += len(fr)
			}
			if int64(total) > fuzzLimits.MaxMessage {
				t.Fatalf("message of %d bytes", total)
			}
			if len(msg.Frames) > 0 && bytes.HasPrefix(msg.Frames[0], []byte("x")) {
				t.Fatalf("refused topic %q delivered", msg.Frames[0])
			}
		}
	})
}

func checkBuffers(t *testing.T, c *conn) {
	t.Helper()
	if n := cap(c.in.body); n > fuzzLimits.MaxCommand {
		t.Fatalf("body buffer grew to %d", n)
	}
	if n := cap(c.in.ready); n > 2*(greetingLen+9+fuzzLimits.MaxCommand) {
		t.Fatalf("ready buffer grew to %d", n)
	}
	if n := cap(c.in.raw); n != rawSize {
		t.Fatalf("raw buffer is %d", n)
	}
}

// checkEnd requires the stream to have ended with a refusal or at the end of the
// input.
func checkEnd(t *testing.T, c *conn, mc *memConn, err error) {
	t.Helper()
	checkBuffers(t, c)
	if errors.Is(err, ErrRefused) || c.failed.Load() != nil {
		return
	}
	if (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)) && mc.r.Len() == 0 {
		return
	}
	t.Fatalf("ended with %v and %d bytes unread, no refusal", err, mc.r.Len())
}
