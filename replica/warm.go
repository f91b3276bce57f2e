package replica

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
)

// Warm start: a replica serves its service's index snapshot to joining
// peers, and a joining replica loads one from a serving peer before it
// reports itself synced (see the package doc, Warm start).

// Defaults and bounds of the warm start.
const (
	// DefaultWarmTimeout bounds a warm start (Options.WarmTimeout).
	DefaultWarmTimeout = 30 * time.Second
	// DefaultMaxIndexBytes bounds an index snapshot served or taken
	// (Options.MaxIndexBytes): the selection package's own bound.
	DefaultMaxIndexBytes = 1 << 30
	// maxIndexTransfers is the most index transfers a replica serves at once
	// (each holds one encoding of its snapshot); further requests are told to
	// wait (busy).
	maxIndexTransfers = 2
	// indexChunkRetries is how often one chunk is asked again after a
	// damaged or inconsistent answer before the peer is given up.
	indexChunkRetries = 3
)

// Errors of a warm start attempt (logged, never returned to a caller).
var (
	errChecksum      = errors.New("replica: checksum mismatch")
	errNotServing    = errors.New("replica: peer not serving")
	errIndexRefused  = errors.New("replica: index transfer refused")
	errIndexTransfer = errors.New("replica: index transfer failed")
)

// WarmStats are the warm start's counters (Stats.Warm).
type WarmStats struct {
	// Done is true once the warm start is over, loaded or cold; Loaded is
	// true when a peer's index was loaded. Cold counts cold starts (no
	// serving peer), Timeouts those that WarmTimeout cut short (WARN).
	Done, Loaded   bool
	Cold, Timeouts uint64
	// From is the peer whose index was loaded; Bytes its size; Resumed and
	// Skipped the event sources resumed from it and left to their feed
	// (selection.IndexLoad).
	From             string
	Bytes            int64
	Resumed, Skipped int
	// ChunksRefused counts chunks this replica refused as a taker (damaged,
	// torn, inconsistent with the transfer); TransfersFailed the transfers
	// given up (a peer not serving is not counted).
	ChunksRefused, TransfersFailed uint64
	// Served counts transfers this replica started for peers, ChunksServed
	// their chunks; ServeRefused the requests it refused, by reason:
	// "not_serving", "busy", "unknown_transfer", "too_large", "failed",
	// "malformed".
	Served, ChunksServed uint64
	ServeRefused         map[string]uint64
}

var serveRefusedNames = [numIndexStatus]string{
	indexNotServing: "not_serving", indexBusy: "busy", indexUnknown: "unknown_transfer",
	indexTooLarge: "too_large", indexFailed: "failed", indexOK: "malformed",
}

// warmState is the Replicator's warm start, taker and server.
type warmState struct {
	done   atomic.Bool
	loaded atomic.Bool

	cold, timeouts, chunksRefused, failed atomic.Uint64
	served, chunksServed                  atomic.Uint64
	serveRefused                          [numIndexStatus]atomic.Uint64

	mu        sync.Mutex
	from      string
	bytes     int64
	resumed   int
	skipped   int
	transfers map[uint64]*transfer
	preparing int // transfers being encoded, counted against maxIndexTransfers
	nextID    uint64
}

// transfer is one encoding served in chunks.
type transfer struct {
	buf  []byte
	crc  uint32
	used time.Time // real time of the last request
}

// warmDone reports whether the warm start is over (loaded, cold or timed
// out): Synced is false before.
func (r *Replicator) warmDone() bool { return r.warm.done.Load() }

func (r *Replicator) indexSubject(id string) string { return r.o.Subject + ".index." + id }

// warmDefaults fills in and checks the warm start's options.
func (o *Options) warmDefaults(bad func(string, ...any)) {
	switch {
	case o.WarmTimeout < 0:
		bad("WarmTimeout is %v, want >= 0", o.WarmTimeout)
	case o.WarmTimeout == 0:
		o.WarmTimeout = max(DefaultWarmTimeout, 4*o.HeartbeatInterval)
	}
	if o.HeartbeatInterval > 0 && o.WarmTimeout > 0 && o.WarmTimeout <= 2*o.HeartbeatInterval {
		bad("WarmTimeout %v is not longer than the listening window, 2 x HeartbeatInterval %v", o.WarmTimeout, o.HeartbeatInterval)
	}
	switch {
	case o.MaxIndexBytes < 0:
		bad("MaxIndexBytes is %d, want >= 0", o.MaxIndexBytes)
	case o.MaxIndexBytes == 0:
		o.MaxIndexBytes = DefaultMaxIndexBytes
	case o.MaxIndexBytes < MinMessageBytes:
		bad("MaxIndexBytes %d is below MinMessageBytes %d", o.MaxIndexBytes, MinMessageBytes)
	}
}

