package kvindex

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"slices"
	"sort"
	"testing"

	"github.com/kvselect/kvselect/catalog"
	"github.com/stretchr/testify/require"
)

// oracle is the naive reference model of an Index: per worker rank and tier, a map
// from engine block hash to the sequence hashes that block covers, and a reference
// count for repeated stores. Lookups scan it block by block.
type oracle struct {
	bs      int
	workers map[catalog.WorkerRank]*oracleWorker
}

type oracleWorker struct {
	ratio  int
	blocks [numTiers]map[uint64]*oracleBlock
}

type oracleBlock struct {
	seqs  []uint64 // covered sequence hashes, shallowest first
	count int
}

func newOracle(bs int) *oracle {
	return &oracle{bs: bs, workers: map[catalog.WorkerRank]*oracleWorker{}}
}

func (o *oracle) holdsAny(ow *oracleWorker) bool {
	for _, m := range ow.blocks {
		if len(m) > 0 {
			return true
		}
	}
	return false
}

// apply mirrors Index.Apply and returns whether the event should be accepted.
func (o *oracle) apply(w catalog.WorkerRank, ev Event) bool {
	ow := o.workers[w]
	switch ev.Kind {
	case EventCleared:
		delete(o.workers, w)
		return true
	case EventRemoved:
		if ow == nil {
			return len(ev.BlockHashes) == 0
		}
		known := true
		for _, h := range ev.BlockHashes {
			b := ow.blocks[ev.Tier][h]
			if b == nil {
				known = false
				continue
			}
			b.count--
			if b.count == 0 {
				delete(ow.blocks[ev.Tier], h)
			}
		}
		if !o.holdsAny(ow) {
			delete(o.workers, w)
		}
		return known
	}
	nb := len(ev.BlockHashes)
	if nb == 0 {
		return true
	}
	bs := ev.BlockSize
	if bs == 0 {
		bs = o.bs
	}
	if bs%o.bs != 0 || len(ev.Tokens) != nb*bs {
		return false
	}
	seen := map[uint64]bool{}
	if ev.HasParent {
		seen[ev.ParentHash] = true
	}
	for _, h := range ev.BlockHashes {
		if seen[h] {
			return false
		}
		seen[h] = true
	}
	ratio := bs / o.bs
	if ow != nil && ow.ratio != ratio && o.holdsAny(ow) {
		return false
	}
	var prev uint64
	hasPrev := false
	if ev.HasParent {
		var pb *oracleBlock
		if ow != nil {
			pb = ow.blocks[ev.Tier][ev.ParentHash]
			for t := range Tier(numTiers) {
				if pb == nil {
					pb = ow.blocks[t][ev.ParentHash]
				}
			}
		}
		if pb == nil {
			return false
		}
		prev, hasPrev = pb.seqs[len(pb.seqs)-1], true
	}
	if ow == nil {
		ow = &oracleWorker{}
		o.workers[w] = ow
	}
	ow.ratio = ratio
	if ow.blocks[ev.Tier] == nil {
		ow.blocks[ev.Tier] = map[uint64]*oracleBlock{}
	}
	ho := HashOptions{LoRAName: ev.LoRAName, CacheSalt: ev.CacheSalt}
	for j, h := range ev.BlockHashes {
		var seqs []uint64
		for s := 0; s < ratio; s++ {
			off := j*bs + s*o.bs
			var extra uint64
			if ev.Extra != nil {
				extra = ev.Extra[j]
			}
			seed := ho.laterSeed()
			if !hasPrev {
				seed = ho.seed()
			}
			local := blockHash(seed, ev.Tokens[off:off+o.bs], extra)
			if hasPrev {
				prev = chainHash(prev, local)
			} else {
				prev, hasPrev = local, true
			}
			seqs = append(seqs, prev)
		}
		if b := ow.blocks[ev.Tier][h]; b != nil && equalSeqs(b.seqs, seqs) {
			b.count++
			continue
		}
		ow.blocks[ev.Tier][h] = &oracleBlock{seqs: seqs, count: 1}
	}
	return true
}

