package kvindex

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/iotest"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

// snapOp is one random operation, built once and applied to several indexes.
type snapOp struct {
	kind  int // snapStore, snapRemove, snapClear, snapRemoveWorker, snapSetLimit
	w     catalog.WorkerRank
	ev    Event
	limit int
}

const (
	snapStore = iota
	snapRemove
	snapClear
	snapRemoveWorker
	snapSetLimit
)

// snapGen draws random operations over the oracle tests' documents (shared
// prefixes that branch) for a random fleet of worker ranks: stores that mostly
// extend what a worker rank stored before, on every tier, with LoRA names and
// cache salts, in engine blocks of one or two index blocks (ratioOf); removals
// mostly of stored blocks; clears, worker removals and rank limits.
type snapGen struct {
	r       *rand.Rand
	g       *opGen
	workers []catalog.WorkerRank
	// frontier is how far each worker rank has stored along a document.
	frontier map[frontierKey]int
}

type frontierKey struct {
	w    catalog.WorkerRank
	doc  int
	lora string
}

func newSnapGen(seed uint64) *snapGen {
	r := rand.New(rand.NewPCG(seed, 11))
	next := func(n int) int {
		if n <= 0 {
			return 0
		}
		return r.IntN(n)
	}
	sg := &snapGen{r: r, g: &opGen{next: next, docs: newDocs(r), bs: oracleBS}, frontier: map[frontierKey]int{}}
	names := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	seen := map[catalog.WorkerRank]bool{}
	for range 2 + r.IntN(12) {
		w := catalog.WorkerRank{WorkerID: names[r.IntN(len(names))], Rank: r.IntN(4)}
		if !seen[w] {
			seen[w] = true
			sg.workers = append(sg.workers, w)
		}
	}
	return sg
}

func (sg *snapGen) op() snapOp {
	w := sg.workers[sg.r.IntN(len(sg.workers))]
	switch p := sg.r.IntN(100); {
	case p < 70:
		return snapOp{kind: snapStore, w: w, ev: sg.store(w)}
	case p < 94:
		return snapOp{kind: snapRemove, w: w, ev: sg.remove(w)}
	case p < 96:
		sg.forget(func(k frontierKey) bool { return k.w == w })
		return snapOp{kind: snapClear, w: w}
	case p < 97:
		sg.forget(func(k frontierKey) bool { return k.w.WorkerID == w.WorkerID })
		return snapOp{kind: snapRemoveWorker, w: w}
	default:
		return snapOp{kind: snapSetLimit, w: w, limit: []int{0, 30, 300}[sg.r.IntN(3)]}
	}
}

func (sg *snapGen) store(w catalog.WorkerRank) Event {
	r, bs, ratio := sg.r, sg.g.bs, ratioOf(w)
	d := r.IntN(len(sg.g.docs))
	var lora string
	if r.IntN(6) == 0 {
		lora = "ad"
	}
	k := frontierKey{w, d, lora}
	doc := sg.g.docs[d]
	nEngine := len(doc) / (bs * ratio)
	start := sg.frontier[k]
	switch r.IntN(10) {
	case 0, 1: // branch off, or store again, somewhere in what was stored
		start = r.IntN(start + 1)
	case 2: // a run whose parent was never stored
		start = r.IntN(nEngine)
	}
	if start >= nEngine {
		start = 0
	}
	n := 1 + r.IntN(min(6, nEngine-start))
	ev := Event{Kind: EventStored, BlockSize: bs * ratio, LoRAName: lora}
	if r.IntN(4) == 0 {
		ev.Tier = Tier(1 + r.IntN(2))
	}
	if lora == "" && r.IntN(8) == 0 {
		ev.CacheSalt = "tenant" // same engine hashes, other content: remaps
	}
	if start > 0 {
		ev.HasParent, ev.ParentHash = true, engineHash(d, start-1, ratio, lora)
	}
	for j := start; j < start+n; j++ {
		ev.BlockHashes = append(ev.BlockHashes, engineHash(d, j, ratio, lora))
	}
	ev.Tokens = slices.Clone(doc[start*bs*ratio : (start+n)*bs*ratio])
	if r.IntN(20) == 0 {
		ev.Tokens = ev.Tokens[1:] // refused
		return ev
	}
	sg.frontier[k] = max(sg.frontier[k], start+n)
	return ev
}

func (sg *snapGen) forget(match func(frontierKey) bool) {
	maps.DeleteFunc(sg.frontier, func(k frontierKey, _ int) bool { return match(k) })
}

