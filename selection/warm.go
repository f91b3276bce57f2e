package selection

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
	"maps"
	"slices"
	"sync"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/kvindex/kvevents"
)

// Warm start: a service writes a consistent cut of every model's index with
// the last batch it applied from each event source (EventPlane.WriteSnapshot), and
// a joining service loads it and resumes each source's feed from there
// (EventPlane.LoadSnapshot).
//
// The format, version 1, integers little-endian:
//
//	header   magic "KVSELIDX" | version u32 | models u32
//	model    name length u16 | name | one kvindex snapshot (its own header,
//	         payload and checksums; it records the model's sources)
//	trailer  CRC-32C of every byte before it u32
//
// Models come in name order, so equal services encode to equal bytes.
const (
	warmMagic   = "KVSELIDX"
	warmVersion = 1
	// maxWarmModels bounds the models of one snapshot, maxWarmName a model's
	// name, maxWarmBytes the whole snapshot read.
	maxWarmModels = 4096
	maxWarmName   = 1024
	maxWarmBytes  = 1 << 30
)

// cutGate stands between the event feed and the handler: every batch and
// reset is handled under its read lock, and it records the last batch each
// source applied, so a cut (its write lock) sees no batch half applied and
// reads the sequence numbers that match the index exactly
// (kvindex.Index.Snapshot).
type cutGate struct {
	mu   sync.RWMutex
	h    kvevents.Handler
	seqs sync.Map // catalog.WorkerRank -> *gateSeq
}

// gateSeq is one source's last applied batch. Written by the source's calls
// (which never overlap) under mu's read lock, read under its write lock.
type gateSeq struct {
	has bool
	seq uint64
}

var _ kvevents.Handler = (*cutGate)(nil)

func newCutGate(h kvevents.Handler) *cutGate { return &cutGate{h: h} }

func (g *cutGate) state(src catalog.WorkerRank) *gateSeq {
	if v, ok := g.seqs.Load(src); ok {
		return v.(*gateSeq)
	}
	v, _ := g.seqs.LoadOrStore(src, &gateSeq{})
	return v.(*gateSeq)
}

// HandleBatch applies one batch under the read lock and records its seq.
func (g *cutGate) HandleBatch(src catalog.WorkerRank, seq uint64, payload []byte) {
	st := g.state(src)
	g.mu.RLock()
	g.h.HandleBatch(src, seq, payload)
	st.has, st.seq = true, seq
	g.mu.RUnlock()
}

// ResetSource clears the source under the read lock; it has no last batch
// until its next one.
func (g *cutGate) ResetSource(src catalog.WorkerRank) {
	st := g.state(src)
	g.mu.RLock()
	g.h.ResetSource(src)
	st.has = false
	g.mu.RUnlock()
}

// indexCut is one model's part of a cut.
type indexCut struct {
	model   string
	snap    *kvindex.Snapshot
	sources map[catalog.WorkerRank]uint64
}

// WriteSnapshot writes a snapshot of every model's KV index to w, with
// the last batch applied from each event source, read at the same cut: while
// the index is copied no batch is half applied (every source's next batch
// waits for the copy, tens of milliseconds per million blocks; requests do
// not). A source is recorded when it applied a batch since its last reset.
// A joining service loads it with EventPlane.LoadSnapshot. The encoding is built
// in memory, one model at a time (its size is about 10 bytes per block held
// and 9 per prefix); an error is w's, wrapped. Without KV events, or with
// ExternalEvents (no feed, hence no sequence numbers), it returns
// ErrBadRequest.
func (view EventPlane) WriteSnapshot(w io.Writer) error {
	s := view.s
	if s.feed == nil {
		return fmt.Errorf("%w: index snapshots need the built-in KV-event feed", ErrBadRequest)
	}
	return writeIndexCuts(w, s.cutIndexes())
}

// writeIndexCuts encodes cuts, in model order, to w.
func writeIndexCuts(w io.Writer, cuts []indexCut) error {
	cw := &crcWriter{w: w, h: crc32.New(crc32.MakeTable(crc32.Castagnoli))}
	var hdr []byte
	hdr = append(hdr, warmMagic...)
	hdr = binary.LittleEndian.AppendUint32(hdr, warmVersion)
	hdr = binary.LittleEndian.AppendUint32(hdr, uint32(len(cuts)))
	if _, err := cw.Write(hdr); err != nil {
		return fmt.Errorf("selection: writing an index snapshot: %w", err)
	}
	for _, c := range cuts {
		name := binary.LittleEndian.AppendUint16(nil, uint16(len(c.model)))
		if _, err := cw.Write(append(name, c.model...)); err != nil {
			return fmt.Errorf("selection: writing an index snapshot: %w", err)
		}
		if err := c.snap.Encode(cw, c.sources); err != nil {
			return fmt.Errorf("selection: writing the index snapshot of model %q: %w", c.model, err)
		}
	}
	if _, err := w.Write(binary.LittleEndian.AppendUint32(nil, cw.h.Sum32())); err != nil {
		return fmt.Errorf("selection: writing an index snapshot: %w", err)
	}
	return nil
}

