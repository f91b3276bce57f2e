package selection

import (
	"math"
	"sync"
	"sync/atomic"
)

// rankPressure is a rank's cache pressure (PredictiveCost.EvictionWeight):
// of the device blocks its engine reported storing lately, the share its
// removals matched, each count decayed per event the rank's feed applied.
// The routing applier updates it (a rank's events come from one feed, one
// at a time, but a caller of EventPlane.Apply may race it: mu); decisions
// read it without a lock.
type rankPressure struct {
	mu              sync.Mutex
	stored, removed float64
	share           atomic.Uint64 // float64 bits of min(1, removed / stored)
}

// Pressure's memory and confidence: each event keeps pressureKeep of the
// counts before it (a window of about 50 events), and the share stays 0
// until pressureMinBlocks stored blocks weigh in it.
const (
	pressureKeep      = 0.98
	pressureMinBlocks = 16.0
)

// event counts a stored run of stored device blocks, or a removal of
// removed ones.
func (r *rankPressure) event(stored, removed int) {
	r.mu.Lock()
	r.stored = r.stored*pressureKeep + float64(stored)
	r.removed = r.removed*pressureKeep + float64(removed)
	share := 0.0
	if r.stored >= pressureMinBlocks {
		share = math.Min(1, r.removed/r.stored)
	}
	r.share.Store(math.Float64bits(share)) // under mu: racing events store in order
	r.mu.Unlock()
}

// reset forgets everything (the rank's cache was cleared).
func (r *rankPressure) reset() {
	r.mu.Lock()
	r.stored, r.removed = 0, 0
	r.share.Store(0)
	r.mu.Unlock()
}

// load returns the rank's pressure, in [0, 1]; 0 for a nil r.
func (r *rankPressure) load() float64 {
	if r == nil {
		return 0
	}
	return math.Float64frombits(r.share.Load())
}
