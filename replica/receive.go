package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

// Bounds of what a replica holds for its peers.
const (
	// MaxPeers bounds the peers one replica follows; messages of further
	// origins are refused (Stats.Refused["too_many_peers"]).
	MaxPeers = 1024
	// maxTail bounds the batches buffered while a peer's snapshot is taken
	// (and their bytes, at 8 x MaxMessageBytes); beyond it the snapshot is
	// taken again.
	maxTail = 1024
	// maxSnapshotEntries bounds one peer's snapshot.
	maxSnapshotEntries = 1 << 20
	// MaxSeqJump is how far beyond the last batch applied of a peer a
	// sequence number may be and still be believed, once the peer's stream
	// has been followed (a batch applied in order, or a snapshot): further
	// is refused (Stats.Refused["implausible_seq"]) and moves nothing. A
	// real stream cannot get that far ahead unheard: a peer silent for
	// PeerTimeout is dropped, and then rejoins as a new one.
	MaxSeqJump = 1 << 20
	// maxSnapshotTakers bounds the snapshots taken at once, each of one
	// peer on a goroutine of its own, so that one slow peer delays no
	// other.
	maxSnapshotTakers = 64
)

// peer is what this replica holds of one other replica. Guarded by pmu.
type peer struct {
	origin string
	epoch  uint64
	last   uint64 // the last batch applied
	seen   uint64 // the highest sequence number heard since the snapshot was asked
	heard  int64  // Now's UnixNano of the last message
	ids    map[string]remote
	blocks int // the blocks (hashes and private) of the bookings in ids

	// anchored: a batch was applied in order or a snapshot taken in this
	// epoch, so MaxSeqJump applies.
	anchored bool

	syncing bool
	queued  bool   // in syncQ
	gen     uint64 // bumped to abandon a snapshot in flight
	cancel  func() // cancels the snapshot in flight
	retryAt int64  // after a failed snapshot, or backing off: when the watchdog asks again
	// streak counts repairs begun within repairWindow of the one before;
	// from the third on they back off (see startSyncLocked). repairedAt is
	// when the last one began.
	streak     int
	repairedAt int64
	// The snapshot in progress: each page's range and sequence number, the
	// lowest and highest of those, and whether the last page is in (the
	// snapshot then waits for the stream to reach snapTop).
	marks   []pageMark
	snapSeq uint64
	snapTop uint64
	pagesIn bool
	// again: the peer asked for a snapshot (flagResync) while this one was
	// in flight, which may not show what made it ask: take another after it.
	again    bool
	tail     []tailBatch // batches received while syncing
	tailSize int
	tailLost uint64 // the highest sequence number dropped from the tail
}

// tailBatch is a raw batch received while its peer is synchronising.
type tailBatch struct {
	seq uint64
	raw []byte
}

// pageMark is one page of a snapshot: it holds the ids after the previous
// page's hi up to its own hi (the last page: every id after), as of the
// batch seq.
type pageMark struct {
	hi  string
	seq uint64
}

// pageSeq returns the sequence number of the page of the snapshot in
// progress that holds id's range.
func (p *peer) pageSeq(id string) uint64 {
	m := p.marks
	i := sort.Search(len(m)-1, func(i int) bool { return id <= m[i].hi })
	return m[i].seq
}

// remote is one of the peer's bookings booked into the service.
type remote struct {
	deadline int64
	lease    time.Duration
	blocks   int
}

// Peer is what a replica holds of one peer (Replicator.Peers).
type Peer struct {
	ID    string
	Epoch uint64
	// Seq is the last batch applied.
	Seq uint64
	// Syncing is true while a snapshot of the peer is being taken (or
	// retried).
	Syncing bool
	// Bookings counts the peer's bookings held in the service.
	Bookings int
	// LastHeard is when the peer's last message arrived (Options.Now).
	LastHeard time.Time
}

