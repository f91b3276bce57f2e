package kvevents

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
)

type applyCall struct {
	W  catalog.WorkerRank
	Ev kvindex.Event
}

// recorder is a fake Applier that records calls (deep-copying events, since the
// decoder reuses their memory) and can fail chosen events.
type recorder struct {
	mu      sync.Mutex
	applied []applyCall
	cleared []catalog.WorkerRank
	fail    func(kvindex.Event) error
}

func (r *recorder) Apply(w catalog.WorkerRank, ev kvindex.Event) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail != nil {
		if err := r.fail(ev); err != nil {
			return err
		}
	}
	ev.BlockHashes = append([]uint64(nil), ev.BlockHashes...)
	ev.Tokens = append([]uint32(nil), ev.Tokens...)
	if ev.Extra != nil {
		ev.Extra = append([]uint64(nil), ev.Extra...)
	}
	r.applied = append(r.applied, applyCall{w, ev})
	return nil
}

func (r *recorder) ClearRank(w catalog.WorkerRank) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cleared = append(r.cleared, w)
}

func newTestHandler(t *testing.T, a Applier, opts HandlerOptions) *IndexHandler {
	t.Helper()
	if opts.BlockSize == 0 {
		opts.BlockSize = 4
	}
	h, err := NewIndexHandler(a, opts)
	require.NoError(t, err)
	return h
}

func TestNewIndexHandlerValidates(t *testing.T) {
	_, err := NewIndexHandler(nil, HandlerOptions{BlockSize: 0, Decoder: DecoderOptions{MaxEvents: -1}})
	require.ErrorIs(t, err, ErrInvalidOptions)
	for _, want := range []string{"nil Applier", "BlockSize", "MaxEvents"} {
		require.Contains(t, err.Error(), want)
	}
	_, err = NewIndexHandler(&recorder{}, HandlerOptions{BlockSize: 16})
	require.NoError(t, err)
}

func TestIndexHandlerAppliesToBatchRank(t *testing.T) {
	rec := &recorder{}
	h := newTestHandler(t, rec, HandlerOptions{})
	src := catalog.WorkerRank{WorkerID: "w1", Rank: 0}

	h.HandleBatch(src, 0, payloadA(t))                                                                            // dp_rank 0
	h.HandleBatch(src, 1, arrayBatch(2, storedArr([]uint64{9}, nil, seqTokens(0, 4), 4)))                         // dp_rank 2
	h.HandleBatch(src, 2, arrayBatch(noRank, v(func(e mp) mp { return e.arr(2).str("BlockRemoved").hashes(9) }))) // none

	require.Equal(t, []applyCall{
		{src, storedA()},
		{catalog.WorkerRank{WorkerID: "w1", Rank: 2}, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: []uint64{9}, Tokens: seqTokens(0, 4), BlockSize: 4}},
		{src, kvindex.Event{Kind: kvindex.EventRemoved, BlockHashes: []uint64{9}}},
	}, rec.applied)
	require.Equal(t, HandlerStats{Batches: 3, EventsApplied: 3, StoresApplied: 2, LastSeq: 2}, h.Stats(src))

	// Reset clears the registered rank and the override seen, once.
	h.ResetSource(src)
	require.ElementsMatch(t, []catalog.WorkerRank{src, {WorkerID: "w1", Rank: 2}}, rec.cleared)
	rec.cleared = nil
	h.ResetSource(src)
	require.Equal(t, []catalog.WorkerRank{src}, rec.cleared)
	require.Equal(t, uint64(2), h.Stats(src).Resets)

	// A source never seen is still cleared, and has zero stats.
	other := catalog.WorkerRank{WorkerID: "w2", Rank: 3}
	rec.cleared = nil
	h.ResetSource(other)
	require.Equal(t, []catalog.WorkerRank{other}, rec.cleared)
	require.Equal(t, HandlerStats{}, h.Stats(other))
}

