package kvindex

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvselect/kvselect/catalog"
)

// TestConcurrentAppliersMatchOracle runs the oracle test's random operations
// from three goroutines at once, each on worker ranks of its own (so their
// events commute), while a fourth takes snapshots, stats and lookups. Apply
// calls for different worker ranks share the tree but not its lock's whole
// hold, so this is what checks that they do not trip over each other: every
// applier's lookups restricted to its own worker ranks must equal its own
// oracle's exactly (nobody else changes those ranks), and at the end the
// index must equal the union of the three oracles, structure included.
func TestConcurrentAppliersMatchOracle(t *testing.T) {
	steps := 20000
	if testing.Short() {
		steps = 2000
	}
	docs := newDocs(rand.New(rand.NewPCG(7, 7)))
	ix, err := New(Options{BlockSize: oracleBS})
	if err != nil {
		t.Fatal(err)
	}
	groups := [][]catalog.WorkerRank{
		{{WorkerID: "a", Rank: 0}, {WorkerID: "a", Rank: 1}},
		{{WorkerID: "b", Rank: 0}}, // engine blocks of two index blocks
		{{WorkerID: "c", Rank: 0}, {WorkerID: "d", Rank: 3}},
	}
	oracles := make([]*oracle, len(groups))
	var appliers, observer sync.WaitGroup
	// start lines the goroutines up, so they overlap from their first step.
	start, done := make(chan struct{}), make(chan struct{})
	var matched atomic.Int64
	for i, ws := range groups {
		o := newOracle(oracleBS)
		oracles[i] = o
		appliers.Go(func() {
			<-start
			r := rand.New(rand.NewPCG(uint64(i), 33))
			g := &opGen{next: r.IntN, docs: docs, bs: oracleBS}
			for step := range steps {
				w := ws[r.IntN(len(ws))]
				switch op := r.IntN(20); {
				case op < 9:
					ev := g.storeEvent(w)
					if want, err := o.apply(w, ev), ix.Apply(w, ev); want != (err == nil) {
						t.Errorf("applier %d step %d: store %+v: %v, want accepted %v", i, step, ev, err, want)
						return
					}
				case op < 14:
					ev := g.removeEvent(w)
					if want, err := o.apply(w, ev), ix.Apply(w, ev); want != (err == nil) {
						t.Errorf("applier %d step %d: remove %+v: %v, want accepted %v", i, step, ev, err, want)
						return
					}
				case op < 15:
					o.apply(w, Event{Kind: EventCleared})
					ix.ClearRank(w)
				case op < 16:
					for k := range o.workers {
						if k.WorkerID == w.WorkerID {
							delete(o.workers, k)
						}
					}
					ix.RemoveWorker(w.WorkerID)
				default:
					seqs, _ := g.query()
					want := o.findMatches(seqs, ws)
					got := ix.FindMatches(seqs, MatchOptions{Candidates: ws})
					sortMatches(got)
					if !reflect.DeepEqual(want, got) && (len(want) != 0 || len(got) != 0) {
						t.Errorf("applier %d step %d: query of %d blocks: got %v, want %v", i, step, len(seqs), got, want)
						return
					}
					if len(want) > 0 {
						matched.Add(1)
					}
				}
			}
		})
	}
	observer.Go(func() {
		<-start
		h, _ := NewHasher(oracleBS, HashOptions{})
		seqs := h.SeqHashes(docs[0])
		var buf bytes.Buffer
		for {
			select {
			case <-done:
				return
			default:
			}
			ix.FindMatches(seqs, MatchOptions{})
			_ = ix.Stats()
			buf.Reset()
			if err := ix.WriteSnapshot(&buf, nil); err != nil {
				t.Error(err)
				return
			}
			if _, _, err := ReadSnapshot(&buf, ReadOptions{}); err != nil {
				t.Errorf("a snapshot taken among appliers does not read back: %v", err)
				return
			}
		}
	})
	close(start)
	appliers.Wait()
	close(done)
	observer.Wait()
	if t.Failed() {
		return
	}
	if matched.Load() == 0 {
		t.Fatal("no applier's lookup matched anything: the test proves nothing")
	}

	all := newOracle(oracleBS)
	for _, o := range oracles {
		for w, ow := range o.workers {
			all.workers[w] = ow
		}
	}
	checkStructure(t, ix, all)
	g := &opGen{next: rand.New(rand.NewPCG(9, 9)).IntN, docs: docs, bs: oracleBS}
	for q := range 200 {
		seqs, cands := g.query()
		want := all.findMatches(seqs, cands)
		got := ix.FindMatches(seqs, MatchOptions{Candidates: cands})
		sortMatches(got)
		if !reflect.DeepEqual(want, got) && (len(want) != 0 || len(got) != 0) {
			t.Fatalf("query %d (%s): got %v, want %v", q, fmt.Sprint(cands), got, want)
		}
	}
}
