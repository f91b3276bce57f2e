package kvevents

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
)

// Handler consumes one source's batches in sequence order; calls for one source never overlap.
type Handler interface {
	HandleBatch(src catalog.WorkerRank, seq uint64, payload []byte)
	ResetSource(src catalog.WorkerRank)
}

// Applier is what IndexHandler writes decoded events into; *kvindex.Index
// implements it. Apply is called for one worker rank at a time per source, but
// different sources call it concurrently, so it must be safe for concurrent use.
type Applier interface {
	// Apply applies one event to worker rank w, returning nil or an error that
	// wraps kvindex.ErrUnknownParent, ErrBlockSize, ErrTokenCount,
	// ErrInvalidEvent, ErrUnknownBlock, ErrRankFull, ErrIndexFull, or this package's
	// ErrUnknownRank (w names a rank its worker does not have). Apply must not
	// keep the event's slices after it returns.
	Apply(w catalog.WorkerRank, ev kvindex.Event) error
	// ClearRank drops every block of worker rank w.
	ClearRank(w catalog.WorkerRank)
}

var _ Handler = (*IndexHandler)(nil)

// HandlerOptions configure an IndexHandler.
type HandlerOptions struct {
	// BlockSize is the index's tokens per block. Required (> 0). Stored events whose
	// block size is not a whole multiple of it are skipped as SkipBlockSize without
	// calling Apply.
	BlockSize int
	// Decoder bounds what each source's Decoder accepts. The zero value means the
	// defaults of DecoderOptions.
	Decoder DecoderOptions
	// Logger, when set, receives a warning the first time a source loses events
	// for a reason (every reason that is not by design, and undecodable
	// batches), then at most one per reason a minute, saying how many were lost
	// since the previous one. Everything is counted in Stats regardless.
	// Default: no logging.
	Logger *slog.Logger

	// warnInterval is the least time between two warnings of one source for one
	// reason. 0 means defaultWarnInterval; negative is invalid. Set by tests.
	warnInterval time.Duration
	// now is the clock of the warning limiter. Default time.Now. Set by tests.
	now func() time.Time
}

// defaultWarnInterval is the least time between two warnings of one source for
// one reason.
const defaultWarnInterval = time.Minute

// HandlerStats are the counters of one source, as returned by IndexHandler.Stats.
type HandlerStats struct {
	// Batches counts HandleBatch calls, decodable or not.
	Batches uint64
	// DecodeErrors counts batches whose envelope could not be decoded (nothing of
	// them was applied).
	DecodeErrors uint64
	// EventsApplied counts events the Applier accepted.
	EventsApplied uint64
	// StoresApplied counts the stored events among them; StoresRejected counts
	// stored events the Applier refused (also in Skipped, by reason).
	StoresApplied, StoresRejected uint64
	// Skipped counts events left out, indexed by SkipReason: the decoder's reasons
	// and the Applier's rejections.
	Skipped [NumSkipReasons]uint64
	// Resets counts ResetSource calls.
	Resets uint64
	// Warnings counts the warnings logged for this source.
	Warnings uint64
	// LastSeq is the sequence number of the last batch handled; meaningful only
	// when Batches > 0.
	LastSeq uint64
}

// SkippedTotal returns the number of events skipped for any reason.
func (s HandlerStats) SkippedTotal() uint64 {
	var n uint64
	for _, c := range s.Skipped {
		n += c
	}
	return n
}

// IndexHandler decodes the batches of many sources and applies their events to an
// Applier. Each source (the catalog.WorkerRank a transport registered) gets its own
// Decoder and counters, created on its first batch.
//
// Concurrency: IndexHandler is safe for concurrent use by many sources. As the
// Handler contract states, calls for one source (HandleBatch, ResetSource, and
// Forget) must not overlap; its caller (one goroutine per source, or any sequence
// of goroutines that synchronise with each other) provides that. Calls for
// different sources run in parallel without sharing a lock. Stats may be called
// at any time from any goroutine; it reads atomics.
type IndexHandler struct {
	applier   Applier
	blockSize int
	decOpts   DecoderOptions
	log       *slog.Logger
	warnEvery time.Duration
	now       func() time.Time

	sources sync.Map // catalog.WorkerRank -> *sourceState
}

