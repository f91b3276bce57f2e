package fakeengine

import (
	"context"
	"encoding/binary"
	"slices"

	"github.com/go-zeromq/zmq4"
)

// EndSeq is the sequence number of the replay end marker (-1 as signed 64-bit).
const EndSeq uint64 = 0xffff_ffff_ffff_ffff

// replayEntry is one published batch: its sequence number and its good payload.
// The payload is never modified after it is stored, so it may be shared with
// sockets and snapshots.
type replayEntry struct {
	seq     uint64
	payload []byte
}

// replayRing keeps the last cap batches. Sequence numbers in the ring are
// contiguous and increasing from the oldest to the newest entry. Not safe for
// concurrent use; the Engine's mutex guards it.
type replayRing struct {
	capacity int
	buf      []replayEntry // grows by append up to capacity, then wraps
	start, n int
}

func (r *replayRing) push(e replayEntry) {
	switch {
	case r.n == len(r.buf) && len(r.buf) < r.capacity:
		// Full but allowed to grow: put the entries in order, then append.
		if r.start != 0 {
			r.buf = slices.Concat(r.buf[r.start:], r.buf[:r.start])
			r.start = 0
		}
		r.buf = append(r.buf, e)
		r.n++
	case r.n < len(r.buf):
		r.buf[(r.start+r.n)%len(r.buf)] = e
		r.n++
	default:
		r.buf[r.start] = e
		r.start = (r.start + 1) % len(r.buf)
	}
}

func (r *replayRing) at(i int) replayEntry { return r.buf[(r.start+i)%len(r.buf)] }

// since returns copies of the entry headers with seq >= from, oldest first.
func (r *replayRing) since(from uint64) []replayEntry {
	if r.n == 0 {
		return nil
	}
	first := 0
	if oldest := r.at(0).seq; from > oldest {
		off := from - oldest
		if off >= uint64(r.n) {
			return nil
		}
		first = int(off)
	}
	out := make([]replayEntry, 0, r.n-first)
	for i := first; i < r.n; i++ {
		out = append(out, r.at(i))
	}
	return out
}

// dropBefore forgets entries with seq < before.
func (r *replayRing) dropBefore(before uint64) {
	for r.n > 0 && r.at(0).seq < before {
		r.buf[r.start] = replayEntry{}
		r.start = (r.start + 1) % len(r.buf)
		r.n--
	}
}

func (r *replayRing) clear() {
	clear(r.buf)
	r.buf = r.buf[:0]
	r.start, r.n = 0, 0
}

// oldestNewest reports the sequence range held; ok is false when empty.
func (r *replayRing) oldestNewest() (oldest, newest uint64, ok bool) {
	if r.n == 0 {
		return 0, 0, false
	}
	return r.at(0).seq, r.at(r.n - 1).seq, true
}

// serveReplay answers replay requests on router until ctx is cancelled (Close).
func (e *Engine) serveReplay(ctx context.Context, router zmq4.Socket) {
	for {
		msg, err := router.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			continue
		}
		e.answer(ctx, router, msg.Frames)
	}
}

// answer handles one request as seen by a ROUTER: [identity, "", start_seq(8B BE)].
func (e *Engine) answer(ctx context.Context, router zmq4.Socket, frames [][]byte) {
	e.mu.Lock()
	if len(frames) != 3 || len(frames[1]) != 0 || len(frames[2]) != 8 {
		e.stats.ReplayMalformed++
		e.mu.Unlock()
		return
	}
	e.stats.ReplayRequests++
	if e.dropReplay {
		e.stats.ReplayDropped++
		e.mu.Unlock()
		return
	}
	entries := e.ring.since(binary.BigEndian.Uint64(frames[2]))
	e.mu.Unlock()

	id := frames[0]
	withTopic := e.opts.ReplayLayout == ReplayWithTopic
	send := func(seq uint64, payload []byte, topic []byte) bool {
		if ctx.Err() != nil {
			return false
		}
		var seqb [8]byte
		binary.BigEndian.PutUint64(seqb[:], seq)
		var m zmq4.Msg
		if withTopic {
			m = zmq4.NewMsgFrom(id, []byte{}, topic, seqb[:], payload)
		} else {
			m = zmq4.NewMsgFrom(id, []byte{}, seqb[:], payload)
		}
		return router.Send(m) == nil
	}
	sent := 0
	for _, en := range entries {
		if !send(en.seq, en.payload, e.topic) {
			return
		}
		sent++
	}
	// Count before the end marker goes out, so a client that has seen the marker
	// also sees the counters.
	e.mu.Lock()
	e.stats.ReplayBatchesSent += uint64(sent)
	e.stats.ReplaysAnswered++
	e.mu.Unlock()
	send(EndSeq, []byte{}, []byte{})
}
