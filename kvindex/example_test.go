package kvindex_test

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
)

func ExampleHasher() {
	h, err := kvindex.NewHasher(4, kvindex.HashOptions{})
	if err != nil {
		panic(err)
	}
	// Ten tokens make two complete blocks of four; the last two tokens are not
	// hashed.
	seqs := h.SeqHashes([]uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10})
	fmt.Println(len(seqs))
	// A request sharing the first block shares the first sequence hash only.
	other := h.SeqHashes([]uint32{1, 2, 3, 4, 50, 60, 70, 80})
	fmt.Println(seqs[0] == other[0], seqs[1] == other[1])
	// Output:
	// 2
	// true false
}

func ExampleIndex_FindMatches() {
	ix, err := kvindex.New(kvindex.Options{BlockSize: 2})
	if err != nil {
		panic(err)
	}
	prompt := []uint32{10, 11, 12, 13, 14, 15}
	a := catalog.WorkerRank{WorkerID: "pod-a"}
	b := catalog.WorkerRank{WorkerID: "pod-b"}

	// pod-a cached all three blocks; pod-b only the first. Engine hashes (101,
	// 102, ...) are opaque: the index hashes the tokens itself.
	_ = ix.Apply(a, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: []uint64{101, 102, 103}, Tokens: prompt})
	_ = ix.Apply(b, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: []uint64{201}, Tokens: prompt[:2]})
	// pod-b later stores the second block after its first.
	_ = ix.Apply(b, kvindex.Event{Kind: kvindex.EventStored, HasParent: true, ParentHash: 201, BlockHashes: []uint64{202}, Tokens: prompt[2:4]})

	h, _ := kvindex.NewHasher(2, kvindex.HashOptions{})
	matches := ix.FindMatches(h.SeqHashes(prompt), kvindex.MatchOptions{})
	slices.SortFunc(matches, func(x, y kvindex.Match) int { return strings.Compare(x.Worker.WorkerID, y.Worker.WorkerID) })
	for _, m := range matches {
		fmt.Println(m.Worker.WorkerID, m.Device)
	}
	// pod-a evicts its middle block: only the first block is a usable prefix.
	_ = ix.Apply(a, kvindex.Event{Kind: kvindex.EventRemoved, BlockHashes: []uint64{102}})
	for _, m := range ix.FindMatches(h.SeqHashes(prompt), kvindex.MatchOptions{Candidates: []catalog.WorkerRank{a}}) {
		fmt.Println(m.Worker.WorkerID, m.Device)
	}
	// Output:
	// pod-a 3
	// pod-b 2
	// pod-a 1
}

func ExampleApprox() {
	now := time.Unix(0, 0)
	a, err := kvindex.NewApprox(kvindex.ApproxOptions{TTL: time.Minute, Now: func() time.Time { return now }})
	if err != nil {
		panic(err)
	}
	h, _ := kvindex.NewHasher(2, kvindex.HashOptions{})
	seqs := h.SeqHashes([]uint32{1, 2, 3, 4})
	// The router sent this request to pod-a: assume pod-a caches it for a minute.
	a.Record(catalog.WorkerRank{WorkerID: "pod-a"}, seqs)
	fmt.Println(a.FindMatches(seqs, kvindex.MatchOptions{})[0].Device)
	now = now.Add(61 * time.Second)
	fmt.Println(len(a.FindMatches(seqs, kvindex.MatchOptions{})))
	// Output:
	// 2
	// 0
}