// warmLoop is the goroutine of the warm start: it takes a peer's index (or
// starts cold), then expires idle served transfers every HeartbeatInterval
// until Close.
func (r *Replicator) warmLoop() {
	defer r.wg.Done()
	r.warmStart()
	t := time.NewTicker(r.o.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-r.stop:
			r.warm.mu.Lock()
			clear(r.warm.transfers)
			r.warm.mu.Unlock()
			return
		case <-t.C:
			r.expireTransfers(time.Now())
		}
	}
}

// warmStart listens for the listening window, then asks the peers it heard,
// in random order, for their index until one that is serving sends it; with
// none, or once WarmTimeout has passed, the replica starts cold.
func (r *Replicator) warmStart() {
	defer r.warm.done.Store(true)
	if r.svc.Events().Sources() == nil {
		return // no event feed, no index to warm
	}
	ctx, cancel := context.WithTimeout(r.ctx, r.o.WarmTimeout)
	defer cancel()
	listen := time.NewTimer(r.listenWindow())
	select {
	case <-listen.C:
	case <-ctx.Done():
		listen.Stop()
		return
	}
	peers := r.Peers()
	rand.Shuffle(len(peers), func(i, j int) { peers[i], peers[j] = peers[j], peers[i] })
	for _, p := range peers {
		err := r.takeIndex(ctx, p.ID)
		switch {
		case err == nil:
			return
		case r.ctx.Err() != nil:
			return // closing
		case ctx.Err() != nil:
			r.warm.timeouts.Add(1)
			r.log.Warn("replica: warm start timed out; starting with the index built so far (cold)",
				"warm_timeout", r.o.WarmTimeout, "peer", p.ID, "err", err)
			return
		case errors.Is(err, errNotServing):
			r.log.Debug("replica: peer not serving its index yet", "peer", p.ID)
		default:
			r.warm.failed.Add(1)
			r.log.Warn("replica: index transfer failed; trying another peer", "peer", p.ID, "err", err)
		}
	}
	r.warm.cold.Add(1)
	r.log.Info("replica: no serving peer; cold start", "peers_heard", len(peers))
}

// takeIndex fetches peer's index snapshot chunk by chunk and loads it into
// the service. The first request waits up to what is left of ctx (the peer
// encodes its snapshot for it); the others up to SnapshotTimeout each.
func (r *Replicator) takeIndex(ctx context.Context, peer string) error {
	subj := r.indexSubject(peer)
	var (
		buf              []byte
		tid, total, off  uint64
		crc              uint32
		retries, started = 0, false
	)
	release := func() {
		if started {
			rctx, cancel := context.WithTimeout(r.ctx, r.o.SnapshotTimeout)
			_, _ = r.o.Bus.Request(rctx, subj, appendIndexRequest(nil, indexRequest{requester: r.o.ID, release: true, transfer: tid}))
			cancel()
		}
	}
	defer release()
	for !started || off < total {
		rctx, cancel := ctx, context.CancelFunc(func() {})
		if started {
			rctx, cancel = context.WithTimeout(ctx, r.o.SnapshotTimeout)
		}
		resp, err := r.o.Bus.Request(rctx, subj, appendIndexRequest(nil, indexRequest{requester: r.o.ID, transfer: tid, offset: off}))
		cancel()
		if err != nil {
			return fmt.Errorf("%w: %s at %d of %d bytes: %w", errIndexTransfer, peer, off, total, err)
		}
		c, err := decodeIndexChunk(resp, r.recvMax())
		if err == nil {
			err = r.checkChunk(&c, peer, started, tid, total, crc, off)
		}
		if err != nil {
			r.warm.chunksRefused.Add(1)
			r.warn("index_chunk", "replica: refused an index chunk", "peer", peer, "offset", off, "err", err)
			if retries++; retries > indexChunkRetries {
				return fmt.Errorf("%w: %s: %d bad chunks in a row: %w", errIndexTransfer, peer, retries, err)
			}
			continue
		}
		retries = 0
		switch c.status {
		case indexOK:
		case indexNotServing:
			return errNotServing
		default:
			return fmt.Errorf("%w: %s answered %s", errIndexRefused, peer, serveRefusedNames[c.status])
		}
		if !started {
			started, tid, total, crc = true, c.transfer, c.total, c.crc
			buf = make([]byte, 0, min(total, 64<<20))
		}
		buf = append(buf, c.data...)
		off += uint64(len(c.data))
	}
	if got := crc32.Checksum(buf, castagnoli); got != crc {
		r.warm.chunksRefused.Add(1)
		return fmt.Errorf("%w: %s: %w: %d bytes sum to %#08x, the transfer says %#08x", errIndexTransfer, peer, errChecksum, len(buf), got, crc)
	}
	release()
	started = false
	rep, err := r.svc.Events().LoadSnapshot(ctx, bytes.NewReader(buf))
	if err != nil {
		return fmt.Errorf("%w: %s: %w", errIndexTransfer, peer, err)
	}
	r.warm.mu.Lock()
	r.warm.from, r.warm.bytes, r.warm.resumed, r.warm.skipped = peer, int64(len(buf)), rep.Resumed, rep.Skipped
	r.warm.mu.Unlock()
	r.warm.loaded.Store(true)
	r.log.Info("replica: warm start: loaded a peer's index", "peer", peer, "bytes", len(buf),
		"models", rep.Models, "sources", rep.Sources, "resumed", rep.Resumed, "skipped", rep.Skipped)
	return nil
}

