package replica_test

import (
	"context"
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/reservation"
)

// The tests of this file force, one step at a time, the interleavings of a
// snapshot with the peer's stream in which a booking whose free the snapshot
// already reflects could be booked again by the taker: from the replay of its
// booked op, or from a batch after the snapshot.

// hookedBus is a hub member whose Publish (after delivery) and Request
// (after the answer) call test hooks.
type hookedBus struct {
	*member
	afterPublish atomic.Pointer[func(data []byte)]
	afterRequest atomic.Pointer[func(subject string)]
}

func (b *hookedBus) Publish(subject string, data []byte) error {
	err := b.member.Publish(subject, data)
	if f := b.afterPublish.Load(); f != nil {
		(*f)(data)
	}
	return err
}

func (b *hookedBus) Request(ctx context.Context, subject string, data []byte) ([]byte, error) {
	resp, err := b.member.Request(ctx, subject, data)
	if f := b.afterRequest.Load(); f != nil {
		(*f)(subject)
	}
	return resp, err
}

// batchHeader reads a batch message's flags, sequence number and op count
// (see the grammar in wire.go); ok is false for other messages.
func batchHeader(data []byte) (flags byte, seq, ops uint64, ok bool) {
	if len(data) < 8 || string(data[:4]) != "KVSR" || data[5] != 1 {
		return 0, 0, 0, false
	}
	flags = data[6]
	n, k := binary.Uvarint(data[7:])
	off := 7 + k + int(n) + 8
	seq, k = binary.Uvarint(data[off:])
	ops, _ = binary.Uvarint(data[off+k:])
	return flags, seq, ops, true
}

// gate is a channel closed once, by the test or at its end.
type gate struct {
	ch   chan struct{}
	once sync.Once
}

func newGate(t *testing.T) *gate {
	g := &gate{ch: make(chan struct{})}
	t.Cleanup(g.open)
	return g
}

func (g *gate) open() { g.once.Do(func() { close(g.ch) }) }
func (g *gate) wait() { <-g.ch }
func (g *gate) isOpen() bool {
	select {
	case <-g.ch:
		return true
	default:
		return false
	}
}

// blockBatch makes n's bus hold the publish of its batch seq (before
// delivery) until g opens.
func blockBatch(n *node, seq uint64, g *gate) {
	n.bus.dropIf(func(data []byte) bool {
		if _, s, ops, ok := batchHeader(data); ok && s == seq && ops > 0 {
			g.wait()
		}
		return false
	})
}

func eventually(t *testing.T, cond func() bool, msg string) {
	t.Helper()
	require.Eventually(t, cond, 5*time.Second, 100*time.Microsecond, msg)
}

// An overflow drops x's free while x's booking waits in the pending buffer.
// The flagged batch makes b take a snapshot, served before x's booking has
// its sequence number: the snapshot shows x freed, and x's booking, in a
// batch after it, must not book x again (nothing would ever free it).
func TestSnapshotDoesNotRebookOverflowedFree(t *testing.T) {
	h := newHub()
	var ab *hookedBus
	wrap := func(m *member) replica.Bus { ab = &hookedBus{member: m}; return ab }
	a := newNodeWith(t, h, "a", wrap, func(o *replica.Options) { o.BatchMax, o.PendingMax = 4, 8 })
	b := newNode(t, h, "b", nil)
	rng := rand.New(rand.NewPCG(21, 21))
	a.book(t, rng, 2)
	requireConverged(t, a, b)

	release := a.bus.hold(t)
	seq0 := a.r.Stats().Seq
	a.book(t, rng, 2) // its batch seq0+1 waits in Publish
	eventually(t, func() bool { return a.r.Stats().Seq == seq0+1 }, "the publisher took the booking")
	for range 7 {
		a.book(t, rng, 2)
	}
	x := a.book(t, rng, 2) // the eighth pending op: the batch seq0+3
	require.NoError(t, a.svc.Reservations().Free(reservation.ID(x)))
	require.Equal(t, uint64(1), a.r.Stats().Overflow, "x's free was dropped")

	// The publisher stops right after the flagged batch seq0+2 reached b.
	after := newGate(t)
	hook := func(data []byte) {
		if flags, seq, _, ok := batchHeader(data); ok && seq == seq0+2 && flags&1 != 0 {
			after.wait()
		}
	}
	ab.afterPublish.Store(&hook)
	release()
	eventually(t, func() bool { return a.r.Stats().PagesServed > 0 }, "b asked a for a snapshot")
	after.open()
	require.NoError(t, a.r.Flush())
	requireConverged(t, a, b)
	require.NotContains(t, b.r.RemoteIDs("a"), x)
	require.Zero(t, b.r.Stats().Refused["not_found"])
}