func (sg *snapGen) remove(w catalog.WorkerRank) Event {
	r, ratio := sg.r, ratioOf(w)
	d := r.IntN(len(sg.g.docs))
	var lora string
	if r.IntN(6) == 0 {
		lora = "ad"
	}
	ev := Event{Kind: EventRemoved}
	if r.IntN(4) == 0 {
		ev.Tier = Tier(r.IntN(numTiers))
	}
	k := frontierKey{w, d, lora}
	end := sg.frontier[k]
	// Mostly evict the tail of what was stored; sometimes blocks in the middle,
	// or beyond it.
	start := max(0, end-1-r.IntN(4))
	if r.IntN(4) == 0 {
		start = r.IntN(end + 2)
	}
	n := 1 + r.IntN(4)
	for j := start; j < start+n; j++ {
		ev.BlockHashes = append(ev.BlockHashes, engineHash(d, j, ratio, lora))
	}
	if start < end && ev.Tier == TierDevice {
		sg.frontier[k] = start
	}
	return ev
}

// apply applies op to ix and returns what it reported, for comparing indexes.
func (op snapOp) apply(ix *Index) string {
	switch op.kind {
	case snapStore, snapRemove:
		if err := ix.Apply(op.w, op.ev); err != nil {
			return err.Error()
		}
		return "ok"
	case snapClear:
		ix.ClearRank(op.w)
		return "cleared"
	case snapRemoveWorker:
		return fmt.Sprint(ix.RemoveWorker(op.w.WorkerID))
	default:
		ix.SetRankLimit(op.w.WorkerID, op.limit)
		return "limit"
	}
}

// query draws a request and, sometimes, a candidate set.
func (sg *snapGen) query() ([]uint64, MatchOptions) {
	seqs, _ := sg.g.query()
	var opts MatchOptions
	if sg.r.IntN(4) == 0 {
		opts.Candidates = []catalog.WorkerRank{{WorkerID: "nobody"}}
		for _, w := range sg.workers {
			if sg.r.IntN(2) == 0 {
				opts.Candidates = append(opts.Candidates, w)
			}
		}
	}
	opts.StopAtOne = sg.r.IntN(5) == 0
	return seqs, opts
}

func (sg *snapGen) sources() map[catalog.WorkerRank]uint64 {
	src := map[catalog.WorkerRank]uint64{}
	for _, w := range sg.workers {
		switch sg.r.IntN(4) {
		case 0:
		case 1:
			src[w] = 0
		case 2:
			src[w] = math.MaxUint64 - sg.r.Uint64N(3)
		default:
			src[w] = sg.r.Uint64()
		}
	}
	return src
}

func randomIndex(t testing.TB, sg *snapGen, steps int) *Index {
	ix := mustIndex(t, oracleBS)
	for range steps {
		sg.op().apply(ix)
	}
	return ix
}

func writeSnapshot(t testing.TB, ix *Index, sources map[catalog.WorkerRank]uint64) []byte {
	var buf bytes.Buffer
	require.NoError(t, ix.WriteSnapshot(&buf, sources))
	return buf.Bytes()
}

func readSnapshot(t testing.TB, b []byte) (*Index, map[catalog.WorkerRank]uint64) {
	ix, src, err := ReadSnapshot(bytes.NewReader(b), ReadOptions{})
	require.NoError(t, err)
	return ix, src
}

// equalIndexes requires a and b to hold the same state entry by entry: the
// same settings and limits, the same tree node for node (by key path) with the
// same holders per tier counted with their repeated memberships, and for every
// worker rank the same engine blocks per tier, mapped to the same prefix, with
// the same repeated stores. Slot numbers may differ; nothing observable
// depends on them.
func equalIndexes(t testing.TB, a, b *Index) {
	t.Helper()
	a.mu.RLock()
	defer a.mu.RUnlock()
	b.mu.RLock()
	defer b.mu.RUnlock()
	require.Equal(t, a.blockSize, b.blockSize, "block size")
	require.Equal(t, a.maxBlocks, b.maxBlocks, "max blocks per rank")
	require.Equal(t, a.limits, b.limits, "rank limits")
	require.Equal(t, a.t.nodes, b.t.nodes, "nodes")
	require.Equal(t, a.t.entries, b.t.entries, "memberships")
	require.Equal(t, a.t.lowerEntries, b.t.lowerEntries, "host and disk memberships")
	require.Equal(t, a.t.mapEntries, b.t.mapEntries, "block map entries")
	require.Equal(t, len(a.t.workers), len(b.t.workers), "worker ranks")

	// Walk both trees together, pairing nodes by key path.
	pair := map[nodeID]nodeID{}
	var walk func(na, nb nodeID, depth int)
	walk = func(na, nb nodeID, depth int) {
		ka, kb := childKeys(&a.t, na), childKeys(&b.t, nb)
		require.Equal(t, ka, kb, "children at depth %d", depth)
		for _, k := range ka {
			ca, _ := a.t.childFor(a.t.at(na), k)
			cb, _ := b.t.childFor(b.t.at(nb), k)
			pair[ca] = cb
			for tier := range Tier(numTiers) {
				require.Equal(t, holders(&a.t, ca, tier), holders(&b.t, cb, tier), "holders of %#x on %v", k, tier)
			}
			walk(ca, cb, depth+1)
		}
	}
	walk(rootID, rootID, 0)

	for w, wa := range a.t.workers {
		wb := b.t.workers[w]
		require.NotNil(t, wb, "worker rank %v", w)
		require.Equal(t, wa.ratio, wb.ratio, "ratio of %v", w)
		require.Equal(t, len(wa.dups), len(wb.dups), "repeated stores of %v", w)
		for k, c := range wa.dups {
			require.Equal(t, c, wb.dups[k], "repeated stores of %v", w)
		}
		for tier := range Tier(numTiers) {
			require.Equal(t, wa.blocks[tier].count(), wb.blocks[tier].count(), "blocks of %v on %v", w, tier)
			for h, na := range wa.blocks[tier].all() {
				nb := wb.blocks[tier].get(h)
				require.NotZero(t, nb, "block %#x of %v on %v", h, w, tier)
				require.Equal(t, pair[na], nb, "prefix of block %#x of %v", h, w)
			}
		}
	}
}