func TestIndexHandlerCountsSkipsAndRejections(t *testing.T) {
	rec := &recorder{fail: func(ev kvindex.Event) error {
		if len(ev.BlockHashes) == 0 {
			return nil
		}
		switch ev.BlockHashes[0] {
		case 100:
			return fmt.Errorf("store: %w", kvindex.ErrUnknownParent)
		case 101:
			return fmt.Errorf("store: %w", kvindex.ErrTokenCount)
		case 102:
			return fmt.Errorf("store: %w", kvindex.ErrInvalidEvent)
		case 103:
			return fmt.Errorf("store: %w", kvindex.ErrBlockSize)
		case 104:
			return fmt.Errorf("disk on fire")
		}
		return nil
	}}
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	now := time.Unix(1000, 0)
	h := newTestHandler(t, rec, HandlerOptions{BlockSize: 4, Logger: logger, now: func() time.Time { return now }})
	src := catalog.WorkerRank{WorkerID: "w", Rank: 1}
	toks := seqTokens(0, 12)
	batch := arrayBatch(noRank,
		storedArr([]uint64{1}, nil, toks[:4], 4),
		storedArr([]uint64{100}, u64p(5), toks[:4], 4),
		storedArr([]uint64{101}, nil, toks[:3], 4),
		storedArr([]uint64{102}, nil, toks[:4], 4),
		storedArr([]uint64{2}, nil, toks[:6], 6), // not a multiple of 4: never reaches Apply
		storedArr([]uint64{103}, nil, toks[:4], 4),
		storedArr([]uint64{104}, nil, toks[:4], 4),
		storedArr([]uint64{3}, nil, toks[:8], 8), // a multiple: applied
		storedMap([]uint64{4}, nil, toks[:4], 4, v(func(e mp) mp { return e.str("group_idx").i(1) })),
		v(func(e mp) mp { return e.arr(1).str("Nope") }),
	)
	h.HandleBatch(src, 10, batch)
	h.HandleBatch(src, 11, batch)
	h.HandleBatch(src, 12, []byte{0x90})
	h.HandleBatch(src, 13, nil)

	st := h.Stats(src)
	var want [NumSkipReasons]uint64
	want[SkipUnknownParent] = 2
	want[SkipTokenCount] = 2
	want[SkipInvalidEvent] = 2
	want[SkipBlockSize] = 4
	want[SkipApplyError] = 2
	want[SkipNonMainGroup] = 2
	want[SkipUnknownType] = 2
	require.Equal(t, HandlerStats{Batches: 4, DecodeErrors: 2, EventsApplied: 4, StoresApplied: 4, StoresRejected: 12, Skipped: want, Warnings: 6, LastSeq: 13}, st)
	require.Equal(t, uint64(16), st.SkippedTotal())
	require.Len(t, rec.applied, 4)
	for _, c := range rec.applied {
		require.NotEqual(t, 6, c.Ev.BlockSize)
	}

	// One line per reason of loss within a minute, however often it happened;
	// skips by design (another group, an unknown type) are not warned about.
	out := logs.String()
	require.Equal(t, 6, strings.Count(out, "\n"), out)
	for _, want := range []string{"reason=unknown_parent", "reason=token_count", "reason=invalid_event",
		"reason=block_size", "reason=apply_error", "reason=undecodable_batch",
		"event_block_size=6", "index_block_size=4", "disk on fire"} {
		require.Contains(t, out, want)
	}
	require.NotContains(t, out, "non_main_group")
	require.NotContains(t, out, "unknown_type")

	// A minute later each reason warns again, with the count since its last
	// warning.
	now = now.Add(defaultWarnInterval)
	logs.Reset()
	h.HandleBatch(src, 14, batch)
	out = logs.String()
	require.Equal(t, 5, strings.Count(out, "\n"), out)
	require.Contains(t, out, "reason=block_size count_since_last_warning=4") // 2 in the second batch, 2 now
	require.Contains(t, out, "reason=unknown_parent count_since_last_warning=2")

	// After a reset the first occurrence is logged at once.
	logs.Reset()
	h.ResetSource(src)
	h.HandleBatch(src, 0, batch)
	require.Equal(t, 5, strings.Count(logs.String(), "\n"))
}

func TestIndexHandlerStatsAndForget(t *testing.T) {
	h := newTestHandler(t, &recorder{}, HandlerOptions{})
	a := catalog.WorkerRank{WorkerID: "a"}
	b := catalog.WorkerRank{WorkerID: "b", Rank: 1}
	h.HandleBatch(a, 5, payloadA(t))
	h.HandleBatch(b, 7, payloadB(t))
	all := h.AllStats()
	require.Equal(t, map[catalog.WorkerRank]HandlerStats{
		a: {Batches: 1, EventsApplied: 1, StoresApplied: 1, LastSeq: 5},
		b: {Batches: 1, EventsApplied: 1, StoresApplied: 1, LastSeq: 7},
	}, all)
	h.Forget(a)
	require.Equal(t, HandlerStats{}, h.Stats(a))
	require.Len(t, h.AllStats(), 1)
}