// onBatch is the subscription callback of the booking stream: subject is
// the publishing replica's own, Subject+".ops."+ID.
func (r *Replicator) onBatch(subject string, data []byte) {
	if !r.enter() {
		return
	}
	defer r.leave()
	r.pmu.Lock()
	defer r.pmu.Unlock()
	b := &r.rx
	if err := decodeBatch(data, r.recvMax(), b); err != nil {
		r.refuse(reasonMalformed)
		r.warn("malformed", "replica: undecodable message on the booking stream", "err", err, "bytes", len(data))
		return
	}
	if subject != r.o.Subject+".ops."+b.origin {
		r.refuse(reasonOriginMismatch)
		r.warn("origin_mismatch", "replica: a batch names another replica than the subject it was published on (forged, or a misconfigured replica)",
			"subject", subject, "origin", b.origin)
		return
	}
	if b.origin == r.o.ID {
		if b.epoch != r.epoch {
			r.st.idClashes.Add(1)
			r.warn("clash", "replica: another replica publishes with this replica's ID; give each replica its own",
				"their_epoch", b.epoch)
		}
		return
	}
	r.st.received.Add(1)
	now := r.o.Now().UnixNano()
	p := r.peers[b.origin]
	if p != nil && b.epoch < p.epoch {
		r.refuse(reasonStaleEpoch)
		return
	}
	if p != nil && b.epoch > p.epoch {
		// A restart, or a forged epoch: the snapshot this starts asks the
		// peer itself, and its answer's epoch is the one followed.
		r.limited(slog.LevelInfo, "restart", "replica: peer restarted", "peer", p.origin, "epoch", b.epoch, "bookings_dropped", len(p.ids))
		r.restartPeerLocked(p, b.epoch)
	}
	if p == nil {
		if len(r.peers) >= MaxPeers {
			r.refuse(reasonTooManyPeers)
			return
		}
		p = &peer{origin: b.origin, epoch: b.epoch, ids: map[string]remote{}}
		r.peers[b.origin] = p
		r.tellPeersLocked()
		r.limited(slog.LevelInfo, "join", "replica: peer joined", "peer", p.origin, "epoch", p.epoch, "seq", b.seq)
	}
	if p.anchored && b.seq > p.last+MaxSeqJump {
		r.refuse(reasonImplausibleSeq)
		r.warn("implausible_seq", "replica: refused a sequence number far beyond the peer's stream (forged, or another process using its ID)",
			"peer", p.origin, "have", p.last, "got", b.seq, "max_jump", MaxSeqJump)
		return
	}
	p.heard = now
	p.seen = max(p.seen, b.seq)
	switch {
	case p.syncing:
		if b.flags&flagResync != 0 {
			r.st.resyncs.Add(1)
			p.again = true
		}
		r.bufferLocked(p, b, data)
		r.finishSyncLocked(p, now)
	case b.flags&flagResync != 0:
		r.st.resyncs.Add(1)
		r.startSyncLocked(p, "resync asked", now)
		r.bufferLocked(p, b, data)
	case b.seq <= p.last:
		// A heartbeat, or a batch already covered.
	case len(b.ops) == 0 || b.seq != p.last+1:
		r.st.gaps.Add(1)
		r.startSyncLocked(p, "gap", now, "have", p.last, "got", b.seq)
		r.bufferLocked(p, b, data)
	default:
		r.applyLocked(p, b.ops, now)
		p.last, p.anchored = b.seq, true
	}
}

// restartPeerLocked follows p's new epoch from its start: its bookings are
// freed and any snapshot in flight abandoned; its repair streak is kept.
func (r *Replicator) restartPeerLocked(p *peer, epoch uint64) {
	r.dropViewLocked(p)
	r.resetSyncLocked(p)
	p.epoch, p.last, p.seen, p.anchored, p.syncing = epoch, 0, 0, false, false
}