func childKeys(tr *tree, id nodeID) []uint64 {
	var ks []uint64
	for k := range tr.children(tr.at(id)) {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// holders returns n's holders on tier, each with its number of memberships.
func holders(t *tree, id nodeID, tier Tier) map[catalog.WorkerRank]uint32 {
	var words []sword
	n, e := t.at(id), t.extOf(t.at(id))
	switch {
	case tier == TierDevice:
		words = t.devWords(n)
	case e == nil:
	case tier == TierHost:
		words = e.host.words()
	default:
		words = e.disk.words()
	}
	out := map[catalog.WorkerRank]uint32{}
	for _, w := range words {
		for b := range 64 {
			if w.bits&(1<<b) != 0 {
				slot := w.idx<<6 | uint32(b)
				out[t.slots[slot].key] = 1 + t.extra[extraKey{heldKey{id, tier}, slot}]
			}
		}
	}
	return out
}

// checkLoaded verifies a loaded index's bookkeeping by recounting its tree
// (checkStructure), and that every block-map entry points at a node the worker
// rank holds on that tier.
func checkLoaded(t testing.TB, ix *Index) {
	t.Helper()
	// checkStructure also compares the worker ranks with an oracle's; give it
	// one that has the index's own.
	o := newOracle(ix.blockSize)
	for w := range ix.t.workers {
		o.workers[w] = nil
	}
	checkStructure(t, ix, o)
	for w, ws := range ix.t.workers {
		for tier := range ws.blocks {
			for h, n := range ws.blocks[tier].all() {
				_, ok := holders(&ix.t, n, Tier(tier))[w]
				require.True(t, ok, "block %#x of %v on %v points at a node it does not hold", h, w, Tier(tier))
			}
		}
	}
}

// requireSameAnswers runs queries against both indexes and requires equal
// matches (order aside).
func requireSameAnswers(t testing.TB, sg *snapGen, a, b *Index, queries int) {
	t.Helper()
	nonEmpty := 0
	for q := range queries {
		seqs, opts := sg.query()
		want := a.FindMatches(seqs, opts)
		got := b.FindMatches(seqs, opts)
		sortMatches(want)
		sortMatches(got)
		require.Equal(t, want, got, "query %d of %d blocks", q, len(seqs))
		if len(want) > 0 {
			nonEmpty++
		}
	}
	require.Positive(t, nonEmpty, "no query matched anything: the comparison proves nothing")
}

func rankBlocks(ix *Index) map[catalog.WorkerRank][numTiers]int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	out := map[catalog.WorkerRank][numTiers]int{}
	for w, ws := range ix.t.workers {
		var n [numTiers]int
		for tier := range ws.blocks {
			n[tier] = ws.blocks[tier].count()
		}
		out[w] = n
	}
	return out
}

// TestSnapshotRoundTrip: a random index read back from its snapshot is equal
// to it entry by entry, answers every query alike, has the same blocks per
// worker rank and tier, carries the sources' sequence numbers, encodes to the
// same bytes, and keeps behaving alike under the same further events.
func TestSnapshotRoundTrip(t *testing.T) {
	var dups, lower, remapped, limited int
	for seed := range uint64(30) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			sg := newSnapGen(seed)
			orig := randomIndex(t, sg, 200+sg.r.IntN(1500))
			sources := sg.sources()
			snap := writeSnapshot(t, orig, sources)

			loaded, gotSources := readSnapshot(t, snap)
			checkLoaded(t, loaded)
			equalIndexes(t, orig, loaded)
			require.Equal(t, rankBlocks(orig), rankBlocks(loaded))
			require.Equal(t, sources, gotSources)
			st, lst := orig.Stats(), loaded.Stats()
			require.Equal(t, [3]int{st.Nodes, st.Entries, st.WorkerRanks}, [3]int{lst.Nodes, lst.Entries, lst.WorkerRanks})
			require.Zero(t, lst.Applied, "a loaded index's counters start at zero")
			requireSameAnswers(t, sg, orig, loaded, 300)
			require.Equal(t, snap, writeSnapshot(t, loaded, sources), "re-encoding differs")

			orig.mu.RLock()
			for _, ws := range orig.t.workers {
				dups += len(ws.dups)
				lower += ws.blocks[TierHost].count() + ws.blocks[TierDisk].count()
			}
			remapped += len(orig.t.extra)
			limited += len(orig.limits)
			orig.mu.RUnlock()

			for i := range 400 {
				op := sg.op()
				require.Equal(t, op.apply(orig), op.apply(loaded), "further op %d", i)
			}
			equalIndexes(t, orig, loaded)
			requireSameAnswers(t, sg, orig, loaded, 100)
		})
	}
	// The random indexes must have exercised what the format carries.
	require.Positive(t, dups, "no repeated stores")
	require.Positive(t, lower, "no host or disk blocks")
	require.Positive(t, remapped, "no node held twice by one worker rank")
	require.Positive(t, limited, "no rank limits")
}

