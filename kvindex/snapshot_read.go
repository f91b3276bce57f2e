package kvindex

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/binfmt"
)

// Errors returned by ReadSnapshot, wrapped with context.
var (
	// ErrSnapshotCorrupt: the input is not a complete, well-formed snapshot: the
	// magic is wrong, it ends early, a checksum does not match, or its contents
	// could not have come from an Index (a block naming a node that is not
	// there, a node nobody holds, a worker rank listed twice).
	ErrSnapshotCorrupt = errors.New("kvindex: corrupt snapshot")
	// ErrSnapshotVersion: the snapshot's format version is not one this package
	// reads.
	ErrSnapshotVersion = errors.New("kvindex: unsupported snapshot version")
	// ErrSnapshotLimit: the snapshot is intact but larger than a ReadOptions
	// bound allows.
	ErrSnapshotLimit = errors.New("kvindex: snapshot exceeds a read limit")
)

// ReadOptions' defaults.
const (
	defaultSnapMaxBytes       = 1 << 30
	defaultSnapMaxWorkerRanks = 1 << 16
	defaultSnapMaxNodes       = 1 << 24
	defaultSnapMaxBlocks      = 1 << 24
	defaultSnapMaxStringLen   = 1 << 10
)

// ReadOptions configure ReadSnapshot. The zero value reads a snapshot into an
// index with the snapshot's own settings, under the default bounds. Every bound
// is checked before anything of that size is allocated; a snapshot over a bound
// is refused with ErrSnapshotLimit.
type ReadOptions struct {
	// Index configures the new index. BlockSize 0 takes the snapshot's; any
	// other value must equal it (ErrBlockSize otherwise). MaxBlocksPerRank 0
	// takes the snapshot's. OnStored applies to events applied after loading;
	// it is not called for the loaded blocks.
	Index Options
	// MaxBytes bounds the payload. Default 1 GiB.
	MaxBytes int
	// MaxWorkerRanks bounds the worker ranks, and separately the sources and
	// the per-worker limits. Default 65536.
	MaxWorkerRanks int
	// MaxNodes bounds the tree's nodes (distinct prefixes). Default 16M
	// (1<<24); at most the package's MaxNodes.
	MaxNodes int
	// MaxBlocks bounds the blocks held over all worker ranks and tiers,
	// counting an engine block as the index blocks it covers. Default 16M
	// (1<<24).
	MaxBlocks int
	// MaxStringLen bounds every worker name, in bytes. Default 1024.
	MaxStringLen int
}

// withDefaults validates o and fills in its defaults; it never changes the
// caller's value. Negative fields are invalid.
func (o ReadOptions) withDefaults() (ReadOptions, error) {
	var errs []error
	for _, f := range []struct {
		name string
		v    *int
		def  int
	}{
		{"MaxBytes", &o.MaxBytes, defaultSnapMaxBytes},
		{"MaxWorkerRanks", &o.MaxWorkerRanks, defaultSnapMaxWorkerRanks},
		{"MaxNodes", &o.MaxNodes, defaultSnapMaxNodes},
		{"MaxBlocks", &o.MaxBlocks, defaultSnapMaxBlocks},
		{"MaxStringLen", &o.MaxStringLen, defaultSnapMaxStringLen},
		{"Index.BlockSize", &o.Index.BlockSize, 0},
		{"Index.MaxBlocksPerRank", &o.Index.MaxBlocksPerRank, 0},
	} {
		switch {
		case *f.v < 0:
			errs = append(errs, fmt.Errorf("%w: ReadOptions.%s is %d, want >= 0", ErrInvalidOptions, f.name, *f.v))
		case *f.v == 0:
			*f.v = f.def
		}
	}
	if o.MaxNodes > MaxNodes {
		errs = append(errs, fmt.Errorf("%w: ReadOptions.MaxNodes is %d, want <= %d", ErrInvalidOptions, o.MaxNodes, MaxNodes))
	}
	return o, errors.Join(errs...)
}

