package replica

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/selection"
)

// Errors of Start, Flush and Close.
var (
	// ErrClosed: the Replicator was closed.
	ErrClosed = errors.New("replica: closed")
	// ErrStarted: Start was already called.
	ErrStarted = errors.New("replica: already started")
	// ErrNotStarted: Flush before Start.
	ErrNotStarted = errors.New("replica: not started")
)

// Replicator shares one SelectionService's bookings with the replicas of the
// same routing group and books theirs into it (see the package doc). It
// implements selection.BookingObserver: attach it with
// SelectionServiceBuilder.Observe before Build, then Start it with the built
// service.
//
// A Replicator is safe for concurrent use. Booked and Settled, called on the
// service's request path, take one short lock and never block on the bus.
type Replicator struct {
	o       Options
	log     *slog.Logger
	epoch   uint64
	opsSubj string // where this replica publishes its batches
	// msgMax is the bound on the messages this replica sends: its
	// MaxMessageBytes, or less (more, when it was left to its default) as
	// the Bus's broker says on each connection (PayloadLimiter).
	msgMax        atomic.Int64
	followPayload bool // Options.MaxMessageBytes was left 0

	closed atomic.Bool

	// mu guards the request path's state: the live local bookings (the
	// snapshot's source) and the ops waiting for the publisher.
	mu struct {
		sync.Mutex
		local map[string]*localEntry
		// retired holds entries freed since the last flush: a pending op may
		// still read their hashes, so they are recycled into spare only
		// once that flush is done.
		retired     []*localEntry
		spare       []*localEntry
		pend        *pendingBuf
		overflowing bool // ops were dropped since the last flush
		idle        bool // the publisher waits for a kick (see publishLoop)
		// seals are positions in pend at which a snapshot page read the
		// sequence numbers: a batch ends at each (see pageSeqLocked).
		seals []int
		// flushing is true while the publisher publishes out, whose last
		// batch takes the sequence number outEnd.
		flushing bool
		outEnd   uint64
		ends     []int // pageSeqLocked's scratch
	}
	seq      atomic.Uint64 // the last batch sequence number assigned (publisher)
	resync   atomic.Bool   // the next batch asks peers for a snapshot
	degraded atomic.Bool
	synced   atomic.Bool // latched by Synced

	out      *pendingBuf   // the buffer being published (publisher only)
	retired  []*localEntry // the retired entries it may read (publisher only)
	outSeals []int         // a spare seals buffer (publisher only)
	ends     []int         // where out's batches end (publisher only)
	enc      []byte        // the publisher's encoding buffer

	// pmu guards what this replica holds of its peers.
	pmu        sync.Mutex
	peers      map[string]*peer
	syncQ      []string
	rx, tailRx wireBatch // decode buffers of onBatch and of the tail replay

	// gate keeps bus callbacks out once Close has begun: callbacks hold it
	// for reading; Close takes it for writing and sets shut.
	gate sync.RWMutex
	shut bool

	startMu   sync.Mutex
	started   bool
	startedAt time.Time // real time, for Synced's window
	svc       *selection.SelectionService
	stops     []func()
	closeOnce sync.Once

	kick     chan struct{}
	flushReq chan chan struct{}
	syncKick chan struct{}
	stop     chan struct{}
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup

	st  counters
	lim limiter

	warm warmState // the warm start (warm.go)
}

var _ selection.BookingObserver = (*Replicator)(nil)

// localEntry is one live local booking, as a snapshot sends it.
type localEntry struct {
	model     string
	worker    catalog.WorkerRank
	hashes    []uint64
	private   int
	prefill   int
	expected  int
	lease     time.Duration
	deadline  int64 // Now's UnixNano
	prefilled bool
	session   string
}

// pendingBuf holds ops waiting to be published, reused, so queueing an op
// allocates nothing once it has grown.
type pendingBuf struct {
	ops   []pendingOp
	bytes int
}

// pendingOp is one op waiting to be published. A booked op's hashes are its
// table entry's: an entry freed before the op is published is retired, not
// reused, until the flush that publishes the op is done.
type pendingOp struct {
	id, model string
	session   string
	worker    catalog.WorkerRank
	hashes    []uint64
	private   int32
	prefill   int32
	expected  int32
	leaseMS   int32
	size      int32
	kind      uint8
	how       selection.Settlement
}

// maxSpareEntries bounds the entries kept for reuse.
const maxSpareEntries = 4096