// TestSnapshotEmpty: an empty index with no sources round-trips to an empty,
// usable index and an empty (non-nil) source map.
func TestSnapshotEmpty(t *testing.T) {
	ix := mustIndex(t, 16)
	snap := writeSnapshot(t, ix, nil)
	loaded, src := readSnapshot(t, snap)
	require.NotNil(t, src)
	require.Empty(t, src)
	require.Equal(t, 16, loaded.BlockSize())
	require.Equal(t, Stats{ApproxBytes: int64(chunkBytes)}, loaded.Stats(), "nothing but the arena's first chunk")
	equalIndexes(t, ix, loaded)
	toks := make([]uint32, 32)
	w := catalog.WorkerRank{WorkerID: "w"}
	require.NoError(t, loaded.Apply(w, Event{Kind: EventStored, BlockHashes: []uint64{1, 2}, Tokens: toks}))
	require.Equal(t, 2, only(loaded.FindMatches(seqsOf(t, 16, toks), MatchOptions{}), w).Device)
}

// TestSnapshotSources: sequence numbers round-trip exactly, for any worker
// rank key, with or without blocks in the index.
func TestSnapshotSources(t *testing.T) {
	src := map[catalog.WorkerRank]uint64{
		{WorkerID: "a"}:                       0,
		{WorkerID: "a", Rank: 7}:              1,
		{WorkerID: "b", Rank: math.MaxInt32}:  math.MaxUint64,
		{WorkerID: "", Rank: -1}:              42,
		{WorkerID: strings.Repeat("x", 1024)}: 1 << 40,
	}
	_, got := readSnapshot(t, writeSnapshot(t, mustIndex(t, 4), src))
	require.Equal(t, src, got)
}

// smallSnapshot is a snapshot of a few hundred bytes that uses every section:
// limits, sources, branching prefixes, host and disk blocks, a two-block engine
// block, a repeated store.
func smallSnapshot(t testing.TB) []byte {
	ix := mustIndex(t, 2)
	a, b := catalog.WorkerRank{WorkerID: "a"}, catalog.WorkerRank{WorkerID: "b", Rank: 1}
	toks := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	store := func(w catalog.WorkerRank, ev Event) {
		ev.Kind = EventStored
		require.NoError(t, ix.Apply(w, ev))
	}
	store(a, Event{BlockHashes: []uint64{11, 12, 13}, Tokens: toks[:6]})
	store(a, Event{BlockHashes: []uint64{11, 12, 13}, Tokens: toks[:6]}) // repeated
	store(a, Event{BlockHashes: []uint64{14}, Tokens: []uint32{9, 9}, HasParent: true, ParentHash: 11, Tier: TierHost})
	store(a, Event{BlockHashes: []uint64{15}, Tokens: toks[:2], Tier: TierDisk, LoRAName: "ad"})
	store(b, Event{BlockHashes: []uint64{21, 22}, Tokens: toks, BlockSize: 4})
	ix.SetRankLimit("b", 100)
	return writeSnapshot(t, ix, map[catalog.WorkerRank]uint64{a: 7, b: 1 << 33})
}

// TestSnapshotTruncated: every proper prefix of a snapshot, the empty one
// included, is ErrSnapshotCorrupt (and io.ErrUnexpectedEOF), never a panic or
// an index.
func TestSnapshotTruncated(t *testing.T) {
	snap := smallSnapshot(t)
	for n := range len(snap) {
		ix, src, err := ReadSnapshot(bytes.NewReader(snap[:n]), ReadOptions{})
		require.ErrorIs(t, err, ErrSnapshotCorrupt, "prefix of %d bytes", n)
		require.ErrorIs(t, err, io.ErrUnexpectedEOF, "prefix of %d bytes", n)
		require.Nil(t, ix)
		require.Nil(t, src)
	}
	_, _, err := ReadSnapshot(bytes.NewReader(snap), ReadOptions{})
	require.NoError(t, err)
}