// cutIndexes copies every model's index and its sources' last batches at one
// cut. The gate comes first, then mu: a batch holds the gate's read lock while
// it takes mu's, so the other order could wait on a batch that waits on a
// writer of mu.
func (s *SelectionService) cutIndexes() []indexCut {
	applied := map[catalog.WorkerRank]bool{}
	for _, st := range s.feed.Stats() {
		applied[st.Worker] = st.Applied > 0 // a source added again has applied nothing yet
	}
	s.gate.mu.Lock()
	defer s.gate.mu.Unlock()
	s.mu.RLock()
	defer s.mu.RUnlock()
	byModel := map[string]*indexCut{}
	for model, p := range s.partitions {
		if p.index != nil && len(model) <= maxWarmName {
			byModel[model] = &indexCut{model: model, sources: map[catalog.WorkerRank]uint64{}}
		}
	}
	s.gate.seqs.Range(func(k, v any) bool {
		src, st := k.(catalog.WorkerRank), v.(*gateSeq)
		if !st.has || !applied[src] {
			return true
		}
		if p := s.workerPart[src.WorkerID]; p != nil {
			if c := byModel[p.model]; c != nil {
				c.sources[src] = st.seq
			}
		}
		return true
	})
	out := make([]indexCut, 0, len(byModel))
	for _, c := range byModel {
		c.snap = s.partitions[c.model].index.Snapshot()
		out = append(out, *c)
	}
	slices.SortFunc(out, func(a, b indexCut) int { return cmp.Compare(a.model, b.model) })
	return out
}

// IndexLoad reports what EventPlane.LoadSnapshot did.
type IndexLoad struct {
	// Models is the number of models in the snapshot; Sources the event
	// sources it recorded.
	Models, Sources int
	// Resumed counts the sources whose entries were installed and whose feed
	// then replayed from the recorded batch (kvevents.Feed.ResumeSource).
	Resumed int
	// Skipped counts the sources left to their own feed: a worker this service
	// does not know (yet), of another model here, a rank it does not have, or
	// a source its feed does not run.
	Skipped int
}

// LoadSnapshot reads a snapshot written by EventPlane.WriteSnapshot (a serving
// peer's) and makes this service's index equal to it, source by source: for
// every recorded source this service also runs, of a worker of the same
// model, the source's entries are replaced by the snapshot's and its feed
// resumes from the recorded batch, replaying from the engine what came after
// (events it applied live before are applied again, in order, onto the
// snapshot; see kvevents.Feed.ResumeSource for what happens when the engine
// cannot replay that far, restarted since, or has no replay endpoint: the
// feed's usual handling of a gap, a restart, a stream without replay). Other
// sources are skipped and keep what their feed built; a rank that held blocks
// in the peer through another rank's source (a batch's dp_rank) is not
// loaded. It may run before or while the feeds run, typically right after
// the workers are known.
//
// The whole snapshot is read and checked before anything changes; then
// LoadSnapshot waits until every resumed source has installed its
// entries and replayed, or ctx ends (the resumes then still complete on their
// own). Errors: ErrBadRequest without the built-in feed; a malformed, damaged
// or oversized snapshot wraps ErrBadRequest and kvindex.ErrSnapshotCorrupt,
// ErrSnapshotVersion, ErrSnapshotLimit or ErrBlockSize (another block size
// than the service's); r's errors, wrapped; ctx.Err().
func (view EventPlane) LoadSnapshot(ctx context.Context, r io.Reader) (IndexLoad, error) {
	s := view.s
	var rep IndexLoad
	if s.feed == nil {
		return rep, fmt.Errorf("%w: index snapshots need the built-in KV-event feed", ErrBadRequest)
	}
	parts, err := readIndexSnapshot(r, s.cfg.BlockSize)
	if err != nil {
		return rep, err
	}
	rep.Models = len(parts)
	var waits []<-chan struct{}
	for _, lp := range parts {
		srcs := slices.SortedFunc(maps.Keys(lp.sources), catalog.WorkerRank.Compare)
		rep.Sources += len(srcs)
		for _, src := range srcs {
			if !s.loadable(lp.model, src) {
				rep.Skipped++
				continue
			}
			seq := lp.sources[src]
			done, err := s.feed.ResumeSource(src, seq, s.installer(lp.model, lp.ix, src, seq))
			if err != nil {
				rep.Skipped++
				continue
			}
			waits = append(waits, done)
			rep.Resumed++
		}
	}
	for _, d := range waits {
		select {
		case <-d:
		case <-ctx.Done():
			return rep, ctx.Err()
		}
	}
	s.logger.Info("selection: index snapshot loaded", "models", rep.Models, "sources", rep.Sources, "resumed", rep.Resumed, "skipped", rep.Skipped)
	return rep, nil
}

// loadable reports whether src is a rank of a worker of model here.
func (s *SelectionService) loadable(model string, src catalog.WorkerRank) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	p := s.workerPart[src.WorkerID]
	return p != nil && p.model == model && p.index != nil && s.rankKnownLocked(src)
}

