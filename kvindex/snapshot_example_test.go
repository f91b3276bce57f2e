package kvindex_test

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
)

func ExampleIndex_WriteSnapshot() {
	ix, err := kvindex.New(kvindex.Options{BlockSize: 2})
	if err != nil {
		panic(err)
	}
	pod := catalog.WorkerRank{WorkerID: "pod-a"}
	prompt := []uint32{10, 11, 12, 13}
	_ = ix.Apply(pod, kvindex.Event{Kind: kvindex.EventStored, BlockHashes: []uint64{101, 102}, Tokens: prompt})

	// The serving replica writes its index, recording that the last batch it
	// applied from pod-a's feed was number 41.
	var buf bytes.Buffer
	if err := ix.WriteSnapshot(&buf, map[catalog.WorkerRank]uint64{pod: 41}); err != nil {
		panic(err)
	}
	snap := bytes.Clone(buf.Bytes())

	// A joining replica loads it, and replays pod-a's feed from batch 42.
	warm, seqs, err := kvindex.ReadSnapshot(&buf, kvindex.ReadOptions{})
	if err != nil {
		panic(err)
	}
	h, _ := kvindex.NewHasher(2, kvindex.HashOptions{})
	m := warm.FindMatches(h.SeqHashes(prompt), kvindex.MatchOptions{})
	fmt.Println(m[0].Worker.WorkerID, m[0].Device, seqs[pod]+1)

	// A snapshot cut short in transit is refused whole.
	_, _, err = kvindex.ReadSnapshot(bytes.NewReader(snap[:len(snap)-1]), kvindex.ReadOptions{})
	fmt.Println(errors.Is(err, kvindex.ErrSnapshotCorrupt))
	// Output:
	// pod-a 2 42
	// true
}
