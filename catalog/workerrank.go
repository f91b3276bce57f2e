package catalog

import (
	"cmp"
	"fmt"
	"strings"
)

// WorkerRank names one KV cache: a worker and one of its data-parallel ranks.
// Each data-parallel rank of an engine has its own cache, publishes its own
// events and carries its own load, so the index, the ledger and the selection
// service all key by this pair. The zero Rank is the only rank of an engine
// without data parallelism.
type WorkerRank struct {
	WorkerID string
	Rank     int
}

// String returns "worker/rank".
func (w WorkerRank) String() string { return fmt.Sprintf("%s/%d", w.WorkerID, w.Rank) }

// Compare orders worker ranks by worker id, then rank: -1, 0 or +1, for
// slices.SortFunc.
func (w WorkerRank) Compare(o WorkerRank) int {
	return cmp.Or(strings.Compare(w.WorkerID, o.WorkerID), cmp.Compare(w.Rank, o.Rank))
}
