package reservation

import "math/rand/v2"

// tableSlot is one slot of a blockTable: a sequence hash and the slab index of its
// entry plus one, so that the zero slot is empty.
type tableSlot struct {
	key uint64
	val int32
}

// blockTable maps sequence hashes to slab indices. It is an open-addressing hash
// table with linear probing and backward-shift deletion (no tombstones). Its size
// is a power of two; it doubles when it would be more than half full and halves
// when it is larger than shrinkFloor and less than 1/16 full, so it follows the
// number of active blocks without rehashing back and forth. Keys are mixed with a per-table
// random seed, so hashes chosen to collide cannot be aimed at it. It is the hot
// structure of Book and Free, where it does about half the work of a Go map.
//
// It is not safe for concurrent use; its block stripe's mutex guards it.
type blockTable struct {
	slots []tableSlot
	n     int
	shift uint8 // 64 - log2(len(slots))
	seed  uint64
}

const (
	minTableSize = 16
	// shrinkFloor is the size below which a table never shrinks, so that a
	// ledger that goes idle between requests does not rehash on every booking.
	shrinkFloor = 4096
)

func newBlockTable() blockTable {
	t := blockTable{seed: rand.Uint64()}
	t.resize(minTableSize)
	return t
}

func (t *blockTable) len() int { return t.n }

// home returns the slot a key probes first: the top bits of the seeded key times
// 2^64 divided by the golden ratio (Fibonacci hashing), which spreads both the
// random-looking sequence hashes and small consecutive values.
func (t *blockTable) home(h uint64) uint64 {
	return ((h ^ t.seed) * 0x9E3779B97F4A7C15) >> t.shift
}

// find returns the position of h and true, or the empty slot where h would go and
// false.
func (t *blockTable) find(h uint64) (uint64, bool) {
	mask := uint64(len(t.slots) - 1)
	for i := t.home(h); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.val == 0 {
			return i, false
		}
		if s.key == h {
			return i, true
		}
	}
}

// get returns the slab index of h.
func (t *blockTable) get(h uint64) (int32, bool) {
	if t.n == 0 {
		return 0, false
	}
	i, ok := t.find(h)
	if !ok {
		return 0, false
	}
	return t.slots[i].val - 1, true
}

// reserve makes room for one more key, so that a position find returns for an
// absent key stays valid for insertAt.
func (t *blockTable) reserve() {
	if 2*(t.n+1) > len(t.slots) {
		t.resize(2 * len(t.slots))
	}
}

// insertAt stores h with slab index v at position i, an empty slot that find
// returned after reserve.
func (t *blockTable) insertAt(i uint64, h uint64, v int32) {
	t.slots[i] = tableSlot{key: h, val: v + 1}
	t.n++
}

// remove deletes h, which must be present.
func (t *blockTable) remove(h uint64) {
	i, ok := t.find(h)
	if !ok {
		panic("reservation: internal error: removing a hash the table does not hold")
	}
	mask := uint64(len(t.slots) - 1)
	// Backward shift: pull later members of the probe run into the hole unless
	// their home lies cyclically in (hole, position], where they must stay.
	for j := (i + 1) & mask; t.slots[j].val != 0; j = (j + 1) & mask {
		k := t.home(t.slots[j].key)
		var stays bool
		if i <= j {
			stays = i < k && k <= j
		} else {
			stays = i < k || k <= j
		}
		if stays {
			continue
		}
		t.slots[i] = t.slots[j]
		i = j
	}
	t.slots[i] = tableSlot{}
	t.n--
	if len(t.slots) > shrinkFloor && 16*t.n < len(t.slots) {
		t.resize(len(t.slots) / 2)
	}
}

// resize rehashes into size slots (a power of two).
func (t *blockTable) resize(size int) {
	old := t.slots
	t.slots = make([]tableSlot, size)
	t.shift = 64
	for s := size; s > 1; s >>= 1 {
		t.shift--
	}
	mask := uint64(size - 1)
	for _, s := range old {
		if s.val == 0 {
			continue
		}
		i := t.home(s.key)
		for t.slots[i].val != 0 {
			i = (i + 1) & mask
		}
		t.slots[i] = s
	}
}

// all calls f for every key and slab index, in no particular order.
func (t *blockTable) all(f func(h uint64, i int32)) {
	for _, s := range t.slots {
		if s.val != 0 {
			f(s.key, s.val-1)
		}
	}
}
