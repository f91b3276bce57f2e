package eppserver

import (
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// The degraded mode: when no tokenizer answers, a request is routed on load
// alone rather than refused (DYN_EPP_TOKENIZER_NO_DEGRADE turns it off). It
// is booked as a load-only decision (selection.Request.ISL, its length
// estimated from the body, no tokens): no rank is credited a cached prefix,
// the pick follows the loads and the session, and the booking is settled as
// any other. selection/httproute does the same for a Go gateway.

// degradedLogEvery is how often the degraded mode is logged at most.
const degradedLogEvery = 10 * time.Second

// degradation counts the requests routed in the degraded mode and logs them:
// a WARN the first time, then at most once every degradedLogEvery with the
// count since the previous line. The zero value is ready; it is safe for
// concurrent use.
type degradation struct {
	n atomic.Uint64 // requests routed degraded, ever

	mu    sync.Mutex
	last  time.Time // the last WARN; zero before the first
	since uint64    // degraded requests since the last WARN
}

// Load returns the requests routed in the degraded mode so far.
func (d *degradation) Load() uint64 { return d.n.Load() }

// note counts one degraded request, whose tokenization failed with err,
// and logs it on log when the last line is old enough.
func (d *degradation) note(log *slog.Logger, err error, now time.Time) {
	d.n.Add(1)
	d.mu.Lock()
	d.since++
	if !d.last.IsZero() && now.Sub(d.last) < degradedLogEvery {
		d.mu.Unlock()
		return
	}
	n := d.since
	d.last, d.since = now, 0
	d.mu.Unlock()
	log.Warn("the tokenizer failed; routing on load alone (degraded: no prefix reuse) until it answers",
		"err", err, "count_since_last_line", n)
}
