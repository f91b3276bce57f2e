package kvindex

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/binfmt"
)

// snapVersion is the format version Encode writes and the only one
// ReadSnapshot reads.
const snapVersion = 1

// The format, version 1, in internal/binfmt's encoding (little-endian
// integers; uv a uvarint, sv a varint, str a length-prefixed string; a
// CRC-32C after the bytes it covers).
//
//	header   magic "KVIXSNAP" | version u32 | payload length u64 | CRC-32C of these 20 bytes u32
//	payload  block size uv | max blocks per rank uv
//	         limits:  count uv, then per worker: name str | limit uv
//	         sources: count uv, then per source: worker str | rank sv | last seq uv
//	         nodes:   count uv, then per node, parents first: parent distance uv | key u64
//	         ranks:   count uv, then per worker rank: worker str | rank uv | ratio uv |
//	                  per tier (device, host, disk):
//	                    blocks: count uv, then per block: node delta uv | engine hash u64
//	                    dups:   count uv, then per duplicated block: position delta uv | extra stores uv
//	trailer  CRC-32C of the payload u32
//
// Nodes come depth first. Node i's parent distance is i minus its parent's
// position, the root counting as position -1, so a node written right after its
// parent costs one byte besides its key. A tier's blocks are sorted by node
// position, each coded as the distance from the previous block's node (the
// first from node 0); a dup names its block by its distance from the position
// after the previous dup's (the first from 0), with the number of stores beyond
// the first. The encoding is canonical: children in key order, worker ranks,
// limits and sources in name order, blocks of one node by hash, so equal indexes
// and sources encode to equal bytes.
const (
	snapMagic     = "KVIXSNAP"
	snapHeaderLen = 24
	snapChunk     = 1 << 16 // ReadSnapshot's first payload buffer; it grows as bytes arrive
)

// Snapshot is a consistent cut of an Index, taken by Index.Snapshot: every
// worker rank's blocks per tier with their engine hashes and prefix chains,
// repeated stores, and the index's block limits. It shares nothing with the
// index, never changes, and is safe for concurrent use.
type Snapshot struct {
	blockSize int
	maxBlocks int
	limits    []snapLimit
	keys      []uint64 // node keys, parents first
	dists     []uint32 // node parent distances (see the format)
	ranks     []snapRank
	blocks    int
}

type snapLimit struct {
	worker string
	n      int
}

type snapRank struct {
	w     catalog.WorkerRank
	ratio int
	tiers [numTiers]snapTier
}

type snapTier struct {
	blocks []snapBlock // sorted by node, then hash
	dups   []snapDup   // sorted by pos
}

type snapBlock struct {
	node uint32
	hash uint64
}

type snapDup struct {
	pos, count uint32
}

// rawCut is what Snapshot copies under the read lock: the tree in whatever
// order it is walked, nodes named by id. Only the ids' identity is used once
// the lock is released (a later event may reuse them).
type rawCut struct {
	limits map[string]int
	nodes  []rawNode
	ranks  []rawRank
}

type rawNode struct {
	n      nodeID
	key    uint64
	parent uint32 // position+1 in nodes, 0 for the root
}

type rawRank struct {
	w      catalog.WorkerRank
	ratio  int
	blocks [numTiers][]rawBlock
	dups   map[uint64]uint32
}

type rawBlock struct {
	hash uint64
	n    nodeID
}

// Snapshot copies the index's contents under its read lock and returns them as
// a Snapshot. The copy is a cut between two events: an event applied while it
// runs waits for it (and lookups queue behind that waiting event), and is not
// in the snapshot. Only the copy holds the lock, at a cost proportional to the
// index's nodes and blocks; ordering it into the canonical form happens after
// the lock is released, and encoding it is up to the caller.
//
// A feed applies an engine's batch as several events, and the index does not
// know batch boundaries: a caller that records each source's last sequence
// number with the snapshot must read those numbers and call Snapshot while no
// batch is half applied, or a joining replica replays part of a batch twice.
func (ix *Index) Snapshot() *Snapshot {
	ix.ranksMu.Lock() // the block maps: no Apply in progress
	ix.mu.RLock()
	raw := ix.cutLocked()
	ix.mu.RUnlock()
	ix.ranksMu.Unlock()
	return raw.canonical(ix.blockSize, ix.maxBlocks)
}

