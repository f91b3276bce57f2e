package replica

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"
)

// Defaults of Options.
const (
	DefaultSubject           = "kvselect.replica"
	DefaultBatchInterval     = 2 * time.Millisecond
	DefaultBatchMax          = 256
	DefaultHeartbeatInterval = time.Second
	DefaultSnapshotTimeout   = 2 * time.Second
	DefaultSyncTimeout       = 10 * time.Second
	// DefaultMaxPeerBookings and DefaultMaxPeerBlocks bound what one peer
	// may hold in this replica's service: an EPP has at most 1,024 requests
	// in flight by default, each of a few hundred blocks (512 is an 8k-token
	// prompt of 16-token blocks). A booked block costs the service's ledger
	// about 120 bytes, so one peer holds at most about 64 MB.
	DefaultMaxPeerBookings = 16384
	DefaultMaxPeerBlocks   = 1 << 19
	// DefaultMaxMessageBytes is NATS's default max_payload.
	DefaultMaxMessageBytes = 1 << 20
)

// Bounds of Options: Options.MaxMessageBytes is between MinMessageBytes and
// MessageBytesLimit, BatchMax at most MaxBatchMax, an ID at most MaxIDLen
// characters.
const (
	MinMessageBytes   = 4 << 10
	MessageBytesLimit = 64 << 20
	MaxBatchMax       = 1 << 16
	MaxIDLen          = 64
)