// ReadSnapshot reads one snapshot from r and returns a new index holding its
// contents, and the sequence numbers of the sources recorded with it (an empty
// map when there are none). It reads exactly the snapshot's bytes, so r may
// carry more after it; it verifies both checksums before parsing, checks every
// count against the bytes left and the bounds of opts before allocating for
// it, and returns the index only when the whole snapshot loaded. The new
// index's counters (Stats) start at zero.
//
// Errors: a wrapped ErrSnapshotCorrupt for input that ends early or is damaged
// or malformed, ErrSnapshotVersion for another format version,
// ErrSnapshotLimit when a bound of opts is exceeded, ErrBlockSize when
// opts.Index.BlockSize differs from the snapshot's, ErrInvalidOptions for a
// negative option, and r's own errors, wrapped.
func ReadSnapshot(r io.Reader, opts ReadOptions) (*Index, map[catalog.WorkerRank]uint64, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, nil, err
	}
	var hdr [snapHeaderLen]byte
	if err := binfmt.ReadFull(r, hdr[:]); err != nil {
		return nil, nil, readError(err, "header")
	}
	if string(hdr[:8]) != snapMagic {
		return nil, nil, fmt.Errorf("%w: magic %q, want %q", ErrSnapshotCorrupt, hdr[:8], snapMagic)
	}
	if v := binary.LittleEndian.Uint32(hdr[8:]); v != snapVersion {
		return nil, nil, fmt.Errorf("%w: version %d, this package reads %d", ErrSnapshotVersion, v, snapVersion)
	}
	if got, want := binfmt.Checksum(hdr[:20]), binary.LittleEndian.Uint32(hdr[20:]); got != want {
		return nil, nil, fmt.Errorf("%w: header checksum %#08x, want %#08x", ErrSnapshotCorrupt, got, want)
	}
	n := binary.LittleEndian.Uint64(hdr[12:])
	if n > uint64(opts.MaxBytes) || n > math.MaxInt-4 {
		return nil, nil, fmt.Errorf("%w: payload of %d bytes, ReadOptions.MaxBytes is %d", ErrSnapshotLimit, n, opts.MaxBytes)
	}
	payload, err := binfmt.ReadN(r, int(n)+4, snapChunk)
	if err != nil {
		return nil, nil, readError(err, "payload")
	}
	payload, trailer := payload[:n], payload[n:]
	if got, want := binfmt.Checksum(payload), binary.LittleEndian.Uint32(trailer); got != want {
		return nil, nil, fmt.Errorf("%w: payload checksum %#08x, want %#08x", ErrSnapshotCorrupt, got, want)
	}
	d := &snapDecoder{Decoder: binfmt.NewDecoder(payload), opts: &opts}
	ix, sources := d.decode()
	if err := d.failure(); err != nil {
		return nil, nil, err
	}
	return ix, sources, nil
}

// readError is ReadSnapshot's error for a failed read of what: a stream that
// ends early is ErrSnapshotCorrupt.
func readError(err error, what string) error {
	if errors.Is(err, binfmt.ErrTruncated) {
		return fmt.Errorf("%w: truncated %s: %w", ErrSnapshotCorrupt, what, io.ErrUnexpectedEOF)
	}
	return fmt.Errorf("kvindex: reading a snapshot %s: %w", what, err)
}

// snapDecoder parses a payload whose checksum matched. The first error sticks
// (binfmt.Decoder's latch): later reads return zero values and the caller
// checks Err before using them.
type snapDecoder struct {
	binfmt.Decoder
	opts   *ReadOptions
	blocks int // index blocks held so far, against MaxBlocks
}

func (d *snapDecoder) corrupt(format string, args ...any) {
	if d.Err() == nil {
		d.Fail(fmt.Errorf("%w: payload byte %d: %s", ErrSnapshotCorrupt, d.Offset(), fmt.Sprintf(format, args...)))
	}
}

// failure returns the decode's error: the package's own as latched, and
// binfmt's (the payload ending inside a value, a varint over 64 bits) as
// ErrSnapshotCorrupt at the byte where the value starts.
func (d *snapDecoder) failure() error {
	err := d.Err()
	if errors.Is(err, binfmt.ErrTruncated) || errors.Is(err, binfmt.ErrOverflow) {
		return fmt.Errorf("%w: payload byte %d: %v", ErrSnapshotCorrupt, d.Offset(), err)
	}
	return err
}

// integer reads a uv that must lie in [lo, hi].
func (d *snapDecoder) integer(what string, lo, hi uint64) int {
	v := d.Uvarint(math.MaxUint64)
	if d.Err() == nil && (v < lo || v > hi) {
		d.corrupt("%s %d, want %d..%d", what, v, lo, hi)
		return 0
	}
	return int(v)
}

