package catalog

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeClock advances one second per reading.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(time.Second)
	return c.t
}

func newCatalog(t *testing.T, req Requirements) (*Catalog, *fakeClock) {
	t.Helper()
	clk := &fakeClock{t: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
	return New(Options{Requirements: req, Now: clk.Now}), clk
}

func ids(rs []Record) []string {
	var out []string
	for _, r := range rs {
		out = append(out, r.Worker.ID)
	}
	return out
}

func TestUpsertAdd(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true, Queueing: true})
	rec, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	require.Equal(t, Schedulable, rec.Lifecycle)
	require.Nil(t, rec.Reasons)
	require.Equal(t, time.Date(2025, 1, 1, 0, 0, 1, 0, time.UTC), rec.UpdatedAt)
	require.True(t, rec.Worker.Equal(complete("a")))

	w := Worker{ID: "b", Endpoint: "10.9.9.9:1", DPSize: 1} // no block size, no events, no max batched
	rec, err = c.Upsert(w)
	require.NoError(t, err)
	require.Equal(t, Incomplete, rec.Lifecycle)
	require.Equal(t, []Reason{ReasonNoBlockSize, ReasonNoMaxBatched, ReasonNoEventEndpoint.forRank(0)}, rec.Reasons)
	require.Equal(t, DefaultModel, rec.Worker.Model, "model normalised")
	require.Equal(t, time.Date(2025, 1, 1, 0, 0, 2, 0, time.UTC), rec.UpdatedAt)
	all := c.List()
	require.Equal(t, []string{"a", "b"}, ids(all))
	require.Equal(t, "llama", all[0].Worker.Model)
	require.Equal(t, DefaultModel, all[1].Worker.Model)
}

func TestUpsertInvalid(t *testing.T) {
	c, _ := newCatalog(t, Requirements{})
	_, err := c.Upsert(Worker{ID: "a", Endpoint: "http://h:1"})
	require.ErrorIs(t, err, ErrInvalidWorker)
	require.Empty(t, c.List())

	// An invalid update leaves the stored record as it was.
	first, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	bad := complete("a")
	bad.BlockSize = -1
	_, err = c.Upsert(bad)
	require.ErrorIs(t, err, ErrInvalidWorker)
	rec, ok := c.Get("a")
	require.True(t, ok)
	require.Equal(t, 16, rec.Worker.BlockSize)
	require.Equal(t, first, rec)
}

// TestUpsertUpdate checks what an update of each field does to the record.
func TestUpsertUpdate(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*Worker)
		changed bool
		after   Lifecycle
	}{
		{"nothing", func(*Worker) {}, false, Schedulable},
		{"model spelled the same", func(w *Worker) { w.Model = "llama" }, false, Schedulable},
		{"serving endpoint", func(w *Worker) { w.Endpoint = "10.0.0.6:8000" }, true, Schedulable},
		{"event endpoint", func(w *Worker) { w.KVEventEndpoints = map[int]string{0: "tcp://10.0.0.6:5557"} }, true, Schedulable},
		{"replay endpoint", func(w *Worker) { w.ReplayEndpoint = "" }, true, Schedulable},
		{"dp ranges", func(w *Worker) {
			w.DPSize = 2
			w.KVEventEndpoints = map[int]string{0: "tcp://10.9.9.9:1", 1: "tcp://10.9.9.9:2"}
		}, true, Schedulable},
		{"block size", func(w *Worker) { w.BlockSize = 32 }, true, Schedulable},
		{"model", func(w *Worker) { w.Model = "qwen" }, true, Schedulable},
		{"capacity", func(w *Worker) { w.TotalKVBlocks = 2000 }, true, Schedulable},
		{"labels", func(w *Worker) { w.Labels = map[string]string{"app": "x"} }, true, Schedulable},
		{"identity", func(w *Worker) { w.Identity = "renamed" }, true, Schedulable},
		{"endpoint lost", func(w *Worker) { w.Endpoint = "" }, true, Incomplete},
		{"max batched lost", func(w *Worker) { w.MaxNumBatchedTokens = 0 }, true, Incomplete},
		{"pod moved", func(w *Worker) {
			w.Endpoint = "10.0.0.9:8000"
			w.KVEventEndpoints = map[int]string{0: "tcp://10.0.0.9:5557"}
			w.Identity = "new-pod"
		}, true, Schedulable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _ := newCatalog(t, Requirements{KVEvents: true, Queueing: true})
			first, err := c.Upsert(complete("a"))
			require.NoError(t, err)
			w := complete("a")
			tt.mutate(&w)
			rec, err := c.Upsert(w)
			require.NoError(t, err)
			require.Equal(t, tt.after, rec.Lifecycle)
			got, _ := c.Get("a")
			require.Equal(t, rec, got)
			if !tt.changed {
				require.Equal(t, first, rec, "an unchanged upsert bumps nothing")
				return
			}
			require.True(t, rec.Worker.Equal(w))
			require.True(t, rec.UpdatedAt.After(first.UpdatedAt))
		})
	}
}