// Options configure a Replicator. The zero value of every field but Bus means
// its default; negative durations and sizes are invalid. New copies the
// options and never changes the caller's value.
type Options struct {
	// Bus carries the traffic. Required. When it also implements ConnWatcher,
	// the Replicator follows its connection (see Stats.Degraded).
	Bus Bus
	// ID names this replica to its peers: 1 to MaxIDLen characters of
	// [A-Za-z0-9_-], unique among the replicas that share a Subject. Default: 16
	// random hex digits. Peers key what they hold of this replica by ID; a
	// replica restarted with the same ID is told apart by its epoch (see the
	// package doc).
	ID string
	// Subject is the prefix of the subjects the replicas share: each
	// replica's booking stream on Subject+".ops."+ID (all of them read with
	// Subject+".ops.*"), its snapshot service on Subject+".snapshot."+ID and
	// its index service on Subject+".index."+ID. Dot-separated tokens of [A-Za-z0-9_-]. Default
	// DefaultSubject. Replicas of one routing group share it; different groups
	// (another pool, another EPP) use different ones.
	Subject string
	// BatchInterval is the least time between two batches that are not full,
	// so the most a booking waits before it is published: a booking that
	// arrives when no batch went out for BatchInterval goes at once, later
	// ones join the next batch. Default 2 ms; at most HeartbeatInterval.
	BatchInterval time.Duration
	// BatchMax is the most operations in one batch: a batch is published as
	// soon as it has that many (or reaches MaxMessageBytes). Default 256, at
	// most MaxBatchMax.
	BatchMax int
	// PendingMax bounds the operations waiting to be published. When the
	// publisher cannot keep up (the bus blocks, or the process starves it of
	// CPU), further operations are not queued: they are counted
	// (Stats.Overflow), logged, and the next batch asks every peer to take a
	// snapshot instead. Default 64 x BatchMax; at least BatchMax. Pending ops
	// are bounded in bytes too, at 4 x MaxMessageBytes encoded.
	PendingMax int
	// HeartbeatInterval is how often the replica tells its peers it lives (an
	// empty batch carrying its last sequence number), and how often it checks
	// its peers for silence. Default 1 s.
	HeartbeatInterval time.Duration
	// PeerTimeout is how long a peer may stay silent before the bookings it
	// made are dropped from this replica's service: they are dropped at most
	// one HeartbeatInterval later, so within PeerTimeout + HeartbeatInterval of
	// the peer's last message. Default 3 x HeartbeatInterval + 1 s; at least 2 x
	// HeartbeatInterval.
	PeerTimeout time.Duration
	// SnapshotTimeout bounds each snapshot request (one page). A failed
	// snapshot is retried every HeartbeatInterval while the peer is heard.
	// Default 2 s.
	SnapshotTimeout time.Duration
	// SnapshotDeadline bounds a whole snapshot of one peer, all its pages:
	// past it the snapshot fails and is retried like a failed page. Each
	// peer's snapshot runs on its own, so a slow one delays no other.
	// Default 8 x SnapshotTimeout; at least SnapshotTimeout.
	SnapshotDeadline time.Duration
	// MaxPeerBookings and MaxPeerBlocks bound what one peer may hold in this
	// replica's service: its live bookings, and their blocks (sequence
	// hashes and private blocks). A booking beyond either is refused
	// (Stats.Refused["peer_full"], a WARN) and not retried, as a booking on
	// an unknown worker is. Defaults DefaultMaxPeerBookings and
	// DefaultMaxPeerBlocks.
	MaxPeerBookings int
	MaxPeerBlocks   int
	// SyncTimeout bounds the initial sync (see Replicator.Synced): past it the
	// replica reports itself synced with a WARN, even if a peer's snapshot is
	// still missing. Default 10 s; at least 2 x HeartbeatInterval.
	SyncTimeout time.Duration
	// MaxMessageBytes bounds every message the replica sends and decodes: a
	// batch, a snapshot page (snapshots larger than this are paged), a
	// request. When the Bus is a PayloadLimiter (natsbus), the broker's own
	// limit (NATS: max_payload) is read at Start and on every reconnection:
	// messages sent stay within it, and when MaxMessageBytes is left 0 the
	// broker's limit is the bound (1 MiB until it is known). Between
	// MinMessageBytes and MessageBytesLimit. A single booking too large for
	// one message is not replicated (Stats.Unsendable).
	MaxMessageBytes int
	// Logger receives state changes (peers joined, restarted and dropped, gaps,
	// snapshots, overflow, degraded). Default: discard. Nothing is logged per
	// booking.
	Logger *slog.Logger
	// HoldBursts tells the service that its callers hold a burst's requests
	// until the bookings of the peers ahead of this replica have arrived,
	// so that it need not price them (selection.Peers.Hold): set it only
	// when every caller that books through the service waits
	// selection.ReplicaPlane.Hold first, as the reference EPP does. Default
	// false: the service prices them.
	HoldBursts bool
	// WarmTimeout bounds the warm start (see the package doc, Warm start):
	// listening for peers, taking a serving peer's index and replaying the
	// engines from it; past it the replica starts cold, with a WARN. Default
	// DefaultWarmTimeout (30 s) or 4 x HeartbeatInterval, the longer;
	// longer than the listening window, 2 x HeartbeatInterval.
	WarmTimeout time.Duration
	// MaxIndexBytes bounds an index snapshot this replica serves (one
	// encoding per transfer, at most 2 at once) or takes. Default
	// DefaultMaxIndexBytes (1 GiB); at least MinMessageBytes.
	MaxIndexBytes int64
	// Now is the clock of lease deadlines and peer silence. It must be safe
	// for concurrent use; give it the service's clock
	// (SelectionServiceBuilder.Clock) so that the bookings a snapshot sends are
	// the ones the service still holds. Default time.Now. Timers (batching,
	// heartbeats) run on real time.
	Now func() time.Time
}

// ErrInvalidOptions is returned by New for options that cannot work; the
// message names every problem.
var ErrInvalidOptions = errors.New("replica: invalid options")

