package zmtpguard

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
)

const attackMaxCommand = 1024

// attack is a byte stream a hostile peer sends, and the refusal it must earn.
type attack struct {
	name  string
	bytes []byte
	want  Reason
	// afterReady: the attack comes after a valid handshake, so zmq4's Dial succeeds.
	afterReady bool
}

// attacks returns the streams of a hostile peer of type typ.
func attacks(typ string) []attack {
	hs := peerHandshake(typ)
	g := greetingBytes("NULL", 3)
	return []attack{
		{name: "frame 2^62", bytes: cat(hs, longHeader(0, 1<<62)), want: ReasonFrameTooLarge, afterReady: true},
		{name: "frame 2^40", bytes: cat(hs, longHeader(0, 1<<40)), want: ReasonFrameTooLarge, afterReady: true},
		{name: "frame 2^63+", bytes: cat(hs, longHeader(0, 1<<63|5)), want: ReasonFrameTooLarge, afterReady: true},
		// zmq4 itself slices past the end of both of these (a panic).
		{name: "ready name length past end", want: ReasonBadReady,
			bytes: cat(g, commandBytes("READY", []byte{3, 'S', 'o'}))},
		{name: "ready value length past end", want: ReasonBadReady,
			bytes: cat(g, commandBytes("READY", append([]byte{11}, "Socket-Type\x00\x00\x00\xffPUB"...)))},
		{name: "ready value length cut", want: ReasonBadReady,
			bytes: cat(g, commandBytes("READY", append([]byte{11}, "Socket-Type\x00\x00"...)))},
		{name: "ready without socket type", want: ReasonBadReady,
			bytes: cat(g, commandBytes("READY", propsBytes("Identity", "x")))},
		{name: "command name past end", want: ReasonBadCommand,
			bytes: cat(g, frameBytes(flagCommand, []byte{200, 'R'}))},
		{name: "incompatible socket type", want: ReasonIncompatible, bytes: peerHandshake("REQ")},
		{name: "bad signature", want: ReasonBadGreeting, bytes: []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")},
		{name: "zmtp 2", want: ReasonBadGreeting, bytes: greetingBytes("NULL", 1)},
		{name: "plain mechanism", want: ReasonBadMechanism, bytes: greetingBytes("PLAIN", 3)},
		{name: "curve mechanism", want: ReasonBadMechanism, bytes: greetingBytes("CURVE", 3)},
		{name: "reserved flags", want: ReasonBadFlags, afterReady: true, bytes: cat(hs, []byte{0x80, 1, 'x'})},
		{name: "more on command", want: ReasonBadFlags, afterReady: true,
			bytes: cat(hs, frameBytes(flagCommand|flagMore, []byte("\x04PING")))},
		{name: "command too large", want: ReasonCommandTooLarge,
			bytes: cat(g, longHeader(flagCommand, attackMaxCommand+1))},
		{name: "command in message", want: ReasonBadCommand, afterReady: true,
			bytes: cat(hs, frameBytes(flagMore, []byte("t")), commandBytes("PING", nil))},
		{name: "second ready", want: ReasonBadCommand, afterReady: true, bytes: cat(hs, readyBytes(typ))},
		{name: "too many parts", want: ReasonMessageTooLarge, afterReady: true,
			bytes: cat(hs, repeat(frameBytes(flagMore, nil), DefaultMaxParts+1))},
	}
}

func repeat(b []byte, n int) []byte {
	var out []byte
	for range n {
		out = append(out, b...)
	}
	return out
}

// TestAttacksOnListener sends each attack to a guarded listening SUB from a raw
// TCP connection: the guard closes the connection and counts the reason, zmq4
// delivers nothing of it, and a legitimate PUB still gets through afterwards.
func TestAttacksOnListener(t *testing.T) {
	for _, a := range attacks("PUB") {
		t.Run(a.name, func(t *testing.T) {
			tr, refused := guard(t, Limits{MaxCommand: attackMaxCommand}, Policy{})
			_, r, addr := listenSub(t, tr)

			c := rawDial(t, addr, a.bytes)
			got := awaitRefusal(t, refused, a.want)
			var re *RefusedError
			require.ErrorAs(t, got.err, &re)
			require.ErrorIs(t, got.err, ErrRefused)
			require.Equal(t, a.want, re.Reason)
			requireClosedByPeer(t, c)

			deliver(t, addr, r)
			st := tr.Stats()
			require.Equal(t, uint64(1), st.Refused[a.want])
			require.Len(t, st.Refused, 1)
		})
	}
}

// TestAttacksOnDialer points a guarded SUB at a raw TCP "engine" that sends each
// attack: Dial fails (or, after a valid handshake, the connection is dropped), the
// reason is counted, and the same SUB then receives from a legitimate PUB.
func TestAttacksOnDialer(t *testing.T) {
	for _, a := range attacks("PUB") {
		t.Run(a.name, func(t *testing.T) {
			tr, refused := guard(t, Limits{MaxCommand: attackMaxCommand}, Policy{})
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			defer ln.Close()

			var wg sync.WaitGroup
			defer wg.Wait()
			engineClosed := make(chan error, 1)
			wg.Add(1)
			go func() { // the hostile engine: one connection, the attack, then wait for close
				defer wg.Done()
				c, err := ln.Accept()
				if err != nil {
					engineClosed <- err
					return
				}
				defer c.Close()
				_, _ = c.Write(a.bytes)
				_ = c.SetReadDeadline(time.Now().Add(wait))
				buf := make([]byte, 4096)
				for {
					if _, err := c.Read(buf); err != nil {
						engineClosed <- err
						return
					}
				}
			}()

			sub := zmq4.NewSub(context.Background(), quiet, zmq4.WithDialerMaxRetries(0))
			require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
			r := newReceiver(t, sub)
			err = sub.Dial(tr.Endpoint("tcp://" + ln.Addr().String()))
			if a.afterReady {
				require.NoError(t, err)
			} else {
				require.ErrorIs(t, err, ErrRefused)
			}
			awaitRefusal(t, refused, a.want)
			select {
			case err := <-engineClosed:
				var ne net.Error
				require.False(t, errors.As(err, &ne) && ne.Timeout(), "guard did not close the connection")
			case <-time.After(wait):
				t.Fatal("engine connection not closed")
			}

			pub := newPub(t)
			require.NoError(t, pub.Listen("tcp://127.0.0.1:0"))
			require.NoError(t, sub.Dial(tr.Endpoint("tcp://"+pub.Addr().String())))
			got := untilReceived(t, pub, r, zmq4.NewMsgString("legit"))
			require.Equal(t, "legit", string(got.Frames[0]))
			require.Equal(t, uint64(1), tr.Stats().Refused[a.want])
		})
	}
}