// sourceState is one source's decoder and counters. dec, ranks and warn are
// touched only by calls for this source, which never overlap; the counters are
// atomics because Stats reads them from anywhere.
type sourceState struct {
	dec   *Decoder
	ranks []int // data-parallel ranks applied to since the last reset, besides the registered one
	// warn limits the warnings per reason; index NumSkipReasons is undecodable
	// batches.
	warn [NumSkipReasons + 1]warnState

	batches        atomic.Uint64
	decodeErrors   atomic.Uint64
	applied        atomic.Uint64
	storesApplied  atomic.Uint64
	storesRejected atomic.Uint64
	resets         atomic.Uint64
	warnings       atomic.Uint64
	lastSeq        atomic.Uint64
	skipped        [NumSkipReasons]atomic.Uint64
}

// warnState is one reason's warning limiter: when it last warned and how many
// events it saw since.
type warnState struct {
	warned bool
	last   time.Time
	since  uint64
}

// undecodable is the warning slot of batches that could not be decoded.
const undecodable = NumSkipReasons

// NewIndexHandler returns a handler that applies events to a. It returns an error
// wrapping ErrInvalidOptions when a is nil, BlockSize is not positive or the
// decoder options are invalid.
func NewIndexHandler(a Applier, opts HandlerOptions) (*IndexHandler, error) {
	var errs []error
	if a == nil {
		errs = append(errs, fmt.Errorf("%w: nil Applier", ErrInvalidOptions))
	}
	if opts.BlockSize <= 0 {
		errs = append(errs, fmt.Errorf("%w: BlockSize is %d, want > 0", ErrInvalidOptions, opts.BlockSize))
	}
	if opts.warnInterval < 0 {
		errs = append(errs, fmt.Errorf("%w: warnInterval is %v, want >= 0 (0 means %v)", ErrInvalidOptions, opts.warnInterval, defaultWarnInterval))
	}
	dec, err := opts.Decoder.withDefaults()
	if err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	h := &IndexHandler{applier: a, blockSize: opts.BlockSize, decOpts: dec, log: opts.Logger, warnEvery: opts.warnInterval, now: opts.now}
	if h.warnEvery == 0 {
		h.warnEvery = defaultWarnInterval
	}
	if h.now == nil {
		h.now = time.Now
	}
	return h, nil
}

func (h *IndexHandler) state(src catalog.WorkerRank) *sourceState {
	if st, ok := h.sources.Load(src); ok {
		return st.(*sourceState)
	}
	// The options were validated by NewIndexHandler, so this cannot fail.
	dec, _ := NewDecoder(h.decOpts)
	st, _ := h.sources.LoadOrStore(src, &sourceState{dec: dec})
	return st.(*sourceState)
}

// HandleBatch decodes one payload of source src and applies its events, in order,
// to the worker rank {src.Worker, dp_rank} when the batch carries a data-parallel
// rank, else to src itself. An undecodable batch is counted and dropped; skipped
// and rejected events are counted by reason; neither stops the following events.
func (h *IndexHandler) HandleBatch(src catalog.WorkerRank, seq uint64, payload []byte) {
	st := h.state(src)
	st.batches.Add(1)
	st.lastSeq.Store(seq)

	batch, err := st.dec.Decode(payload)
	if err != nil {
		st.decodeErrors.Add(1)
		h.warn(st, src, undecodable, 1, "kvevents: dropping an undecodable batch", "seq", seq, "error", err)
		return
	}
	for r, n := range batch.Skipped {
		if n > 0 {
			st.skipped[r].Add(uint64(n))
			if !SkipReason(r).byDesign() {
				h.warn(st, src, SkipReason(r), uint64(n), "kvevents: engine events skipped by the decoder", "seq", seq)
			}
		}
	}

	target := src
	other := batch.HasDPRank && batch.DPRank != src.Rank
	if other {
		target.Rank = batch.DPRank
	}

	var applied, stores, rejected uint64
	for i := range batch.Events {
		ev := &batch.Events[i]
		stored := ev.Kind == kvindex.EventStored
		if stored && ev.BlockSize > 0 && ev.BlockSize%h.blockSize != 0 {
			rejected++
			h.skip(st, src, SkipBlockSize, "kvevents: engine block size is not a multiple of the index block size; its stored blocks are not indexed",
				"event_block_size", ev.BlockSize, "index_block_size", h.blockSize)
			continue
		}
		if err := h.applier.Apply(target, *ev); err != nil {
			r := classify(err)
			if stored {
				rejected++
			}
			h.skip(st, src, r, "kvevents: index refused an engine event", "error", err)
			continue
		}
		applied++
		if stored {
			stores++
		}
	}
	if other && applied > 0 && !slices.Contains(st.ranks, target.Rank) {
		// Only ranks the Applier took are remembered for ResetSource, so
		// made-up ranks cost nothing here.
		st.ranks = append(st.ranks, target.Rank)
	}
	if applied > 0 {
		st.applied.Add(applied)
	}
	if stores > 0 {
		st.storesApplied.Add(stores)
	}
	if rejected > 0 {
		st.storesRejected.Add(rejected)
	}
}

