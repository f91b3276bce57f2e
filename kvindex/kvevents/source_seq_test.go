package kvevents

import (
	"context"
	"errors"
	"testing"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

// fakeReplay serves seqs from a fixed list, the way an engine's buffer would.
type fakeReplay struct {
	have  []uint64 // buffered seqs, ascending
	err   error    // returned after serving
	asked []uint64
}

func (r *fakeReplay) fn(ctx context.Context, start uint64, yield func(frame)) error {
	r.asked = append(r.asked, start)
	for _, s := range r.have {
		if s >= start {
			yield(frame{Seq: s, Payload: payloadFor(s)})
		}
	}
	return r.err
}

func newTestSequencer(t *testing.T, rp *fakeReplay) (*sequencer, *batchRecorder, *counters) {
	rec := newBatchRecorder(t)
	st := &counters{}
	q := &sequencer{src: catalog.WorkerRank{WorkerID: "w"}, h: rec, st: st}
	if rp != nil {
		q.replay = rp.fn
	}
	return q, rec, st
}

func feedLive(q *sequencer, seqs ...uint64) {
	for _, s := range seqs {
		q.handle(context.Background(), item{seq: s, payload: payloadFor(s)})
	}
}

func TestSequencer(t *testing.T) {
	src := catalog.WorkerRank{WorkerID: "w"}
	type want struct {
		applied                []uint64
		resets                 int
		gaps, lost, stale      uint64
		replaysOK, replaysFail uint64
		restarts               uint64
		suspect, jumps         uint64
		degraded               bool
		asked                  []uint64
	}
	cases := []struct {
		name    string
		replay  *fakeReplay
		maxJump uint64
		live    []uint64
		resync  bool // send a resync marker after live
		after   []uint64
		want    want
	}{
		{name: "in order", live: seqRange(0, 4), want: want{applied: seqRange(0, 4)}},
		{name: "gap without replay", live: []uint64{0, 1, 5, 6}, want: want{
			applied: []uint64{0, 1, 5, 6}, gaps: 1, lost: 3, degraded: true}},
		{name: "join mid-stream without replay", live: []uint64{7, 8}, want: want{
			applied: []uint64{7, 8}, gaps: 1, lost: 7, degraded: true}},
		{name: "gap repaired by replay", replay: &fakeReplay{have: seqRange(0, 9)},
			live: []uint64{0, 1, 5, 6, 7}, want: want{
				applied: seqRange(0, 9), gaps: 1, stale: 3, replaysOK: 1, asked: []uint64{2}}},
		{name: "join mid-stream repaired", replay: &fakeReplay{have: seqRange(0, 3)},
			live: []uint64{3, 4}, want: want{
				applied: seqRange(0, 4), gaps: 1, stale: 1, replaysOK: 1, asked: []uint64{0}}},
		{name: "replay started late", replay: &fakeReplay{have: seqRange(4, 6)},
			live: []uint64{0, 1, 6}, want: want{
				applied: []uint64{0, 1, 4, 5, 6}, gaps: 1, lost: 2, stale: 1, replaysFail: 1, degraded: true, asked: []uint64{2}}},
		{name: "replay truncated", replay: &fakeReplay{have: []uint64{2, 3}},
			live: []uint64{0, 1, 7}, want: want{
				applied: []uint64{0, 1, 2, 3, 7}, gaps: 1, lost: 3, replaysFail: 1, degraded: true, asked: []uint64{2}}},
		{name: "replay with a hole", replay: &fakeReplay{have: []uint64{2, 4, 5}},
			live: []uint64{0, 1, 6}, want: want{
				applied: []uint64{0, 1, 2, 4, 5, 6}, gaps: 1, lost: 1, replaysFail: 1, degraded: true, asked: []uint64{2}}},
		{name: "replay error", replay: &fakeReplay{err: errors.New("boom")},
			live: []uint64{0, 3}, want: want{
				applied: []uint64{0, 3}, gaps: 1, lost: 2, replaysFail: 1, degraded: true, asked: []uint64{1}}},
		{name: "restart at zero", live: []uint64{0, 1, 2, 0, 1}, want: want{
			applied: []uint64{0, 1}, resets: 1, restarts: 1}},
		{name: "restart clears degraded", live: []uint64{0, 5, 0, 1}, want: want{
			applied: []uint64{0, 1}, resets: 1, restarts: 1, gaps: 1, lost: 4}},
		{name: "restart mid-stream replays from zero", replay: &fakeReplay{have: seqRange(0, 2)},
			live: []uint64{5, 6, 2}, want: want{
				// 5 joins mid-stream: replay from 0 serves 0-2 and loses 3-4 (buffer
				// is the new engine's); 2 < 6 is then a restart: reset, replay 0-2
				// (so the live 2 is stale).
				applied: []uint64{0, 1, 2}, resets: 1, restarts: 1, gaps: 2, lost: 2, stale: 1,
				replaysOK: 1, replaysFail: 1, asked: []uint64{0, 0}}},
		{name: "first batch numbered 1", live: seqRange(1, 4), want: want{applied: seqRange(1, 4)}},
		{name: "first batch numbered 1 needs no replay", replay: &fakeReplay{have: seqRange(1, 3)},
			live: seqRange(1, 3), want: want{applied: seqRange(1, 3)}},
		{name: "restart at one", live: []uint64{1, 2, 3, 1, 2}, want: want{
			applied: []uint64{1, 2}, resets: 1, restarts: 1}},
		{name: "resync replay of an engine that numbers from 1", replay: &fakeReplay{have: seqRange(1, 5)},
			live: []uint64{1, 2}, resync: true, after: []uint64{5, 6}, want: want{
				applied: seqRange(1, 6), resets: 1, stale: 1, replaysOK: 1, asked: []uint64{0}}},
		{name: "a first batch of 2 is a gap", live: []uint64{2, 3}, want: want{
			applied: []uint64{2, 3}, gaps: 1, lost: 2, degraded: true}},
		{name: "a forged far-ahead seq is dropped and clears nothing", maxJump: 100,
			live: []uint64{0, 1, 1_000_000, 2, 3}, want: want{applied: seqRange(0, 3), suspect: 1}},
		{name: "a jump within the bound is a gap", maxJump: 100,
			live: []uint64{0, 1, 101, 102}, want: want{applied: []uint64{0, 1, 101, 102}, gaps: 1, lost: 99, degraded: true}},
		{name: "a confirmed jump starts over", maxJump: 100,
			live: []uint64{0, 1, 5000, 5001, 5002, 5003}, want: want{
				applied: []uint64{5002, 5003}, resets: 1, suspect: 3, jumps: 1, gaps: 1, lost: 5002, degraded: true}},
		{name: "a confirmed jump replays from 0", maxJump: 100, replay: &fakeReplay{have: seqRange(4990, 5002)},
			live: []uint64{0, 1, 5000, 5001, 5002, 5003}, want: want{
				applied: seqRange(4990, 5003), resets: 1, suspect: 3, jumps: 1, gaps: 1, lost: 4990, stale: 1,
				replaysFail: 1, degraded: true, asked: []uint64{0}}},
		{name: "suspects that do not number on are never believed", maxJump: 100,
			live: []uint64{0, 9000, 7000, 9001, 8000, 1}, want: want{applied: []uint64{0, 1}, suspect: 4}},
		{name: "duplicate live batch is stale", live: []uint64{0, 1, 1, 2}, want: want{
			applied: seqRange(0, 2), stale: 1}},
		{name: "resync with replay", replay: &fakeReplay{have: seqRange(0, 5)},
			live: []uint64{0, 1}, resync: true, after: []uint64{5, 6}, want: want{
				applied: seqRange(0, 6), resets: 1, stale: 1, replaysOK: 1, asked: []uint64{0}}},
		{name: "resync without replay", live: []uint64{0, 1}, resync: true, after: []uint64{5, 6}, want: want{
			applied: []uint64{5, 6}, resets: 1, gaps: 1, lost: 5, degraded: true}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			q, rec, st := newTestSequencer(t, tc.replay)
			q.maxJump = tc.maxJump
			feedLive(q, tc.live...)
			if tc.resync {
				q.handle(context.Background(), item{kind: itemResync})
			}
			feedLive(q, tc.after...)
			applied, resets := rec.state(src)
			require.Equal(t, tc.want.applied, applied, "applied since last reset")
			require.Equal(t, tc.want.resets, resets, "resets")
			got := want{
				applied: applied, resets: resets,
				gaps: st.gaps.Load(), lost: st.lost.Load(), stale: st.stale.Load(),
				replaysOK: st.replaysOK.Load(), replaysFail: st.replaysFailed.Load(),
				restarts: st.restarts.Load(), degraded: st.degraded.Load(),
				suspect: st.suspect.Load(), jumps: st.jumps.Load(),
			}
			if tc.replay != nil {
				got.asked = tc.replay.asked
			}
			require.Equal(t, tc.want, got)
		})
	}
}

func TestSequencerSaysWhatHappened(t *testing.T) {
	q, _, _ := newTestSequencer(t, nil)
	q.maxJump = 100
	var kinds []string
	q.note = func(kind, _ string, args ...any) {
		require.Equal(t, "source", args[0])
		kinds = append(kinds, kind)
	}
	feedLive(q, 0, 1, 5, 1_000_000, 6, 2)
	q.handle(context.Background(), item{kind: itemResync})
	// After the restart, 2 is a start in the middle of the new stream: lost.
	require.Equal(t, []string{"lost_batches", "suspect_seq", "restart", "lost_batches", "overflow"}, kinds)
}
