package replica

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

// captureBus keeps every published message.
type captureBus struct{ msgs [][]byte }

func (c *captureBus) Publish(_ string, data []byte) error {
	c.msgs = append(c.msgs, append([]byte(nil), data...))
	return nil
}
func (c *captureBus) Subscribe(string, func(string, []byte)) (func(), error) {
	return func() {}, nil
}
func (c *captureBus) Request(context.Context, string, []byte) ([]byte, error) {
	return nil, context.Canceled
}
func (c *captureBus) Respond(string, func([]byte) []byte) (func(), error) { return func() {}, nil }

// A booking freed before it is published, and whose table entry a later
// booking reuses, is still published with its own hashes.
func TestRetiredEntryNotReusedBeforeFlush(t *testing.T) {
	bus := &captureBus{}
	r, err := New(Options{Bus: bus, ID: "a"})
	require.NoError(t, err)
	defer r.Close()
	w := catalog.WorkerRank{WorkerID: "w1"}
	ev := func(id string, h uint64) selection.BookingEvent {
		return selection.BookingEvent{ID: reservation.ID(id), Worker: w, SeqHashes: []uint64{h, h, h}, Lease: time.Minute}
	}
	// Warm the spare list so that the next entry is a recycled one.
	r.Booked(ev("warm", 9))
	r.Settled("warm", selection.SettleFree)
	require.True(t, r.flush())

	r.Booked(ev("x", 1))
	r.Settled("x", selection.SettleFree)
	r.Booked(ev("y", 2)) // must not take x's entry: x's op is not published yet
	require.True(t, r.flush())
	var b wireBatch
	require.NoError(t, decodeBatch(bus.msgs[len(bus.msgs)-1], MessageBytesLimit, &b))
	require.Len(t, b.ops, 3)
	require.Equal(t, []uint64{1, 1, 1}, b.ops[0].hashes, "x is published with its own hashes")
	require.Equal(t, []uint64{2, 2, 2}, b.ops[2].hashes)

	// Once published, the entry is reused.
	r.Booked(ev("z", 3))
	require.Len(t, r.mu.spare, 0, "z took a recycled entry")
}