// b reconnects and takes a snapshot of a while x's booking and x's free are
// both pending at a: the snapshot shows x freed. x's booking is published
// next, x's free is held up: b must not hold x in between.
func TestSnapshotDoesNotRebookPendingFree(t *testing.T) {
	h := newHub()
	a := newNode(t, h, "a", func(o *replica.Options) { o.BatchMax = 4 })
	b := newNode(t, h, "b", nil)
	rng := rand.New(rand.NewPCG(22, 22))
	a.book(t, rng, 2)
	requireConverged(t, a, b)

	b.bus.setDown(true)
	release := a.bus.hold(t)
	seq0 := a.r.Stats().Seq
	a.book(t, rng, 2) // the batch seq0+1, held in Publish
	eventually(t, func() bool { return a.r.Stats().Seq == seq0+1 }, "the publisher took the booking")
	var ys []string
	for range 3 {
		ys = append(ys, string(a.book(t, rng, 2)))
	}
	x := a.book(t, rng, 2) // ys and x: the batch seq0+2
	require.NoError(t, a.svc.Reservations().Free(reservation.ID(x)))
	held := newGate(t) // x's free: the batch seq0+3
	blockBatch(a, seq0+3, held)

	b.bus.setDown(false) // b resynchronises: a serves its snapshot now
	eventually(t, func() bool { return slices.Contains(b.r.RemoteIDs("a"), reservation.ID(ys[2])) }, "the snapshot is in")
	published := a.r.Stats().PublishedBatches
	release()
	eventually(t, func() bool { return a.r.Stats().PublishedBatches >= published+2 }, "x's booking is out")
	require.NotContains(t, b.r.RemoteIDs("a"), x, "the snapshot showed x freed; its booking must not come back")
	held.open()
	require.NoError(t, a.r.Flush())
	requireConverged(t, a, b)
	require.NotContains(t, b.r.RemoteIDs("a"), x)
}

// c joins late and takes a paged snapshot of a. Between the first page and
// the next ones, a books x and frees it; x's booking reaches c (buffered),
// x's free is held up. The later pages show x freed: c must not hold x.
func TestPagedSnapshotDoesNotRebookFreeBetweenPages(t *testing.T) {
	h := newHub()
	small := func(o *replica.Options) { o.MaxMessageBytes = replica.MinMessageBytes }
	a := newNode(t, h, "a", small)
	rng := rand.New(rand.NewPCG(23, 23))
	for range 30 {
		a.book(t, rng, 40) // ~360 bytes per entry: ~10 per 4 KiB page
	}
	require.NoError(t, a.r.Flush()) // before c: c joins a stream past its start
	hit, resume := make(chan struct{}), newGate(t)
	var once sync.Once
	hook := func(subject string) {
		if strings.HasSuffix(subject, ".snapshot.a") {
			once.Do(func() { close(hit); resume.wait() })
		}
	}
	wrap := func(m *member) replica.Bus {
		cb := &hookedBus{member: m}
		cb.afterRequest.Store(&hook)
		return cb
	}
	c := newNodeWith(t, h, "c", wrap, small)
	select {
	case <-hit: // c has a's first page, not yet applied
	case <-time.After(5 * time.Second):
		t.Fatal("c took no snapshot of a")
	}
	x := a.book(t, rng, 1)
	require.NoError(t, a.r.Flush()) // x's booking reaches c, which buffers it
	seq := a.r.Stats().Seq
	held := newGate(t)
	blockBatch(a, seq+1, held)
	require.NoError(t, a.svc.Reservations().Free(reservation.ID(x)))
	eventually(t, func() bool { return a.r.Stats().Seq == seq+1 }, "x's free has its batch")
	resume.open()

	local := a.r.LocalIDs()
	eventually(t, func() bool { return slices.Contains(c.r.RemoteIDs("a"), local[len(local)-1]) }, "the last page is in")
	require.NotContains(t, c.r.RemoteIDs("a"), x, "the later pages showed x freed; its booking must not come back")
	require.Greater(t, a.r.Stats().PagesServed, uint64(2), "the snapshot was paged")
	held.open()
	require.NoError(t, a.r.Flush())
	requireConverged(t, a, c)
	require.NotContains(t, c.r.RemoteIDs("a"), x)
}

// c's snapshot of a shows x; before c applies it, an overflow at a drops
// x's free, and a's next batch asks for a snapshot, which c receives while
// its own is in flight. c must take another one: the one it has cannot know
// of the free.
func TestResyncDuringSnapshotTakesAnother(t *testing.T) {
	h := newHub()
	a := newNode(t, h, "a", func(o *replica.Options) { o.BatchMax, o.PendingMax = 4, 8 })
	rng := rand.New(rand.NewPCG(24, 24))
	x := a.book(t, rng, 2)
	a.book(t, rng, 2)
	require.NoError(t, a.r.Flush()) // before c: c joins a stream past its start
	hit, resume := make(chan struct{}), newGate(t)
	var once sync.Once
	hook := func(subject string) {
		if strings.HasSuffix(subject, ".snapshot.a") {
			once.Do(func() { close(hit); resume.wait() })
		}
	}
	wrap := func(m *member) replica.Bus {
		cb := &hookedBus{member: m}
		cb.afterRequest.Store(&hook)
		return cb
	}
	c := newNodeWith(t, h, "c", wrap, nil)
	select {
	case <-hit: // c has a's snapshot, with x, not yet applied
	case <-time.After(5 * time.Second):
		t.Fatal("c took no snapshot of a")
	}
	release := a.bus.hold(t)
	seq0 := a.r.Stats().Seq
	a.book(t, rng, 2)
	eventually(t, func() bool { return a.r.Stats().Seq == seq0+1 }, "the publisher took the booking")
	for range 8 {
		a.book(t, rng, 2)
	}
	require.NoError(t, a.svc.Reservations().Free(reservation.ID(x)))
	require.Equal(t, uint64(1), a.r.Stats().Overflow, "x's free was dropped")
	release()
	require.NoError(t, a.r.Flush()) // the flagged batches reach c
	resume.open()
	requireConverged(t, a, c)
	require.NotContains(t, c.r.RemoteIDs("a"), x)
}
