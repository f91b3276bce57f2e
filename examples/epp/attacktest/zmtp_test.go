package attacktest

import (
	"encoding/binary"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// ZMTP 3.0 (RFC 23) written by hand: zmq4 can neither dial from a chosen local
// address (its options have no dialer; only a whole custom transport could) nor
// send malformed bytes, and both are what the attacks need.

// Frame flags.
const (
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
)

// greeting is a valid 64-byte ZMTP 3.0 greeting: signature 0xFF, 8 padding
// bytes, 0x7F; version 3.0; mechanism "NULL" padded to 20 bytes; as-server 0;
// 31 filler bytes.
func greeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xFF, 0x7F, 3, 0
	copy(g[12:32], "NULL")
	return g
}

// longHeader is a LONG frame header declaring size bytes, with no body.
func longHeader(flags byte, size uint64) []byte {
	h := make([]byte, 9)
	h[0] = flags | flagLong
	binary.BigEndian.PutUint64(h[1:], size)
	return h
}

// frame is one whole frame, short or long as its size needs.
func frame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		return append(longHeader(flags, uint64(len(body))), body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// command is a command frame: name length, name, data.
func command(name string, data []byte) []byte {
	body := append([]byte{byte(len(name))}, name...)
	return frame(flagCommand, append(body, data...))
}

// property is one READY metadata property.
func property(name, value string) []byte {
	b := append([]byte{byte(len(name))}, name...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(value)))
	return append(b, value...)
}

// ready is a valid READY naming the socket type.
func ready(socketType string) []byte {
	return command("READY", property("Socket-Type", socketType))
}

// truncatedReady is a READY whose frame size is honest but whose Socket-Type
// value declares 65535 bytes and carries 3: the property runs past the end
// of the command (zmq4 alone slices past its buffer on this).
func truncatedReady() []byte {
	data := append([]byte{11}, "Socket-Type"...)
	data = binary.BigEndian.AppendUint32(data, 0xFFFF)
	data = append(data, "PUB"...)
	return command("READY", data)
}

// message is a multi-frame data message.
func message(frames ...[]byte) []byte {
	var out []byte
	for i, f := range frames {
		fl := byte(flagMore)
		if i == len(frames)-1 {
			fl = 0
		}
		out = append(out, frame(fl, f)...)
	}
	return out
}

// liveMessage is a KV-event message [topic, seq (8 bytes big-endian), payload].
func liveMessage(topic string, seq uint64, payload []byte) []byte {
	return message([]byte(topic), binary.BigEndian.AppendUint64(nil, seq), payload)
}

// hostile is one malicious byte sequence a peer sends, and the refusal
// reason it must be counted as.
type hostile struct {
	name   string
	reason string
	bytes  []byte
}

// hostileSequences are the ZMTP attacks of the bind and dial tests, each
// opening with a valid greeting.
func hostileSequences() []hostile {
	g, r := greeting(), ready("PUB")
	cat := func(parts ...[]byte) []byte {
		var out []byte
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	return []hostile{
		{"data frame of 2^62 bytes after READY", "frame_too_large", cat(g, r, longHeader(0, 1<<62))},
		{"data frame of 2^40 bytes after READY", "frame_too_large", cat(g, r, longHeader(0, 1<<40))},
		{"data frame of 2^62 bytes instead of READY", "bad_ready", cat(g, longHeader(0, 1<<62))},
		{"command of 2^62 bytes instead of READY", "command_too_large", cat(g, longHeader(flagCommand, 1<<62))},
		{"READY whose property runs past its end", "bad_ready", cat(g, truncatedReady())},
	}
}

// peerConn is a raw TCP connection to the EPP whose inbound bytes are
// drained by one goroutine; closed is closed when the EPP ends the
// connection (or the test closes it).
type peerConn struct {
	net.Conn
	closed chan struct{}
}

// dialPeer connects to addr from localIP (nil: the kernel's choice) and
// starts the drain. The connection is closed in t.Cleanup.
func dialPeer(t *testing.T, localIP net.IP, addr string) *peerConn {
	t.Helper()
	d := net.Dialer{Timeout: waitTimeout}
	if localIP != nil {
		d.LocalAddr = &net.TCPAddr{IP: localIP}
	}
	c, err := d.Dial("tcp", addr)
	require.NoError(t, err)
	return drained(t, c)
}

// drained wraps c and starts its drain goroutine, which ends when c closes.
func drained(t *testing.T, c net.Conn) *peerConn {
	pc := &peerConn{Conn: c, closed: make(chan struct{})}
	go func() {
		defer close(pc.closed)
		buf := make([]byte, 4096)
		for {
			if _, err := c.Read(buf); err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() {
		_ = c.Close()
		<-pc.closed
	})
	return pc
}

// waitClosed reports whether the EPP closed the connection within timeout.
func (pc *peerConn) waitClosed(timeout time.Duration) bool {
	select {
	case <-pc.closed:
		return true
	case <-time.After(timeout):
		return false
	}
}

// publisher opens a ZMTP PUB connection by hand: greeting and READY, then
// whatever the caller sends. The EPP's greeting, READY and SUBSCRIBE are
// drained and ignored.
func publisher(t *testing.T, localIP net.IP, addr string) *peerConn {
	t.Helper()
	pc := dialPeer(t, localIP, addr)
	_, _ = pc.Write(append(greeting(), ready("PUB")...)) // a refused peer may be closed already
	return pc
}
