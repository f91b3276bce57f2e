package replica

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Stats is a snapshot of a Replicator's counters.
type Stats struct {
	// ID and Epoch name this replica on the wire; Seq is its last batch.
	ID    string
	Epoch uint64
	Seq   uint64
	// MaxMessageBytes is the bound on the messages the replica sends now
	// (Options.MaxMessageBytes, or the broker's, see PayloadLimiter).
	MaxMessageBytes int
	// Degraded is true while the bus reports its connection lost (see
	// ConnWatcher): the replica routes on its own bookings and on what its
	// peers sent before, and resynchronises when the connection is back.
	// Disconnects counts the losses.
	Degraded    bool
	Disconnects uint64
	// Synced is Replicator.Synced as last evaluated; SyncTimeouts is 1 when
	// the initial sync gave up at Options.SyncTimeout.
	Synced       bool
	SyncTimeouts uint64

	// PublishedBatches and PublishedOps count the batches (heartbeats
	// excluded) and ops handed to the bus; Heartbeats the empty batches;
	// PublishErrors the publishes the bus refused (each leaves a gap peers
	// repair with a snapshot).
	PublishedBatches, PublishedOps, Heartbeats, PublishErrors uint64
	// Overflow counts ops dropped because the pending buffer was full
	// (Options.PendingMax); every episode asks the peers to resynchronise.
	// Unsendable counts own bookings too large for one message, never
	// shared.
	Overflow, Unsendable uint64

	// Received counts the peers' messages (batches and heartbeats), Applied
	// the ops applied from them (stream and replay; snapshot entries are
	// counted by SnapshotsTaken).
	Received, Applied uint64
	// Gaps counts sequence gaps seen (a lost batch, a peer joining mid
	// stream, a hole left while a snapshot was taken); Resyncs the peers'
	// requests to be snapshotted (after their overflow or reconnection);
	// RepairBackoffs the repairs delayed because the peer's repairs
	// followed each other (see the package doc, Refusals and bounds).
	Gaps, Resyncs, RepairBackoffs uint64
	// SnapshotsServed counts snapshots sent to peers (PagesServed their
	// pages); SnapshotsTaken the peers' snapshots applied; SnapshotFailures
	// the snapshot requests that failed (retried every HeartbeatInterval).
	SnapshotsServed, PagesServed, SnapshotsTaken, SnapshotFailures uint64
	// DroppedPeers counts peers whose bookings were dropped after
	// PeerTimeout of silence.
	DroppedPeers uint64
	// Duplicates counts peers' bookings already held (a batch replayed over
	// the snapshot that covers it): expected, not an error.
	Duplicates uint64
	// Refused counts peers' ops and messages not applied, by reason:
	// "not_found" (a booking on a worker or rank this service does not know:
	// not retried, see the package doc), "unknown_id" (a settling call on a
	// booking not held here: refused, expired or dropped before),
	// "expired" (no lease left), "invalid" (refused by the service
	// otherwise), "closed" (the service is closed), "malformed"
	// (undecodable), "stale_epoch" (from a replica's earlier run),
	// "too_many_peers" (beyond MaxPeers), "implausible_seq" (a sequence
	// number more than MaxSeqJump beyond the peer's stream: forged, or
	// another process using the peer's ID), "implausible_epoch" (a newer
	// epoch on the stream than the peer's own snapshot shows), "peer_full"
	// (a booking beyond Options.MaxPeerBookings or MaxPeerBlocks),
	// "origin_mismatch" (a batch naming another replica than the subject it
	// came on).
	Refused map[string]uint64
	// IDClashes counts messages of another replica using this replica's ID.
	IDClashes uint64

	// Peers, LocalBookings and RemoteBookings are current: the peers
	// followed, the live local bookings shared, and the peers' bookings held
	// in the service.
	Peers, LocalBookings, RemoteBookings int

	// Warm is the warm start's state and counters.
	Warm WarmStats
}

type reason uint8

const (
	reasonNotFound reason = iota
	reasonUnknown
	reasonExpired
	reasonInvalid
	reasonClosed
	reasonMalformed
	reasonStaleEpoch
	reasonTooManyPeers
	reasonImplausibleSeq
	reasonImplausibleEpoch
	reasonPeerFull
	reasonOriginMismatch
	numReasons
)

var reasonNames = [numReasons]string{
	"not_found", "unknown_id", "expired", "invalid", "closed", "malformed", "stale_epoch", "too_many_peers",
	"implausible_seq", "implausible_epoch", "peer_full", "origin_mismatch",
}

