package catalog

import (
	"fmt"
	"testing"
)

func benchWorkers(n int) []Worker {
	ws := make([]Worker, n)
	for i := range ws {
		w := complete(fmt.Sprintf("ns/vllm-%04d", i))
		w.Endpoint = fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250+1)
		w.KVEventEndpoints = map[int]string{0: fmt.Sprintf("tcp://10.0.%d.%d:5557", i/250, i%250+1)}
		ws[i] = w
	}
	return ws
}

func benchCatalog(b *testing.B, n int) (*Catalog, []Worker) {
	b.Helper()
	c := New(Options{Requirements: Requirements{KVEvents: true, Queueing: true}})
	ws := benchWorkers(n)
	for _, w := range ws {
		if _, err := c.Upsert(w); err != nil {
			b.Fatal(err)
		}
	}
	return c, ws
}

func BenchmarkUpsert(b *testing.B) {
	b.Run("unchanged", func(b *testing.B) {
		c, ws := benchCatalog(b, 64)
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			if _, err := c.Upsert(ws[i%len(ws)]); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("changed", func(b *testing.B) {
		c, ws := benchCatalog(b, 64)
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			w := ws[i%len(ws)]
			w.TotalKVBlocks = i
			if _, err := c.Upsert(w); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func BenchmarkSchedulable(b *testing.B) {
	for _, n := range []int{8, 64, 512} {
		b.Run(fmt.Sprintf("workers=%d", n), func(b *testing.B) {
			c, _ := benchCatalog(b, n)
			b.ReportAllocs()
			for b.Loop() {
				if len(c.Schedulable("llama")) != n {
					b.Fatal("wrong count")
				}
			}
		})
	}
}

// BenchmarkReconcileConverged is a discovery loop's steady state: the desired
// set equals the catalog.
func BenchmarkReconcileConverged(b *testing.B) {
	for _, n := range []int{64, 512} {
		b.Run(fmt.Sprintf("workers=%d", n), func(b *testing.B) {
			c, ws := benchCatalog(b, n)
			b.ReportAllocs()
			for b.Loop() {
				p, err := Reconcile(c.List(), ws)
				if err != nil || len(p.Upserts)+len(p.Deletes) != 0 {
					b.Fatal(err, p)
				}
			}
		})
	}
}