// str reads a string, whose length the bytes left must hold (else
// ErrSnapshotCorrupt) and ReadOptions.MaxStringLen bound (else
// ErrSnapshotLimit).
func (d *snapDecoder) str(what string) string {
	n := d.Uvarint(math.MaxUint64)
	switch {
	case d.Err() != nil:
		return ""
	case n > uint64(d.Len()):
		d.corrupt("%s of %d bytes, %d left", what, n, d.Len())
		return ""
	case n > uint64(d.opts.MaxStringLen):
		d.Fail(fmt.Errorf("%w: %s of %d bytes, ReadOptions.MaxStringLen is %d", ErrSnapshotLimit, what, n, d.opts.MaxStringLen))
		return ""
	}
	return string(d.Next(int(n)))
}

// count reads a number of items that take at least minBytes each, and checks
// it against what is left of the payload and then against limit, the bound
// ReadOptions.name, of which used is taken already.
func (d *snapDecoder) count(what string, minBytes int, used, limit int, name string) int {
	n := d.Uvarint(math.MaxUint64)
	switch {
	case d.Err() != nil:
		return 0
	case n > uint64(d.Len()/minBytes):
		d.corrupt("%d %s in %d bytes", n, what, d.Len())
		return 0
	case n > uint64(limit-used):
		d.Fail(fmt.Errorf("%w: %d %s, ReadOptions.%s is %d", ErrSnapshotLimit, uint64(used)+n, what, name, limit))
		return 0
	}
	return int(n)
}

func (d *snapDecoder) decode() (*Index, map[catalog.WorkerRank]uint64) {
	o := d.opts
	bs := d.integer("block size", 1, math.MaxInt)
	mb := d.integer("max blocks per rank", 1, math.MaxInt)
	if d.Err() != nil {
		return nil, nil
	}
	if o.Index.BlockSize != 0 && o.Index.BlockSize != bs {
		d.Fail(fmt.Errorf("%w: snapshot block size %d, ReadOptions.Index.BlockSize %d", ErrBlockSize, bs, o.Index.BlockSize))
		return nil, nil
	}
	if o.Index.MaxBlocksPerRank != 0 {
		mb = o.Index.MaxBlocksPerRank
	}
	ix, err := New(Options{BlockSize: bs, MaxBlocksPerRank: mb, OnStored: o.Index.OnStored})
	if err != nil {
		d.Fail(err)
		return nil, nil
	}

	nl := d.count("limits", 2, 0, o.MaxWorkerRanks, "MaxWorkerRanks")
	for range nl {
		w := d.str("limit's worker name")
		n := d.integer("limit", 1, math.MaxInt)
		if _, dup := ix.limits[w]; dup && d.Err() == nil {
			d.corrupt("limit of worker %q repeats", w)
		}
		if d.Err() != nil {
			return nil, nil
		}
		ix.limits[w] = n
	}

	ns := d.count("sources", 3, 0, o.MaxWorkerRanks, "MaxWorkerRanks")
	sources := make(map[catalog.WorkerRank]uint64, ns)
	for range ns {
		w := d.str("source's worker name")
		rank := d.Varint()
		seq := d.Uvarint(math.MaxUint64)
		if d.Err() == nil && (rank < math.MinInt || rank > math.MaxInt) {
			d.corrupt("source rank %d out of range", rank)
		}
		src := catalog.WorkerRank{WorkerID: w, Rank: int(rank)}
		if _, dup := sources[src]; dup && d.Err() == nil {
			d.corrupt("source %v repeats", src)
		}
		if d.Err() != nil {
			return nil, nil
		}
		sources[src] = seq
	}

	nodes, depths := d.nodes(&ix.t)
	if d.Err() != nil {
		return nil, nil
	}
	nr := d.count("worker ranks", 10, 0, o.MaxWorkerRanks, "MaxWorkerRanks")
	var hashes []uint64
	for range nr {
		hashes = d.rank(&ix.t, nodes, depths, hashes)
		if d.Err() != nil {
			return nil, nil
		}
	}
	if d.Len() != 0 {
		d.corrupt("%d bytes after the last worker rank", d.Len())
		return nil, nil
	}
	t := &ix.t
	for i, id := range nodes {
		if n := t.at(id); t.unheld(n) && t.childless(n) {
			d.corrupt("node %d (key %#x) is held by no worker rank and has no children", i, n.key)
			return nil, nil
		}
	}
	return ix, sources
}

