package kvindex

import (
	"maps"

	"github.com/kvselect/kvselect/catalog"
)

// LoadRanks makes each worker rank of ranks hold in ix exactly what it holds
// in from, typically an index ReadSnapshot built from a peer's snapshot: the
// rank's blocks in ix are dropped, then from's blocks of it are added on the
// same tiers, with their engine hashes, prefix chains and repeated stores, so
// the rank then encodes in a snapshot of ix as it does in one of from. A rank
// from does not hold is only cleared. Other ranks of ix are untouched, and so
// are both indexes' block limits; the loaded blocks are not checked against
// ix's limits (from was bounded when it was read; ix's nodes and from's
// together must stay within MaxNodes) and do not call Options.OnStored. It
// returns the blocks loaded.
//
// LoadRanks takes from's locks (as Snapshot does) and then ix's (as
// ClearRank does), never both indexes' at once; from must not be ix. Its
// cost is that of the loaded ranks' blocks and the nodes on their paths.
func (ix *Index) LoadRanks(from *Index, ranks []catalog.WorkerRank) int {
	if from == ix {
		panic("kvindex: LoadRanks from the index itself")
	}
	cut := from.cutRanks(ranks)
	ix.ranksMu.Lock()
	defer ix.ranksMu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	t := &ix.t
	for _, w := range ranks {
		if ws := t.worker(w, false); ws != nil {
			t.dropWorker(ws)
			ix.applied.Add(1)
		}
	}
	// placed maps a node of from to its copy in ix; the root maps to the root.
	ft := &from.t
	placed := map[nodeID]nodeID{}
	var path []nodeID
	copyNode := func(n nodeID) nodeID {
		path = path[:0]
		for ; n != rootID; n = ft.at(n).parent() {
			if c := placed[n]; c != 0 {
				break
			}
			path = append(path, n)
		}
		at := rootID
		if n != rootID {
			at = placed[n]
		}
		for i := len(path) - 1; i >= 0; i-- {
			at = t.child(at, ft.at(path[i]).key)
			placed[path[i]] = at
		}
		return at
	}
	loaded := 0
	for _, r := range cut {
		ws := t.worker(r.w, true)
		ws.ratio = r.ratio
		ratio := max(r.ratio, 1)
		for tier := range Tier(numTiers) {
			src := r.blocks[tier]
			if len(src) == 0 {
				continue
			}
			m := ws.tierMap(tier)
			for _, b := range src {
				n := copyNode(b.n)
				m.put(b.hash, n)
				t.mapEntries++
				for k, s := n, 0; s < ratio && k != rootID; s++ {
					t.hold(ws, k, tier)
					k = t.at(k).parent()
				}
				loaded++
			}
		}
		if len(r.dups) > 0 {
			ws.dups = maps.Clone(r.dups)
		}
	}
	return loaded
}

// cutRanks copies, under the locks Snapshot takes, what LoadRanks needs of
// the named ranks: their blocks by node id (nodes are only read through
// their key and parent afterwards, which never change while the node is
// attached; the caller of LoadRanks owns from, so nothing detaches them
// meanwhile).
func (ix *Index) cutRanks(ranks []catalog.WorkerRank) []rawRank {
	ix.ranksMu.Lock()
	defer ix.ranksMu.Unlock()
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	out := make([]rawRank, 0, len(ranks))
	for _, w := range ranks {
		ws := ix.t.worker(w, false)
		if ws == nil || !ws.holdsAny() { // emptied: about to be dropped
			continue
		}
		r := rawRank{w: w, ratio: ws.ratio, dups: maps.Clone(ws.dups)}
		for tier := range ws.blocks {
			for h, n := range ws.blocks[tier].all() {
				r.blocks[tier] = append(r.blocks[tier], rawBlock{hash: h, n: n})
			}
		}
		out = append(out, r)
	}
	return out
}
