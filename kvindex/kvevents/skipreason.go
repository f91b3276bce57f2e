package kvevents

import (
	"math"
	"strconv"
)

// SkipReason says why an event was not applied. The decoder sets the reasons up to
// SkipLimit; IndexHandler adds the ones the index reports when applying.
type SkipReason uint8

// Reasons for skipping an event.
const (
	// SkipMalformed: the event is not an array or map, lacks its tag or block
	// hashes, or a field has the wrong type.
	SkipMalformed SkipReason = iota
	// SkipUnknownType: the event's tag is not BlockStored, BlockRemoved or
	// AllBlocksCleared.
	SkipUnknownType
	// SkipUnknownMedium: the medium names no known storage tier.
	SkipUnknownMedium
	// SkipNonMainGroup: group_idx is set and not 0 (a secondary KV-cache group of a
	// hybrid model, such as its sliding-window layers).
	SkipNonMainGroup
	// SkipNonMainKind: kv_cache_spec_kind is set and is not a full-attention kind.
	SkipNonMainKind
	// SkipLocality: locality is set and is not LOCAL (remote or unknown blocks fail
	// closed).
	SkipLocality
	// SkipTokenRange: a token id is negative or does not fit 32 bits.
	SkipTokenRange
	// SkipLimit: the event exceeds a DecoderOptions limit.
	SkipLimit
	// SkipUnknownParent: the index does not know the stored run's parent block.
	SkipUnknownParent
	// SkipBlockSize: the event's block size is not a whole multiple of the index's.
	SkipBlockSize
	// SkipTokenCount: the number of token ids does not match blocks x block size.
	SkipTokenCount
	// SkipInvalidEvent: the index rejected the event as inconsistent.
	SkipInvalidEvent
	// SkipApplyError: the index returned an error this package does not classify.
	SkipApplyError
	// SkipNoTokens: a stored event names blocks but carries no token ids
	// (storage-tier publishers announce offloaded copies of blocks by hash
	// only); the router cannot key them.
	SkipNoTokens
	// SkipUnknownRank: the batch names a data-parallel rank the worker does not
	// have (the Applier returned ErrUnknownRank).
	SkipUnknownRank
	// SkipRankFull: the worker rank holds its limit of blocks
	// (kvindex.ErrRankFull).
	SkipRankFull
	// SkipUnknownBlock: a removal named blocks the index does not hold for the
	// worker rank (their store was lost or skipped); the known ones were removed.
	SkipUnknownBlock
	// SkipIndexFull: the stored run could take the index past the nodes it
	// can hold (kvindex.ErrIndexFull).
	SkipIndexFull

	// NumSkipReasons is the number of reasons; SkipReason values index arrays of
	// this length.
	NumSkipReasons = iota
)

var skipReasonNames = [NumSkipReasons]string{
	SkipMalformed:     "malformed",
	SkipUnknownType:   "unknown_type",
	SkipUnknownMedium: "unknown_medium",
	SkipNonMainGroup:  "non_main_group",
	SkipNonMainKind:   "non_main_kind",
	SkipLocality:      "not_local",
	SkipTokenRange:    "token_range",
	SkipLimit:         "limit",
	SkipUnknownParent: "unknown_parent",
	SkipBlockSize:     "block_size",
	SkipTokenCount:    "token_count",
	SkipInvalidEvent:  "invalid_event",
	SkipApplyError:    "apply_error",
	SkipNoTokens:      "no_tokens",
	SkipUnknownRank:   "unknown_rank",
	SkipRankFull:      "rank_full",
	SkipUnknownBlock:  "unknown_block",
	SkipIndexFull:     "index_full",
}

// byDesign reports whether events skipped for r are left out on purpose, not
// lost: events of another cache group or kind, of remote blocks, or of a type
// this package does not know (newer engines). The other reasons mean the index
// is missing something the engine holds (or holds something it lost).
func (r SkipReason) byDesign() bool {
	switch r {
	case SkipUnknownType, SkipNonMainGroup, SkipNonMainKind, SkipLocality, SkipNoTokens:
		return true
	}
	return false
}

// String returns a short snake_case name, suitable as a metrics label.
func (r SkipReason) String() string {
	if int(r) < len(skipReasonNames) {
		return skipReasonNames[r]
	}
	return "skip_reason(" + strconv.Itoa(int(r)) + ")"
}

// keep is the internal "not skipped" result of the field parsers.
const keep SkipReason = math.MaxUint8