func equalSeqs(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func (o *oracle) held(ow *oracleWorker, tiers []Tier, seq uint64) bool {
	for _, t := range tiers {
		for _, b := range ow.blocks[t] {
			for _, s := range b.seqs {
				if s == seq {
					return true
				}
			}
		}
	}
	return false
}

func (o *oracle) findMatches(seqs []uint64, cands []catalog.WorkerRank) []Match {
	var out []Match
	allowed := func(w catalog.WorkerRank) bool {
		if cands == nil {
			return true
		}
		for _, c := range cands {
			if c == w {
				return true
			}
		}
		return false
	}
	for w, ow := range o.workers {
		if !allowed(w) {
			continue
		}
		depth := func(tiers ...Tier) int {
			d := 0
			for d < len(seqs) && o.held(ow, tiers, seqs[d]) {
				d++
			}
			return d
		}
		d0 := depth(TierDevice)
		d1 := depth(TierDevice, TierHost)
		d2 := depth(TierDevice, TierHost, TierDisk)
		if d2 > 0 {
			out = append(out, Match{Worker: w, Device: d0, Host: d1 - d0, Disk: d2 - d1})
		}
	}
	sortMatches(out)
	return out
}

func sortMatches(ms []Match) {
	sort.Slice(ms, func(i, j int) bool {
		if ms[i].Worker.WorkerID != ms[j].Worker.WorkerID {
			return ms[i].Worker.WorkerID < ms[j].Worker.WorkerID
		}
		return ms[i].Worker.Rank < ms[j].Worker.Rank
	})
}

// opGen drives random operations from a byte-or-PRNG source over a small universe
// of documents so that prefixes are shared, parents are often (not always) known,
// and stores, removes and clears collide.
type opGen struct {
	next func(n int) int
	docs [][]uint32
	bs   int
}

const oracleBS = 4

func newDocs(r *rand.Rand) [][]uint32 {
	base := make([]uint32, 40*oracleBS)
	for i := range base {
		base[i] = uint32(r.IntN(50))
	}
	docs := make([][]uint32, 6)
	for d := range docs {
		doc := append([]uint32(nil), base...)
		// Diverge after a per-document shared prefix.
		from := (d * 7 % 30) * oracleBS
		for i := from; i < len(doc); i++ {
			doc[i] = uint32(r.IntN(1000))
		}
		if d == 0 {
			doc = base
		}
		docs[d] = doc
	}
	return docs
}

var oracleWorkers = []catalog.WorkerRank{{WorkerID: "a", Rank: 0}, {WorkerID: "a", Rank: 1}, {WorkerID: "b", Rank: 0}, {WorkerID: "c", Rank: 0}, {WorkerID: "d", Rank: 3}}

// ratioOf gives workers fixed engine block sizes: "b" uses twice the index block.
func ratioOf(w catalog.WorkerRank) int {
	if w.WorkerID == "b" {
		return 2
	}
	return 1
}

// engineHash is a stand-in for an engine's block hash: it depends on the document
// prefix and the engine block boundaries, and sometimes collides across documents
// to exercise remapping.
func engineHash(doc, block, ratio int, lora string) uint64 {
	h := uint64(doc)<<32 | uint64(block)<<8 | uint64(ratio)
	if block < 3 { // documents share their first engine blocks' identity
		h = uint64(block)<<8 | uint64(ratio)
	}
	if lora != "" {
		h ^= 0xabcdef
	}
	return h + 1
}

func (g *opGen) storeEvent(w catalog.WorkerRank) Event {
	ratio := ratioOf(w)
	d := g.next(len(g.docs))
	doc := g.docs[d]
	nEngine := len(doc) / (g.bs * ratio)
	start := g.next(nEngine)
	n := 1 + g.next(min(6, nEngine-start))
	tier := Tier(0)
	if g.next(4) == 0 {
		tier = Tier(1 + g.next(2))
	}
	lora := ""
	if g.next(8) == 0 {
		lora = "ad"
	}
	ev := Event{Kind: EventStored, Tier: tier, BlockSize: g.bs * ratio, LoRAName: lora}
	if lora == "" && g.next(8) == 0 {
		ev.CacheSalt = "tenant"
	}
	if ratio == 1 && g.next(2) == 0 {
		ev.BlockSize = 0
	}
	if start > 0 {
		ev.HasParent = true
		ev.ParentHash = engineHash(d, start-1, ratio, lora)
	}
	for j := start; j < start+n; j++ {
		ev.BlockHashes = append(ev.BlockHashes, engineHash(d, j, ratio, lora))
	}
	ev.Tokens = append([]uint32(nil), doc[start*g.bs*ratio:(start+n)*g.bs*ratio]...)
	if g.next(10) == 0 && len(ev.Tokens) > 0 { // broken token count
		ev.Tokens = ev.Tokens[1:]
	}
	return ev
}

func (g *opGen) removeEvent(w catalog.WorkerRank) Event {
	ratio := ratioOf(w)
	d := g.next(len(g.docs))
	nEngine := len(g.docs[d]) / (g.bs * ratio)
	ev := Event{Kind: EventRemoved, Tier: Tier(g.next(numTiers))}
	if g.next(3) > 0 {
		ev.Tier = TierDevice
	}
	start := g.next(nEngine)
	for j := start; j < min(nEngine, start+1+g.next(4)); j++ {
		ev.BlockHashes = append(ev.BlockHashes, engineHash(d, j, ratio, ""))
	}
	return ev
}

func (g *opGen) query() ([]uint64, []catalog.WorkerRank) {
	d := g.next(len(g.docs))
	toks := append([]uint32(nil), g.docs[d]...)
	if g.next(3) == 0 { // diverge somewhere
		at := g.next(len(toks))
		toks[at] = 99999
	}
	lora := ""
	if g.next(8) == 0 {
		lora = "ad"
	}
	salt := ""
	if lora == "" && g.next(8) == 0 {
		salt = "tenant"
	}
	h, _ := NewHasher(g.bs, HashOptions{LoRAName: lora, CacheSalt: salt})
	seqs := h.SeqHashes(toks[:g.next(len(toks)+1)])
	var cands []catalog.WorkerRank
	if g.next(4) == 0 {
		cands = []catalog.WorkerRank{}
		for _, w := range oracleWorkers {
			if g.next(2) == 0 {
				cands = append(cands, w)
			}
		}
		cands = append(cands, catalog.WorkerRank{WorkerID: "nobody"})
	}
	return seqs, cands
}

// runOracle applies steps random operations to an Index and the oracle and
// requires identical answers after every lookup.
func runOracle(t testing.TB, next func(n int) int, docs [][]uint32, steps int) {
	ix, err := New(Options{BlockSize: oracleBS})
	require.NoError(t, err)
	o := newOracle(oracleBS)
	g := &opGen{next: next, docs: docs, bs: oracleBS}
	var trace []string
	defer func() {
		if t.Failed() && testing.Verbose() {
			for _, l := range trace {
				t.Log(l)
			}
		}
	}()
	for step := 0; step < steps; step++ {
		w := oracleWorkers[g.next(len(oracleWorkers))]
		switch op := g.next(20); {
		case op < 9:
			ev := g.storeEvent(w)
			want := o.apply(w, ev)
			err := ix.Apply(w, ev)
			trace = append(trace, fmt.Sprintf("%d store %v tier=%d parent=%v/%x hashes=%x ntok=%d bs=%d lora=%q -> %v", step, w, ev.Tier, ev.HasParent, ev.ParentHash, ev.BlockHashes, len(ev.Tokens), ev.BlockSize, ev.LoRAName, err))
			require.Equal(t, want, err == nil, "step %d store %+v: %v", step, ev, err)
		case op < 14:
			ev := g.removeEvent(w)
			if o.apply(w, ev) {
				require.NoError(t, ix.Apply(w, ev))
			} else {
				require.ErrorIs(t, ix.Apply(w, ev), ErrUnknownBlock)
			}
			trace = append(trace, fmt.Sprintf("%d remove %v tier=%d hashes=%x", step, w, ev.Tier, ev.BlockHashes))
		case op < 15:
			o.apply(w, Event{Kind: EventCleared})
			ix.ClearRank(w)
			trace = append(trace, fmt.Sprintf("%d clear %v", step, w))
		case op < 16:
			for k := range o.workers {
				if k.WorkerID == w.WorkerID {
					delete(o.workers, k)
				}
			}
			ix.RemoveWorker(w.WorkerID)
			trace = append(trace, fmt.Sprintf("%d removeworker %v", step, w.WorkerID))
		default:
			seqs, cands := g.query()
			want := o.findMatches(seqs, cands)
			got := ix.FindMatches(seqs, MatchOptions{Candidates: cands})
			sortMatches(got)
			require.Equal(t, want, got, "step %d: query of %d blocks", step, len(seqs))
			one := ix.FindMatches(seqs, MatchOptions{Candidates: cands, StopAtOne: true})
			checkStopAtOne(t, want, one)
		}
		checkStructure(t, ix, o)
	}
}

// checkStopAtOne: with StopAtOne the result names the same worker ranks when more
// than one matched, and never overcounts.
func checkStopAtOne(t testing.TB, full, one []Match) {
	byW := map[catalog.WorkerRank]Match{}
	for _, m := range full {
		byW[m.Worker] = m
	}
	require.LessOrEqual(t, len(one), len(full))
	for _, m := range one {
		f, ok := byW[m.Worker]
		require.True(t, ok, "StopAtOne reported %v which does not match", m.Worker)
		require.LessOrEqual(t, m.Total(), f.Total())
	}
}

// checkStructure verifies the index's bookkeeping against a recount of the tree.
func checkStructure(t testing.TB, ix *Index, o *oracle) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	tr := &ix.t
	nodes, entries := 0, 0
	extras := map[nodeID]int{} // extra entries naming each node
	for k := range tr.extra {
		extras[k.held.n]++
	}
	seen := map[nodeID]bool{rootID: true} // attached nodes
	usedExts := map[extID]bool{}
	require.Zero(t, tr.root.ext, "the root keeps its children in rootKids")
	var walk func(id nodeID)
	walk = func(id nodeID) {
		n := tr.at(id)
		var kids []nodeID
		if n.child != 0 {
			require.Nil(t, tr.kids(n))
		}
		for key, c := range tr.children(n) {
			require.Equal(t, key, tr.at(c).key, "child %d filed under another key", c)
			kids = append(kids, c)
		}
		if id != rootID {
			require.False(t, len(kids) == 1 && n.child == 0, "single child kept in a map")
			require.False(t, tr.unheld(n) && len(kids) == 0, "leaked unheld leaf")
		}
		for _, cid := range kids {
			c := tr.at(cid)
			require.Equal(t, id, c.parent())
			require.False(t, seen[cid], "node %d reached twice", cid)
			seen[cid] = true
			nodes++
			entries += countWords(tr.devWords(c))
			if e := tr.extOf(c); e != nil {
				require.False(t, usedExts[c.ext], "ext %d shared", c.ext)
				usedExts[c.ext] = true
				entries += e.host.count() + e.disk.count()
				require.False(t, e.idle(), "idle ext kept")
				require.Equal(t, extras[cid], e.extras, "extra entries of node %#x", c.key)
			} else {
				require.Zero(t, extras[cid], "extra entries of node %#x, which has no ext", c.key)
			}
			walk(cid)
		}
	}
	walk(rootID)
	require.Equal(t, nodes, tr.nodes, "node count")
	require.Equal(t, entries, tr.entries, "entry count")
	require.Equal(t, len(o.workers), len(tr.workers), "worker ranks")
	mapped := 0
	for _, ws := range tr.workers {
		for tier := range ws.blocks {
			mapped += ws.blocks[tier].count()
			for _, id := range ws.blocks[tier].all() {
				require.True(t, seen[id], "a block map names detached node %d", id)
			}
		}
	}
	require.Equal(t, tr.mapEntries, mapped, "block map entries")
	// The arena: every id handed out is attached or free, never both, and
	// a free node is zero; so is every ext id in use or free.
	listed := map[int32]bool{}
	for _, c := range tr.partial {
		require.False(t, listed[c], "chunk %d listed twice", c)
		listed[c] = true
		require.True(t, tr.freeIDs[c].listed)
	}
	for c := range tr.freeIDs {
		f := &tr.freeIDs[c]
		n := 0
		for w, b := range f.bits {
			for ; b != 0; b &= b - 1 {
				id := nodeID(c)<<chunkBits | nodeID(w)<<6 | nodeID(bits.TrailingZeros64(b))
				require.Less(t, id, tr.nextID, "free id %d never handed out", id)
				require.GreaterOrEqual(t, int32(w), f.cursor, "free id %d below its chunk's cursor", id)
				require.False(t, seen[id], "free node %d is attached", id)
				seen[id] = true
				require.Equal(t, node{}, *tr.at(id), "free node %d is not zero", id)
				n++
			}
		}
		require.Equal(t, int32(n), f.n, "free ids of chunk %d", c)
		require.Equal(t, f.listed, listed[int32(c)], "chunk %d listed", c)
		require.True(t, n == 0 || f.listed, "chunk %d has free ids and is not listed", c)
	}
	require.Len(t, seen, int(tr.nextID)-1, "ids handed out: attached or free")
	for _, e := range tr.freeExts {
		require.Equal(t, nodeExt{}, *tr.ext(e), "free ext %d is not zero", e)
		require.False(t, usedExts[e], "free ext %d named by a node", e)
		usedExts[e] = true
	}
	require.Len(t, usedExts, int(tr.nextExt)-1, "ext ids: in use or free")
}