// TestSnapshotBitFlips: flipping any bit of a snapshot is ErrSnapshotCorrupt,
// or ErrSnapshotVersion when the bit is in the version field.
func TestSnapshotBitFlips(t *testing.T) {
	snap := smallSnapshot(t)
	bad := make([]byte, len(snap))
	for i := range snap {
		for bit := range 8 {
			copy(bad, snap)
			bad[i] ^= 1 << bit
			ix, _, err := ReadSnapshot(bytes.NewReader(bad), ReadOptions{})
			require.Nil(t, ix)
			if i >= 8 && i < 12 {
				require.ErrorIs(t, err, ErrSnapshotVersion, "byte %d bit %d", i, bit)
			} else {
				require.ErrorIs(t, err, ErrSnapshotCorrupt, "byte %d bit %d", i, bit)
			}
		}
	}
}

// resealHeader rewrites a snapshot's version and fixes the header checksum.
func resealHeader(snap []byte, version uint32) []byte {
	b := slices.Clone(snap)
	binary.LittleEndian.PutUint32(b[8:], version)
	binary.LittleEndian.PutUint32(b[20:], crc32.Checksum(b[:20], crc32.MakeTable(crc32.Castagnoli)))
	return b
}

// TestSnapshotVersion: a well-formed header of another version is
// ErrSnapshotVersion, naming the version, and not ErrSnapshotCorrupt.
func TestSnapshotVersion(t *testing.T) {
	snap := smallSnapshot(t)
	for _, v := range []uint32{0, 2, math.MaxUint32} {
		_, _, err := ReadSnapshot(bytes.NewReader(resealHeader(snap, v)), ReadOptions{})
		require.ErrorIs(t, err, ErrSnapshotVersion)
		require.NotErrorIs(t, err, ErrSnapshotCorrupt)
		require.ErrorContains(t, err, fmt.Sprintf("version %d", v))
	}
	_, _, err := ReadSnapshot(strings.NewReader("not a snapshot, not even close"), ReadOptions{})
	require.ErrorIs(t, err, ErrSnapshotCorrupt)
	require.ErrorContains(t, err, "magic")
}

// TestSnapshotLimits: each bound accepts a snapshot exactly at it and refuses
// it one below with ErrSnapshotLimit, naming the option.
func TestSnapshotLimits(t *testing.T) {
	ix := mustIndex(t, 2)
	long := strings.Repeat("w", 40)
	srcs := map[catalog.WorkerRank]uint64{}
	for i := range 3 {
		// Three ranks of two chained blocks each, sharing the first: 4 nodes,
		// 6 blocks.
		w := catalog.WorkerRank{WorkerID: long, Rank: i}
		require.NoError(t, ix.Apply(w, Event{Kind: EventStored, BlockHashes: []uint64{1, uint64(2 + i)}, Tokens: []uint32{1, 1, 2, uint32(i)}}))
		if i < 2 {
			srcs[w] = uint64(i)
		}
	}
	snap := writeSnapshot(t, ix, srcs)
	cases := []struct {
		option string
		at     int
		set    func(*ReadOptions, int)
	}{
		{"MaxBytes", len(snap) - snapHeaderLen - 4, func(o *ReadOptions, v int) { o.MaxBytes = v }},
		{"MaxWorkerRanks", 3, func(o *ReadOptions, v int) { o.MaxWorkerRanks = v }},
		{"MaxNodes", 4, func(o *ReadOptions, v int) { o.MaxNodes = v }},
		{"MaxBlocks", 6, func(o *ReadOptions, v int) { o.MaxBlocks = v }},
		{"MaxStringLen", len(long), func(o *ReadOptions, v int) { o.MaxStringLen = v }},
	}
	for _, c := range cases {
		t.Run(c.option, func(t *testing.T) {
			var opts ReadOptions
			c.set(&opts, c.at)
			_, _, err := ReadSnapshot(bytes.NewReader(snap), opts)
			require.NoError(t, err, "exactly at the bound")
			c.set(&opts, c.at-1)
			ix, _, err := ReadSnapshot(bytes.NewReader(snap), opts)
			require.ErrorIs(t, err, ErrSnapshotLimit)
			require.NotErrorIs(t, err, ErrSnapshotCorrupt)
			require.ErrorContains(t, err, "ReadOptions."+c.option)
			require.Nil(t, ix)
		})
	}
	// An engine block counts as the index blocks it covers: smallSnapshot holds
	// 5 blocks of one and 2 of two.
	_, _, err := ReadSnapshot(bytes.NewReader(smallSnapshot(t)), ReadOptions{MaxBlocks: 9})
	require.NoError(t, err)
	_, _, err = ReadSnapshot(bytes.NewReader(smallSnapshot(t)), ReadOptions{MaxBlocks: 8})
	require.ErrorIs(t, err, ErrSnapshotLimit)
	require.ErrorContains(t, err, "of 2 index blocks each")

	// Sources and limits count against MaxWorkerRanks on their own.
	ix.SetRankLimit("x", 5)
	ix.SetRankLimit("y", 5)
	ix.SetRankLimit("z", 5)
	ix.SetRankLimit("zz", 5)
	_, _, err = ReadSnapshot(bytes.NewReader(writeSnapshot(t, ix, nil)), ReadOptions{MaxWorkerRanks: 3})
	require.ErrorIs(t, err, ErrSnapshotLimit)
	require.ErrorContains(t, err, "4 limits")
	srcs[catalog.WorkerRank{WorkerID: "x"}] = 1
	srcs[catalog.WorkerRank{WorkerID: "y"}] = 1
	_, _, err = ReadSnapshot(bytes.NewReader(writeSnapshot(t, mustIndex(t, 2), srcs)), ReadOptions{MaxWorkerRanks: 3})
	require.ErrorIs(t, err, ErrSnapshotLimit)
	require.ErrorContains(t, err, "4 sources")
}

