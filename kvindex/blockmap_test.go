package kvindex

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestBlockMapModel runs random puts and deletes against a blockMap and a Go
// map, over key ranges small enough to revisit keys, and requires the same
// contents throughout, the load between its bounds, and every entry reachable
// from its home slot without crossing an empty one (what deletion must keep).
func TestBlockMapModel(t *testing.T) {
	for _, keys := range []uint64{4, 50, 3000} {
		r := rand.New(rand.NewPCG(keys, 7))
		var m blockMap
		model := map[uint64]nodeID{}
		for step := range 40000 {
			k := r.Uint64N(keys) * 0x10000 // structured keys, as engines send
			switch op := r.IntN(10); {
			case op < 5 || step < 2000:
				n := nodeID(1 + r.IntN(64))
				m.put(k, n)
				model[k] = n
			default:
				require.Equal(t, model[k], m.remove(k), "remove %#x", k)
				delete(model, k)
			}
			if step%97 == 0 {
				requireBlockMap(t, &m, model)
			}
		}
		requireBlockMap(t, &m, model)
		for k, n := range model {
			require.Equal(t, n, m.remove(k))
		}
		require.Zero(t, m.count())
		require.LessOrEqual(t, len(m.slots), minSlots, "an emptied map shrinks")
		require.Zero(t, m.get(0))
	}
}

func requireBlockMap(t *testing.T, m *blockMap, model map[uint64]nodeID) {
	t.Helper()
	require.Equal(t, len(model), m.count())
	for k, n := range model {
		require.Equal(t, n, m.get(k), "get %#x", k)
	}
	seen := 0
	for k, n := range m.all() {
		require.Equal(t, model[k], n, "all yields %#x", k)
		seen++
	}
	require.Equal(t, len(model), seen)
	if len(m.slots) > minSlots {
		require.LessOrEqual(t, m.count()*4, len(m.slots)*3, "load above 3/4")
		require.GreaterOrEqual(t, m.count()*4, len(m.slots), "load below 1/4")
	}
	for i, s := range m.slots {
		if s.id == 0 {
			continue
		}
		for j := m.home(s.key()); j != i; j = (j + 1) % len(m.slots) {
			require.NotZero(t, m.slots[j].id, "slot %d of %#x is cut off from its home", i, s.key())
		}
	}
}

func TestBlockMapZeroAndReserve(t *testing.T) {
	var m blockMap
	require.Zero(t, m.get(1))
	require.Zero(t, m.remove(1))
	require.Zero(t, m.bytes())
	m.reserve(0)
	require.Zero(t, m.bytes(), "reserving nothing allocates nothing")
	m.reserve(100)
	size := len(m.slots)
	n := nodeID(3)
	for k := range uint64(100) {
		m.put(k, n)
	}
	require.Equal(t, size, len(m.slots), "reserve(100) holds 100 entries without a resize")
	m.put(7, 7)
	require.Equal(t, nodeID(7), m.get(7), "put replaces")
	m.put(100, n)
	require.Equal(t, n, m.get(100), "put adds")
	require.Equal(t, 101, m.count())
}

// TestBlockMapRoom: after room(k), k new entries leave every slot where it
// was, so a slot found before the others are added can still be written
// (Index.storeRanked writes a stored run's nodes into its slots last).
func TestBlockMapRoom(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 9))
	var m blockMap
	for _, k := range []int{1, 7, 100, 1000, 5000} {
		m.room(k)
		size := len(m.slots)
		slots := make([]*blockSlot, 0, k)
		keys := make([]uint64, 0, k)
		for range k {
			key := r.Uint64()
			s, found := m.slot(key, pending)
			require.False(t, found)
			slots, keys = append(slots, s), append(keys, key)
		}
		require.Equal(t, size, len(m.slots), "room(%d) then %d adds resized the table", k, k)
		for i, s := range slots {
			s.id = nodeID(i + 1)
		}
		for i, key := range keys {
			require.Equal(t, nodeID(i+1), m.get(key), "the id written into slot %d", i)
		}
	}
	// The sizes adding one by one reaches: a rank's 16 runs of 512 blocks
	// end in the table of 8,192 adds.
	var one, runs blockMap
	for k := range uint64(8192) {
		if k%512 == 0 {
			runs.room(512)
		}
		one.put(k*0x9e3779b97f4a7c15+1, 1)
		runs.put(k*0x9e3779b97f4a7c15+1, 1)
		if k%512 == 511 {
			require.Equal(t, len(one.slots), len(runs.slots), "after %d adds", k+1)
		}
	}
}