// New returns a Replicator for o (see Options); it starts nothing. Attach it
// to a service with SelectionServiceBuilder.Observe, then call Start with the
// service. Errors: ErrInvalidOptions.
func New(o Options) (*Replicator, error) {
	follow := o.MaxMessageBytes == 0
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Replicator{
		o:             o,
		log:           o.Logger.With("replica", o.ID),
		epoch:         newEpoch(),
		opsSubj:       o.Subject + ".ops." + o.ID,
		followPayload: follow,
		out:           &pendingBuf{},
		peers:         map[string]*peer{},
		kick:          make(chan struct{}, 1),
		flushReq:      make(chan chan struct{}),
		syncKick:      make(chan struct{}, 1),
		stop:          make(chan struct{}),
	}
	r.msgMax.Store(int64(o.MaxMessageBytes))
	r.mu.local = map[string]*localEntry{}
	r.mu.pend = &pendingBuf{}
	r.mu.idle = true
	r.ctx, r.cancel = context.WithCancel(context.Background())
	return r, nil
}

// lastEpoch keeps epochs of one process strictly increasing.
var lastEpoch atomic.Uint64

// newEpoch returns the wall-clock start in milliseconds above 16 random bits,
// larger than any epoch this process made before: a restarted replica's epoch
// is larger than its previous one.
func newEpoch() uint64 {
	var b [2]byte
	_, _ = io.ReadFull(rand.Reader, b[:])
	e := uint64(time.Now().UnixMilli())<<16 | uint64(binary.LittleEndian.Uint16(b[:]))
	for {
		last := lastEpoch.Load()
		if e <= last {
			e = last + 1
		}
		if lastEpoch.CompareAndSwap(last, e) {
			return e
		}
	}
}

// PayloadLimiter is implemented by a Bus whose broker bounds the size of a
// message (NATS: the server's max_payload, which a client learns on each
// connection). The Replicator reads it at Start and on every reconnection
// (ConnWatcher): it then sends messages of at most that size, and, when
// Options.MaxMessageBytes was left to its default, takes that size as its
// bound. 0 means not known yet.
type PayloadLimiter interface {
	MaxPayload() int
}

// sendMax is the bound on the messages this replica sends.
func (r *Replicator) sendMax() int { return int(r.msgMax.Load()) }

// recvMax is the bound on the messages this replica decodes: its
// MaxMessageBytes, or the broker's larger bound it follows.
func (r *Replicator) recvMax() int { return max(r.o.MaxMessageBytes, r.sendMax()) }

// followBusPayload reads the broker's bound on a message, when the Bus
// tells it.
func (r *Replicator) followBusPayload() {
	pl, ok := r.o.Bus.(PayloadLimiter)
	if !ok {
		return
	}
	n := pl.MaxPayload()
	if n <= 0 {
		return
	}
	n = min(max(n, MinMessageBytes), MessageBytesLimit)
	if !r.followPayload {
		n = min(n, r.o.MaxMessageBytes)
	}
	if old := r.msgMax.Swap(int64(n)); old != int64(n) {
		r.log.Info("replica: message bound follows the broker", "max_message_bytes", n, "was", old)
	}
}

// ID returns the replica's ID (Options.ID or the generated one).
func (r *Replicator) ID() string { return r.o.ID }

// Start subscribes to the bus and starts the Replicator's goroutines (the
// publisher, the peer watchdog and the snapshot taker) for svc, the service
// built with this Replicator as its observer: peers' bookings are booked into
// svc. Bookings svc made before Start are published with the first batch.
// Errors: ErrStarted, ErrClosed, the Bus's subscription errors (nothing is
// left subscribed then).
func (r *Replicator) Start(svc *selection.SelectionService) error {
	if svc == nil {
		return errors.New("replica: Start with a nil service")
	}
	r.startMu.Lock()
	defer r.startMu.Unlock()
	switch {
	case r.closed.Load():
		return ErrClosed
	case r.started:
		return ErrStarted
	}
	r.svc = svc
	var stops []func()
	undo := func(err error) error {
		for _, s := range stops {
			s()
		}
		return err
	}
	unsub, err := r.o.Bus.Subscribe(r.o.Subject+".ops.*", r.onBatch)
	if err != nil {
		return undo(err)
	}
	stops = append(stops, unsub)
	stopResp, err := r.o.Bus.Respond(r.snapSubject(r.o.ID), r.serveSnapshot)
	if err != nil {
		return undo(err)
	}
	stops = append(stops, stopResp)
	stopIndex, err := r.o.Bus.Respond(r.indexSubject(r.o.ID), r.serveIndex)
	if err != nil {
		return undo(err)
	}
	stops = append(stops, stopIndex)
	if cw, ok := r.o.Bus.(ConnWatcher); ok {
		stopWatch, err := cw.WatchConn(r.connChanged)
		if err != nil {
			return undo(err)
		}
		stops = append(stops, stopWatch)
	}
	r.stops, r.started, r.startedAt = stops, true, time.Now()
	r.followBusPayload()
	r.wg.Add(3)
	go r.publishLoop()
	go r.watchLoop()
	go r.syncLoop()
	r.wg.Add(1)
	go r.warmLoop()
	r.log.Info("replica started", "epoch", r.epoch, "subject", r.o.Subject)
	return nil
}

