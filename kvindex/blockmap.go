package kvindex

import (
	"iter"
	"math/bits"
	"math/rand/v2"
)

// blockMap maps a worker rank's block hashes (engine hashes in an Index,
// sequence hashes in Approx) to nodes, and a node's children keys to them
// (nodeExt.kids, tree.rootKids). It is an open-addressing table with linear
// probing, written instead of a Go map for its memory: a slot is 12 bytes (the
// hash in two halves, so that nothing pads the slot, and the node's id), and
// the table grows by half, not by doubling, whenever it would be more than 3/4
// full (shrinking by half below 1/4, down to minSlots), so between about 16
// and 24 bytes hold each entry of a large map (17 at 8,192 entries, what a
// worker rank of the benchmark fleets holds). A Go map of the same takes 17
// bytes a slot (the hash and id padded to 16, and a control byte) and is
// between 7/16 and 7/8 full. The zero value is an empty map.
//
// Slots are placed by a keyed mix of the hash (seed, random per table), so an
// engine that chooses its hashes cannot make them collide. Deletion shifts the
// following entries back instead of leaving tombstones, so probe sequences
// never outgrow what the live entries need.
type blockMap struct {
	slots []blockSlot
	n     int
	seed  uint64
}

// blockSlot is one slot: a hash in halves and its node's id; id 0 marks it
// empty (a mapped node is never 0).
type blockSlot struct {
	lo, hi uint32
	id     nodeID
}

func (s *blockSlot) key() uint64 { return uint64(s.hi)<<32 | uint64(s.lo) }

func (s *blockSlot) is(key uint64) bool { return s.lo == uint32(key) && s.hi == uint32(key>>32) }

func newSlot(key uint64, id nodeID) blockSlot {
	return blockSlot{lo: uint32(key), hi: uint32(key >> 32), id: id}
}

// blockSlotBytes is the size of a slot, for the memory estimate.
const blockSlotBytes = 12

// minSlots is the size below which a table does not shrink, so a worker rank
// that stores and removes a few blocks at a time does not resize every time.
const minSlots = 32

// home returns the slot where key's probe sequence starts.
func (m *blockMap) home(key uint64) int { return keyedSlot(key, m.seed, len(m.slots)) }

// keyedSlot places key in a table of size slots by a mix of key and seed
// (SplitMix64's finalizer), scaled to the size.
func keyedSlot(key, seed uint64, size int) int {
	x := key ^ seed
	x ^= x >> 31
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	hi, _ := bits.Mul64(x, uint64(size))
	return int(hi)
}

// count returns the number of entries.
func (m *blockMap) count() int { return m.n }

// get returns the node of key, or 0.
func (m *blockMap) get(key uint64) nodeID {
	if m.n == 0 {
		return 0
	}
	for i := m.home(key); ; {
		s := &m.slots[i]
		if s.id == 0 {
			return 0
		}
		if s.is(key) {
			return s.id
		}
		if i++; i == len(m.slots) {
			i = 0
		}
	}
}

// warm loads the home slot of each key. Looking the keys up one at a time
// waits for each slot's cache miss in turn (a large worker rank's map is
// megabytes, and a removal's blocks are scattered through it); loading them
// together first lets the misses overlap. The sum it returns keeps the loads
// (a function that is not inlined computes it whether or not it is read).
//
//go:noinline
func (m *blockMap) warm(keys []uint64) (sum nodeID) {
	if m.n == 0 {
		return 0
	}
	for _, k := range keys {
		sum += m.slots[m.home(k)].id
	}
	return sum
}

// put maps key to node id (not 0), replacing any node key had.
func (m *blockMap) put(key uint64, id nodeID) {
	if s, found := m.slot(key, id); found {
		s.id = id
	}
}

// slot returns key's slot and whether key was present, adding key with node id
// when it was absent.
func (m *blockMap) slot(key uint64, id nodeID) (*blockSlot, bool) {
	if (m.n+1)*4 > len(m.slots)*3 {
		m.resize(max(8, len(m.slots)+len(m.slots)/2))
	}
	for i := m.home(key); ; {
		s := &m.slots[i]
		if s.id == 0 {
			*s = newSlot(key, id)
			m.n++
			return s, false
		}
		if s.is(key) {
			return s, true
		}
		if i++; i == len(m.slots) {
			i = 0
		}
	}
}

// remove deletes key and returns its node, or 0 when key was absent.
func (m *blockMap) remove(key uint64) nodeID {
	if m.n == 0 {
		return 0
	}
	i := m.home(key)
	for {
		s := &m.slots[i]
		if s.id == 0 {
			return 0
		}
		if s.is(key) {
			break
		}
		if i++; i == len(m.slots) {
			i = 0
		}
	}
	removed := m.slots[i].id
	// Shift back every following entry of the run that may live at i: one
	// whose probe sequence starts at or before i (cyclically).
	size := len(m.slots)
	for j := i; ; {
		if j++; j == size {
			j = 0
		}
		s := m.slots[j]
		if s.id == 0 {
			break
		}
		h := m.home(s.key())
		if (j-h+size)%size >= (j-i+size)%size {
			m.slots[i] = s
			i = j
		}
	}
	m.slots[i] = blockSlot{}
	m.n--
	if m.n*4 < len(m.slots) && len(m.slots) > minSlots {
		m.resize(len(m.slots) / 2)
	}
	return removed
}

// room makes room for k more entries without a resize, so that the slots
// of entries added meanwhile stay where they are. It grows the table to the
// size adding k new entries one by one would (by half, as often as needed):
// another rule of growth lands other sizes, and a rank's map of 8,192
// entries took 15,553 slots rather than 11,623 (BenchmarkScaleMemory: 44.4
// -> 49.5 bytes an entry).
func (m *blockMap) room(k int) {
	size := len(m.slots)
	for (m.n+k)*4 > size*3 {
		size = max(8, size+size/2)
	}
	if size != len(m.slots) {
		m.resize(size)
	}
}

// reserve makes room for n entries in all without a resize.
func (m *blockMap) reserve(n int) {
	if size := n*4/3 + 1; n > 0 && size > len(m.slots) {
		m.resize(max(8, size))
	}
}

// resize moves the entries into a table of size slots.
func (m *blockMap) resize(size int) {
	old := m.slots
	m.slots = make([]blockSlot, size)
	if m.seed == 0 {
		m.seed = rand.Uint64() | 1
	}
	for _, s := range old {
		if s.id == 0 {
			continue
		}
		for i := m.home(s.key()); ; {
			if m.slots[i].id == 0 {
				m.slots[i] = s
				break
			}
			if i++; i == size {
				i = 0
			}
		}
	}
}

// all yields every entry, in no particular order. The map must not change
// during the iteration.
func (m *blockMap) all() iter.Seq2[uint64, nodeID] {
	return func(yield func(uint64, nodeID) bool) {
		for _, s := range m.slots {
			if s.id != 0 && !yield(s.key(), s.id) {
				return
			}
		}
	}
}

// bytes is the heap memory of the table.
func (m *blockMap) bytes() int { return cap(m.slots) * blockSlotBytes }
