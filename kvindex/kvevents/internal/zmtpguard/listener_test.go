package zmtpguard

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
)

// TestSilentPeersDoNotBlock holds silent connections (and one that sends only the
// signature) open against a guarded listener; a real PUB dialing afterwards still
// delivers, well before HandshakeTimeout could have freed anything.
func TestSilentPeersDoNotBlock(t *testing.T) {
	const timeout = 30 * time.Second
	admitted := make(chan struct{}, 8)
	tr, _ := guard(t, Limits{HandshakeTimeout: timeout}, Policy{
		Admit: func(net.Addr) error { admitted <- struct{}{}; return nil },
	})
	_, r, addr := listenSub(t, tr)

	rawDial(t, addr, nil)
	rawDial(t, addr, nil)
	rawDial(t, addr, nil)
	rawDial(t, addr, greetingBytes("NULL", 3)[:10])
	for range 4 {
		<-admitted // all four are in the guard's hands before the PUB dials
	}

	start := time.Now()
	deliver(t, addr, r)
	require.Less(t, time.Since(start), timeout/6)
	st := tr.Stats()
	require.Empty(t, st.Refused)
	require.Equal(t, int64(5), st.Open)
}

// TestHandshakeTimeout: silent peers are closed and counted after HandshakeTimeout.
func TestHandshakeTimeout(t *testing.T) {
	tr, refused := guard(t, Limits{HandshakeTimeout: 100 * time.Millisecond}, Policy{})
	_, r, addr := listenSub(t, tr)

	silent := rawDial(t, addr, nil)
	sigOnly := rawDial(t, addr, greetingBytes("NULL", 3)[:10])
	halfReady := rawDial(t, addr, cat(greetingBytes("NULL", 3), readyBytes("PUB")[:5]))
	for range 3 {
		got := awaitRefusal(t, refused, ReasonHandshakeTimeout)
		require.ErrorIs(t, got.err, ErrRefused)
	}
	requireClosedByPeer(t, silent)
	requireClosedByPeer(t, sigOnly)
	requireClosedByPeer(t, halfReady)
	require.Equal(t, uint64(3), tr.Stats().Refused[ReasonHandshakeTimeout])
	deliver(t, addr, r)
}