func TestModelMove(t *testing.T) {
	c, _ := newCatalog(t, Requirements{})
	_, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	w := complete("a")
	w.Model = ""
	rec, err := c.Upsert(w)
	require.NoError(t, err)
	require.Equal(t, DefaultModel, rec.Worker.Model)
	require.Empty(t, c.Schedulable("llama"))
	require.Len(t, c.Schedulable(""), 1)
	require.Len(t, c.Schedulable(DefaultModel), 1)
	require.Len(t, c.List(), 1)
}

func TestDelete(t *testing.T) {
	c, _ := newCatalog(t, Requirements{})
	_, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	_, err = c.Upsert(complete("b"))
	require.NoError(t, err)

	rec, err := c.Delete("a")
	require.NoError(t, err)
	require.Equal(t, Unschedulable, rec.Lifecycle)
	require.Equal(t, []Reason{ReasonDeleted}, rec.Reasons)
	require.Equal(t, "a", rec.Worker.ID)
	require.Equal(t, time.Date(2025, 1, 1, 0, 0, 3, 0, time.UTC), rec.UpdatedAt)

	_, ok := c.Get("a")
	require.False(t, ok)
	require.Equal(t, []string{"b"}, ids(c.List()))
	require.Equal(t, []string{"b"}, ids(c.Schedulable("llama")))

	before := c.List()
	_, err = c.Delete("a")
	require.ErrorIs(t, err, ErrNotFound)
	require.Contains(t, err.Error(), `"a"`)
	_, err = c.Delete("never")
	require.ErrorIs(t, err, ErrNotFound)
	require.Equal(t, before, c.List(), "a failed delete changes nothing")

	// Re-adding a deleted id starts a fresh record: a draining worker deleted
	// and added back is not draining.
	_, err = c.SetDraining("b", true)
	require.NoError(t, err)
	_, err = c.Delete("b")
	require.NoError(t, err)
	rec, err = c.Upsert(complete("b"))
	require.NoError(t, err)
	require.Equal(t, Schedulable, rec.Lifecycle)
	require.Nil(t, rec.Reasons)
}

func TestDraining(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true})
	_, err := c.SetDraining("a", true)
	require.ErrorIs(t, err, ErrNotFound)

	first, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	rec, err := c.SetDraining("a", true)
	require.NoError(t, err)
	require.Equal(t, Draining, rec.Lifecycle)
	require.Equal(t, []Reason{ReasonDraining}, rec.Reasons)
	require.True(t, rec.UpdatedAt.After(first.UpdatedAt))
	require.Empty(t, c.Schedulable("llama"))
	require.Equal(t, []string{"a"}, ids(c.List()))

	// Draining again is a no-op.
	again, err := c.SetDraining("a", true)
	require.NoError(t, err)
	require.Equal(t, rec, again)

	// Upserts keep it draining, and the missing pieces show after the draining reason.
	w := complete("a")
	w.KVEventEndpoints = nil
	rec, err = c.Upsert(w)
	require.NoError(t, err)
	require.Equal(t, Draining, rec.Lifecycle)
	require.Equal(t, []Reason{ReasonDraining, ReasonNoEventEndpoint.forRank(0)}, rec.Reasons)

	// Undraining evaluates afresh: still incomplete.
	rec, err = c.SetDraining("a", false)
	require.NoError(t, err)
	require.Equal(t, Incomplete, rec.Lifecycle)
	require.Equal(t, []Reason{ReasonNoEventEndpoint.forRank(0)}, rec.Reasons)

	_, err = c.Upsert(complete("a"))
	require.NoError(t, err)
	require.Len(t, c.Schedulable("llama"), 1)

	// A draining worker can be deleted.
	_, err = c.SetDraining("a", true)
	require.NoError(t, err)
	rec, err = c.Delete("a")
	require.NoError(t, err)
	require.Equal(t, Unschedulable, rec.Lifecycle)
	require.Equal(t, []Reason{ReasonDeleted}, rec.Reasons)
}

func TestListsSortedAndFiltered(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true})
	for _, id := range []string{"d", "b", "a", "c"} {
		w := complete(id)
		if id == "c" {
			w.Model = "qwen"
		}
		if id == "b" {
			w.Endpoint = ""
		}
		_, err := c.Upsert(w)
		require.NoError(t, err)
	}
	_, err := c.SetDraining("d", true)
	require.NoError(t, err)

	require.Equal(t, []string{"a", "b", "c", "d"}, ids(c.List()))
	require.Equal(t, []string{"a"}, ids(c.Schedulable("llama")))
	require.Equal(t, []string{"c"}, ids(c.Schedulable("qwen")))
	require.Empty(t, c.Schedulable("unknown"))
	require.NotNil(t, c.Schedulable("unknown"))

	// Schedulable follows every change: undrain, lose an endpoint, move model, delete.
	_, err = c.SetDraining("d", false)
	require.NoError(t, err)
	require.Equal(t, []string{"a", "d"}, ids(c.Schedulable("llama")))
	w := complete("a")
	w.Endpoint = ""
	_, err = c.Upsert(w)
	require.NoError(t, err)
	require.Equal(t, []string{"d"}, ids(c.Schedulable("llama")))
	w = complete("d")
	w.Model = "qwen"
	_, err = c.Upsert(w)
	require.NoError(t, err)
	require.Empty(t, c.Schedulable("llama"))
	require.Equal(t, []string{"c", "d"}, ids(c.Schedulable("qwen")))
	_, err = c.Delete("c")
	require.NoError(t, err)
	require.Equal(t, []string{"d"}, ids(c.Schedulable("qwen")))
}