// installer returns what the feed runs, on src's apply goroutine, to replace
// src's entries by from's, under the cut gate like a batch: src is cleared as
// by a reset (with the ranks its batches reached), the worker's partition is
// looked up again (it may have moved or gone since) and src takes seq as its
// last batch.
func (s *SelectionService) installer(model string, from *kvindex.Index, src catalog.WorkerRank, seq uint64) func() {
	return func() {
		st := s.gate.state(src)
		s.gate.mu.RLock()
		defer s.gate.mu.RUnlock()
		s.handler.ResetSource(src)
		s.mu.RLock()
		if p := s.workerPart[src.WorkerID]; p != nil && p.model == model && p.index != nil && s.rankKnownLocked(src) {
			p.index.LoadRanks(from, []catalog.WorkerRank{src})
		}
		s.mu.RUnlock()
		st.has, st.seq = true, seq
	}
}

// loadedPart is one model of a snapshot read.
type loadedPart struct {
	model   string
	ix      *kvindex.Index
	sources map[catalog.WorkerRank]uint64
}

// readIndexSnapshot reads and checks a whole snapshot; blockSize must be the
// snapshot's.
func readIndexSnapshot(r io.Reader, blockSize int) ([]loadedPart, error) {
	lr := &io.LimitedReader{R: r, N: maxWarmBytes + 1}
	cr := &crcReader{r: lr, h: crc32.New(crc32.MakeTable(crc32.Castagnoli))}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %w: "+format, append([]any{ErrBadRequest, kvindex.ErrSnapshotCorrupt}, args...)...)
	}
	var hdr [16]byte
	if err := readFull(cr, hdr[:], "header"); err != nil {
		return nil, err
	}
	if string(hdr[:8]) != warmMagic {
		return nil, bad("magic %q, want %q", hdr[:8], warmMagic)
	}
	if v := binary.LittleEndian.Uint32(hdr[8:]); v != warmVersion {
		return nil, fmt.Errorf("%w: %w: index snapshot version %d, this package reads %d", ErrBadRequest, kvindex.ErrSnapshotVersion, v, warmVersion)
	}
	n := binary.LittleEndian.Uint32(hdr[12:])
	if n > maxWarmModels {
		return nil, fmt.Errorf("%w: %w: %d models, at most %d", ErrBadRequest, kvindex.ErrSnapshotLimit, n, maxWarmModels)
	}
	parts := make([]loadedPart, 0, min(n, 64))
	for i := range n {
		var l [2]byte
		if err := readFull(cr, l[:], "model name"); err != nil {
			return nil, err
		}
		nl := int(binary.LittleEndian.Uint16(l[:]))
		if nl == 0 || nl > maxWarmName {
			return nil, bad("model %d: name of %d bytes, want 1 to %d", i, nl, maxWarmName)
		}
		name := make([]byte, nl)
		if err := readFull(cr, name, "model name"); err != nil {
			return nil, err
		}
		model := string(name)
		if len(parts) > 0 && model <= parts[len(parts)-1].model {
			return nil, bad("model %q out of order or repeated", model)
		}
		ix, sources, err := kvindex.ReadSnapshot(cr, kvindex.ReadOptions{Index: kvindex.Options{BlockSize: blockSize}})
		if err != nil {
			if lr.N <= 0 {
				return nil, fmt.Errorf("%w: %w: more than %d bytes", ErrBadRequest, kvindex.ErrSnapshotLimit, maxWarmBytes)
			}
			return nil, fmt.Errorf("%w: model %q: %w", ErrBadRequest, model, err)
		}
		parts = append(parts, loadedPart{model: model, ix: ix, sources: sources})
	}
	sum := cr.h.Sum32()
	var tr [4]byte
	if err := readFull(cr, tr[:], "trailer"); err != nil {
		return nil, err
	}
	if want := binary.LittleEndian.Uint32(tr[:]); sum != want {
		return nil, bad("checksum %#08x, want %#08x", sum, want)
	}
	if lr.N <= 0 {
		return nil, fmt.Errorf("%w: %w: more than %d bytes", ErrBadRequest, kvindex.ErrSnapshotLimit, maxWarmBytes)
	}
	return parts, nil
}

func readFull(r io.Reader, b []byte, what string) error {
	if _, err := io.ReadFull(r, b); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return fmt.Errorf("%w: %w: truncated index snapshot %s", ErrBadRequest, kvindex.ErrSnapshotCorrupt, what)
		}
		return fmt.Errorf("selection: reading an index snapshot %s: %w", what, err)
	}
	return nil
}

// crcWriter and crcReader checksum what passes through them.
type crcWriter struct {
	w io.Writer
	h hash.Hash32
}

func (c *crcWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.h.Write(p[:n])
	return n, err
}

type crcReader struct {
	r io.Reader
	h hash.Hash32
}

func (c *crcReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.h.Write(p[:n])
	return n, err
}
