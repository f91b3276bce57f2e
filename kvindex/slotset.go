package kvindex

import (
	"math/bits"
	"slices"
	"unsafe"
)

// sword is one 64-slot word of a sparse slot set: bit b set means slot idx*64+b is
// a member.
type sword struct {
	idx uint32
	// The padding is spelled out so that a node's inline devWord, which keeps
	// the node's marks there, has the same layout on every platform. It is not
	// part of the set: == ignores blank fields.
	_    uint32
	bits uint64
}

// slotSet is a sparse bitset of worker-rank slots, sorted by word index. Most
// blocks are held by workers whose slots fall in one word, so that word is stored
// inline and only wider sets allocate. The zero value is the empty set.
//
// Invariant: when more is nil, the set is one (empty when one.bits == 0); when
// more is non-nil it holds at least two words, all with bits != 0, sorted by idx,
// and one is zero.
type slotSet struct {
	one  sword
	more *[]sword
}

// words returns the set's words; the slice aliases s and is valid until s changes.
func (s *slotSet) words() []sword {
	if s.more != nil {
		return *s.more
	}
	if s.one.bits == 0 {
		return nil
	}
	return unsafe.Slice(&s.one, 1)
}

func (s *slotSet) empty() bool { return s.more == nil && s.one.bits == 0 }

// add inserts slot and reports whether it was absent.
func (s *slotSet) add(slot uint32) bool {
	idx, bit := slot>>6, uint64(1)<<(slot&63)
	if s.more == nil {
		switch {
		case s.one.bits == 0:
			s.one = sword{idx: idx, bits: bit}
			return true
		case s.one.idx == idx:
			was := s.one.bits&bit != 0
			s.one.bits |= bit
			return !was
		}
		ws := make([]sword, 1, 2)
		ws[0] = s.one
		s.one = sword{}
		s.more = &ws
	}
	ws := *s.more
	i := 0
	for i < len(ws) && ws[i].idx < idx {
		i++
	}
	if i < len(ws) && ws[i].idx == idx {
		was := ws[i].bits&bit != 0
		ws[i].bits |= bit
		return !was
	}
	ws = append(ws, sword{})
	copy(ws[i+1:], ws[i:])
	ws[i] = sword{idx: idx, bits: bit}
	*s.more = ws
	return true
}

// remove deletes slot and reports whether it was present.
func (s *slotSet) remove(slot uint32) bool {
	idx, bit := slot>>6, uint64(1)<<(slot&63)
	if s.more == nil {
		if s.one.idx != idx || s.one.bits&bit == 0 {
			return false
		}
		s.one.bits &^= bit
		if s.one.bits == 0 {
			s.one = sword{}
		}
		return true
	}
	ws := *s.more
	for i := range ws {
		if ws[i].idx != idx {
			continue
		}
		if ws[i].bits&bit == 0 {
			return false
		}
		ws[i].bits &^= bit
		if ws[i].bits == 0 {
			ws = append(ws[:i], ws[i+1:]...)
			if len(ws) == 1 {
				s.one, s.more = ws[0], nil
			} else {
				*s.more = ws
			}
		}
		return true
	}
	return false
}

// equal reports whether s and o have the same members.
func (s *slotSet) equal(o *slotSet) bool {
	if s.more == nil && o.more == nil {
		return s.one == o.one
	}
	return slices.Equal(s.words(), o.words())
}

// count returns the number of members.
func (s *slotSet) count() int {
	n := 0
	for _, w := range s.words() {
		n += bits.OnesCount64(w.bits)
	}
	return n
}

// extraBytes is the heap memory the set uses beyond its inline part.
func (s *slotSet) extraBytes() int {
	if s.more == nil {
		return 0
	}
	return 24 + cap(*s.more)*16
}