// cutLocked copies what the snapshot needs. The caller holds ix.ranksMu for
// writing and ix.mu.
func (ix *Index) cutLocked() *rawCut {
	t := &ix.t
	raw := &rawCut{limits: maps.Clone(ix.limits), nodes: make([]rawNode, 0, t.nodes)}
	type frame struct {
		n      nodeID
		parent uint32
	}
	var stack []frame
	push := func(n *node, pos uint32) {
		for _, c := range t.children(n) {
			stack = append(stack, frame{c, pos})
		}
	}
	push(t.root, 0)
	for len(stack) > 0 {
		f := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		n := t.at(f.n)
		raw.nodes = append(raw.nodes, rawNode{n: f.n, key: n.key, parent: f.parent})
		push(n, uint32(len(raw.nodes)))
	}
	raw.ranks = make([]rawRank, 0, len(t.workers))
	for w, ws := range t.workers {
		if !ws.holdsAny() {
			continue // emptied by a removal that is about to drop it
		}
		r := rawRank{w: w, ratio: ws.ratio, dups: maps.Clone(ws.dups)}
		for tier := range ws.blocks {
			m := &ws.blocks[tier]
			if m.count() == 0 {
				continue
			}
			bs := make([]rawBlock, 0, m.count())
			for h, n := range m.all() {
				bs = append(bs, rawBlock{hash: h, n: n})
			}
			r.blocks[tier] = bs
		}
		raw.ranks = append(raw.ranks, r)
	}
	return raw
}

// canonical orders a cut: nodes depth first with children in key order, worker
// ranks by name and rank, blocks by node and hash.
func (raw *rawCut) canonical(blockSize, maxBlocks int) *Snapshot {
	s := &Snapshot{blockSize: blockSize, maxBlocks: maxBlocks}
	for w, n := range raw.limits {
		s.limits = append(s.limits, snapLimit{w, n})
	}
	slices.SortFunc(s.limits, func(a, b snapLimit) int { return strings.Compare(a.worker, b.worker) })

	// Children of raw position p (0 the root) are kids[start[p]:start[p+1]].
	nn := len(raw.nodes)
	start := make([]uint32, nn+2)
	for _, r := range raw.nodes {
		start[r.parent+1]++
	}
	for p := 1; p < len(start); p++ {
		start[p] += start[p-1]
	}
	kids := make([]uint32, nn)
	fill := slices.Clone(start[:nn+1])
	for i, r := range raw.nodes {
		kids[fill[r.parent]] = uint32(i)
		fill[r.parent]++
	}
	for p := range nn + 1 {
		if ks := kids[start[p]:start[p+1]]; len(ks) > 1 {
			slices.SortFunc(ks, func(a, b uint32) int { return cmp.Compare(raw.nodes[a].key, raw.nodes[b].key) })
		}
	}

	// Depth first, smallest key first; pos maps a node to its snapshot position.
	s.keys = make([]uint64, 0, nn)
	s.dists = make([]uint32, 0, nn)
	pos := make(map[nodeID]uint32, nn)
	type frame struct{ raw, parent uint32 } // parent: snapshot position+1, 0 the root
	stack := make([]frame, 0, 64)
	pushKids := func(p, parent uint32) {
		ks := kids[start[p]:start[p+1]]
		for i := len(ks) - 1; i >= 0; i-- {
			stack = append(stack, frame{ks[i], parent})
		}
	}
	pushKids(0, 0)
	for len(stack) > 0 {
		f := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		at := uint32(len(s.keys))
		r := &raw.nodes[f.raw]
		s.keys = append(s.keys, r.key)
		s.dists = append(s.dists, at+1-f.parent)
		pos[r.n] = at
		pushKids(f.raw+1, at+1)
	}

	slices.SortFunc(raw.ranks, func(a, b rawRank) int { return compareWorkerRanks(a.w, b.w) })
	s.ranks = make([]snapRank, len(raw.ranks))
	s.bucketBlocks(raw, pos)
	for i, r := range raw.ranks {
		if len(r.dups) == 0 {
			continue
		}
		for tier := range s.ranks[i].tiers {
			st := &s.ranks[i].tiers[tier]
			for j, b := range st.blocks {
				if c := r.dups[tierKey(b.hash, Tier(tier))]; c > 0 {
					st.dups = append(st.dups, snapDup{pos: uint32(j), count: c})
				}
			}
		}
	}
	return s
}

// bucketBlocks fills every worker rank's block lists sorted by node position,
// then hash: a counting sort over the nodes, so its cost is linear; only
// blocks of one node are compared with each other.
func (s *Snapshot) bucketBlocks(raw *rawCut, pos map[nodeID]uint32) {
	type placed struct {
		list uint32 // rank*numTiers + tier
		hash uint64
	}
	nn := len(raw.nodes)
	for i, r := range raw.ranks {
		s.ranks[i].w, s.ranks[i].ratio = r.w, r.ratio
		for tier, bs := range r.blocks {
			s.ranks[i].tiers[tier].blocks = make([]snapBlock, 0, len(bs))
			s.blocks += len(bs)
		}
	}
	// end[p+1] counts node p's blocks; summed, end[p] is where they start, and
	// after placing them, where they end.
	end := make([]uint32, nn+1)
	at := make([]uint32, 0, s.blocks) // every block's node position, in raw order
	for _, r := range raw.ranks {
		for _, bs := range r.blocks {
			for _, b := range bs {
				p := pos[b.n]
				at = append(at, p)
				end[p+1]++
			}
		}
	}
	for p := 1; p <= nn; p++ {
		end[p] += end[p-1]
	}
	out := make([]placed, s.blocks)
	k := 0
	for i, r := range raw.ranks {
		for tier, bs := range r.blocks {
			for _, b := range bs {
				out[end[at[k]]] = placed{list: uint32(i*numTiers + tier), hash: b.hash}
				end[at[k]]++
				k++
			}
		}
	}
	begin := uint32(0)
	for p := range nn {
		bucket := out[begin:end[p]]
		if len(bucket) > 1 {
			slices.SortFunc(bucket, func(a, b placed) int {
				return cmp.Or(cmp.Compare(a.list, b.list), cmp.Compare(a.hash, b.hash))
			})
		}
		for _, e := range bucket {
			st := &s.ranks[e.list/numTiers].tiers[e.list%numTiers]
			st.blocks = append(st.blocks, snapBlock{node: uint32(p), hash: e.hash})
		}
		begin = end[p]
	}
}

