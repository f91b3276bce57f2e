package kvevents

import (
	"sync/atomic"

	"github.com/kvselect/kvselect/catalog"
)

// SourceStats is a snapshot of one source's counters. Counters only grow during the
// life of a source; a source that is removed and added again starts from zero. Fields
// are read from atomics one by one, so a snapshot taken while batches flow may mix
// values from slightly different instants.
type SourceStats struct {
	// Worker is the source's worker rank.
	Worker catalog.WorkerRank
	// Endpoint is the PUB endpoint dialed, or the bound address for a source that was
	// attributed by a bind listener.
	Endpoint string
	// Bound is true for a source created by a bind listener (engines dial in).
	Bound bool

	// Connected is true while the SUB socket has a live connection to the publisher
	// (dial sources), or while the bind listener serves (bound sources).
	Connected bool
	// Degraded is true when batches of this source are known to be missing from what
	// the Handler received since its last reset: a gap without replay, a failed or
	// truncated replay, or a start (or resync) in the middle of the stream without a
	// complete replay. It clears when the source is reset (engine restart, overflow).
	Degraded bool

	// Received counts live batches taken off the socket with a well-formed frame.
	Received uint64
	// Applied counts HandleBatch calls (live and replayed).
	Applied uint64
	// Stale counts batches dropped because their seq was already applied (live
	// batches covered by a replay, duplicates in a replay).
	Stale uint64
	// FramesSkipped counts messages with a bad frame layout, live or replayed.
	FramesSkipped uint64
	// Gaps counts missing ranges detected, including a start in the middle of a stream.
	Gaps uint64
	// LostBatches counts batches known to be missing and not recovered by a replay.
	LostBatches uint64
	// ReplaysOK counts replays that delivered exactly the requested range;
	// ReplaysFailed counts the others (dial or timeout error, late start, holes,
	// truncation).
	ReplaysOK, ReplaysFailed uint64
	// Suspect counts live batches dropped because they were numbered more than
	// 100000 beyond the watermark (see the package documentation); Jumps counts
	// the runs of them that were confirmed (each followed by a ResetSource).
	Suspect, Jumps uint64
	// Restarts counts sequence regressions (the engine restarted), each followed by a
	// ResetSource.
	Restarts uint64
	// Overflows counts queue overflows, each followed by a ResetSource and a resync;
	// Dropped counts the batches discarded by them.
	Overflows, Dropped uint64
	// Reconnects counts successful SUB connections after the first (dial sources).
	Reconnects uint64
	// Resumes counts Feed.ResumeSource calls run; ResumesRefused those whose
	// engine held nothing from the resumed seq on (each followed by a
	// ResetSource).
	Resumes, ResumesRefused uint64

	// LastSeq is the last live seq received; meaningful when Received > 0.
	LastSeq uint64
	// Watermark is the last seq applied; meaningful when Applied > 0.
	Watermark uint64
	// Queued is the number of items waiting in the source's queue.
	Queued int
}

// counters are a source's statistics. They are written by the source's goroutines and
// read by Stats with atomic loads only: no lock on the hot path.
type counters struct {
	received, applied, stale, framesSkipped  atomic.Uint64
	gaps, lost, replaysOK, replaysFailed     atomic.Uint64
	restarts, overflows, dropped, reconnects atomic.Uint64
	suspect, jumps                           atomic.Uint64
	resumes, resumesRefused                  atomic.Uint64
	lastSeq, watermark                       atomic.Uint64
	connected, degraded                      atomic.Bool
}

func (c *counters) snapshot(s *SourceStats) {
	s.Connected = c.connected.Load()
	s.Degraded = c.degraded.Load()
	s.Received = c.received.Load()
	s.Applied = c.applied.Load()
	s.Stale = c.stale.Load()
	s.FramesSkipped = c.framesSkipped.Load()
	s.Gaps = c.gaps.Load()
	s.LostBatches = c.lost.Load()
	s.ReplaysOK = c.replaysOK.Load()
	s.ReplaysFailed = c.replaysFailed.Load()
	s.Restarts = c.restarts.Load()
	s.Suspect = c.suspect.Load()
	s.Jumps = c.jumps.Load()
	s.Overflows = c.overflows.Load()
	s.Dropped = c.dropped.Load()
	s.Reconnects = c.reconnects.Load()
	s.Resumes = c.resumes.Load()
	s.ResumesRefused = c.resumesRefused.Load()
	s.LastSeq = c.lastSeq.Load()
	s.Watermark = c.watermark.Load()
}

// BindStats is a snapshot of one bind listener's counters (see Feed.Bind).
type BindStats struct {
	// Endpoint is the endpoint as configured; Addr is the address actually bound.
	Endpoint, Addr string
	// Received counts well-formed live messages; FramesSkipped counts the others.
	Received, FramesSkipped uint64
	// Unattributed counts well-formed messages dropped because no worker rank could be
	// attributed to their topic, the rank belongs to a dial source, or the feed's
	// bound-source limit was reached.
	Unattributed uint64
}