// bufferLocked keeps a copy of a batch received while p is synchronising.
func (r *Replicator) bufferLocked(p *peer, b *wireBatch, data []byte) {
	if len(b.ops) == 0 {
		return // a heartbeat: p.seen has its sequence number
	}
	if len(p.tail) >= maxTail || p.tailSize+len(data) > 8*r.recvMax() {
		p.tailLost = max(p.tailLost, b.seq)
		return
	}
	p.tail = append(p.tail, tailBatch{seq: b.seq, raw: append([]byte(nil), data...)})
	p.tailSize += len(data)
}

// applyLocked books and settles a peer's ops in the service.
func (r *Replicator) applyLocked(p *peer, ops []wireOp, now int64) {
	for i := range ops {
		r.applyOpLocked(p, &ops[i], now)
	}
}

// replayLocked applies the ops of p's batch seq, buffered during a snapshot,
// that the snapshot does not show: those on ids of a page older than the
// batch. A page shows exactly the ops of the batches up to its sequence
// number, so an op is never applied twice: above all, a booking the page
// shows freed is not booked again by its replayed op.
func (r *Replicator) replayLocked(p *peer, ops []wireOp, seq uint64, now int64) {
	for i := range ops {
		if o := &ops[i]; seq > p.pageSeq(o.id) {
			r.applyOpLocked(p, o, now)
		}
	}
}

// applyOpLocked books or settles one of p's ops in the service.
func (r *Replicator) applyOpLocked(p *peer, o *wireOp, now int64) {
	r.st.applied.Add(1)
	if o.kind == opBooked {
		r.bookLocked(p, o, now)
		return
	}
	if _, held := p.ids[o.id]; !held {
		r.refuse(reasonUnknown)
		return
	}
	if o.how == selection.SettleOutputBlock && p.blocks >= r.o.MaxPeerBlocks {
		r.refuse(reasonPeerFull) // output growth counts against the bound too
		return
	}
	err := r.svc.Replicas().Settle(p.origin, reservation.ID(o.id), o.how)
	switch {
	case err == nil && o.how == selection.SettleFree:
		r.forgetLocked(p, o.id)
	case err == nil && o.how == selection.SettleRenew:
		h := p.ids[o.id]
		h.deadline = max(h.deadline, now+int64(h.lease))
		p.ids[o.id] = h
	case err == nil && o.how == selection.SettleOutputBlock:
		h := p.ids[o.id]
		h.blocks++
		p.blocks++
		p.ids[o.id] = h
	case err == nil:
	case errors.Is(err, selection.ErrUnknownReservation): // expired here first
		r.forgetLocked(p, o.id)
		r.refuse(reasonUnknown)
	default:
		r.refuse(reasonInvalid)
	}
}

// forgetLocked removes id from what p holds (the service has freed it).
func (r *Replicator) forgetLocked(p *peer, id string) {
	if h, ok := p.ids[id]; ok {
		p.blocks -= h.blocks
		delete(p.ids, id)
	}
}