func TestDeepCopies(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true})
	in := complete("a")
	in.KVEventEndpoints = map[int]string{0: ""} // incomplete, so there are reasons
	rec, err := c.Upsert(in)
	require.NoError(t, err)
	_, err = c.Upsert(complete("b"))
	require.NoError(t, err)

	// Mutating the input after the call changes nothing.
	in.KVEventEndpoints[0] = "tcp://evil:1"
	in.Labels["app"] = "evil"
	// Nor does mutating any returned record.
	rec.Worker.Labels["app"] = "evil"
	rec.Worker.KVEventEndpoints[0] = "tcp://evil:2"
	rec.Reasons[0] = "evil"
	got, _ := c.Get("a")
	got.Worker.Labels["x"] = "y"
	list := c.List()
	list[0].Worker.Labels["x"] = "z"
	list[0].Reasons[0] = "evil"
	sched := c.Schedulable("llama")
	sched[0].Worker.KVEventEndpoints[0] = "tcp://evil:3"

	rec, ok := c.Get("a")
	require.True(t, ok)
	require.Equal(t, map[string]string{"app": "vllm"}, rec.Worker.Labels)
	require.Equal(t, map[int]string{0: ""}, rec.Worker.KVEventEndpoints)
	require.Equal(t, []Reason{ReasonNoEventEndpoint.forRank(0)}, rec.Reasons)
	require.Equal(t, Incomplete, rec.Lifecycle)
	rec, _ = c.Get("b")
	require.Equal(t, map[int]string{0: "tcp://10.0.0.5:5557"}, rec.Worker.KVEventEndpoints)

	// Records returned by SetDraining and Delete are copies too.
	dr, err := c.SetDraining("a", true)
	require.NoError(t, err)
	dr.Worker.Labels["app"] = "evil"
	dr.Reasons[0] = "evil"
	rec, _ = c.Get("a")
	require.Equal(t, "vllm", rec.Worker.Labels["app"])
	require.Equal(t, ReasonDraining, rec.Reasons[0])
}

func TestZeroValueCatalog(t *testing.T) {
	var c Catalog
	require.Empty(t, c.List())
	require.Empty(t, c.Schedulable(""))
	_, ok := c.Get("a")
	require.False(t, ok)
	_, err := c.Delete("a")
	require.ErrorIs(t, err, ErrNotFound)
	rec, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	require.Equal(t, Schedulable, rec.Lifecycle, "zero requirements: no events, no queueing")
	require.False(t, rec.UpdatedAt.IsZero())
	_, err = c.SetDraining("a", true)
	require.NoError(t, err)
	_, err = c.Delete("a")
	require.NoError(t, err)
	require.Empty(t, c.List())
}

// TestConcurrentAccess runs readers and writers together under -race and checks
// the invariants at the end.
func TestConcurrentAccess(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true})
	const nids = 32
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 300 {
				id := fmt.Sprintf("w%02d", (g*13+i)%nids)
				w := complete(id)
				w.Model = []string{"m1", "m2"}[i%2]
				if i%5 == 0 {
					w.KVEventEndpoints = nil
				}
				switch i % 6 {
				case 0, 1, 2, 5:
					_, err := c.Upsert(w)
					assert.NoError(t, err)
				case 3:
					_, _ = c.SetDraining(id, i%12 == 3)
				case 4:
					_, _ = c.Delete(id)
				}
			}
		})
	}
	for range 2 {
		wg.Go(func() {
			for range 300 {
				for _, r := range c.Schedulable("m1") {
					assert.Equal(t, Schedulable, r.Lifecycle)
					assert.Equal(t, "m1", r.Worker.Model)
				}
				if r, ok := c.Get("w01"); ok {
					r.Worker.Labels["x"] = "y" // must not race with the catalog
				}
				_ = c.List()
			}
		})
	}
	wg.Wait()

	all := c.List()
	want := map[string][]string{}
	for i, r := range all {
		if i > 0 {
			require.Less(t, all[i-1].Worker.ID, r.Worker.ID)
		}
		life, reasons := evaluate(r.Worker, c.req)
		if r.Lifecycle == Draining {
			require.Equal(t, append([]Reason{ReasonDraining}, reasons...), r.Reasons)
		} else {
			require.Equal(t, life, r.Lifecycle)
			require.Equal(t, reasons, r.Reasons)
		}
		if r.Lifecycle == Schedulable {
			want[r.Worker.Model] = append(want[r.Worker.Model], r.Worker.ID)
		}
		require.NotContains(t, r.Worker.Labels, "x")
	}
	for _, m := range []string{"m1", "m2"} {
		require.Equal(t, want[m], ids(c.Schedulable(m)), "Schedulable matches the records")
	}
}
