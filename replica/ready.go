package replica

import (
	"context"
	"time"
)

// Synced reports whether the replica has made its initial sync: it was
// started, its listening window has passed (see listenWindow), and no peer
// heard so far is
// still being snapshotted. Once true it stays true: later gaps and resyncs
// are repaired while the replica serves. When SyncTimeout passes first, it
// becomes true anyway with a WARN naming the peers still syncing (the
// replica then serves on what it holds, as it does in a partition). Both
// bounds run on real time, like the Replicator's timers.
//
// An EPP reports itself ready only once Synced is true, so that a replica
// that joins does not route on a view without its peers' load.
func (r *Replicator) Synced() bool {
	if r.synced.Load() {
		return true
	}
	r.startMu.Lock()
	started, at := r.started, r.startedAt
	r.startMu.Unlock()
	if !started || r.closed.Load() || !r.warmDone() {
		return false
	}
	since := time.Since(at)
	if since < r.listenWindow() {
		return false
	}
	r.pmu.Lock()
	var pending []string
	for _, p := range r.peers {
		if p.syncing {
			pending = append(pending, p.origin)
		}
	}
	r.pmu.Unlock()
	switch {
	case len(pending) == 0:
		if r.synced.CompareAndSwap(false, true) {
			r.log.Info("replica: initial sync done", "took", since.Round(time.Millisecond), "peers", len(r.Peers()))
		}
	case since >= r.o.SyncTimeout:
		if r.synced.CompareAndSwap(false, true) {
			r.st.syncTimeouts.Add(1)
			r.log.Warn("replica: initial sync timed out; serving on what is held so far", "took", since.Round(time.Millisecond), "still_syncing", pending)
		}
	default:
		return false
	}
	return true
}

// listenWindow is how long a starting replica listens before it may count
// the peers it heard as all the live ones (for its initial sync and its warm
// start): two HeartbeatIntervals, so that a peer's heartbeat delayed by up to
// one interval (a loaded machine, a slow link) still lands inside it.
func (r *Replicator) listenWindow() time.Duration { return 2 * r.o.HeartbeatInterval }

// WaitSynced returns nil once Synced is true, or ctx.Err() when ctx ends
// first, or ErrClosed when the Replicator closes first. It checks every
// HeartbeatInterval/8 (at least every 10 ms).
func (r *Replicator) WaitSynced(ctx context.Context) error {
	t := time.NewTicker(max(r.o.HeartbeatInterval/8, 10*time.Millisecond))
	defer t.Stop()
	for !r.Synced() {
		if r.closed.Load() {
			return ErrClosed
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}