func TestIndexHandlerConcurrentSources(t *testing.T) {
	rec := &recorder{}
	h := newTestHandler(t, rec, HandlerOptions{})
	const sources, batches = 8, 50
	var wg sync.WaitGroup
	stop := make(chan struct{})
	readerDone := make(chan struct{})
	go func() { // a metrics reader racing with the sources
		defer close(readerDone)
		for {
			select {
			case <-stop:
				return
			default:
				_ = h.AllStats()
			}
		}
	}()
	for s := range sources {
		wg.Add(1)
		go func() {
			defer wg.Done()
			src := catalog.WorkerRank{WorkerID: fmt.Sprintf("w%d", s)}
			for i := range batches {
				h.HandleBatch(src, uint64(i), arrayBatch(s%3, storedArr([]uint64{uint64(i)}, nil, seqTokens(i, 4), 4)))
			}
			h.ResetSource(src)
		}()
	}
	wg.Wait()
	close(stop)
	<-readerDone
	require.Len(t, rec.applied, sources*batches)
	for s := range sources {
		st := h.Stats(catalog.WorkerRank{WorkerID: fmt.Sprintf("w%d", s)})
		require.Equal(t, HandlerStats{Batches: batches, EventsApplied: batches, StoresApplied: batches, LastSeq: batches - 1, Resets: 1}, st)
	}
	for _, c := range rec.applied {
		var s int
		_, err := fmt.Sscanf(c.W.WorkerID, "w%d", &s)
		require.NoError(t, err)
		require.Equal(t, s%3, c.W.Rank, "dp_rank of the batch")
	}
}

// TestIndexHandlerWithIndex runs the glue against the real index.
func TestIndexHandlerWithIndex(t *testing.T) {
	ix, err := kvindex.New(kvindex.Options{BlockSize: 4})
	require.NoError(t, err)
	h := newTestHandler(t, ix, HandlerOptions{BlockSize: ix.BlockSize()})
	src := catalog.WorkerRank{WorkerID: "engine-0"}

	toks := seqTokens(1, 16)
	h.HandleBatch(src, 0, arrayBatch(0,
		// Engine blocks of 8 tokens: each becomes two index blocks.
		storedArr([]uint64{11}, nil, toks[:8], 8),
		storedArr([]uint64{13}, u64p(11), toks[8:16], 8),
		storedArr([]uint64{20}, u64p(999), toks[:8], 8), // unknown parent
		storedArr([]uint64{21}, nil, toks[:3], 8),       // token count
		storedArr([]uint64{22}, nil, toks[:6], 6),       // block size
	))
	st := h.Stats(src)
	require.Equal(t, uint64(2), st.EventsApplied)
	require.Equal(t, uint64(1), st.Skipped[SkipUnknownParent])
	require.Equal(t, uint64(1), st.Skipped[SkipTokenCount])
	require.Equal(t, uint64(1), st.Skipped[SkipBlockSize])

	hasher, err := kvindex.NewHasher(4, kvindex.HashOptions{})
	require.NoError(t, err)
	matches := ix.FindMatches(hasher.SeqHashes(toks), kvindex.MatchOptions{})
	require.Len(t, matches, 1)
	require.Equal(t, src, matches[0].Worker)
	require.Equal(t, 4, matches[0].Device, "two index blocks per engine block")

	h.ResetSource(src)
	require.Empty(t, ix.FindMatches(hasher.SeqHashes(toks), kvindex.MatchOptions{}))
}

func TestIndexHandlerRefusedRanksAreNotRemembered(t *testing.T) {
	rec := &recorder{}
	h := newTestHandler(t, rec, HandlerOptions{})
	src := catalog.WorkerRank{WorkerID: "w"}
	rec.fail = func(ev kvindex.Event) error {
		if ev.BlockHashes[0] == 7 {
			return fmt.Errorf("rank 7: %w", ErrUnknownRank)
		}
		if ev.BlockHashes[0] == 8 {
			return fmt.Errorf("full: %w", kvindex.ErrRankFull)
		}
		if ev.BlockHashes[0] == 10 {
			return fmt.Errorf("full: %w", kvindex.ErrIndexFull)
		}
		return nil
	}
	h.HandleBatch(src, 0, arrayBatch(7, storedArr([]uint64{7}, nil, seqTokens(0, 4), 4)))
	h.HandleBatch(src, 1, arrayBatch(1, storedArr([]uint64{8}, nil, seqTokens(0, 4), 4)))
	h.HandleBatch(src, 2, arrayBatch(2, storedArr([]uint64{9}, nil, seqTokens(0, 4), 4)))
	h.HandleBatch(src, 3, arrayBatch(2, storedArr([]uint64{10}, nil, seqTokens(0, 4), 4)))
	st := h.Stats(src)
	require.EqualValues(t, 1, st.Skipped[SkipUnknownRank])
	require.EqualValues(t, 1, st.Skipped[SkipRankFull])
	require.EqualValues(t, 1, st.Skipped[SkipIndexFull])
	require.Equal(t, "index_full", SkipIndexFull.String())
	require.EqualValues(t, 3, st.StoresRejected)
	h.ResetSource(src)
	require.ElementsMatch(t, []catalog.WorkerRank{src, {WorkerID: "w", Rank: 2}}, rec.cleared)
}