// classify maps an Apply error to a skip reason.
func classify(err error) SkipReason {
	switch {
	case errors.Is(err, kvindex.ErrUnknownParent):
		return SkipUnknownParent
	case errors.Is(err, kvindex.ErrBlockSize):
		return SkipBlockSize
	case errors.Is(err, kvindex.ErrTokenCount):
		return SkipTokenCount
	case errors.Is(err, kvindex.ErrInvalidEvent):
		return SkipInvalidEvent
	case errors.Is(err, kvindex.ErrUnknownBlock):
		return SkipUnknownBlock
	case errors.Is(err, ErrUnknownRank):
		return SkipUnknownRank
	case errors.Is(err, kvindex.ErrRankFull):
		return SkipRankFull
	case errors.Is(err, kvindex.ErrIndexFull):
		return SkipIndexFull
	default:
		return SkipApplyError
	}
}

// skip counts one event the index did not take and warns about it (rate
// limited).
func (h *IndexHandler) skip(st *sourceState, src catalog.WorkerRank, r SkipReason, msg string, args ...any) {
	st.skipped[r].Add(1)
	h.warn(st, src, r, 1, msg, args...)
}

// warn logs msg for n more events lost for reason slot r of source src: at
// once the first time, then at most once every warnEvery, with the count since
// the previous warning.
func (h *IndexHandler) warn(st *sourceState, src catalog.WorkerRank, r SkipReason, n uint64, msg string, args ...any) {
	if h.log == nil {
		return
	}
	w := &st.warn[r]
	w.since += n
	now := h.now()
	if w.warned && now.Sub(w.last) < h.warnEvery {
		return
	}
	reason := "undecodable_batch"
	if r < NumSkipReasons {
		reason = r.String()
	}
	h.log.Warn(msg, append([]any{"source", src.String(), "reason", reason, "count_since_last_warning", w.since}, args...)...)
	w.warned, w.last, w.since = true, now, 0
	st.warnings.Add(1)
}

// ResetSource forgets everything src contributed to the index: it clears the
// registered worker rank and every other rank the source's batches were applied to
// (through their dp_rank) since the last reset. Counters are kept; the warning
// limiter starts over, so the first loss after a reset is logged at once.
func (h *IndexHandler) ResetSource(src catalog.WorkerRank) {
	h.applier.ClearRank(src)
	v, ok := h.sources.Load(src)
	if !ok {
		return
	}
	st := v.(*sourceState)
	for _, r := range st.ranks {
		if r != src.Rank {
			h.applier.ClearRank(catalog.WorkerRank{WorkerID: src.WorkerID, Rank: r})
		}
	}
	st.ranks = st.ranks[:0]
	st.warn = [NumSkipReasons + 1]warnState{}
	st.resets.Add(1)
}

// Forget drops src's decoder and counters, for a source removed for good. It does
// not touch the index (call ResetSource first for that). It must not overlap other
// calls for src.
func (h *IndexHandler) Forget(src catalog.WorkerRank) {
	h.sources.Delete(src)
}

// Stats returns the counters of src; all zero when src has not been seen.
func (h *IndexHandler) Stats(src catalog.WorkerRank) HandlerStats {
	v, ok := h.sources.Load(src)
	if !ok {
		return HandlerStats{}
	}
	return v.(*sourceState).snapshot()
}

func (st *sourceState) snapshot() HandlerStats {
	s := HandlerStats{
		Batches:        st.batches.Load(),
		DecodeErrors:   st.decodeErrors.Load(),
		EventsApplied:  st.applied.Load(),
		StoresApplied:  st.storesApplied.Load(),
		StoresRejected: st.storesRejected.Load(),
		Resets:         st.resets.Load(),
		Warnings:       st.warnings.Load(),
		LastSeq:        st.lastSeq.Load(),
	}
	for i := range st.skipped {
		s.Skipped[i] = st.skipped[i].Load()
	}
	return s
}
