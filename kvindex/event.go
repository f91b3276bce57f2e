package kvindex

import "fmt"

// Tier is the storage medium on which a worker holds a block. The zero value is
// TierDevice, the accelerator memory that serves requests directly.
type Tier uint8

// Storage tiers, fastest first.
const (
	TierDevice Tier = iota // accelerator memory (GPU HBM)
	TierHost               // host memory (pinned CPU RAM offload)
	TierDisk               // local disk or remote storage offload

	numTiers = 3
)

// String returns "device", "host" or "disk".
func (t Tier) String() string {
	switch t {
	case TierDevice:
		return "device"
	case TierHost:
		return "host"
	case TierDisk:
		return "disk"
	default:
		return fmt.Sprintf("tier(%d)", uint8(t))
	}
}

// valid reports whether t is one of the three defined tiers.
func (t Tier) valid() bool { return t < numTiers }

// EventKind says what an Event does.
type EventKind uint8

// Event kinds, mirroring the engines' KV-cache events.
const (
	// EventStored adds a run of consecutive blocks that follows ParentHash (or starts
	// the sequence when HasParent is false).
	EventStored EventKind = iota + 1
	// EventRemoved drops the listed blocks.
	EventRemoved
	// EventCleared drops every block of the worker rank (the engine reset its cache).
	EventCleared
)

// String returns the engine-side name of the kind.
func (k EventKind) String() string {
	switch k {
	case EventStored:
		return "BlockStored"
	case EventRemoved:
		return "BlockRemoved"
	case EventCleared:
		return "AllBlocksCleared"
	default:
		return fmt.Sprintf("EventKind(%d)", uint8(k))
	}
}

// Event is one KV-cache change of one worker rank, in the form the index applies. The
// kvevents package turns engine messages into Events; tests and simulators build them
// directly.
//
// Engine block hashes are opaque identifiers: the index keeps them per worker rank only
// to find a stored block's parent and to remove blocks later. What the index matches
// requests against is its own hash of the tokens (see Hasher), so the engine's hash
// algorithm does not matter and two engines that happen to emit equal hashes never
// share anything.
type Event struct {
	Kind EventKind
	// Tier is the medium the blocks live on (Stored and Removed).
	Tier Tier
	// BlockHashes are the engine's hashes of the blocks (Stored and Removed), in prefix
	// order for Stored.
	BlockHashes []uint64
	// ParentHash is the engine hash of the block just before BlockHashes[0]; it is
	// meaningful only when HasParent is true (Stored).
	ParentHash uint64
	HasParent  bool
	// Tokens holds the token ids of all stored blocks, concatenated: exactly
	// len(BlockHashes)*BlockSize of them (Stored).
	Tokens []uint32
	// BlockSize is the engine's tokens per block (Stored). Zero means the index's block
	// size. It must equal the index's block size or be a whole multiple of it; a
	// multiple splits each engine block into several index blocks.
	BlockSize int
	// Extra, when non-nil, holds one digest per engine block of whatever else the
	// engine mixed into that block's identity (multimodal content hashes, for
	// instance); 0 means nothing. A non-zero value is folded into the index's hash of
	// that block so token-only requests cannot falsely match it. len(Extra) must equal
	// len(BlockHashes) when it is non-nil.
	Extra []uint64
	// LoRAName and CacheSalt isolate adapters and tenants: they seed the index's block
	// hash exactly as they seed a request's (Stored).
	LoRAName  string
	CacheSalt string
}
