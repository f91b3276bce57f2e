// Package replica lets several replicas of one router (Endpoint Pickers that
// route the same pool) carry the same active load: every replica shares the
// bookings its SelectionService makes and books its peers' into its own, so
// none of them sends a request to a worker the others have just filled.
//
// Only active load is shared: bookings and their settling calls
// (PrefillComplete, Reservations.Renew, Reservations.Free, AddOutputBlocks; a
// Reservations.Move travels as a free and a new booking), and with each
// booking its session (selection.Request.SessionID), which pins the session
// on every peer as on its origin. Each replica builds
// its KV index from the workers' own event streams, and each has its own
// catalog; a peer's booking on a worker a replica does not know yet is not
// applied there (see Refusals).
//
// A Replicator is a selection.BookingObserver. The observer must exist
// before the service is built and the service before the Replicator can book
// into it, hence three steps:
//
//	r, err := replica.New(replica.Options{Bus: bus})
//	svc, err := selection.NewSelectionServiceBuilder(cfg).Observe(r).Build(ctx)
//	err = r.Start(svc)
//	defer r.Close() // before svc.Close
//
// The transport is a Bus (publish/subscribe plus request/reply);
// package replica/natsbus, a module of its own, implements it over NATS.
//
// # Wire
//
// Every message starts with the magic "KVSR" and a version byte (WireVersion)
// and is at most Options.MaxMessageBytes; integers are little-endian, uv is
// an unsigned varint, str a uv length and its bytes (the full grammar is in
// wire.go):
//
//	subject                  message   body
//	<Subject>.ops.<ID>       batch     flags (resync) | origin | epoch u64 | seq uv | ops
//	<Subject>.snapshot.<ID>  request   requester | after (the page cursor: the last id received)
//	                         page      flags (more) | origin | epoch u64 | seq uv (see Ordering) | booked ops
//
//	op booked    id | model | worker | rank | seq hashes (u64 each) | private blocks |
//	             prefill tokens | expected output tokens | lease ms | remaining lease ms |
//	             session
//	op settled   id | settlement (prefill, renew, free, output block)
//
// Every length and number is bounded (strings at 1 KiB, numbers at
// math.MaxInt32, counts by the bytes left), and every decode error is one of
// a few sentinels; the decoders are fuzzed. A batch whose origin is not the
// replica its subject names is refused ("origin_mismatch"): on a broker that
// lets each replica publish only on its own subject (natsbus.ReplicaPermissions)
// no replica can speak for another.
//
// # Ordering
//
// A replica's batches carry its ID, its epoch (its start time in milliseconds
// above 16 random bits, so a restarted replica is a new, larger epoch) and a
// sequence number that grows by one per batch. One goroutine publishes, so
// batches leave in sequence order, and the Bus keeps one publisher's order.
// A heartbeat is a batch without ops carrying the last sequence number; it
// goes every HeartbeatInterval.
//
// A receiver follows each peer (origin, epoch):
//
//   - the next batch (last+1) is applied: ReplicaPlane.Book and ReplicaPlane.Settle into the
//     service, in order;
//   - a heartbeat or batch at or below last changes nothing;
//   - a gap (a batch beyond last+1, a heartbeat beyond last, an unknown peer
//     whose stream is past its start) or a batch flagged resync starts a
//     snapshot of that peer (a resync asked while one is in flight, another
//     once it is applied);
//   - a larger epoch means the peer restarted: its old bookings are freed and
//     the new epoch is followed from its start; a smaller one is ignored;
//   - once a peer's stream is followed (a batch applied in order, or a
//     snapshot taken), a sequence number more than MaxSeqJump beyond its last
//     batch is refused ("implausible_seq") and moves nothing.
//
// Nothing a peer's stream says moves state without a check: a snapshot is
// asked of the peer itself, and its answer wins over the stream. Its first
// page's epoch is the one followed (a forged restart is undone,
// "implausible_epoch"), and every sequence number heard before the
// snapshot was asked is superseded by it (a batch published by then is at or
// below the first page's sequence number, so a higher one heard then was
// never sent by the peer, and is forgotten rather than chased). Repairs of
// one peer that follow each other back off from the third on (1, 2, 4, then 8
// HeartbeatIntervals; Stats.RepairBackoffs), so a stream that keeps claiming
// batches it never sends costs a snapshot every few seconds.
//
// A snapshot is requested on the peer's snapshot subject, in pages of at most
// MaxMessageBytes, each answering "my live bookings with ids after this
// cursor, in id order". Each page carries the sequence number S it is exactly
// consistent with: that of the batch that will carry the last op queued when
// its ids are collected, read under the lock that queues ops, which seals the
// pending ops there (a batch ends at S; later ops go in later batches). So a
// page shows what the batches up to S leave, and nothing of a batch after S
// (a booking freed while the page is encoded is left out: its free is after S
// and finds nothing). The taker frees every booking it held of the peer,
// books the pages' entries with their remaining lease as the first deadline
// (a renewal then extends a copy by the whole lease, as it does the original;
// prefill tokens left out once prefilled), and meanwhile buffers the peer's batches. Once the last
// page is in and the buffered batches reach the highest page's S without a
// hole (it waits for them), it replays them in order, each op only over an id
// whose page is older than the op's batch. A hole, or a sequence number heard
// and never applied, starts another snapshot at once. A failed request is
// retried every HeartbeatInterval while the peer is heard from. Each peer's
// snapshot is taken on a goroutine of its own (at most 64 at once), each
// page bounded by SnapshotTimeout and the whole by SnapshotDeadline, so one
// slow peer delays no other's repair.
//
// So no op is applied twice over a snapshot, and a booking a page shows freed
// is never booked again, neither by its replayed booked op nor by a batch
// after the snapshot, even when its free never reached the stream (dropped
// by an overflow). That is what lets a snapshot be taken while the peer keeps
// booking, and be paged. The ops are idempotent on the receiver besides: a
// booking already held is not booked twice (Stats.Duplicates), a settling
// call on a booking not held is ignored, a second prefill is a no-op and a
// renewal only extends.
//
// # Deciding in the same instant
//
// Shared bookings still arrive up to a batch and a delivery late, so
// replicas that decide in the same instant (a burst the gateway spreads
// over them) cannot see each other's choices. A Replicator tells its service
// whom it hears (selection.ReplicaPlane.SetPeers: the peers' number, its
// own place among all of them by replica id, and twice BatchInterval as the
// window within which bookings do not see each other), so that a burst's
// requests price the bookings their peers are making meanwhile
// (selection.Peers), or, with Options.HoldBursts, wait for them. It says
// so again whenever a peer joins or is dropped.
//
// # Silence, leases and partitions
//
// A peer with no message for PeerTimeout has all its bookings freed, at most
// one HeartbeatInterval later (so within PeerTimeout + HeartbeatInterval of
// its last message). Every remote booking also carries its lease: it
// expires by itself if its Free never arrives.
//
// When the Bus reports its connection lost (ConnWatcher), the replica keeps
// routing on its own bookings and on what it holds of its peers, and reports
// itself degraded (Stats.Degraded, a WARN line). When the connection is
// back, it asks every peer for a snapshot and flags its next batch resync so
// that every peer takes one of it. A partition longer than PeerTimeout
// drops peers on both sides; they rejoin as unknown peers with a stream
// past its start, which is a gap.
//
// # Initial sync
//
// A replica that starts reports itself Synced once it has listened for two
// HeartbeatIntervals (every live peer heartbeats within it, even one
// interval late) and every
// peer it heard has been snapshotted; or, with a WARN, once SyncTimeout has
// passed. It serves before that (a decision never waits for the bus); an EPP
// holds its readiness until then, so that a gateway does not send it
// requests while it sees none of its peers' load.
//
// # Warm start
//
// A replica with KV events (without, there is nothing to warm) also warms
// its index before it is Synced: in Start it listens for the same two
// HeartbeatIntervals, then asks the peers it heard, in random order, for
// their index on <Subject>.index.<ID>. Only a replica
// that is itself Synced answers (the others say so at once, so replicas that
// all start together all start cold, waiting on nobody). The peer takes one
// cut of its service (selection.EventPlane.WriteSnapshot: every
// model's index and each event source's last applied batch), encodes it
// once per transfer (at most 2 at once, each at most MaxIndexBytes; dropped
// after 4 x SnapshotTimeout + HeartbeatInterval without a request) and serves
// it by offset in chunks of at most MaxMessageBytes:
//
//	<Subject>.index.<ID>     index request  requester | flags (release) | transfer u64 (0: new) | offset uv
//	                         index chunk    status | origin | transfer u64 | total uv | total CRC-32C |
//	                                        offset uv | data | data CRC-32C
//
// The joiner refuses and counts a chunk whose checksum, offset or transfer
// does not match (asked again 3 times, then the next peer), checks the whole
// transfer's checksum, and loads it (EventPlane.LoadSnapshot): each source it also
// follows gets the peer's entries and resumes its feed from the recorded
// batch, replaying the engine from there. Synced waits for that, or for
// WarmTimeout, past which the replica starts cold with a WARN. Stats.Warm
// counts all of it.
//
// # Refusals and bounds
//
// Peers' ops that cannot be applied are counted by reason (Stats.Refused),
// never retried: a booking on a worker this service does not know yet
// (discovery behind) stays unapplied until the next snapshot of that peer,
// and its settling calls are ignored. The request path never waits for the
// bus: Booked and Settled copy the op into a pending buffer of at most
// PendingMax ops; when the publisher cannot keep up, further ops are dropped
// from the stream (Stats.Overflow, one WARN per episode) but kept in the
// local table, and the next batch asks the peers for a snapshot, which
// carries them. A replica follows at most MaxPeers peers and buffers a
// bounded tail while it takes a snapshot. One peer holds at most
// MaxPeerBookings bookings of at most MaxPeerBlocks blocks in all in the
// service (beyond: "peer_full"), each with a lease of at most the service's
// own (selection.ReplicaPlane.LeaseLimit), so no peer, real or forged,
// can grow a replica's memory past that or pin a worker's load longer than
// a local booking. Log lines of one kind are limited to 10 a minute,
// whatever peer they name.
//
// # Concurrency
//
// A Replicator is safe for concurrent use. Booked and Settled (on the
// service's request path) take one short lock: Booked copies the booking's
// hashes once, into its entry of the live-booking table (entries are reused),
// and both queue an op in a reused buffer, so neither allocates in the steady
// state. An entry freed before its op is published is reused only after the
// flush that publishes it. A snapshot page is encoded under the same lock
// (at most MaxMessageBytes). Start begins four goroutines, all stopped and
// waited for by Close:
//
//	publisher         batches (BatchInterval, BatchMax), heartbeats, the final flush
//	watchdog          every HeartbeatInterval: silent peers, snapshot retries, expired leases
//	snapshot taker    starts each peer's snapshot on a goroutine of its own
//	                  (at most 64 at once), and waits for them
//	warm start        the warm start (bounded by WarmTimeout), then every
//	                  HeartbeatInterval: expires idle served index transfers
//
// Bus callbacks (batches, snapshot requests, connection changes) run on the
// Bus's goroutines; they are admitted only until Close begins, and Close
// waits for those running. The peers' state has its own lock, separate from
// the request path's; neither is held while the other is taken.
//
// # Invariants
//
//   - What a replica holds of a peer is the peer's live bookings as of some
//     batch of the peer's stream, less the refused ones (while a snapshot is
//     taken, each page's range as of its own batch); after a snapshot and
//     once the stream is quiet, exactly the peer's live bookings.
//   - A booking is never applied after its free, or after a snapshot that
//     shows it freed, for one (origin, epoch).
//   - A remote booking is freed when its origin frees it, when its lease
//     passes, when its origin is silent for PeerTimeout, restarts, or is
//     snapshotted without it, and when the Replicator closes.
//   - A replica never applies its own batches, nor a peer's batch twice.
package replica
