package kvevents

import (
	"context"

	"github.com/kvselect/kvselect/catalog"
)

// replayFunc asks a replay server for every buffered batch from start on and calls
// yield for each, in the order received, until the end marker. It returns nil only when
// the end marker arrived.
type replayFunc func(ctx context.Context, start uint64, yield func(frame)) error

// itemKind tells the apply goroutine what a queue item is.
type itemKind uint8

const (
	itemBatch  itemKind = iota // a live batch
	itemResync                 // the queue overflowed: reset the source and resynchronise
)

// item is one entry of a source's bounded queue.
type item struct {
	kind    itemKind
	seq     uint64
	payload []byte
}

// sequencer is the per-source state machine that turns live batches (and replays) into
// in-order Handler calls. It is owned by exactly one goroutine (the source's apply
// goroutine) and is not safe for concurrent use; it publishes what it does through the
// atomic counters only.
//
// Invariants: Handler.HandleBatch is called with strictly increasing seq between two
// ResetSource calls; a seq is never applied twice; a replayed batch is never applied
// after a later live batch (live batches wait in the queue while a replay runs, and
// those at or below the watermark are dropped afterwards).
type sequencer struct {
	src    catalog.WorkerRank
	h      Handler
	replay replayFunc // nil: no replay endpoint
	st     *counters

	hasWM bool   // wm is set: at least one batch applied since the last reset
	wm    uint64 // last applied seq

	hasLive  bool   // lastLive is set
	lastLive uint64 // last live seq taken from the queue (restart detection)

	maxJump uint64 // a live seq more than this beyond the watermark is suspect; 0: never
	// note, when set, logs an event of the stream (rate-limited per kind by
	// the feed); the counters say the same.
	note        func(kind, msg string, args ...any)
	suspectRun  int    // consecutive suspect batches numbering on from each other
	suspectLast uint64 // the last suspect seq
}

// next is the seq the sequencer expects to apply next.
func (q *sequencer) next() uint64 {
	if !q.hasWM {
		return 0
	}
	return q.wm + 1
}

// missing returns how many batches are known to be missing before seq. A source
// with nothing applied since its last reset may start at 0 or at 1: engines number
// their first batch either way (vLLM and SGLang from 0, some vLLM-compatible
// engines from 1), so neither is a gap.
func (q *sequencer) missing(seq uint64) uint64 {
	want := q.next()
	if seq <= want || (!q.hasWM && seq == 1) {
		return 0
	}
	return seq - want
}

// handle processes one queue item.
func (q *sequencer) handle(ctx context.Context, it item) {
	switch it.kind {
	case itemResync:
		q.resync(ctx)
	default:
		q.live(ctx, it.seq, it.payload)
	}
}

// suspect reports whether live batch seq is too far ahead of the watermark to be
// believed, counting it; a run of suspectConfirm such batches, each numbered one
// after the previous, is believed: the source is then reset (its history is
// lost either way) and starts over from seq.
func (q *sequencer) suspect(seq uint64) bool {
	if !q.hasWM || q.maxJump == 0 || seq <= q.wm || seq-q.wm <= q.maxJump {
		q.suspectRun = 0
		return false
	}
	if q.suspectRun > 0 && seq == q.suspectLast+1 {
		q.suspectRun++
	} else {
		q.suspectRun = 1
	}
	q.suspectLast = seq
	q.st.suspect.Add(1)
	if q.suspectRun < suspectConfirm {
		q.log("suspect_seq", "kvevents: dropped a batch numbered far beyond the source's watermark (forged or corrupt?)",
			"seq", seq, "watermark", q.wm, "max_jump", q.maxJump)
		return true
	}
	q.suspectRun = 0
	q.st.jumps.Add(1)
	q.log("seq_jump", "kvevents: the source's sequence jumped far ahead and stayed there; starting over from it", "seq", seq, "watermark", q.wm)
	q.reset()
	q.hasLive = false
	return false
}