// bookLocked books one of p's bookings (from the stream or a snapshot) with
// its remaining lease, both at most the service's own lease
// (selection.ReplicaPlane.LeaseLimit), within the peer's bounds
// (Options.MaxPeerBookings, MaxPeerBlocks).
func (r *Replicator) bookLocked(p *peer, o *wireOp, now int64) {
	remaining := time.Duration(o.remainingMS) * time.Millisecond
	if remaining <= 0 {
		r.refuse(reasonExpired)
		return
	}
	if _, held := p.ids[o.id]; held {
		r.st.duplicates.Add(1) // a batch replayed over the snapshot that covers it
		return
	}
	blocks := len(o.hashes) + o.private
	if len(p.ids) >= r.o.MaxPeerBookings || p.blocks+blocks > r.o.MaxPeerBlocks {
		r.refuse(reasonPeerFull)
		r.warn("peer_full", "replica: a peer holds as many bookings as this replica takes from one peer; refusing more",
			"peer", p.origin, "bookings", len(p.ids), "blocks", p.blocks,
			"max_peer_bookings", r.o.MaxPeerBookings, "max_peer_blocks", r.o.MaxPeerBlocks)
		return
	}
	// The copy lives what is left of the original's lease; a renewal extends
	// it by the whole lease, as it does the original. Neither outlives a
	// local booking's lease: a peer cannot pin load for longer.
	limit := r.svc.Replicas().LeaseLimit()
	lease := min(max(time.Duration(o.leaseMS)*time.Millisecond, remaining), limit)
	remaining = min(remaining, limit)
	err := r.svc.Replicas().Book(p.origin, selection.BookingEvent{
		ID: reservation.ID(o.id), Model: o.model, Worker: o.worker, SeqHashes: o.hashes, PrivateBlocks: o.private,
		PrefillTokens: o.prefill, ExpectedOutputTokens: o.expected, Lease: lease, Remaining: remaining,
		Session: o.session,
	})
	switch {
	case err == nil:
		p.ids[o.id] = remote{deadline: now + int64(remaining), lease: lease, blocks: blocks}
		p.blocks += blocks
	case errors.Is(err, selection.ErrConflict):
		// Held already in the service, not in p.ids: cannot happen unless
		// the service kept a copy p dropped; take it back.
		r.st.duplicates.Add(1)
		p.ids[o.id] = remote{deadline: now + int64(remaining), lease: lease, blocks: blocks}
		p.blocks += blocks
	case errors.Is(err, selection.ErrNotFound):
		r.refuse(reasonNotFound)
	case errors.Is(err, selection.ErrClosed):
		r.refuse(reasonClosed)
	default:
		r.refuse(reasonInvalid)
	}
}

// dropViewLocked frees every booking of p held in the service.
func (r *Replicator) dropViewLocked(p *peer) {
	for id := range p.ids {
		_ = r.svc.Replicas().Settle(p.origin, reservation.ID(id), selection.SettleFree)
	}
	if len(p.ids) > 1024 {
		p.ids = map[string]remote{} // a cleared map keeps its buckets
	} else {
		clear(p.ids)
	}
	p.blocks = 0
}

// removePeerLocked forgets p and frees its bookings.
func (r *Replicator) removePeerLocked(p *peer) {
	r.dropViewLocked(p)
	r.resetSyncLocked(p)
	delete(r.peers, p.origin)
	r.tellPeersLocked()
}

// tellPeersLocked tells the service of the peers it now shares bookings
// with (selection.Peers): their number, this replica's place among all
// of them by replica id, and the window within which their bookings and
// its own do not see each other, twice BatchInterval (the most a booking
// waits to be published, and as much again for its delivery). r.pmu is
// held.
func (r *Replicator) tellPeersLocked() {
	pos := 0
	for id := range r.peers {
		if id < r.o.ID {
			pos++
		}
	}
	_ = r.svc.Replicas().SetPeers(selection.Peers{Count: len(r.peers), Position: pos, Window: 2 * r.o.BatchInterval, Hold: r.o.HoldBursts})
}

// repairWindow: a repair begun within it of the one before continues a
// streak; from the third of a streak on, repairs back off (startSyncLocked).
const repairWindow = 4 // x HeartbeatInterval