func TestIndexMatchesOracle(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 7))
			runOracle(t, func(n int) int {
				if n <= 0 {
					return 0
				}
				return r.IntN(n)
			}, newDocs(r), 1500)
		})
	}
}

func FuzzIndexOracle(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 19, 19, 19})
	f.Add([]byte("the quick brown fox jumps over the lazy dog, again and again"))
	f.Fuzz(func(t *testing.T, data []byte) {
		r := rand.New(rand.NewPCG(1, 2))
		docs := newDocs(r)
		pos := 0
		next := func(n int) int {
			if n <= 0 {
				return 0
			}
			if pos >= len(data) {
				return 0
			}
			v := int(data[pos])
			pos++
			return v % n
		}
		runOracle(t, next, docs, len(data)/3)
	})
}

// TestArenaAcrossChunks: a run long enough to span several of the arena's
// chunks, then partly removed, and another rank's run stored into the ids
// that freed, give the lookups they should (walks across chunk boundaries,
// where the next id is not the next node of the chunk) and keep the arena's
// bookkeeping (checkStructure).
func TestArenaAcrossChunks(t *testing.T) {
	ix, err := New(Options{BlockSize: 1})
	require.NoError(t, err)
	o := newOracle(1)
	apply := func(w catalog.WorkerRank, ev Event) {
		require.True(t, o.apply(w, ev))
		require.NoError(t, ix.Apply(w, ev))
	}
	a, b := catalog.WorkerRank{WorkerID: "a"}, catalog.WorkerRank{WorkerID: "b"}
	check := func(toks []uint32, da, db int) {
		var want []Match
		for _, m := range []Match{{Worker: a, Device: da}, {Worker: b, Device: db}} {
			if m.Device > 0 {
				want = append(want, m)
			}
		}
		got := ix.FindMatches(seqsOf(t, 1, toks), MatchOptions{})
		sortMatches(got)
		require.Equal(t, want, got, "a query of %d blocks", len(toks))
	}
	n := 2*chunkLen + 100
	ha, ta := make([]uint64, n), make([]uint32, n)
	for i := range n {
		ha[i], ta[i] = uint64(i+1), uint32(i)
	}
	apply(a, Event{Kind: EventStored, BlockHashes: ha, Tokens: ta})
	require.Len(t, ix.t.chunks, 3, "the run spans chunks")
	for _, k := range []int{1, chunkLen - 2, chunkLen - 1, chunkLen, chunkLen + 1, 2 * chunkLen, n} {
		check(ta[:k], k, 0)
	}

	// An LRU evicts a's last 2*chunkLen blocks, deepest first.
	tail := slices.Clone(ha[n-2*chunkLen:])
	slices.Reverse(tail)
	apply(a, Event{Kind: EventRemoved, BlockHashes: tail})
	checkStructure(t, ix, o)
	next := ix.t.nextID

	// b shares a's first 100 blocks, then stores 2*chunkLen of its own.
	m := 100 + 2*chunkLen
	hb, tb := make([]uint64, m), make([]uint32, m)
	for i := range m {
		hb[i], tb[i] = uint64(1_000_000+i), uint32(1_000_000+i)
		if i < 100 {
			tb[i] = ta[i]
		}
	}
	apply(b, Event{Kind: EventStored, BlockHashes: hb, Tokens: tb})
	require.Equal(t, next, ix.t.nextID, "b's nodes took the ids a's removal freed")
	check(tb, 100, m)
	check(tb[:150], 100, 150)
	check(ta, 100, 100)
	checkStructure(t, ix, o)
}