// payloadBuilder writes hand-made payloads for the structure tests.
type payloadBuilder []byte

func (p payloadBuilder) uv(vs ...uint64) payloadBuilder {
	for _, v := range vs {
		p = binary.AppendUvarint(p, v)
	}
	return p
}

func (p payloadBuilder) u64(v uint64) payloadBuilder { return binary.LittleEndian.AppendUint64(p, v) }

func (p payloadBuilder) str(s string) payloadBuilder { return append(p.uv(uint64(len(s))), s...) }

// sealed returns the snapshot of payload p, with valid checksums.
func (p payloadBuilder) sealed() []byte {
	return seal(append(make([]byte, snapHeaderLen), p...))
}

// payloadHead is a payload's settings (block size 2, limit 100), no limits and no
// sources.
func payloadHead() payloadBuilder { return payloadBuilder{}.uv(2, 100, 0, 0) }

// payloadChain2 is two chained nodes, keys 1 and 2.
func payloadChain2() payloadBuilder { return payloadHead().uv(2).uv(1).u64(1).uv(1).u64(2) }

// noTiers is two empty tiers (no blocks, no dups).
func (p payloadBuilder) noTiers() payloadBuilder { return p.uv(0, 0, 0, 0) }

// TestSnapshotMalformed: a snapshot with valid checksums whose contents no
// Index could have written is ErrSnapshotCorrupt, naming what is wrong.
func TestSnapshotMalformed(t *testing.T) {
	// Worker "w" rank 0 ratio 1 holds both nodes on device, as engine blocks 6
	// and 7.
	valid := payloadChain2().uv(1).str("w").uv(0, 1).uv(2, 0).u64(6).uv(1).u64(7).uv(0).noTiers()
	ix, _, err := ReadSnapshot(bytes.NewReader(valid.sealed()), ReadOptions{})
	require.NoError(t, err, "the base payload must be valid")
	require.Equal(t, 2, only(ix.FindMatches([]uint64{1, 2}, MatchOptions{}), catalog.WorkerRank{WorkerID: "w"}).Device)

	cases := []struct {
		name, msg string
		p         payloadBuilder
	}{
		{"empty payload", "varint", payloadBuilder{}},
		{"block size 0", "block size 0", payloadBuilder{}.uv(0, 100, 0, 0, 0, 0)},
		{"limit 0", "limit 0", payloadBuilder{}.uv(2, 100, 1).str("w").uv(0, 0, 0, 0)},
		{"limit repeats", "repeats", payloadBuilder{}.uv(2, 100, 2).str("w").uv(5).str("w").uv(6, 0, 0, 0)},
		{"source repeats", "repeats", payloadBuilder{}.uv(2, 100, 0, 2).str("w").uv(0, 1).str("w").uv(0, 2, 0, 0)},
		{"more nodes than bytes", "nodes in", payloadHead().uv(1000).uv(1).u64(1)},
		{"parent distance 0", "parent distance 0", payloadHead().uv(1, 0).u64(1)},
		{"parent before the root", "parent distance 2", payloadHead().uv(1, 2).u64(1)},
		{"key repeats under one parent", "repeats key", payloadHead().uv(2).uv(1).u64(1).uv(2).u64(1)},
		// The overlong distance (1 in four bytes) passes the count's byte check.
		{"payload ends inside a key", "64-bit", append(payloadHead().uv(1), 0x81, 0x80, 0x80, 0x00, 1, 2, 3, 4, 5)},
		{"bad varint", "varint", payloadHead().uv(1, 1).u64(1).uv(1).str("w").uv(0).u64(math.MaxUint64).u64(math.MaxUint64)},
		{"block names a missing node", "names node 2 of 2", payloadChain2().uv(1).str("w").uv(0, 1).uv(1, 2).u64(7).uv(0).noTiers()},
		{"engine block deeper than its node", "depth 2", payloadChain2().uv(1).str("w").uv(0, 3).uv(1, 1).u64(7).uv(0).noTiers()},
		{"block repeats on a tier", "repeats on tier", payloadChain2().uv(1).str("w").uv(0, 1).uv(2, 1).u64(7).uv(0).u64(7).uv(0).noTiers()},
		{"empty worker name", "empty worker", payloadChain2().uv(1).str("").uv(0, 1).uv(1, 1).u64(7).uv(0).noTiers()},
		{"worker rank repeats", "repeats", payloadChain2().uv(2).str("w").uv(0, 1).uv(1, 1).u64(7).uv(0).noTiers().str("w").uv(0, 1).uv(1, 1).u64(7).uv(0).noTiers()},
		{"worker rank holds nothing", "holds no blocks", payloadChain2().uv(1).str("w").uv(0, 1).uv(0, 0).noTiers()},
		{"node held by nobody", "held by no worker rank", payloadChain2().uv(1).str("w").uv(0, 1).uv(1, 0).u64(7).uv(0).noTiers()},
		{"repeated store of a missing block", "repeated store", payloadChain2().uv(1).str("w").uv(0, 1).uv(1, 1).u64(7).uv(1, 1, 1).noTiers()},
		{"repeated store count 0", "count 0", payloadChain2().uv(1).str("w").uv(0, 1).uv(1, 1).u64(7).uv(1, 0, 0).noTiers()},
		{"more dups than blocks", "repeated stores 2", payloadChain2().uv(1).str("w").uv(0, 1).uv(1, 1).u64(7).uv(2, 0, 1).noTiers()},
		{"trailing bytes", "after the last", append(valid, 0)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ix, src, err := ReadSnapshot(bytes.NewReader(c.p.sealed()), ReadOptions{})
			require.ErrorIs(t, err, ErrSnapshotCorrupt)
			require.ErrorContains(t, err, c.msg)
			require.Nil(t, ix)
			require.Nil(t, src)
		})
	}
}