// startSyncLocked marks p as synchronising and queues a snapshot of it: from
// now on its batches are buffered until the snapshot is in. A peer whose
// repairs follow each other (within repairWindow heartbeats) waits before
// the third and later ones: 1, 2, 4, then 8 HeartbeatIntervals, so that a
// stream that keeps claiming batches it never sends (forged, or a broken
// peer) costs a snapshot every few seconds, not thousands.
func (r *Replicator) startSyncLocked(p *peer, why string, now int64, args ...any) {
	if p.syncing {
		return
	}
	hb := int64(r.o.HeartbeatInterval)
	if p.repairedAt != 0 && now-p.repairedAt < repairWindow*hb {
		p.streak++
	} else {
		p.streak = 0
	}
	p.repairedAt = now
	p.syncing = true
	r.resetSyncLocked(p)
	if p.streak >= 2 {
		wait := hb << min(p.streak-2, 3)
		p.retryAt = now + wait
		r.st.repairBackoffs.Add(1)
		r.warn("repair_backoff", "replica: a peer needs repair after repair; backing off",
			append([]any{"peer", p.origin, "why", why, "streak", p.streak + 1, "wait", time.Duration(wait)}, args...)...)
		return
	}
	r.limited(slog.LevelInfo, "sync", "replica: taking a snapshot of a peer", append([]any{"peer", p.origin, "why", why}, args...)...)
	r.enqueueLocked(p)
}

// resetSyncLocked abandons any snapshot of p in flight and its buffered tail.
func (r *Replicator) resetSyncLocked(p *peer) {
	p.gen++
	if p.cancel != nil {
		p.cancel()
		p.cancel = nil
	}
	p.tail, p.tailSize, p.tailLost, p.retryAt = nil, 0, 0, 0
	p.marks, p.pagesIn, p.again = nil, false, false
}

func (r *Replicator) enqueueLocked(p *peer) {
	if p.queued {
		return
	}
	p.queued = true
	r.syncQ = append(r.syncQ, p.origin)
	select {
	case r.syncKick <- struct{}{}:
	default:
	}
}

// syncLoop is the goroutine that starts snapshots: each queued peer's on a
// goroutine of its own (at most maxSnapshotTakers at once), which it waits
// for before it returns.
func (r *Replicator) syncLoop() {
	defer r.wg.Done()
	var takers sync.WaitGroup
	defer takers.Wait()
	slots := make(chan struct{}, maxSnapshotTakers)
	for {
		select {
		case <-r.stop:
			return
		case <-r.syncKick:
		}
		for r.ctx.Err() == nil {
			select {
			case slots <- struct{}{}:
			case <-r.stop:
				return
			}
			r.pmu.Lock()
			if len(r.syncQ) == 0 {
				r.pmu.Unlock()
				<-slots
				break
			}
			origin := r.syncQ[0]
			r.syncQ = slices.Delete(r.syncQ, 0, 1)
			p := r.peers[origin]
			ok := p != nil && p.syncing && !p.pagesIn
			var ctx context.Context
			var gen uint64
			if p != nil {
				p.queued = false
			}
			if ok {
				// The whole snapshot is bounded; a reset (a restart, a
				// newer snapshot, the peer dropped) cancels it at once.
				var cancel func()
				ctx, cancel = context.WithTimeout(r.ctx, r.o.SnapshotDeadline)
				if p.cancel != nil {
					p.cancel()
				}
				p.cancel, gen = cancel, p.gen
				// What the stream said before the snapshot was asked is
				// superseded by it: every batch heard so far is at or below
				// the sequence number of its first page. A sequence number
				// heard before and above that was never sent by the peer,
				// so it is forgotten here rather than starting another
				// repair.
				p.tail, p.tailSize, p.tailLost, p.seen = nil, 0, 0, 0
			}
			r.pmu.Unlock()
			if !ok {
				<-slots
				continue
			}
			takers.Add(1)
			go func() {
				defer takers.Done()
				defer func() { <-slots }()
				r.syncPeer(ctx, p, gen)
			}()
		}
	}
}

