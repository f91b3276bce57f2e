package zmtpguard

import (
	"bytes"
	"context"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
)

// TestDialSubToPlainPub: a SUB dialing through the guard receives from a plain
// zmq4 PUB, including multi-frame messages and frames at MaxFrame.
func TestDialSubToPlainPub(t *testing.T) {
	const maxFrame = 1 << 20
	tr, _ := guard(t, Limits{MaxFrame: maxFrame}, Policy{})

	pub := newPub(t)
	require.NoError(t, pub.Listen("tcp://127.0.0.1:0"))

	sub := zmq4.NewSub(context.Background(), quiet, zmq4.WithDialerMaxRetries(0))
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	r := newReceiver(t, sub)
	require.NoError(t, sub.Dial(tr.Endpoint("tcp://"+pub.Addr().String())))

	untilReceived(t, pub, r, zmq4.NewMsgString("hello"))
	checkStream(t, pub, r, maxFrame)

	st := tr.Stats()
	require.Equal(t, uint64(1), st.Dialed)
	require.Equal(t, uint64(1), st.Handshakes)
	require.Equal(t, int64(1), st.Open)
	require.Empty(t, st.Refused)
}

// TestListenSubFromPlainPub: a SUB listening through the guard receives from a
// plain zmq4 PUB that dials in.
func TestListenSubFromPlainPub(t *testing.T) {
	const maxFrame = 1 << 20
	tr, _ := guard(t, Limits{MaxFrame: maxFrame}, Policy{})
	_, r, addr := listenSub(t, tr)

	pub := newPub(t)
	require.NoError(t, pub.Dial("tcp://"+addr))
	untilReceived(t, pub, r, zmq4.NewMsgString("hello"))
	checkStream(t, pub, r, maxFrame)

	st := tr.Stats()
	require.Equal(t, uint64(1), st.Accepted)
	require.Equal(t, uint64(1), st.Handshakes)
	require.Empty(t, st.Refused)
}

// checkStream sends small, multi-frame and MaxFrame-sized messages and requires
// them in order.
func checkStream(t *testing.T, pub zmq4.Socket, r *receiver, maxFrame int) {
	t.Helper()
	// Drain the messages untilReceived may have sent twice.
	marker := zmq4.NewMsgString("marker")
	for {
		require.NoError(t, pub.Send(marker))
		if string(r.next(t).Frames[0]) == "marker" {
			break
		}
	}
	big := bytes.Repeat([]byte{0xAB}, maxFrame)
	msgs := []zmq4.Msg{
		zmq4.NewMsgFrom([]byte("kv@pod-a"), []byte{0, 0, 0, 1}, []byte("payload")),
		zmq4.NewMsgFrom([]byte("kv@pod-a"), []byte{}, big),
		zmq4.NewMsgFrom(big[:300], big[:maxFrame-1]),
		zmq4.NewMsgString("last"),
	}
	for _, m := range msgs {
		require.NoError(t, pub.Send(m))
	}
	for _, want := range msgs {
		got := r.next(t)
		require.Equal(t, len(want.Frames), len(got.Frames))
		for i := range want.Frames {
			require.True(t, bytes.Equal(want.Frames[i], got.Frames[i]), "frame %d differs", i)
		}
	}
}

// TestDealerRouter: DEALER and ROUTER talk through the guard both ways round.
func TestDealerRouter(t *testing.T) {
	tr, _ := guard(t, Limits{}, Policy{})
	for _, guardDealer := range []bool{true, false} {
		router := zmq4.NewRouter(context.Background(), quiet)
		dealer := zmq4.NewDealer(context.Background(), quiet, zmq4.WithDialerMaxRetries(0))
		rr := newReceiver(t, router)
		dr := newReceiver(t, dealer)
		if guardDealer {
			require.NoError(t, router.Listen("tcp://127.0.0.1:0"))
			require.NoError(t, dealer.Dial(tr.Endpoint("tcp://"+router.Addr().String())))
		} else {
			require.NoError(t, router.Listen(tr.Endpoint("tcp://127.0.0.1:0")))
			require.NoError(t, dealer.Dial("tcp://"+router.Addr().String()))
		}
		require.NoError(t, dealer.Send(zmq4.NewMsgString("ping")))
		got := rr.next(t)
		require.Len(t, got.Frames, 2)
		require.Equal(t, "ping", string(got.Frames[1]))
		require.NoError(t, router.Send(zmq4.NewMsgFrom(got.Frames[0], []byte("pong"))))
		require.Equal(t, "pong", string(dr.next(t).Frames[0]))
	}
	require.Empty(t, tr.Stats().Refused)
}