// checkChunk checks a decoded chunk against the transfer so far.
func (r *Replicator) checkChunk(c *indexChunk, peer string, started bool, tid, total uint64, crc uint32, off uint64) error {
	switch {
	case c.origin != peer:
		return fmt.Errorf("%w: chunk from %q", errField, c.origin)
	case c.status != indexOK:
		return nil
	case !started && c.offset != 0:
		return fmt.Errorf("%w: first chunk at %d", errField, c.offset)
	case !started && c.total > uint64(r.o.MaxIndexBytes):
		return fmt.Errorf("%w: a snapshot of %d bytes, MaxIndexBytes is %d", errTooLarge, c.total, r.o.MaxIndexBytes)
	case !started && c.transfer == 0:
		return fmt.Errorf("%w: transfer 0", errField)
	case started && (c.transfer != tid || c.total != total || c.crc != crc):
		return fmt.Errorf("%w: chunk of transfer %d (%d bytes, sum %#08x), want %d (%d bytes, sum %#08x)",
			errField, c.transfer, c.total, c.crc, tid, total, crc)
	case c.offset != off:
		return fmt.Errorf("%w: chunk at %d, want %d", errField, c.offset, off)
	case len(c.data) == 0 && c.offset < c.total:
		return fmt.Errorf("%w: empty chunk at %d of %d", errField, c.offset, c.total)
	}
	return nil
}

// serveIndex answers an index request (the responder on the replica's index
// subject). Only a replica that is synced serves: a joining one that asks a
// peer still joining is told so at once, so replicas that all start together
// all start cold instead of waiting on each other.
func (r *Replicator) serveIndex(req []byte) []byte {
	if !r.enter() {
		return nil
	}
	defer r.leave()
	q, err := decodeIndexRequest(req, r.recvMax())
	if err != nil {
		r.warm.serveRefused[indexOK].Add(1)
		r.warn("malformed", "replica: undecodable index request", "err", err)
		return nil
	}
	now := time.Now()
	c := indexChunk{origin: r.o.ID, transfer: q.transfer, offset: q.offset}
	refuse := func(status byte, msg string, args ...any) []byte {
		r.warm.serveRefused[status].Add(1)
		r.limited(levelOf(status), "index_refused_"+serveRefusedNames[status], msg,
			append([]any{"requester", q.requester}, args...)...)
		c.status, c.offset = status, 0
		return appendIndexChunk(nil, &c)
	}
	if q.release {
		r.warm.mu.Lock()
		delete(r.warm.transfers, q.transfer)
		r.warm.mu.Unlock()
		c.status = indexReleased
		return appendIndexChunk(nil, &c)
	}
	r.expireTransfers(now)
	var t *transfer
	if q.transfer == 0 {
		if !r.Synced() {
			return refuse(indexNotServing, "replica: asked for its index before it is synced; the peer starts elsewhere or cold")
		}
		var status byte
		t, c.transfer, status = r.newTransfer(now)
		if status != indexOK {
			return refuse(status, "replica: index request refused")
		}
	} else {
		r.warm.mu.Lock()
		t = r.warm.transfers[q.transfer]
		if t != nil {
			t.used = now
		}
		r.warm.mu.Unlock()
		if t == nil {
			return refuse(indexUnknown, "replica: index request for a transfer it does not hold (expired?)", "transfer", q.transfer)
		}
	}
	total := uint64(len(t.buf))
	if q.offset > total {
		return refuse(indexUnknown, "replica: index request past the end of its transfer", "offset", q.offset, "total", total)
	}
	end := min(total, q.offset+uint64(r.sendMax()-indexChunkReserve-2*MaxIDLen))
	c.total, c.crc, c.data = total, t.crc, t.buf[q.offset:end]
	r.warm.chunksServed.Add(1)
	return appendIndexChunk(make([]byte, 0, len(c.data)+indexChunkReserve+MaxIDLen), &c)
}