// WriteSnapshot writes a snapshot of the index to w: Snapshot, then Encode.
// Use the two steps when the sources must be read at the cut (see Snapshot).
func (ix *Index) WriteSnapshot(w io.Writer, sources map[catalog.WorkerRank]uint64) error {
	return ix.Snapshot().Encode(w, sources)
}

// Encode writes s to w in the current format version with sources, the last
// sequence number applied from each event source at the cut (nil for none),
// so a replica that loads it can replay each engine from the next one. It
// builds the whole encoding in memory and writes it with one Write call; an
// error is w's, wrapped.
func (s *Snapshot) Encode(w io.Writer, sources map[catalog.WorkerRank]uint64) error {
	size := snapHeaderLen + 64 + 9*len(s.keys) + 10*s.blocks + 4
	for _, r := range s.ranks {
		size += len(r.w.WorkerID) + 32
	}
	for _, l := range s.limits {
		size += len(l.worker) + 12
	}
	buf := make([]byte, snapHeaderLen, size+len(sources)*40)

	buf = binary.AppendUvarint(buf, uint64(s.blockSize))
	buf = binary.AppendUvarint(buf, uint64(s.maxBlocks))
	buf = binary.AppendUvarint(buf, uint64(len(s.limits)))
	for _, l := range s.limits {
		buf = binfmt.AppendString(buf, l.worker)
		buf = binary.AppendUvarint(buf, uint64(l.n))
	}
	srcs := slices.SortedFunc(maps.Keys(sources), compareWorkerRanks)
	buf = binary.AppendUvarint(buf, uint64(len(srcs)))
	for _, src := range srcs {
		buf = binfmt.AppendString(buf, src.WorkerID)
		buf = binary.AppendVarint(buf, int64(src.Rank))
		buf = binary.AppendUvarint(buf, sources[src])
	}
	buf = binary.AppendUvarint(buf, uint64(len(s.keys)))
	for i, k := range s.keys {
		buf = binary.AppendUvarint(buf, uint64(s.dists[i]))
		buf = binary.LittleEndian.AppendUint64(buf, k)
	}
	buf = binary.AppendUvarint(buf, uint64(len(s.ranks)))
	for _, r := range s.ranks {
		buf = binfmt.AppendString(buf, r.w.WorkerID)
		buf = binary.AppendUvarint(buf, uint64(r.w.Rank))
		buf = binary.AppendUvarint(buf, uint64(r.ratio))
		for _, st := range r.tiers {
			buf = binary.AppendUvarint(buf, uint64(len(st.blocks)))
			prev := uint32(0)
			for _, b := range st.blocks {
				buf = binary.AppendUvarint(buf, uint64(b.node-prev))
				buf = binary.LittleEndian.AppendUint64(buf, b.hash)
				prev = b.node
			}
			buf = binary.AppendUvarint(buf, uint64(len(st.dups)))
			next := uint32(0)
			for _, d := range st.dups {
				buf = binary.AppendUvarint(buf, uint64(d.pos-next))
				buf = binary.AppendUvarint(buf, uint64(d.count))
				next = d.pos + 1
			}
		}
	}
	buf = seal(buf)
	if _, err := w.Write(buf); err != nil {
		return fmt.Errorf("kvindex: writing a snapshot of %d bytes: %w", len(buf), err)
	}
	return nil
}

// seal fills in the header of buf, whose payload follows snapHeaderLen
// reserved bytes, and appends the trailer.
func seal(buf []byte) []byte {
	payload := buf[snapHeaderLen:]
	copy(buf, snapMagic)
	binary.LittleEndian.PutUint32(buf[8:], snapVersion)
	binary.LittleEndian.PutUint64(buf[12:], uint64(len(payload)))
	binary.LittleEndian.PutUint32(buf[20:], binfmt.Checksum(buf[:20]))
	return binfmt.AppendChecksum(buf, payload)
}

func compareWorkerRanks(a, b catalog.WorkerRank) int {
	return cmp.Or(strings.Compare(a.WorkerID, b.WorkerID), cmp.Compare(a.Rank, b.Rank))
}