// syncPeer takes a snapshot of p, page by page, under ctx, and replaces p's
// view with it (see the package doc). The first page's epoch is the one
// followed: it comes from the peer itself, where the stream's epoch may be
// forged.
func (r *Replicator) syncPeer(ctx context.Context, p *peer, gen uint64) {
	subject := r.snapSubject(p.origin)
	var page snapPage
	after, first, epoch, entries := "", true, uint64(0), 0
	for {
		pctx, cancel := context.WithTimeout(ctx, r.o.SnapshotTimeout)
		resp, err := r.o.Bus.Request(pctx, subject, appendRequest(nil, r.o.ID, after))
		cancel()
		if err == nil {
			err = r.checkPage(resp, &page, p.origin, after, first, epoch)
		}
		entries += len(page.entries)
		if err == nil && entries > maxSnapshotEntries {
			err = fmt.Errorf("%w: more than %d entries", errField, maxSnapshotEntries)
		}
		r.pmu.Lock()
		if r.peers[p.origin] != p || p.gen != gen || r.ctx.Err() != nil {
			r.pmu.Unlock()
			return // superseded: the peer restarted, was dropped, or we close
		}
		now := r.o.Now().UnixNano()
		if err != nil {
			r.st.snapshotFailures.Add(1)
			r.warn("snapshot_failed", "replica: snapshot failed; retrying", "peer", p.origin, "err", err)
			r.resetSyncLocked(p)
			p.retryAt = now + int64(r.o.HeartbeatInterval)
			r.pmu.Unlock()
			return
		}
		if first {
			if page.epoch != p.epoch {
				if page.epoch < p.epoch {
					// The stream's newer epoch was not the peer's.
					r.refuse(reasonImplausibleEpoch)
					r.warn("implausible_epoch", "replica: a peer's snapshot is of an older epoch than its stream claimed (forged, or another process using its ID)",
						"peer", p.origin, "claimed", p.epoch, "snapshot", page.epoch)
				}
				// What is buffered is of another epoch's stream.
				p.epoch, p.last, p.seen = page.epoch, 0, 0
				p.tail, p.tailSize, p.tailLost = nil, 0, 0
			}
			r.dropViewLocked(p)
			p.snapSeq, p.snapTop, p.marks = page.seq, page.seq, p.marks[:0]
			epoch, first = page.epoch, false
		}
		p.snapSeq, p.snapTop = min(p.snapSeq, page.seq), max(p.snapTop, page.seq)
		var hi string
		if page.more {
			hi = page.entries[len(page.entries)-1].id
		}
		p.marks = append(p.marks, pageMark{hi: hi, seq: page.seq})
		for i := range page.entries {
			r.bookLocked(p, &page.entries[i], now)
		}
		if !page.more {
			p.pagesIn = true
			r.finishSyncLocked(p, now)
			r.pmu.Unlock()
			return
		}
		r.pmu.Unlock()
		after = page.entries[len(page.entries)-1].id
	}
}

// checkPage decodes one snapshot page and checks it continues the snapshot:
// its origin, its epoch after the first page, ids ascending after the cursor.
func (r *Replicator) checkPage(resp []byte, page *snapPage, origin, after string, first bool, epoch uint64) error {
	if err := decodePage(resp, r.recvMax(), page); err != nil {
		return err
	}
	switch {
	case page.origin != origin:
		return fmt.Errorf("%w: page of %q", errField, page.origin)
	case !first && page.epoch != epoch:
		return fmt.Errorf("%w: the peer restarted during the snapshot", errField)
	case page.more && len(page.entries) == 0:
		return fmt.Errorf("%w: an empty page with more to come", errField)
	}
	prev := after
	for i := range page.entries {
		id := page.entries[i].id
		if id <= prev {
			return fmt.Errorf("%w: page ids out of order", errField)
		}
		prev = id
	}
	return nil
}