type counters struct {
	batches, ops, heartbeats, publishErrors               atomic.Uint64
	overflow, unsendable                                  atomic.Uint64
	received, applied, gaps, resyncs, repairBackoffs      atomic.Uint64
	snapshotsServed, pagesServed, snapshotsTaken          atomic.Uint64
	snapshotFailures, droppedPeers, duplicates, idClashes atomic.Uint64
	disconnects, syncTimeouts                             atomic.Uint64
	refused                                               [numReasons]atomic.Uint64
}

func (r *Replicator) refuse(why reason) { r.st.refused[why].Add(1) }

// RefusalReasons returns every key Stats.Refused may hold, so that a
// metrics exporter can report each from the start, at 0 until it happens.
func RefusalReasons() []string { return slices.Clone(reasonNames[:]) }

// Stats returns the counters.
func (r *Replicator) Stats() Stats {
	c := &r.st
	s := Stats{
		ID: r.o.ID, Epoch: r.epoch, Seq: r.seq.Load(), MaxMessageBytes: r.sendMax(), Degraded: r.degraded.Load(), Disconnects: c.disconnects.Load(),
		Synced: r.synced.Load(), SyncTimeouts: c.syncTimeouts.Load(),
		PublishedBatches: c.batches.Load(), PublishedOps: c.ops.Load(), Heartbeats: c.heartbeats.Load(),
		PublishErrors: c.publishErrors.Load(), Overflow: c.overflow.Load(), Unsendable: c.unsendable.Load(),
		Received: c.received.Load(), Applied: c.applied.Load(), Gaps: c.gaps.Load(), Resyncs: c.resyncs.Load(), RepairBackoffs: c.repairBackoffs.Load(),
		SnapshotsServed: c.snapshotsServed.Load(), PagesServed: c.pagesServed.Load(),
		SnapshotsTaken: c.snapshotsTaken.Load(), SnapshotFailures: c.snapshotFailures.Load(),
		DroppedPeers: c.droppedPeers.Load(), Duplicates: c.duplicates.Load(), IDClashes: c.idClashes.Load(),
		Refused: map[string]uint64{}, Warm: r.warmStats(),
	}
	for i := range c.refused {
		if n := c.refused[i].Load(); n > 0 {
			s.Refused[reasonNames[i]] = n
		}
	}
	r.mu.Lock()
	s.LocalBookings = len(r.mu.local)
	r.mu.Unlock()
	r.pmu.Lock()
	s.Peers = len(r.peers)
	for _, p := range r.peers {
		s.RemoteBookings += len(p.ids)
	}
	r.pmu.Unlock()
	return s
}

// limiter lets a few log lines of each kind through per minute: a kind
// names a class of event (a peer joined, a peer silent, a snapshot failed),
// never a peer, so that messages under forged origins cannot each buy a line.
// The first line of a minute after some were held back says how many.
type limiter struct {
	mu    sync.Mutex
	kinds map[string]*logWindow
}

type logWindow struct {
	start      time.Time
	lines      int
	suppressed int
}

const (
	logEvery = time.Minute
	// logBurst is how many lines of one kind a minute lets through.
	logBurst = 10
)

// warn logs msg at WARN unless logBurst lines of the same kind went out in
// the last minute.
func (r *Replicator) warn(kind, msg string, args ...any) {
	r.limited(slog.LevelWarn, kind, msg, args...)
}

// limited logs msg at level unless logBurst lines of the same kind went out
// in the last minute.
func (r *Replicator) limited(level slog.Level, kind, msg string, args ...any) {
	now := time.Now()
	r.lim.mu.Lock()
	if r.lim.kinds == nil {
		r.lim.kinds = map[string]*logWindow{}
	}
	w := r.lim.kinds[kind]
	if w == nil {
		if len(r.lim.kinds) >= 256 { // kinds are a fixed set; a bound all the same
			clear(r.lim.kinds)
		}
		w = &logWindow{start: now}
		r.lim.kinds[kind] = w
	}
	if now.Sub(w.start) >= logEvery {
		w.start, w.lines = now, 0
	}
	if w.lines >= logBurst {
		w.suppressed++
		r.lim.mu.Unlock()
		return
	}
	w.lines++
	held := w.suppressed
	w.suppressed = 0
	r.lim.mu.Unlock()
	if held > 0 {
		args = append(args, "suppressed_since_last", held)
	}
	r.log.Log(context.Background(), level, msg, args...)
}