// nodes builds the tree's nodes and returns them by position with their depths.
func (d *snapDecoder) nodes(t *tree) ([]nodeID, []uint32) {
	nn := d.count("nodes", 9, 0, d.opts.MaxNodes, "MaxNodes")
	nodes := make([]nodeID, 0, nn)
	depths := make([]uint32, 0, nn)
	for i := range nn {
		dist := d.integer("parent distance", 1, uint64(i)+1)
		key := d.U64()
		if d.Err() != nil {
			return nil, nil
		}
		parent, depth := rootID, uint32(1)
		if p := i - dist; p >= 0 {
			parent, depth = nodes[p], depths[p]+1
		}
		before := t.nodes
		n := t.child(parent, key)
		if t.nodes == before {
			d.corrupt("node %d repeats key %#x under its parent", i, key)
			return nil, nil
		}
		nodes = append(nodes, n)
		depths = append(depths, depth)
	}
	return nodes, depths
}

// rank reads one worker rank and makes it hold its blocks. hashes is scratch
// space, returned for reuse.
func (d *snapDecoder) rank(t *tree, nodes []nodeID, depths []uint32, hashes []uint64) []uint64 {
	worker := d.str("worker name")
	rank := d.integer("rank", 0, math.MaxInt)
	ratio := d.integer("ratio", 1, math.MaxInt)
	w := catalog.WorkerRank{WorkerID: worker, Rank: rank}
	switch {
	case d.Err() != nil:
		return hashes
	case worker == "":
		d.corrupt("empty worker name")
		return hashes
	case t.workers[w] != nil:
		d.corrupt("worker rank %v repeats", w)
		return hashes
	}
	ws := t.worker(w, true)
	ws.ratio = ratio
	held := 0
	for tier := range Tier(numTiers) {
		nb := d.count("blocks", 9, d.blocks, d.opts.MaxBlocks, "MaxBlocks")
		// An engine block holds ratio nodes: count the index blocks, which
		// bounds the work as well as the memory.
		if rem := d.opts.MaxBlocks - d.blocks; nb > 0 && (ratio > rem || nb > rem/ratio) && d.Err() == nil {
			d.Fail(fmt.Errorf("%w: %d more blocks of %d index blocks each after %d, ReadOptions.MaxBlocks is %d",
				ErrSnapshotLimit, nb, ratio, d.blocks, d.opts.MaxBlocks))
		}
		if d.Err() != nil {
			return hashes
		}
		d.blocks += nb * ratio
		held += nb
		m := &ws.blocks[tier]
		m.reserve(nb)
		hashes = hashes[:0]
		at := uint64(0)
		for range nb {
			at += uint64(d.integer("node delta", 0, uint64(len(nodes))))
			hash := d.U64()
			switch {
			case d.Err() != nil:
				return hashes
			case at >= uint64(len(nodes)):
				d.corrupt("block %#x of %v names node %d of %d", hash, w, at, len(nodes))
				return hashes
			case int(depths[at]) < ratio:
				d.corrupt("block %#x of %v covers %d index blocks, its node is at depth %d", hash, w, ratio, depths[at])
				return hashes
			}
			if m.get(hash) != 0 {
				d.corrupt("block %#x of %v repeats on tier %v", hash, w, tier)
				return hashes
			}
			n := nodes[at]
			m.put(hash, n)
			t.mapEntries++
			for k, s := n, 0; s < ratio; s++ {
				t.hold(ws, k, tier)
				k = t.at(k).parent()
			}
			hashes = append(hashes, hash)
		}
		nd := d.integer("repeated stores", 0, uint64(nb))
		next := uint64(0)
		for range nd {
			next += uint64(d.integer("repeated store position", 0, uint64(nb)))
			c := d.Uvarint(math.MaxUint64)
			switch {
			case d.Err() != nil:
				return hashes
			case c == 0 || c > math.MaxUint32:
				d.corrupt("repeated store count %d, want 1..%d", c, uint32(math.MaxUint32))
				return hashes
			case next >= uint64(nb):
				d.corrupt("repeated store names block %d of %d", next, nb)
				return hashes
			}
			if ws.dups == nil {
				ws.dups = make(map[uint64]uint32)
			}
			ws.dups[tierKey(hashes[next], tier)] = uint32(c)
			next++
		}
	}
	if held == 0 && d.Err() == nil {
		d.corrupt("worker rank %v holds no blocks", w)
	}
	return hashes
}