// Close stops the subscriptions, publishes what is pending, stops the
// Replicator's goroutines and waits for them, and frees every peer booking it
// booked into the service (nobody would settle them any more). It sends no
// goodbye: peers drop this replica's bookings after their PeerTimeout. Close
// is idempotent; later calls return ErrClosed.
func (r *Replicator) Close() error {
	err := ErrClosed
	r.closeOnce.Do(func() {
		err = nil
		r.closed.Store(true)
		r.gate.Lock()
		r.shut = true
		r.gate.Unlock()
		r.startMu.Lock()
		started, stops := r.started, r.stops
		r.stops = nil
		r.startMu.Unlock()
		for _, s := range stops {
			s()
		}
		r.cancel()
		close(r.stop)
		r.wg.Wait()
		if started {
			r.pmu.Lock()
			for _, p := range r.peers {
				r.dropViewLocked(p)
			}
			clear(r.peers)
			r.tellPeersLocked()
			r.pmu.Unlock()
			r.log.Info("replica closed")
		}
	})
	return err
}

// Flush publishes every pending operation now and returns once the Bus took
// them. Errors: ErrNotStarted, ErrClosed.
func (r *Replicator) Flush() error {
	r.startMu.Lock()
	started := r.started
	r.startMu.Unlock()
	if !started {
		return ErrNotStarted
	}
	done := make(chan struct{})
	select {
	case r.flushReq <- done:
	case <-r.stop:
		return ErrClosed
	}
	<-done
	return nil
}

// enter admits a bus callback; leave must follow when it returns true.
func (r *Replicator) enter() bool {
	r.gate.RLock()
	if r.shut {
		r.gate.RUnlock()
		return false
	}
	return true
}

func (r *Replicator) leave() { r.gate.RUnlock() }

func (r *Replicator) snapSubject(id string) string { return r.o.Subject + ".snapshot." + id }

// --- the request path -------------------------------------------------------

// Booked records one of the service's own bookings and queues it for the
// peers (selection.BookingObserver). A booking too large for one message
// (Options.MaxMessageBytes) is counted (Stats.Unsendable) and not shared.
func (r *Replicator) Booked(ev selection.BookingEvent) {
	if r.closed.Load() {
		return
	}
	b := booked{
		id: string(ev.ID), model: ev.Model, worker: ev.Worker, hashes: ev.SeqHashes, private: ev.PrivateBlocks,
		prefill: ev.PrefillTokens, expected: ev.ExpectedOutputTokens, leaseMS: leaseMS(ev.Lease),
		session: ev.Session,
	}
	b.remainingMS = b.leaseMS
	size := b.size()
	if !b.sendable() || size > r.sendMax()-headerReserve {
		r.st.unsendable.Add(1)
		r.warn("unsendable", "a booking is too large to replicate; peers will not see it",
			"id", ev.ID, "worker", ev.Worker, "hashes", len(ev.SeqHashes), "max_message_bytes", r.sendMax())
		return
	}
	deadline := r.o.Now().UnixNano() + int64(time.Duration(b.leaseMS)*time.Millisecond)
	r.mu.Lock()
	e := r.entryLocked(len(ev.SeqHashes))
	copy(e.hashes, ev.SeqHashes)
	e.model, e.worker, e.private, e.prefill, e.expected = ev.Model, ev.Worker, ev.PrivateBlocks, ev.PrefillTokens, ev.ExpectedOutputTokens
	e.lease, e.deadline, e.prefilled = time.Duration(b.leaseMS)*time.Millisecond, deadline, false
	e.session = ev.Session
	if old := r.mu.local[string(ev.ID)]; old != nil {
		r.retireLocked(old)
	}
	r.mu.local[string(ev.ID)] = e
	kick, overflow := r.queueLocked(pendingOp{
		id: string(ev.ID), model: ev.Model, worker: ev.Worker, hashes: e.hashes, private: int32(ev.PrivateBlocks),
		prefill: int32(ev.PrefillTokens), expected: int32(ev.ExpectedOutputTokens), leaseMS: int32(b.leaseMS),
		size: int32(size), kind: opBooked, session: ev.Session,
	})
	r.mu.Unlock()
	r.queued(kick, overflow)
}

