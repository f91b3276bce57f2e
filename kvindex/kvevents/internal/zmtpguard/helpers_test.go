package zmtpguard

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
)

// wait bounds every wait of the tests; nothing legitimate takes near this long.
const wait = 10 * time.Second

var quiet = zmq4.WithLogger(log.New(io.Discard, "", 0))

// refusal is one call of Policy.Refused.
type refusal struct {
	reason Reason
	err    error
}

// guard registers a transport whose refusals are sent to the returned channel.
func guard(t *testing.T, l Limits, p Policy) (*Transport, <-chan refusal) {
	t.Helper()
	ch := make(chan refusal, 64)
	p.Refused = func(r Reason, _ net.Addr, err error) {
		select {
		case ch <- refusal{r, err}:
		default:
		}
	}
	tr, err := Register(l, p)
	require.NoError(t, err)
	return tr, ch
}

// awaitRefusal waits for a refusal with reason want, skipping others.
func awaitRefusal(t *testing.T, ch <-chan refusal, want Reason) refusal {
	t.Helper()
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		select {
		case r := <-ch:
			if r.reason == want {
				return r
			}
		case <-timer.C:
			t.Fatalf("no %s refusal within %v", want, wait)
		}
	}
}

// closeSocket closes a receiving socket and drains the reader goroutines go-zeromq
// would otherwise leave blocked on its message channel (see kvevents.closeSocket).
func closeSocket(s zmq4.Socket) {
	_ = s.Close()
	for misses := 0; misses < 64; {
		_, err := s.Recv()
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			misses++
			continue
		}
		misses = 0
	}
}

// receiver runs Recv in one goroutine that ends when the socket closes; messages
// and errors other than refusals arrive on a channel.
type receiver struct {
	c  chan zmq4.Msg
	wg sync.WaitGroup
}

func newReceiver(t *testing.T, s zmq4.Socket) *receiver {
	r := &receiver{c: make(chan zmq4.Msg, 16)}
	ctx, cancel := context.WithCancel(context.Background())
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			m, err := s.Recv()
			if err != nil {
				if ctx.Err() != nil || errors.Is(err, context.Canceled) {
					return
				}
				continue // a refused or lost connection; the socket lives on
			}
			select {
			case r.c <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		closeSocket(s)
		r.wg.Wait()
	})
	return r
}

func (r *receiver) next(t *testing.T) zmq4.Msg {
	t.Helper()
	select {
	case m := <-r.c:
		return m
	case <-time.After(wait):
		t.Fatalf("no message within %v", wait)
		return zmq4.Msg{}
	}
}

// untilReceived sends m every 20 ms until r receives a message (a PUB drops
// messages until the SUB's subscription has reached it) and returns that message.
func untilReceived(t *testing.T, pub zmq4.Socket, r *receiver, m zmq4.Msg) zmq4.Msg {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		require.NoError(t, pub.Send(m))
		select {
		case got := <-r.c:
			return got
		case <-tick.C:
		case <-timer.C:
			t.Fatalf("no message within %v", wait)
		}
	}
}

// listenSub returns a SUB (subscribed to everything) listening on 127.0.0.1:0
// through tr, its receiver and its bound address.
func listenSub(t *testing.T, tr *Transport) (zmq4.Socket, *receiver, string) {
	t.Helper()
	sub := zmq4.NewSub(context.Background(), quiet)
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	require.NoError(t, sub.Listen(tr.scheme+"://127.0.0.1:0"))
	addr := sub.Addr().String()
	return sub, newReceiver(t, sub), addr
}

func newPub(t *testing.T) zmq4.Socket {
	pub := zmq4.NewPub(context.Background(), quiet, zmq4.WithDialerMaxRetries(0))
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// deliver checks that a fresh PUB dialing addr with plain tcp gets a message to r.
func deliver(t *testing.T, addr string, r *receiver) {
	t.Helper()
	pub := newPub(t)
	require.NoError(t, pub.Dial("tcp://"+addr))
	got := untilReceived(t, pub, r, zmq4.NewMsgFrom([]byte("topic"), []byte("legit")))
	require.Equal(t, "legit", string(got.Frames[1]))
}

// Wire builders.

func greetingBytes(mech string, major byte) []byte {
	g := make([]byte, greetingLen)
	g[0], g[9], g[10] = 0xFF, 0x7F, major
	copy(g[12:32], mech)
	return g
}

func frameBytes(flags byte, body []byte) []byte {
	if len(body) > 255 {
		h := make([]byte, 9, 9+len(body))
		h[0] = flags | flagLong
		binary.BigEndian.PutUint64(h[1:], uint64(len(body)))
		return append(h, body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

func commandBytes(name string, data []byte) []byte {
	body := append([]byte{byte(len(name))}, name...)
	return frameBytes(flagCommand, append(body, data...))
}

func propsBytes(kv ...string) []byte {
	var b []byte
	for i := 0; i < len(kv); i += 2 {
		b = append(b, byte(len(kv[i])))
		b = append(b, kv[i]...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(kv[i+1])))
		b = append(b, kv[i+1]...)
	}
	return b
}

func readyBytes(typ string) []byte {
	return commandBytes("READY", propsBytes("Socket-Type", typ, "Identity", ""))
}

// peerHandshake is a valid greeting and READY of a peer of type typ.
func peerHandshake(typ string) []byte {
	return append(greetingBytes("NULL", 3), readyBytes(typ)...)
}

func longHeader(flags byte, size uint64) []byte {
	h := make([]byte, 9)
	h[0] = flags | flagLong
	binary.BigEndian.PutUint64(h[1:], size)
	return h
}

func cat(parts ...[]byte) []byte {
	var b []byte
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}

// rawDial connects to addr, writes b and returns the connection; the test closes it.
func rawDial(t *testing.T, addr string, b []byte) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	if len(b) > 0 {
		_, err = c.Write(b)
		require.NoError(t, err)
	}
	return c
}

// requireClosedByPeer reads c until EOF (the guard closed it), within wait.
func requireClosedByPeer(t *testing.T, c net.Conn) {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(wait)))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the guard did not close the connection within %v", wait)
	}
}