// finishSyncLocked completes p's snapshot once its last page is in and the
// buffered batches reach, without a hole, the highest page's sequence number:
// it replays each buffered batch over the pages older than it, in order (see
// replayLocked). Until the stream gets there it waits (onBatch calls again);
// a hole (or a batch heard of and lost) starts a new snapshot at once, and
// so, once this one is applied, does a resync asked meanwhile.
func (r *Replicator) finishSyncLocked(p *peer, now int64) {
	if !p.pagesIn {
		return
	}
	top, hole := p.snapSeq, p.tailLost > p.snapSeq
	for i := 0; i < len(p.tail) && !hole; i++ {
		switch s := p.tail[i].seq; {
		case s <= top:
		case s == top+1:
			top = s
		default:
			hole = true
		}
	}
	if hole || p.seen > top {
		r.st.gaps.Add(1)
		p.syncing = false
		r.startSyncLocked(p, "hole after the snapshot", now, "snapshot_seq", top, "heard", max(p.seen, p.tailLost))
		return
	}
	if top < p.snapTop {
		return // a page is newer than the stream heard so far
	}
	for i := range p.tail {
		t := &p.tail[i]
		b := &r.tailRx
		if t.seq <= p.snapSeq || decodeBatch(t.raw, r.recvMax(), b) != nil {
			continue // decoded once already, on arrival
		}
		r.replayLocked(p, b.ops, t.seq, now)
	}
	p.last, p.anchored = top, true
	p.syncing, p.pagesIn = false, false
	if p.cancel != nil {
		p.cancel()
		p.cancel = nil
	}
	p.tail, p.tailSize, p.marks = nil, 0, nil
	r.st.snapshotsTaken.Add(1)
	r.log.Debug("replica: snapshot applied", "peer", p.origin, "seq", top, "bookings", len(p.ids))
	if p.again {
		r.startSyncLocked(p, "resync asked during the snapshot", now)
	}
}

// serveSnapshot answers a peer's snapshot request with one page of the live
// local bookings whose ids follow the request's cursor, in id order.
//
// The page's sequence number S is that of the batch that will carry the last
// op queued when the ids are collected, under the lock that queues ops; the
// ops queued later go in batches after S (pageSeqLocked). So the page shows
// what the batches up to S leave: every booking they leave live (less those
// freed while the page is encoded, whose frees are after S and find nothing
// to free), nothing a batch after S books. The taker replays over the page
// only the batches after S.
func (r *Replicator) serveSnapshot(req []byte) []byte {
	if !r.enter() {
		return nil
	}
	defer r.leave()
	q, err := decodeRequest(req, r.recvMax())
	if err != nil {
		r.refuse(reasonMalformed)
		r.warn("malformed", "replica: undecodable snapshot request", "err", err)
		return nil
	}
	now := r.o.Now().UnixNano()
	r.mu.Lock()
	seq := r.pageSeqLocked()
	ids := make([]string, 0, len(r.mu.local))
	for id, e := range r.mu.local {
		if id > q.after && e.deadline > now {
			ids = append(ids, id)
		}
	}
	r.mu.Unlock()
	slices.Sort(ids)

	limit := r.sendMax() - headerReserve
	body := make([]byte, 0, min(limit, 64<<10))
	count, more := 0, false
	r.mu.Lock()
	for _, id := range ids {
		e := r.mu.local[id]
		if e == nil || e.deadline <= now {
			continue
		}
		b := booked{
			id: id, model: e.model, worker: e.worker, hashes: e.hashes, private: e.private, expected: e.expected,
			leaseMS: int64(e.lease / time.Millisecond), remainingMS: (e.deadline - now + int64(time.Millisecond) - 1) / int64(time.Millisecond),
			session: e.session,
		}
		if !e.prefilled {
			b.prefill = e.prefill
		}
		b.remainingMS = min(b.remainingMS, maxNumber)
		if len(body)+b.size() > limit {
			more = true
			break
		}
		body = appendBooked(body, &b)
		count++
	}
	r.mu.Unlock()
	if q.after == "" {
		r.st.snapshotsServed.Add(1)
	}
	r.st.pagesServed.Add(1)
	out := appendPageHeader(make([]byte, 0, len(body)+headerReserve), more, r.o.ID, r.epoch, seq, count)
	return append(out, body...)
}