// Settled records a settling call on one of the service's own bookings and
// queues it for the peers (selection.BookingObserver).
func (r *Replicator) Settled(id reservation.ID, how selection.Settlement) {
	if r.closed.Load() {
		return
	}
	if id == "" || len(id) > maxStr || how < selection.SettlePrefill || how > selection.SettleOutputBlock {
		r.st.unsendable.Add(1)
		return
	}
	var now int64
	if how == selection.SettleRenew {
		now = r.o.Now().UnixNano()
	}
	r.mu.Lock()
	if e := r.mu.local[string(id)]; e != nil {
		switch how {
		case selection.SettlePrefill:
			e.prefilled = true
		case selection.SettleRenew:
			e.deadline = max(e.deadline, now+int64(e.lease))
		case selection.SettleFree:
			delete(r.mu.local, string(id))
			r.retireLocked(e)
		case selection.SettleOutputBlock:
			e.private++
		}
	}
	kick, overflow := r.queueLocked(pendingOp{id: string(id), size: int32(settledSize(string(id))), kind: opSettled, how: how})
	r.mu.Unlock()
	r.queued(kick, overflow)
}

// leaseMS is d in whole milliseconds, at least 1 and at most maxNumber.
func leaseMS(d time.Duration) int64 {
	return min(max(d.Milliseconds(), 1), maxNumber)
}

// entryLocked returns a cleared entry with room for n hashes.
func (r *Replicator) entryLocked(n int) *localEntry {
	var e *localEntry
	if k := len(r.mu.spare); k > 0 {
		e = r.mu.spare[k-1]
		r.mu.spare[k-1] = nil
		r.mu.spare = r.mu.spare[:k-1]
	} else {
		e = new(localEntry)
	}
	if cap(e.hashes) < n {
		e.hashes = make([]uint64, n)
	}
	e.hashes = e.hashes[:n]
	return e
}

// retireLocked takes a freed entry out of use until the next flush is done
// (see pendingOp); beyond PendingMax retired entries (no more can be read by
// pending ops) it is left to the collector.
func (r *Replicator) retireLocked(e *localEntry) {
	if len(r.mu.retired) < r.o.PendingMax {
		r.mu.retired = append(r.mu.retired, e)
	}
}

// recycleLocked makes retired entries reusable: no pending op reads them.
func (r *Replicator) recycleLocked(es []*localEntry) {
	for _, e := range es {
		if len(r.mu.spare) >= maxSpareEntries {
			break
		}
		e.model, e.worker, e.session = "", catalog.WorkerRank{}, ""
		r.mu.spare = append(r.mu.spare, e)
	}
}

// queueLocked appends op to the pending buffer. kick tells the caller to wake
// the publisher: it is idle, or the batch is full; overflow reports the first
// op dropped since the last flush.
func (r *Replicator) queueLocked(op pendingOp) (kick, overflow bool) {
	p := r.mu.pend
	if len(p.ops) >= r.o.PendingMax || p.bytes+int(op.size) > 4*r.sendMax() {
		r.st.overflow.Add(1)
		r.resync.Store(true)
		overflow = !r.mu.overflowing
		r.mu.overflowing = true
		return true, overflow
	}
	p.ops = append(p.ops, op)
	p.bytes += int(op.size)
	kick = r.mu.idle || len(p.ops) >= r.o.BatchMax || p.bytes >= r.sendMax()-headerReserve
	r.mu.idle = false
	return kick, false
}

// queued wakes the publisher and reports an overflow, outside the lock.
func (r *Replicator) queued(kick, overflow bool) {
	if kick {
		select {
		case r.kick <- struct{}{}:
		default:
		}
	}
	if overflow {
		r.log.Warn("replica: pending buffer full, dropping operations; peers will be asked to resynchronise",
			"pending_max", r.o.PendingMax)
	}
}

// --- introspection ------------------------------------------------------------

// LocalIDs returns the ids of the live local bookings this replica shares
// (what its snapshot holds), sorted.
func (r *Replicator) LocalIDs() []reservation.ID {
	now := r.o.Now().UnixNano()
	r.mu.Lock()
	ids := make([]reservation.ID, 0, len(r.mu.local))
	for id, e := range r.mu.local {
		if e.deadline > now {
			ids = append(ids, reservation.ID(id))
		}
	}
	r.mu.Unlock()
	slices.Sort(ids)
	return ids
}