func levelOf(status byte) slog.Level {
	if status == indexNotServing || status == indexBusy {
		return slog.LevelInfo
	}
	return slog.LevelWarn
}

// newTransfer encodes the service's index for a new transfer, unless
// maxIndexTransfers are held or being encoded, or it exceeds MaxIndexBytes.
func (r *Replicator) newTransfer(now time.Time) (*transfer, uint64, byte) {
	r.warm.mu.Lock()
	if len(r.warm.transfers)+r.warm.preparing >= maxIndexTransfers {
		r.warm.mu.Unlock()
		return nil, 0, indexBusy
	}
	r.warm.preparing++
	r.warm.mu.Unlock()
	lw := &limitedBuffer{max: r.o.MaxIndexBytes}
	err := r.svc.Events().WriteSnapshot(lw)
	r.warm.mu.Lock()
	defer r.warm.mu.Unlock()
	r.warm.preparing--
	switch {
	case errors.Is(err, errTooLarge):
		return nil, 0, indexTooLarge
	case err != nil:
		r.log.Warn("replica: writing the index snapshot for a peer failed", "err", err)
		return nil, 0, indexFailed
	}
	if r.warm.transfers == nil {
		r.warm.transfers = map[uint64]*transfer{}
	}
	if r.warm.nextID == 0 {
		r.warm.nextID = rand.Uint64()>>1 + 1
	}
	id := r.warm.nextID
	r.warm.nextID++
	t := &transfer{buf: lw.b.Bytes(), crc: crc32.Checksum(lw.b.Bytes(), castagnoli), used: now}
	r.warm.transfers[id] = t
	r.warm.served.Add(1)
	return t, id, indexOK
}

// transferIdle is how long a served transfer is kept without a request.
func (r *Replicator) transferIdle() time.Duration {
	return 4*r.o.SnapshotTimeout + r.o.HeartbeatInterval
}

// expireTransfers drops served transfers idle for transferIdle.
func (r *Replicator) expireTransfers(now time.Time) {
	r.warm.mu.Lock()
	defer r.warm.mu.Unlock()
	for id, t := range r.warm.transfers {
		if now.Sub(t.used) > r.transferIdle() {
			delete(r.warm.transfers, id)
		}
	}
}

// limitedBuffer is a bytes.Buffer that refuses to grow past max.
type limitedBuffer struct {
	b   bytes.Buffer
	max int64
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	if int64(l.b.Len())+int64(len(p)) > l.max {
		return 0, fmt.Errorf("%w: the index snapshot exceeds MaxIndexBytes %d", errTooLarge, l.max)
	}
	return l.b.Write(p)
}

// warmStats fills s.Warm.
func (r *Replicator) warmStats() WarmStats {
	w := &r.warm
	s := WarmStats{
		Done: w.done.Load(), Loaded: w.loaded.Load(), Cold: w.cold.Load(), Timeouts: w.timeouts.Load(),
		ChunksRefused: w.chunksRefused.Load(), TransfersFailed: w.failed.Load(),
		Served: w.served.Load(), ChunksServed: w.chunksServed.Load(), ServeRefused: map[string]uint64{},
	}
	for i := range w.serveRefused {
		if n := w.serveRefused[i].Load(); n > 0 {
			s.ServeRefused[serveRefusedNames[i]] = n
		}
	}
	w.mu.Lock()
	s.From, s.Bytes, s.Resumed, s.Skipped = w.from, w.bytes, w.resumed, w.skipped
	w.mu.Unlock()
	return s
}