// TestDialHandshakeTimeout: a dialed engine that accepts TCP and never answers
// fails Dial after HandshakeTimeout.
func TestDialHandshakeTimeout(t *testing.T) {
	tr, refused := guard(t, Limits{HandshakeTimeout: 100 * time.Millisecond}, Policy{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()

	sub := zmq4.NewSub(t.Context(), quiet, zmq4.WithDialerMaxRetries(0))
	newReceiver(t, sub)
	err = sub.Dial(tr.Endpoint("tcp://" + ln.Addr().String()))
	require.ErrorIs(t, err, ErrRefused)
	awaitRefusal(t, refused, ReasonHandshakeTimeout)
	c, err := ln.Accept() // the backlog holds the connection the guard closed
	require.NoError(t, err)
	requireClosedByPeer(t, c)
	_ = c.Close()
}

// TestMaxConns: connections beyond MaxConns are closed at once and counted; a
// freed slot admits the next peer.
func TestMaxConns(t *testing.T) {
	admitted := make(chan struct{}, 8)
	tr, refused := guard(t, Limits{MaxConns: 2, HandshakeTimeout: time.Minute}, Policy{
		Admit: func(net.Addr) error { admitted <- struct{}{}; return nil },
	})
	_, r, addr := listenSub(t, tr)

	first := rawDial(t, addr, nil)
	rawDial(t, addr, nil)
	<-admitted
	<-admitted
	extra := rawDial(t, addr, nil)
	awaitRefusal(t, refused, ReasonTooManyConns)
	requireClosedByPeer(t, extra)

	require.NoError(t, first.Close())
	awaitRefusal(t, refused, ReasonHandshakeIO) // the guard sees the hang-up, frees the slot
	deliver(t, addr, r)
	st := tr.Stats()
	require.Equal(t, uint64(1), st.Refused[ReasonTooManyConns])
	require.Equal(t, uint64(4), st.Accepted)
}

// TestAdmit: a peer Admit refuses is closed before it is read.
func TestAdmit(t *testing.T) {
	errNo := errors.New("not on the list")
	var allow bool
	tr, refused := guard(t, Limits{}, Policy{
		Admit: func(net.Addr) error {
			if allow {
				return nil
			}
			allow = true // the next peer may come in
			return errNo
		},
	})
	_, r, addr := listenSub(t, tr)
	c := rawDial(t, addr, peerHandshake("PUB"))
	got := awaitRefusal(t, refused, ReasonNotAdmitted)
	require.Contains(t, got.err.Error(), errNo.Error())
	requireClosedByPeer(t, c)
	deliver(t, addr, r)
}

// TestMessagePolicy: a refused topic drops its whole message; the next message on
// the same connection arrives. Topics above MaxTopic are dropped too.
func TestMessagePolicy(t *testing.T) {
	errBad := errors.New("topic not allowed")
	tr, refused := guard(t, Limits{MaxTopic: 16}, Policy{
		Message: func(_ net.Addr, topic []byte) error {
			if string(topic) == "bad" {
				return errBad
			}
			return nil
		},
	})
	_, r, addr := listenSub(t, tr)
	pub := newPub(t)
	require.NoError(t, pub.Dial("tcp://"+addr))
	untilReceived(t, pub, r, zmq4.NewMsgString("warmup"))
	for { // drain duplicate warm-ups
		require.NoError(t, pub.Send(zmq4.NewMsgString("marker")))
		if string(r.next(t).Frames[0]) == "marker" {
			break
		}
	}

	require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte("bad"), []byte("seq"), make([]byte, 1000))))
	require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte("a-topic-longer-than-16"), []byte("x"))))
	require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte("good"), []byte("1"))))
	got := r.next(t)
	require.Equal(t, []string{"good", "1"}, []string{string(got.Frames[0]), string(got.Frames[1])})

	require.ErrorIs(t, awaitRefusal(t, refused, ReasonTopicRefused).err, errBad)
	require.ErrorIs(t, awaitRefusal(t, refused, ReasonTopicRefused).err, ErrTopicTooLong)
	st := tr.Stats()
	require.Equal(t, uint64(2), st.Refused[ReasonTopicRefused])
	require.Equal(t, int64(1), st.Open) // the connection stayed open
}

// TestRegisterValidates: negative and too-small limits are refused.
func TestRegisterValidates(t *testing.T) {
	for _, l := range []Limits{{MaxFrame: -1}, {MaxConns: -1}, {HandshakeTimeout: -time.Second}, {MaxCommand: 10}} {
		_, err := Register(l, Policy{})
		require.ErrorIs(t, err, ErrInvalidLimits)
	}
	a, err := Register(Limits{}, Policy{})
	require.NoError(t, err)
	b, err := Register(Limits{}, Policy{})
	require.NoError(t, err)
	require.NotEqual(t, a.scheme, b.scheme)
	require.Equal(t, int64(DefaultMaxFrame), a.lim.MaxFrame)
	require.Equal(t, a.scheme+"://h:1", a.Endpoint("tcp://h:1"))
	require.Equal(t, "ipc://x", a.Endpoint("ipc://x"))
	require.Equal(t, "frame_too_large", ReasonFrameTooLarge.String())
	require.Equal(t, "reason(99)", Reason(99).String())
}

// A peer that stops reading cannot stall zmq4's writer: the write times out and
// the connection is refused.
func TestWriteToAPeerThatStopsReadingTimesOut(t *testing.T) {
	tr, err := Register(Limits{WriteTimeout: 20 * time.Millisecond}, Policy{})
	require.NoError(t, err)
	ours, theirs := net.Pipe() // unbuffered: a write waits for a reader
	defer theirs.Close()
	c := newConn(tr, ours, false, nil)
	c.t.c.open.Add(1) // as the transport does for every connection it opens
	c.out.done = true // past the handshake
	start := time.Now()
	_, err = c.Write(make([]byte, 64))
	require.ErrorIs(t, err, ErrRefused)
	require.Less(t, time.Since(start), 5*time.Second)
	require.EqualValues(t, 1, tr.Stats().Refused[ReasonWriteTimeout])
	_, err = c.Write([]byte{1})
	require.ErrorIs(t, err, ErrRefused, "a refused connection stays refused")
	require.Equal(t, "write_timeout", ReasonWriteTimeout.String())
}