// TestSnapshotReadOptions: the block size must agree, MaxBlocksPerRank and
// OnStored apply to the new index, negative bounds are invalid.
func TestSnapshotReadOptions(t *testing.T) {
	snap := smallSnapshot(t) // block size 2; worker "a" holds 3 device blocks
	_, _, err := ReadSnapshot(bytes.NewReader(snap), ReadOptions{Index: Options{BlockSize: 4}})
	require.ErrorIs(t, err, ErrBlockSize)
	for _, bad := range []ReadOptions{{MaxNodes: -1}, {MaxNodes: MaxNodes + 1}, {MaxBytes: -1, MaxStringLen: -2}, {Index: Options{MaxBlocksPerRank: -1}}} {
		_, _, err := ReadSnapshot(bytes.NewReader(snap), bad)
		require.ErrorIs(t, err, ErrInvalidOptions)
	}

	var stored [][]uint64
	ix, _, err := ReadSnapshot(bytes.NewReader(snap), ReadOptions{Index: Options{
		BlockSize:        2,
		MaxBlocksPerRank: 4,
		OnStored:         func(_ catalog.WorkerRank, keys []uint64) { stored = append(stored, slices.Clone(keys)) },
	}})
	require.NoError(t, err)
	require.Empty(t, stored, "OnStored is not called for loaded blocks")
	a := catalog.WorkerRank{WorkerID: "a"}
	require.NoError(t, ix.Apply(a, Event{Kind: EventStored, BlockHashes: []uint64{31}, Tokens: []uint32{5, 5}}))
	require.Len(t, stored, 1)
	require.ErrorIs(t, ix.Apply(a, Event{Kind: EventStored, BlockHashes: []uint64{32}, Tokens: []uint32{6, 6}}), ErrRankFull)

	// Without an override, the snapshot's limits hold: b's is 100.
	ix, _ = readSnapshot(t, snap)
	require.Equal(t, DefaultMaxBlocksPerRank, ix.maxBlocks)
	require.Equal(t, map[string]int{"b": 100}, ix.limits)
}

// TestSnapshotReader: ReadSnapshot reads exactly one snapshot from a stream
// that delivers bytes in small pieces, and returns the reader's own errors
// wrapped, not as corruption.
func TestSnapshotReader(t *testing.T) {
	first, second := smallSnapshot(t), writeSnapshot(t, mustIndex(t, 8), nil)
	r := iotest.OneByteReader(bytes.NewReader(slices.Concat(first, second, []byte("rest"))))
	ix, src, err := ReadSnapshot(r, ReadOptions{})
	require.NoError(t, err)
	require.Len(t, src, 2)
	require.Equal(t, 2, ix.BlockSize())
	ix, _, err = ReadSnapshot(iotest.HalfReader(r), ReadOptions{})
	require.NoError(t, err)
	require.Equal(t, 8, ix.BlockSize())
	rest, err := io.ReadAll(r)
	require.NoError(t, err)
	require.Equal(t, "rest", string(rest))

	boom := errors.New("connection reset")
	for _, n := range []int{0, 10, snapHeaderLen + 5} {
		_, _, err := ReadSnapshot(io.MultiReader(bytes.NewReader(first[:n]), iotest.ErrReader(boom)), ReadOptions{})
		require.ErrorIs(t, err, boom)
		require.NotErrorIs(t, err, ErrSnapshotCorrupt)
	}

	require.ErrorIs(t, mustIndex(t, 2).WriteSnapshot(failWriter{boom}, nil), boom)
}

