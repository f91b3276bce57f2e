package kvevents

import (
	"time"

	"github.com/kvselect/kvselect/catalog"
)

// Test accessors: what the tests read or set that production code does not.

// SourceStats returns the counters of one source, and false when wr has none.
func (f *Feed) SourceStats(wr catalog.WorkerRank) (SourceStats, bool) {
	f.mu.Lock()
	s := f.sources[wr]
	f.mu.Unlock()
	if s == nil {
		return SourceStats{}, false
	}
	return s.stats(), true
}

// AllStats returns the counters of every source seen and not forgotten.
func (h *IndexHandler) AllStats() map[catalog.WorkerRank]HandlerStats {
	out := make(map[catalog.WorkerRank]HandlerStats)
	h.sources.Range(func(k, v any) bool {
		out[k.(catalog.WorkerRank)] = v.(*sourceState).snapshot()
		return true
	})
	return out
}

// WithReplayTimeouts returns o with the replay timeouts set (the external tests'
// way to the unexported fields).
func WithReplayTimeouts(o FeedOptions, idle, total time.Duration) FeedOptions {
	o.replayIdleTimeout, o.replayTimeout = idle, total
	return o
}