// validID reports whether s is a valid replica ID or subject token.
func validToken(s string, maxLen int) bool {
	if s == "" || len(s) > maxLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

func validSubject(s string) bool {
	if len(s) > 200 {
		return false
	}
	for tok := range strings.SplitSeq(s, ".") {
		if !validToken(tok, 200) {
			return false
		}
	}
	return true
}

// randomID returns 16 random hex digits.
func randomID() string {
	var b [8]byte
	_, _ = io.ReadFull(rand.Reader, b[:])
	return hex.EncodeToString(b[:])
}

// withDefaults returns o with defaults filled in and every problem found.
func (o Options) withDefaults() (Options, error) {
	var probs []string
	bad := func(format string, args ...any) { probs = append(probs, fmt.Sprintf(format, args...)) }
	if o.Bus == nil {
		bad("Bus is nil")
	}
	if o.ID == "" {
		o.ID = randomID()
	} else if !validToken(o.ID, MaxIDLen) {
		bad("ID %q: want 1 to %d characters of [A-Za-z0-9_-]", o.ID, MaxIDLen)
	}
	if o.Subject == "" {
		o.Subject = DefaultSubject
	} else if !validSubject(o.Subject) {
		bad("Subject %q: want dot-separated tokens of [A-Za-z0-9_-], at most 200 characters", o.Subject)
	}
	dur := func(name string, d *time.Duration, def time.Duration) {
		switch {
		case *d < 0:
			bad("%s is %v, want >= 0", name, *d)
		case *d == 0:
			*d = def
		}
	}
	dur("HeartbeatInterval", &o.HeartbeatInterval, DefaultHeartbeatInterval)
	dur("BatchInterval", &o.BatchInterval, DefaultBatchInterval)
	dur("PeerTimeout", &o.PeerTimeout, 3*o.HeartbeatInterval+time.Second)
	dur("SnapshotTimeout", &o.SnapshotTimeout, DefaultSnapshotTimeout)
	dur("SnapshotDeadline", &o.SnapshotDeadline, 8*o.SnapshotTimeout)
	if o.SnapshotDeadline > 0 && o.SnapshotDeadline < o.SnapshotTimeout {
		bad("SnapshotDeadline %v is shorter than SnapshotTimeout %v", o.SnapshotDeadline, o.SnapshotTimeout)
	}
	count := func(name string, n *int, def int) {
		switch {
		case *n < 0:
			bad("%s is %d, want >= 0", name, *n)
		case *n == 0:
			*n = def
		}
	}
	count("MaxPeerBookings", &o.MaxPeerBookings, DefaultMaxPeerBookings)
	count("MaxPeerBlocks", &o.MaxPeerBlocks, DefaultMaxPeerBlocks)
	dur("SyncTimeout", &o.SyncTimeout, max(DefaultSyncTimeout, 2*o.HeartbeatInterval))
	if o.SyncTimeout > 0 && o.SyncTimeout < 2*o.HeartbeatInterval {
		bad("SyncTimeout %v is shorter than 2 x HeartbeatInterval %v", o.SyncTimeout, o.HeartbeatInterval)
	}
	if o.HeartbeatInterval > 0 && o.BatchInterval > o.HeartbeatInterval {
		bad("BatchInterval %v is longer than HeartbeatInterval %v", o.BatchInterval, o.HeartbeatInterval)
	}
	if o.HeartbeatInterval > 0 && o.PeerTimeout > 0 && o.PeerTimeout < 2*o.HeartbeatInterval {
		bad("PeerTimeout %v is shorter than 2 x HeartbeatInterval %v", o.PeerTimeout, o.HeartbeatInterval)
	}
	switch {
	case o.BatchMax < 0 || o.BatchMax > MaxBatchMax:
		bad("BatchMax is %d, want 0 (default) to %d", o.BatchMax, MaxBatchMax)
	case o.BatchMax == 0:
		o.BatchMax = DefaultBatchMax
	}
	switch {
	case o.PendingMax < 0:
		bad("PendingMax is %d, want >= 0", o.PendingMax)
	case o.PendingMax == 0:
		o.PendingMax = 64 * max(o.BatchMax, 1)
	case o.PendingMax < o.BatchMax:
		bad("PendingMax %d is smaller than BatchMax %d", o.PendingMax, o.BatchMax)
	}
	switch {
	case o.MaxMessageBytes == 0:
		o.MaxMessageBytes = DefaultMaxMessageBytes
	case o.MaxMessageBytes < MinMessageBytes || o.MaxMessageBytes > MessageBytesLimit:
		bad("MaxMessageBytes is %d, want %d to %d", o.MaxMessageBytes, MinMessageBytes, MessageBytesLimit)
	}
	o.warmDefaults(bad)
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if len(probs) > 0 {
		return o, fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(probs, "; "))
	}
	return o, nil
}
