package kvevents

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvselect/kvselect/kvindex"
)

// Handler consumes one source's batches in sequence order; calls for one source never overlap.
type Handler interface {
	HandleBatch(src kvindex.WorkerRank, seq uint64, payload []byte)
	ResetSource(src kvindex.WorkerRank)
}

// Applier is what IndexHandler writes decoded events into; *kvindex.Index
// implements it. Apply is called for one worker rank at a time per source, but
// different sources call it concurrently, so it must be safe for concurrent use.
type Applier interface {
	// Apply applies one event to worker rank w, returning nil or an error that
	// wraps kvindex.ErrUnknownParent, ErrBlockSize, ErrTokenCount or
	// ErrInvalidEvent. Apply must not keep the event's slices after it returns.
	Apply(w kvindex.WorkerRank, ev kvindex.Event) error
	// ClearRank drops every block of worker rank w.
	ClearRank(w kvindex.WorkerRank)
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
	// Logger, when set, receives one warning per source for the first rejected
	// block size, the first undecodable batch and the first unclassified apply
	// error since the source was created or last reset; everything is counted in
	// Stats regardless. Default: no logging.
	Logger *slog.Logger
}

// HandlerStats are the counters of one source, as returned by IndexHandler.Stats.
type HandlerStats struct {
	// Batches counts HandleBatch calls, decodable or not.
	Batches uint64
	// DecodeErrors counts batches whose envelope could not be decoded (nothing of
	// them was applied).
	DecodeErrors uint64
	// EventsApplied counts events the Applier accepted.
	EventsApplied uint64
	// Skipped counts events left out, indexed by SkipReason: the decoder's reasons
	// and the Applier's rejections.
	Skipped [NumSkipReasons]uint64
	// Resets counts ResetSource calls.
	Resets uint64
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
// Applier. Each source (the kvindex.WorkerRank a transport registered) gets its own
// Decoder and counters, created on its first batch.
//
// Concurrency: IndexHandler is safe for concurrent use by many sources. As the
// Handler contract states, calls for one source (HandleBatch, ResetSource, and
// Forget) must not overlap; its caller (one goroutine per source, or any sequence
// of goroutines that synchronise with each other) provides that. Calls for
// different sources run in parallel without sharing a lock. Stats and AllStats may
// be called at any time from any goroutine; they read atomics.
type IndexHandler struct {
	applier   Applier
	blockSize int
	decOpts   DecoderOptions
	log       *slog.Logger

	sources sync.Map // kvindex.WorkerRank -> *sourceState
}

// sourceState is one source's decoder and counters. dec, ranks and the logged
// flags are touched only by calls for this source, which never overlap; the
// counters are atomics because Stats reads them from anywhere.
type sourceState struct {
	dec   *Decoder
	ranks []int // data-parallel ranks applied to since the last reset, besides the registered one

	loggedBlockSize, loggedDecode, loggedApply bool

	batches      atomic.Uint64
	decodeErrors atomic.Uint64
	applied      atomic.Uint64
	resets       atomic.Uint64
	lastSeq      atomic.Uint64
	skipped      [NumSkipReasons]atomic.Uint64
}

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
	dec, err := opts.Decoder.withDefaults()
	if err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return &IndexHandler{applier: a, blockSize: opts.BlockSize, decOpts: dec, log: opts.Logger}, nil
}

