package trace

import (
	"errors"
	"fmt"
	"time"
)

// DefaultBlockSize is the block size of the Mooncake traces, in tokens.
const DefaultBlockSize = 512

// Errors of this package. Every bad line is reported as a *LineError that wraps
// ErrBadLine and the specific cause.
var (
	// ErrInvalidOptions: a ReaderOptions or generator configuration is invalid.
	ErrInvalidOptions = errors.New("trace: invalid options")
	// ErrBadLine: a line of a trace is not a valid request.
	ErrBadLine = errors.New("trace: bad line")
	// ErrOutOfOrder: a line's timestamp is earlier than the previous line's.
	ErrOutOfOrder = errors.New("trace: timestamp decreases")
	// ErrLineTooLong: a line exceeds ReaderOptions.MaxLineBytes.
	ErrLineTooLong = errors.New("trace: line too long")
	// ErrInvalidRequest: a Request fails Validate.
	ErrInvalidRequest = errors.New("trace: invalid request")
)

// Request is one request of a trace. It is a plain value; share it between
// goroutines only if nobody mutates Blocks.
type Request struct {
	// Arrival is the request's arrival time since the start of the trace.
	Arrival time.Duration
	// InputTokens and OutputTokens are the prompt and output lengths in tokens.
	InputTokens, OutputTokens int
	// Blocks are the identities of the prompt's blocks in order, one per block
	// of the trace's block size (the last one may be partial). Equal ids at the
	// same position with equal ids before them are the same tokens.
	Blocks []uint64
}

// Validate checks r against a block size (tokens per block, > 0): lengths are
// non-negative, the arrival is not negative, and len(Blocks) is exactly
// ceil(InputTokens / blockSize). Errors wrap ErrInvalidRequest.
func (r Request) Validate(blockSize int) error {
	if blockSize <= 0 {
		return fmt.Errorf("%w: block size %d, want > 0", ErrInvalidRequest, blockSize)
	}
	switch {
	case r.Arrival < 0:
		return fmt.Errorf("%w: arrival %v is negative", ErrInvalidRequest, r.Arrival)
	case r.InputTokens < 0:
		return fmt.Errorf("%w: input length %d is negative", ErrInvalidRequest, r.InputTokens)
	case r.OutputTokens < 0:
		return fmt.Errorf("%w: output length %d is negative", ErrInvalidRequest, r.OutputTokens)
	}
	if want := BlocksFor(r.InputTokens, blockSize); len(r.Blocks) != want {
		return fmt.Errorf("%w: %d block ids for %d input tokens, want ceil(%d/%d) = %d",
			ErrInvalidRequest, len(r.Blocks), r.InputTokens, r.InputTokens, blockSize, want)
	}
	return nil
}

// BlocksFor returns ceil(tokens / blockSize): the number of blocks, the last one
// possibly partial, that hold tokens. blockSize must be > 0.
func BlocksFor(tokens, blockSize int) int {
	return (tokens + blockSize - 1) / blockSize
}

// LineError is a bad line of a trace: its 1-based line number and the cause.
// It unwraps to ErrBadLine and to the cause.
type LineError struct {
	Line int
	Err  error
}

func (e *LineError) Error() string { return fmt.Sprintf("trace: line %d: %v", e.Line, e.Err) }

// Unwrap returns ErrBadLine and the cause, so errors.Is matches both.
func (e *LineError) Unwrap() []error { return []error{ErrBadLine, e.Err} }

// Summary describes a trace.
type Summary struct {
	Requests int
	// Blocks counts block references (the sum of len(Blocks)); DistinctBlocks the
	// distinct prefix blocks among them (a block is identified by its id and all
	// the ids before it).
	Blocks, DistinctBlocks    int
	InputTokens, OutputTokens int64
	// Span is the last arrival minus the first.
	Span time.Duration
	// ReachableHitRate is the block hit rate of one infinite cache shared by every
	// worker: the fraction of block references whose prefix block was already
	// seen in an earlier request. No routing policy can beat it.
	ReachableHitRate float64
}

// Summarize computes a trace's Summary. Requests are taken in slice order.
func Summarize(reqs []Request) Summary {
	var s Summary
	s.Requests = len(reqs)
	if len(reqs) == 0 {
		return s
	}
	var pt PrefixTree
	lo, hi := reqs[0].Arrival, reqs[0].Arrival
	var ids []int32
	seen := 0
	for i := range reqs {
		r := &reqs[i]
		lo, hi = min(lo, r.Arrival), max(hi, r.Arrival)
		s.InputTokens += int64(r.InputTokens)
		s.OutputTokens += int64(r.OutputTokens)
		s.Blocks += len(r.Blocks)
		before := pt.Len()
		ids = pt.Append(ids[:0], r.Blocks)
		seen += len(r.Blocks) - (pt.Len() - before)
	}
	s.DistinctBlocks = pt.Len()
	s.Span = hi - lo
	if s.Blocks > 0 {
		s.ReachableHitRate = float64(seen) / float64(s.Blocks)
	}
	return s
}

// PrefixTree gives every distinct prefix block a dense id: the block with id b
// after the prefix whose last block has dense id p. It is exact (no hashing).
// The zero value is ready to use; it is not safe for concurrent use.
type PrefixTree struct {
	nodes map[prefixEdge]int32
}

type prefixEdge struct {
	parent int32 // -1 for the first block
	id     uint64
}

// Len returns the number of distinct prefix blocks seen.
func (t *PrefixTree) Len() int { return len(t.nodes) }

// Append appends the dense prefix id of every block of blocks to dst, adding
// unseen prefixes, and returns the extended slice. Dense ids count from 0 in
// order of first appearance.
func (t *PrefixTree) Append(dst []int32, blocks []uint64) []int32 {
	if t.nodes == nil {
		t.nodes = make(map[prefixEdge]int32)
	}
	parent := int32(-1)
	for _, b := range blocks {
		e := prefixEdge{parent: parent, id: b}
		n, ok := t.nodes[e]
		if !ok {
			n = int32(len(t.nodes))
			t.nodes[e] = n
		}
		dst = append(dst, n)
		parent = n
	}
	return dst
}
