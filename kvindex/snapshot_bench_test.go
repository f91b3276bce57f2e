package kvindex

import (
	"bytes"
	"testing"
)

// BenchmarkSnapshot writes and reads a snapshot of the benchmark fleet: 128
// worker ranks holding 1M engine blocks over about 800k nodes. "lock" is the
// part of Snapshot that holds the index's read lock (what an event applied
// meanwhile waits for); "write" is WriteSnapshot into memory, "read"
// ReadSnapshot from it. blocks/s counts engine blocks; MB is the snapshot's
// size.
func BenchmarkSnapshot(b *testing.B) {
	ix := getFixture(b).ix
	var buf bytes.Buffer
	if err := ix.WriteSnapshot(&buf, nil); err != nil {
		b.Fatal(err)
	}
	snap := buf.Bytes()
	blocks := ix.t.mapEntries
	report := func(b *testing.B) {
		b.ReportMetric(float64(len(snap))/1e6, "MB")
		b.ReportMetric(float64(blocks)*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
	}
	b.Run("lock", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			ix.mu.RLock()
			_ = ix.cutLocked()
			ix.mu.RUnlock()
		}
		report(b)
	})
	b.Run("write", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(snap)))
		var w bytes.Buffer
		for b.Loop() {
			w.Reset()
			if err := ix.WriteSnapshot(&w, nil); err != nil {
				b.Fatal(err)
			}
		}
		report(b)
	})
	b.Run("read", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(snap)))
		for b.Loop() {
			if _, _, err := ReadSnapshot(bytes.NewReader(snap), ReadOptions{}); err != nil {
				b.Fatal(err)
			}
		}
		report(b)
	})
}