// live processes one live batch.
func (q *sequencer) live(ctx context.Context, seq uint64, payload []byte) {
	if q.suspect(seq) {
		return // dropped: neither a gap nor the new restart baseline
	}
	if q.hasLive && seq < q.lastLive {
		// The publisher's sequence went backwards: the engine restarted with an empty
		// cache. Forget what it held and start over from this batch.
		q.st.restarts.Add(1)
		q.log("restart", "kvevents: engine restarted (sequence went back); its index entries are cleared", "seq", seq, "last_seq", q.lastLive)
		q.reset()
	}
	q.hasLive, q.lastLive = true, seq
	if q.hasWM && seq <= q.wm {
		q.st.stale.Add(1) // already applied through a replay
		return
	}
	if n := q.missing(seq); n > 0 {
		q.st.gaps.Add(1)
		if q.replay == nil {
			q.lose(n)
		} else {
			q.replayFrom(ctx, q.next(), seq)
		}
		if q.hasWM && seq <= q.wm {
			q.st.stale.Add(1) // the replay already delivered it
			return
		}
		// A failed or truncated replay has counted what is still missing below seq.
	}
	q.apply(seq, payload)
}

// resync handles a queue overflow: the dropped batches are gone, so the source's state
// is reset and rebuilt from the replay buffer when there is one. Without one, the next
// live batch starts the source again (degraded, since the history before it is lost).
func (q *sequencer) resync(ctx context.Context) {
	q.log("overflow", "kvevents: a source's queue overflowed; its queued batches were dropped and it resynchronises")
	q.reset()
	if q.replay != nil {
		q.replayFrom(ctx, 0, 0)
	}
}

// reset clears the source in the Handler and forgets the watermark. A reset source is
// no longer degraded: nothing of its earlier state remains.
func (q *sequencer) reset() {
	q.h.ResetSource(q.src)
	q.hasWM, q.wm = false, 0
	q.st.degraded.Store(false)
}

// replayFrom replays from start and applies what is new. target, when > 0, is the first
// seq the caller already holds: the replay must cover [start, target) or the rest of
// that range is counted as lost.
func (q *sequencer) replayFrom(ctx context.Context, start, target uint64) {
	exact := true
	err := q.replay(ctx, start, func(f frame) {
		if f.Seq < start || (q.hasWM && f.Seq <= q.wm) {
			q.st.stale.Add(1)
			return
		}
		if n := q.missing(f.Seq); n > 0 {
			// The replay started late (the engine's buffer no longer holds the
			// requested batches) or skipped some: that history is lost.
			q.lose(n)
			exact = false
		}
		q.apply(f.Seq, f.Payload)
	})
	if ctx.Err() != nil {
		return // shutting down: nothing to account
	}
	if n := q.missing(target); n > 0 {
		q.lose(n) // the replay ended (or failed) before reaching target
		exact = false
	}
	if err != nil || !exact {
		q.st.replaysFailed.Add(1)
		return
	}
	q.st.replaysOK.Add(1)
}

// lose records n batches that will never be applied and marks the source degraded.
func (q *sequencer) lose(n uint64) {
	q.log("lost_batches", "kvevents: batches lost (no replay, or the replay fell short); the source is degraded until it resets",
		"lost", n, "watermark", q.wm)
	q.st.lost.Add(n)
	q.st.degraded.Store(true)
}

func (q *sequencer) apply(seq uint64, payload []byte) {
	q.h.HandleBatch(q.src, seq, payload)
	q.hasWM, q.wm = true, seq
	q.st.applied.Add(1)
	q.st.watermark.Store(seq)
}

// log reports one stream event through note, when set.
func (q *sequencer) log(kind, msg string, args ...any) {
	if q.note != nil {
		q.note(kind, msg, append([]any{"source", q.src.String()}, args...)...)
	}
}
