package selection

import (
	"context"

	"github.com/kvselect/kvselect/catalog"
)

// overlapScores is PotentialLoads reduced to the overlap of every eligible
// rank: the index's view alone.
func overlapScores(s *SelectionService, ctx context.Context, req Request) (map[catalog.WorkerRank]Overlap, error) {
	sc, err := s.PotentialLoads(ctx, req)
	if err != nil {
		return nil, err
	}
	out := make(map[catalog.WorkerRank]Overlap, len(sc))
	for _, x := range sc {
		out[x.WorkerRank] = x.Overlap
	}
	return out, nil
}