func (h *IndexHandler) state(src kvindex.WorkerRank) *sourceState {
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
func (h *IndexHandler) HandleBatch(src kvindex.WorkerRank, seq uint64, payload []byte) {
	st := h.state(src)
	st.batches.Add(1)
	st.lastSeq.Store(seq)

	batch, err := st.dec.Decode(payload)
	if err != nil {
		st.decodeErrors.Add(1)
		if h.log != nil && !st.loggedDecode {
			st.loggedDecode = true
			h.log.Warn("kvevents: dropping undecodable batch (further ones are only counted)",
				"source", src.String(), "seq", seq, "error", err)
		}
		return
	}
	for r, n := range batch.Skipped {
		if n > 0 {
			st.skipped[r].Add(uint64(n))
		}
	}

	target := src
	if batch.HasDPRank && batch.DPRank != src.Rank {
		target.Rank = batch.DPRank
		if !slices.Contains(st.ranks, batch.DPRank) {
			st.ranks = append(st.ranks, batch.DPRank)
		}
	}

	var applied uint64
	for i := range batch.Events {
		ev := &batch.Events[i]
		if ev.Kind == kvindex.EventStored && ev.BlockSize > 0 && ev.BlockSize%h.blockSize != 0 {
			h.skip(st, src, SkipBlockSize, ev.BlockSize, nil)
			continue
		}
		if err := h.applier.Apply(target, *ev); err != nil {
			h.skip(st, src, classify(err), ev.BlockSize, err)
			continue
		}
		applied++
	}
	if applied > 0 {
		st.applied.Add(applied)
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
	default:
		return SkipApplyError
	}
}

// skip counts one rejected event and logs the first block-size mismatch and the
// first unclassified error of a source.
func (h *IndexHandler) skip(st *sourceState, src kvindex.WorkerRank, r SkipReason, eventBlockSize int, err error) {
	st.skipped[r].Add(1)
	if h.log == nil {
		return
	}
	switch {
	case r == SkipBlockSize && !st.loggedBlockSize:
		st.loggedBlockSize = true
		h.log.Warn("kvevents: engine block size is not a multiple of the index block size; its stored blocks are not indexed (further ones are only counted)",
			"source", src.String(), "event_block_size", eventBlockSize, "index_block_size", h.blockSize)
	case r == SkipApplyError && !st.loggedApply:
		st.loggedApply = true
		h.log.Warn("kvevents: index rejected an event (further ones are only counted)",
			"source", src.String(), "error", err)
	}
}

// ResetSource forgets everything src contributed to the index: it clears the
// registered worker rank and every other rank the source's batches were applied to
// (through their dp_rank) since the last reset. Counters are kept; the one-time
// log messages are re-armed.
func (h *IndexHandler) ResetSource(src kvindex.WorkerRank) {
	h.applier.ClearRank(src)
	v, ok := h.sources.Load(src)
	if !ok {
		return
	}
	st := v.(*sourceState)
	for _, r := range st.ranks {
		if r != src.Rank {
			h.applier.ClearRank(kvindex.WorkerRank{Worker: src.Worker, Rank: r})
		}
	}
	st.ranks = st.ranks[:0]
	st.loggedBlockSize, st.loggedDecode, st.loggedApply = false, false, false
	st.resets.Add(1)
}

// Forget drops src's decoder and counters, for a source removed for good. It does
// not touch the index (call ResetSource first for that). It must not overlap other
// calls for src.
func (h *IndexHandler) Forget(src kvindex.WorkerRank) {
	h.sources.Delete(src)
}

// Stats returns the counters of src; all zero when src has not been seen.
func (h *IndexHandler) Stats(src kvindex.WorkerRank) HandlerStats {
	v, ok := h.sources.Load(src)
	if !ok {
		return HandlerStats{}
	}
	return v.(*sourceState).snapshot()
}

// AllStats returns the counters of every source seen and not forgotten.
func (h *IndexHandler) AllStats() map[kvindex.WorkerRank]HandlerStats {
	out := make(map[kvindex.WorkerRank]HandlerStats)
	h.sources.Range(func(k, v any) bool {
		out[k.(kvindex.WorkerRank)] = v.(*sourceState).snapshot()
		return true
	})
	return out
}

func (st *sourceState) snapshot() HandlerStats {
	s := HandlerStats{
		Batches:       st.batches.Load(),
		DecodeErrors:  st.decodeErrors.Load(),
		EventsApplied: st.applied.Load(),
		Resets:        st.resets.Load(),
		LastSeq:       st.lastSeq.Load(),
	}
	for i := range st.skipped {
		s.Skipped[i] = st.skipped[i].Load()
	}
	return s
}
