package kvevents

import (
	"context"
	"fmt"

	"github.com/kvselect/kvselect/catalog"
)

// resumeReq is one ResumeSource call waiting for its source's apply goroutine.
type resumeReq struct {
	seq     uint64
	install func()
	done    chan struct{}
}

// ResumeSource makes source wr go on after batch seq, as if it had applied
// every batch up to seq itself: the typical caller has just read a peer's
// index snapshot, which records seq as the last batch the peer applied from
// wr's engine, and wants wr's entries to be the peer's from then on.
//
// On the source's apply goroutine, between two batches, the feed calls install
// instead of Handler.ResetSource (install replaces whatever the Handler holds
// of wr, for instance with the snapshot's blocks of wr), takes seq as the
// watermark and then, with a replay endpoint, asks the engine for every batch
// from seq on and applies those after seq, before any further live batch;
// live batches at or below the watermark are dropped as already applied,
// including those wr applied live before the resume (install wiped them; the
// replay applies them again, in order, onto the snapshot). Outcomes:
//
//   - the replay's first batch is seq: the history is exact, the source
//     continues as the peer's did;
//   - its first batch is beyond seq+1 (the engine's buffer rolled past the
//     snapshot): the batches in between are lost and the source is degraded,
//     as on any gap a replay cannot close;
//   - it returns nothing at or after seq (the engine restarted since, or its
//     stream never reached seq): the snapshot is not this engine's history;
//     the source is reset (Handler.ResetSource) and replays from 0, as after
//     a restart (SourceStats.ResumesRefused);
//   - the replay fails: the installed entries stay, and the live stream
//     decides, as below;
//   - without a replay endpoint: the live stream decides: a next batch
//     numbered seq+1 continues exactly, a later one is a gap (lost,
//     degraded), as on any gap without replay. An engine that restarted
//     between the peer's cut and the resume is then noticed only when its
//     live numbers go back.
//
// A source added before Run resumes first thing when Run starts it, instead
// of its usual replay from 0; so AddSource then ResumeSource before Run
// starts a source from seq. A second ResumeSource before the first ran
// replaces it. The returned channel is closed once the resume, with its
// replay, is done, or once it is dropped: replaced, the source removed or
// replaced by AddSource, or the feed stopped. install must not call the
// Feed. Errors: ErrUnknownSource (wrapped) when the feed has no source wr,
// ErrFeedStopped.
func (f *Feed) ResumeSource(wr catalog.WorkerRank, seq uint64, install func()) (<-chan struct{}, error) {
	if install == nil {
		return nil, fmt.Errorf("%w: ResumeSource of %v with a nil install", ErrInvalidSource, wr)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.state == feedStopped {
		return nil, ErrFeedStopped
	}
	s := f.sources[wr]
	if s == nil {
		return nil, fmt.Errorf("%w: %v", ErrUnknownSource, wr)
	}
	req := &resumeReq{seq: seq, install: install, done: make(chan struct{})}
	s.resumeMu.Lock()
	old := s.resume
	s.resume = req
	s.resumeMu.Unlock()
	if old != nil {
		close(old.done)
	}
	select {
	case s.resumeKick <- struct{}{}:
	default:
	}
	return req.done, nil
}

// takeResume returns the source's pending resume, if any.
func (s *source) takeResume() *resumeReq {
	s.resumeMu.Lock()
	defer s.resumeMu.Unlock()
	req := s.resume
	s.resume = nil
	return req
}

// dropResume closes a resume that will never run (the source stopped).
func (s *source) dropResume() {
	if req := s.takeResume(); req != nil {
		close(req.done)
	}
}

// runResume runs the pending resume, if any, on the apply goroutine; it
// reports whether there was one.
func (s *source) runResume(ctx context.Context, seq *sequencer) bool {
	req := s.takeResume()
	if req == nil {
		return false
	}
	defer close(req.done)
	seq.resume(ctx, req.seq, req.install)
	return true
}

// resume installs a peer's state of the source as of batch at and goes on from
// there (see Feed.ResumeSource).
func (q *sequencer) resume(ctx context.Context, at uint64, install func()) {
	install()
	q.hasWM, q.wm = true, at
	q.st.degraded.Store(false)
	q.st.watermark.Store(at)
	q.st.resumes.Add(1)
	q.suspectRun = 0
	if q.replay == nil {
		return
	}
	found, exact := false, true
	err := q.replay(ctx, at, func(f frame) {
		if f.Seq < at || f.Seq <= q.wm {
			if f.Seq == at {
				found = true
			}
			q.st.stale.Add(1)
			return
		}
		found = true
		if n := q.missing(f.Seq); n > 0 {
			q.lose(n) // the engine's buffer no longer reaches back to at
			exact = false
		}
		q.apply(f.Seq, f.Payload)
	})
	switch {
	case ctx.Err() != nil:
	case err != nil:
		q.st.replaysFailed.Add(1)
		q.log("resume_replay", "kvevents: the replay after a resume failed; the live stream decides", "seq", at, "error", err)
	case !found:
		// Nothing at or after at: this engine's stream is not the one the
		// snapshot recorded (it restarted since). Start over as after a restart.
		q.st.resumesRefused.Add(1)
		q.log("resume_refused", "kvevents: the engine holds nothing from the resumed sequence number on (restarted?); the source starts over", "seq", at)
		q.reset()
		q.replayFrom(ctx, 0, 0)
	case !exact:
		q.st.replaysFailed.Add(1)
	default:
		q.st.replaysOK.Add(1)
	}
}