type failWriter struct{ err error }

func (w failWriter) Write([]byte) (int, error) { return 0, w.err }

// TestSnapshotAllocationBounded: a snapshot that claims more than it holds
// costs memory in proportion to what it holds: a header claiming 1 GiB
// followed by 100 bytes, and a payload claiming 16M nodes in a few bytes.
func TestSnapshotAllocationBounded(t *testing.T) {
	hdr := make([]byte, snapHeaderLen)
	copy(hdr, snapMagic)
	binary.LittleEndian.PutUint32(hdr[8:], snapVersion)
	binary.LittleEndian.PutUint64(hdr[12:], defaultSnapMaxBytes)
	binary.LittleEndian.PutUint32(hdr[20:], crc32.Checksum(hdr[:20], crc32.MakeTable(crc32.Castagnoli)))
	lying := append(hdr, make([]byte, 100)...)
	manyNodes := payloadHead().uv(defaultSnapMaxNodes).uv(1).u64(1).sealed()

	for name, in := range map[string][]byte{"payload length": lying, "node count": manyNodes} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		_, _, err := ReadSnapshot(bytes.NewReader(in), ReadOptions{})
		runtime.ReadMemStats(&after)
		require.ErrorIs(t, err, ErrSnapshotCorrupt, name)
		require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20), "%s: bytes allocated", name)
	}
}

// TestSnapshotConsistentCut: snapshots taken while events are applied are cuts
// between two events. Event i stores two blocks for worker i%W, so after k
// events the block counts follow from k alone; every snapshot's counts must
// match some k, and its lookups the blocks it holds.
func TestSnapshotConsistentCut(t *testing.T) {
	const (
		workers = 4
		events  = 2000
		bs      = 2
	)
	ix := mustIndex(t, bs)
	tokens := func(w, i int) []uint32 { return []uint32{uint32(w), uint32(i), uint32(w), uint32(i)} }
	// The applier stops halfway until a snapshot has been taken, so one cut
	// lies strictly inside the run; the others race with it.
	half, resume, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	release := sync.OnceFunc(func() { close(resume) })
	defer func() { release(); <-done }()
	go func() {
		defer close(done)
		for i := range events {
			if i == events/2 {
				close(half)
				<-resume
			}
			w, n := i%workers, i/workers
			ev := Event{Kind: EventStored, BlockHashes: []uint64{uint64(2*n + 1), uint64(2*n + 2)}, Tokens: tokens(w, n)}
			if n > 0 {
				ev.HasParent, ev.ParentHash = true, uint64(2*n)
			}
			if err := ix.Apply(catalog.WorkerRank{WorkerID: fmt.Sprint(w)}, ev); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	h, err := NewHasher(bs, HashOptions{})
	require.NoError(t, err)
	var chains [workers][]uint64
	for w := range workers {
		var toks []uint32
		for n := range events / workers {
			toks = append(toks, tokens(w, n)...)
		}
		chains[w] = h.SeqHashes(toks)
	}
	cuts := map[int]bool{}
	// snapshot takes a snapshot, reads it back and returns after how many
	// events it was cut.
	snapshot := func() int {
		var buf bytes.Buffer
		require.NoError(t, ix.WriteSnapshot(&buf, nil))
		loaded, _ := readSnapshot(t, buf.Bytes())
		blocks := rankBlocks(loaded)
		k := 0
		for w := range workers {
			k += blocks[catalog.WorkerRank{WorkerID: fmt.Sprint(w)}][TierDevice] / 2
		}
		for w := range workers {
			wr := catalog.WorkerRank{WorkerID: fmt.Sprint(w)}
			want := 2 * ((k - w + workers - 1) / workers) // blocks after k events
			require.Equal(t, want, blocks[wr][TierDevice], "cut after %d events, worker %d", k, w)
			require.Equal(t, want, only(loaded.FindMatches(chains[w], MatchOptions{}), wr).Device)
		}
		cuts[k] = true
		return k
	}
	select {
	case <-half:
	case <-done:
		t.Fatal("the applier stopped early")
	}
	require.Equal(t, events/2, snapshot())
	release()
	for running := true; running; {
		select {
		case <-done:
			running = false
		default:
		}
		snapshot()
	}
	require.True(t, cuts[events], "the last snapshot must see every event")
	inside := 0
	for k := range cuts {
		if k > 0 && k < events {
			inside++
		}
	}
	require.Positive(t, inside, "no snapshot fell inside the run")
}