// watchLoop is the goroutine that drops silent peers, retries failed
// snapshots and prunes expired bookings, every HeartbeatInterval.
func (r *Replicator) watchLoop() {
	defer r.wg.Done()
	t := time.NewTicker(r.o.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-t.C:
			r.checkPeers()
			r.pruneLocal()
		}
	}
}

// checkPeers drops every peer silent for PeerTimeout, asks again for failed
// snapshots and frees remote bookings whose lease has passed.
func (r *Replicator) checkPeers() {
	now := r.o.Now().UnixNano()
	r.pmu.Lock()
	defer r.pmu.Unlock()
	for _, p := range r.peers {
		if now-p.heard > int64(r.o.PeerTimeout) {
			r.st.droppedPeers.Add(1)
			r.limited(slog.LevelWarn, "silent", "replica: peer silent, its bookings dropped", "peer", p.origin,
				"silent_for", time.Duration(now-p.heard), "bookings", len(p.ids))
			r.removePeerLocked(p)
			continue
		}
		if p.syncing && !p.queued && p.retryAt != 0 && now >= p.retryAt {
			p.retryAt = 0
			r.enqueueLocked(p)
		}
		for id, h := range p.ids {
			if h.deadline <= now {
				_ = r.svc.Replicas().Settle(p.origin, reservation.ID(id), selection.SettleFree)
				r.forgetLocked(p, id)
			}
		}
	}
}

// pruneLocal forgets local bookings whose lease has passed: the service has
// expired them (it tells no observer), and snapshots no longer send them.
func (r *Replicator) pruneLocal() {
	now := r.o.Now().UnixNano()
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, e := range r.mu.local {
		if e.deadline <= now {
			delete(r.mu.local, id)
			r.retireLocked(e)
		}
	}
}

// connChanged follows the bus connection (ConnWatcher).
func (r *Replicator) connChanged(up bool) {
	if !r.enter() {
		return
	}
	defer r.leave()
	if !up {
		if r.degraded.CompareAndSwap(false, true) {
			r.st.disconnects.Add(1)
			r.log.Warn("replica: bus disconnected; routing on local bookings and what peers sent so far (degraded)")
		}
		return
	}
	if !r.degraded.CompareAndSwap(true, false) {
		return
	}
	r.log.Info("replica: bus reconnected; resynchronising with every peer")
	r.followBusPayload()
	r.resync.Store(true)
	select {
	case r.kick <- struct{}{}:
	default:
	}
	now := r.o.Now().UnixNano()
	r.pmu.Lock()
	for _, p := range r.peers {
		if p.syncing { // anew: what is in flight may have missed batches
			r.resetSyncLocked(p)
			r.enqueueLocked(p)
		} else {
			r.startSyncLocked(p, "reconnected", now)
		}
	}
	r.pmu.Unlock()
}

// Peers returns what this replica holds of each peer, sorted by ID.
func (r *Replicator) Peers() []Peer {
	r.pmu.Lock()
	out := make([]Peer, 0, len(r.peers))
	for _, p := range r.peers {
		out = append(out, Peer{ID: p.origin, Epoch: p.epoch, Seq: p.last, Syncing: p.syncing, Bookings: len(p.ids),
			LastHeard: time.Unix(0, p.heard)})
	}
	r.pmu.Unlock()
	slices.SortFunc(out, func(a, b Peer) int {
		switch {
		case a.ID < b.ID:
			return -1
		case a.ID > b.ID:
			return 1
		}
		return 0
	})
	return out
}

// RemoteIDs returns the ids of origin's bookings held in the service, sorted
// (nil for an unknown peer).
func (r *Replicator) RemoteIDs(origin string) []reservation.ID {
	r.pmu.Lock()
	p := r.peers[origin]
	var ids []reservation.ID
	if p != nil {
		ids = make([]reservation.ID, 0, len(p.ids))
		for id := range p.ids {
			ids = append(ids, reservation.ID(id))
		}
	}
	r.pmu.Unlock()
	slices.Sort(ids)
	return ids
}
