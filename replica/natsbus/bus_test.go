package natsbus_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/replica/natsbus"
)

func TestNewNilConn(t *testing.T) {
	_, err := natsbus.New(nil)
	require.ErrorIs(t, err, natsbus.ErrNilConn)
}

// One publisher's messages arrive in order; after unsubscribe nothing more
// is delivered.
func TestPublishSubscribe(t *testing.T) {
	srv := startServer(t)
	pub, err := natsbus.New(connect(t, srv.ClientURL(), "pub"))
	require.NoError(t, err)
	sub, err := natsbus.New(connect(t, srv.ClientURL(), "sub"))
	require.NoError(t, err)
	got := make(chan string, 100)
	unsub, err := sub.Subscribe("t.ops", func(_ string, data []byte) { got <- string(data) })
	require.NoError(t, err)
	require.NoError(t, sub.Conn().Flush()) // the subscription reached the server
	for i := range 50 {
		require.NoError(t, pub.Publish("t.ops", fmt.Appendf(nil, "m%d", i)))
	}
	for i := range 50 {
		select {
		case m := <-got:
			require.Equal(t, fmt.Sprintf("m%d", i), m)
		case <-time.After(5 * time.Second):
			t.Fatalf("message %d never arrived", i)
		}
	}
	unsub()
	require.NoError(t, pub.Publish("t.ops", []byte("late")))
	require.NoError(t, pub.Conn().Flush())
	require.NoError(t, sub.Conn().Flush())
	require.Empty(t, got)
}

func TestRequestRespond(t *testing.T) {
	srv := startServer(t)
	a, err := natsbus.New(connect(t, srv.ClientURL(), "a"))
	require.NoError(t, err)
	b, err := natsbus.New(connect(t, srv.ClientURL(), "b"))
	require.NoError(t, err)
	ctx := context.Background()

	_, err = a.Request(ctx, "t.snapshot.b", []byte("x"))
	require.ErrorIs(t, err, nats.ErrNoResponders)

	var calls atomic.Int32
	stop, err := b.Respond("t.snapshot.b", func(req []byte) []byte {
		calls.Add(1)
		if string(req) == "silent" {
			return nil
		}
		return append([]byte("re:"), req...)
	})
	require.NoError(t, err)
	require.NoError(t, b.Conn().Flush())
	resp, err := a.Request(ctx, "t.snapshot.b", []byte("x"))
	require.NoError(t, err)
	require.Equal(t, "re:x", string(resp))

	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	_, err = a.Request(short, "t.snapshot.b", []byte("silent"))
	require.ErrorIs(t, err, context.DeadlineExceeded, "a nil answer sends nothing")

	stop()
	require.NoError(t, b.Conn().Flush())
	_, err = a.Request(ctx, "t.snapshot.b", []byte("x"))
	require.ErrorIs(t, err, nats.ErrNoResponders)
	require.Equal(t, int32(2), calls.Load())
}

// WatchConn reports a lost link and its return, and its goroutine ends with
// stop.
func TestWatchConn(t *testing.T) {
	srv := startServer(t)
	px := newProxy(t, srv.Addr().String())
	bus, err := natsbus.New(connect(t, px.url(), "w"))
	require.NoError(t, err)
	states := make(chan bool, 16)
	stop, err := bus.WatchConn(func(up bool) { states <- up })
	require.NoError(t, err)
	next := func() bool {
		select {
		case up := <-states:
			return up
		case <-time.After(5 * time.Second):
			t.Fatal("no connection state reported")
			return false
		}
	}
	px.setCut(true)
	require.False(t, next())
	px.setCut(false)
	require.True(t, next())
	stop()
	stop()
	require.Empty(t, states, "each change reported once")
}
