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
	c, err := New(Options{Requirements: req, Now: clk.Now})
	require.NoError(t, err)
	return c, clk
}

func TestUpsertAdd(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true, Queueing: true})
	rec, ch, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	require.Equal(t, Change{Kind: Added, After: Schedulable}, ch)
	require.Equal(t, Schedulable, rec.Lifecycle)
	require.Nil(t, rec.Reasons)
	require.Equal(t, uint64(1), rec.Version)
	require.Equal(t, time.Date(2025, 1, 1, 0, 0, 1, 0, time.UTC), rec.UpdatedAt)
	require.True(t, rec.Worker.Equal(complete("a")))

	w := Worker{ID: "b", Endpoint: "10.9.9.9:1", DPSize: 1} // no block size, no events, no max batched
	rec, ch, err = c.Upsert(w)
	require.NoError(t, err)
	require.Equal(t, Added, ch.Kind)
	require.Equal(t, Incomplete, ch.After)
	require.Equal(t, Incomplete, rec.Lifecycle)
	require.Equal(t, []Reason{ReasonNoBlockSize, ReasonNoMaxBatched, ReasonNoEventEndpoint.ForRank(0)}, rec.Reasons)
	require.Equal(t, DefaultModel, rec.Worker.Model, "model normalised")
	require.Equal(t, uint64(2), rec.Version)
	require.Equal(t, 2, c.Len())
	require.Equal(t, uint64(2), c.Version())
	require.Equal(t, []string{DefaultModel, "llama"}, c.Models())
}

func TestUpsertInvalid(t *testing.T) {
	c, _ := newCatalog(t, Requirements{})
	_, _, err := c.Upsert(Worker{ID: "a", Endpoint: "http://h:1"})
	require.ErrorIs(t, err, ErrInvalidWorker)
	require.Zero(t, c.Len())
	require.Zero(t, c.Version())

	// An invalid update leaves the stored record as it was.
	_, _, err = c.Upsert(complete("a"))
	require.NoError(t, err)
	bad := complete("a")
	bad.BlockSize = -1
	_, _, err = c.Upsert(bad)
	require.ErrorIs(t, err, ErrInvalidWorker)
	rec, ok := c.Get("a")
	require.True(t, ok)
	require.Equal(t, 16, rec.Worker.BlockSize)
	require.Equal(t, uint64(1), rec.Version)
}

func TestUpsertChangeClassification(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Worker)
		want   Parts
		after  Lifecycle
	}{
		{"nothing", func(*Worker) {}, 0, Schedulable},
		{"empty maps equal nil maps", func(w *Worker) { w.Model = "llama" }, 0, Schedulable},
		{"serving endpoint", func(w *Worker) { w.Endpoint = "10.0.0.6:8000" }, PartEndpoint, Schedulable},
		{"event endpoint", func(w *Worker) { w.KVEventEndpoints = map[int]string{0: "tcp://10.0.0.6:5557"} }, PartEvents, Schedulable},
		{"replay endpoint", func(w *Worker) { w.ReplayEndpoint = "" }, PartEvents, Schedulable},
		{"dp ranges", func(w *Worker) {
			w.DPSize = 2
			w.KVEventEndpoints = map[int]string{0: "tcp://10.9.9.9:1", 1: "tcp://10.9.9.9:2"}
		}, PartEvents, Schedulable},
		{"block size", func(w *Worker) { w.BlockSize = 32 }, PartEvents, Schedulable},
		{"model", func(w *Worker) { w.Model = "qwen" }, PartModel, Schedulable},
		{"capacity", func(w *Worker) { w.TotalKVBlocks = 2000 }, PartCapacity, Schedulable},
		{"labels", func(w *Worker) { w.Labels = map[string]string{"app": "x"} }, PartMetadata, Schedulable},
		{"identity", func(w *Worker) { w.Identity = "renamed" }, PartMetadata, Schedulable},
		{"endpoint lost", func(w *Worker) { w.Endpoint = "" }, PartEndpoint, Incomplete},
		{"max batched lost", func(w *Worker) { w.MaxNumBatchedTokens = 0 }, PartCapacity, Incomplete},
		{"pod moved", func(w *Worker) {
			w.Endpoint = "10.0.0.9:8000"
			w.KVEventEndpoints = map[int]string{0: "tcp://10.0.0.9:5557"}
			w.Identity = "new-pod"
		}, PartEndpoint | PartEvents | PartMetadata, Schedulable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _ := newCatalog(t, Requirements{KVEvents: true, Queueing: true})
			first, _, err := c.Upsert(complete("a"))
			require.NoError(t, err)
			w := complete("a")
			tt.mutate(&w)
			rec, ch, err := c.Upsert(w)
			require.NoError(t, err)
			require.Equal(t, tt.want, ch.Parts)
			require.Equal(t, Schedulable, ch.Before)
			require.Equal(t, tt.after, ch.After)
			require.Equal(t, tt.after, rec.Lifecycle)
			if tt.want == 0 {
				require.Equal(t, Unchanged, ch.Kind)
				require.Equal(t, first, rec, "an unchanged upsert bumps nothing")
				require.Equal(t, uint64(1), c.Version())
				return
			}
			require.Equal(t, Updated, ch.Kind)
			require.Equal(t, uint64(2), rec.Version)
			require.True(t, rec.UpdatedAt.After(first.UpdatedAt))
			require.Equal(t, tt.want&PartEndpoint != 0, ch.EndpointsChanged())
			require.Equal(t, tt.want&PartEvents != 0, ch.EventsChanged())
			require.Equal(t, tt.want&PartModel != 0, ch.ModelChanged())
			require.Equal(t, tt.want == PartMetadata, ch.MetadataOnly())
			require.Equal(t, tt.after != Schedulable, ch.LifecycleChanged())
		})
	}
}

func TestModelMove(t *testing.T) {
	c, _ := newCatalog(t, Requirements{})
	_, _, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	w := complete("a")
	w.Model = ""
	_, ch, err := c.Upsert(w)
	require.NoError(t, err)
	require.True(t, ch.ModelChanged())
	require.Empty(t, c.ListModel("llama"))
	require.Len(t, c.ListModel(""), 1)
	require.Len(t, c.ListModel(DefaultModel), 1)
	require.Len(t, c.Schedulable(""), 1)
	require.Equal(t, []string{DefaultModel}, c.Models(), "an emptied partition disappears")
}

func TestDelete(t *testing.T) {
	c, _ := newCatalog(t, Requirements{})
	_, _, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	_, _, err = c.Upsert(complete("b"))
	require.NoError(t, err)

	rec, err := c.Delete("a")
	require.NoError(t, err)
	require.Equal(t, Unschedulable, rec.Lifecycle)
	require.Equal(t, []Reason{ReasonDeleted}, rec.Reasons)
	require.Equal(t, "a", rec.Worker.ID)
	require.Equal(t, uint64(3), rec.Version)

	_, ok := c.Get("a")
	require.False(t, ok)
	require.Equal(t, 1, c.Len())
	for _, r := range c.List() {
		require.NotEqual(t, "a", r.Worker.ID)
	}
	for _, r := range c.Schedulable("llama") {
		require.NotEqual(t, "a", r.Worker.ID)
	}

	_, err = c.Delete("a")
	require.ErrorIs(t, err, ErrNotFound)
	require.Contains(t, err.Error(), `"a"`)
	_, err = c.Delete("never")
	require.ErrorIs(t, err, ErrNotFound)
	require.Equal(t, uint64(3), c.Version(), "a failed delete changes nothing")

	// Re-adding the id starts a fresh record with a newer version.
	rec, ch, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	require.Equal(t, Added, ch.Kind)
	require.Equal(t, uint64(4), rec.Version)
}

func TestDraining(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true})
	_, err := c.SetDraining("a", true)
	require.ErrorIs(t, err, ErrNotFound)

	_, _, err = c.Upsert(complete("a"))
	require.NoError(t, err)
	rec, err := c.SetDraining("a", true)
	require.NoError(t, err)
	require.Equal(t, Draining, rec.Lifecycle)
	require.Equal(t, []Reason{ReasonDraining}, rec.Reasons)
	require.Equal(t, uint64(2), rec.Version)
	require.Empty(t, c.Schedulable("llama"))
	require.Len(t, c.ListModel("llama"), 1)

	// Draining again is a no-op.
	again, err := c.SetDraining("a", true)
	require.NoError(t, err)
	require.Equal(t, rec, again)

	// Upserts keep it draining, and the missing pieces show after the draining reason.
	w := complete("a")
	w.KVEventEndpoints = nil
	rec, ch, err := c.Upsert(w)
	require.NoError(t, err)
	require.Equal(t, Change{Kind: Updated, Parts: PartEvents, Before: Draining, After: Draining}, ch)
	require.Equal(t, []Reason{ReasonDraining, ReasonNoEventEndpoint.ForRank(0)}, rec.Reasons)
	require.False(t, ch.LifecycleChanged())

	// Undraining evaluates afresh: still incomplete.
	rec, err = c.SetDraining("a", false)
	require.NoError(t, err)
	require.Equal(t, Incomplete, rec.Lifecycle)
	require.Equal(t, []Reason{ReasonNoEventEndpoint.ForRank(0)}, rec.Reasons)

	_, _, err = c.Upsert(complete("a"))
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
		_, _, err := c.Upsert(w)
		require.NoError(t, err)
	}
	_, err := c.SetDraining("d", true)
	require.NoError(t, err)

	ids := func(rs []Record) []string {
		var out []string
		for _, r := range rs {
			out = append(out, r.Worker.ID)
		}
		return out
	}
	require.Equal(t, []string{"a", "b", "c", "d"}, ids(c.List()))
	require.Equal(t, []string{"a", "b", "d"}, ids(c.ListModel("llama")))
	require.Equal(t, []string{"a"}, ids(c.Schedulable("llama")))
	require.Equal(t, []string{"c"}, ids(c.Schedulable("qwen")))
	require.Empty(t, c.Schedulable("unknown"))
	require.Empty(t, c.ListModel("unknown"))

	targets := c.AppendTargets(nil, "llama")
	require.Equal(t, []Target{{ID: "a", Endpoint: "10.0.0.5:8000", DPSize: 1, BlockSize: 16,
		TotalKVBlocks: 1000, MaxNumBatchedTokens: 8192, Version: 3}}, targets)
	require.Len(t, c.AppendTargets(targets, "qwen"), 2, "appends")
	require.Empty(t, c.AppendTargets(nil, "unknown"))

	// Targets follow every change: undrain, lose an endpoint, move model, delete.
	_, err = c.SetDraining("d", false)
	require.NoError(t, err)
	require.Equal(t, []string{"a", "d"}, targetIDs(c.AppendTargets(nil, "llama")))
	w := complete("a")
	w.Endpoint = ""
	_, _, err = c.Upsert(w)
	require.NoError(t, err)
	require.Equal(t, []string{"d"}, targetIDs(c.AppendTargets(nil, "llama")))
	w = complete("d")
	w.Model = "qwen"
	_, _, err = c.Upsert(w)
	require.NoError(t, err)
	require.Empty(t, c.AppendTargets(nil, "llama"))
	require.Equal(t, []string{"c", "d"}, targetIDs(c.AppendTargets(nil, "qwen")))
	_, err = c.Delete("c")
	require.NoError(t, err)
	require.Equal(t, []string{"d"}, targetIDs(c.AppendTargets(nil, "qwen")))
}

func targetIDs(ts []Target) []string {
	var out []string
	for _, t := range ts {
		out = append(out, t.ID)
	}
	return out
}

func TestDeepCopies(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true})
	in := complete("a")
	in.KVEventEndpoints = map[int]string{0: ""} // incomplete, so there are reasons
	rec, _, err := c.Upsert(in)
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
	sched := c.ListModel("llama")
	sched[0].Worker.KVEventEndpoints[0] = "tcp://evil:3"

	rec, ok := c.Get("a")
	require.True(t, ok)
	require.Equal(t, map[string]string{"app": "vllm"}, rec.Worker.Labels)
	require.Equal(t, map[int]string{0: ""}, rec.Worker.KVEventEndpoints)
	require.Equal(t, []Reason{ReasonNoEventEndpoint.ForRank(0)}, rec.Reasons)
	require.Equal(t, Incomplete, rec.Lifecycle)

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
	require.Zero(t, c.Len())
	require.Empty(t, c.List())
	_, ok := c.Get("a")
	require.False(t, ok)
	_, err := c.Delete("a")
	require.ErrorIs(t, err, ErrNotFound)
	rec, _, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	require.Equal(t, Schedulable, rec.Lifecycle, "zero requirements: no events, no queueing")
	require.False(t, rec.UpdatedAt.IsZero())
	_, err = c.SetDraining("a", true)
	require.NoError(t, err)
	_, err = c.Sync(nil)
	require.NoError(t, err)
	require.Zero(t, c.Len())
}

func TestOnChange(t *testing.T) {
	type seen struct {
		id   string
		ch   Change
		ver  uint64
		life Lifecycle
	}
	var got []seen
	var c *Catalog
	c, err := New(Options{OnChange: func(r Record, ch Change) {
		// The hook may read the catalog: the lock is released.
		_ = c.Len()
		r.Worker.Labels["mutated"] = "by hook" // a private copy
		got = append(got, seen{r.Worker.ID, ch, r.Version, r.Lifecycle})
	}})
	require.NoError(t, err)
	_, _, err = c.Upsert(complete("a"))
	require.NoError(t, err)
	_, _, err = c.Upsert(complete("a")) // unchanged: no call
	require.NoError(t, err)
	_, err = c.SetDraining("a", true)
	require.NoError(t, err)
	_, err = c.Delete("a")
	require.NoError(t, err)
	_, err = c.Delete("a") // not found: no call
	require.ErrorIs(t, err, ErrNotFound)

	require.Equal(t, []seen{
		{"a", Change{Kind: Added, After: Schedulable}, 1, Schedulable},
		{"a", Change{Kind: Updated, Parts: PartDraining, Before: Schedulable, After: Draining}, 2, Draining},
		{"a", Change{Kind: Deleted, Before: Draining, After: Unschedulable}, 3, Unschedulable},
	}, got)
	require.Equal(t, "deleted draining->unschedulable", got[2].ch.String())
	require.Equal(t, "updated(draining) schedulable->draining", got[1].ch.String())
}

// TestOnChangeOrderUnderRace checks that notifications arrive in Version order,
// exactly once each, while many writers race.
func TestOnChangeOrderUnderRace(t *testing.T) {
	var versions []uint64 // written only by the hook, which is serialised
	c, err := New(Options{OnChange: func(r Record, _ Change) { versions = append(versions, r.Version) }})
	require.NoError(t, err)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				id := fmt.Sprintf("w%d", (g*7+i)%16)
				w := complete(id)
				w.TotalKVBlocks = i + 1
				switch i % 4 {
				case 0, 1:
					_, _, _ = c.Upsert(w)
				case 2:
					_, _ = c.SetDraining(id, i%8 == 2)
				case 3:
					_, _ = c.Delete(id)
				}
			}
		})
	}
	wg.Wait()
	require.Equal(t, c.Version(), uint64(len(versions)))
	for i, v := range versions {
		require.Equal(t, uint64(i+1), v)
	}
}

func TestOnChangePanicDoesNotWedge(t *testing.T) {
	calls := 0
	c, err := New(Options{OnChange: func(Record, Change) {
		calls++
		if calls == 1 {
			panic("hook failed")
		}
	}})
	require.NoError(t, err)
	require.Panics(t, func() { _, _, _ = c.Upsert(complete("a")) })
	// The change was made, and later writers are not stuck behind the panic.
	require.Equal(t, 1, c.Len())
	_, _, err = c.Upsert(complete("b"))
	require.NoError(t, err)
	require.Equal(t, 2, calls)
}

// TestConcurrentAccess runs readers and writers together under -race and checks
// the invariants at the end.
func TestConcurrentAccess(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true})
	const ids = 32
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 300 {
				id := fmt.Sprintf("w%02d", (g*13+i)%ids)
				w := complete(id)
				w.Model = []string{"m1", "m2"}[i%2]
				if i%5 == 0 {
					w.KVEventEndpoints = nil
				}
				switch i % 6 {
				case 0, 1, 2:
					_, _, err := c.Upsert(w)
					assert.NoError(t, err)
				case 3:
					_, _ = c.SetDraining(id, i%12 == 3)
				case 4:
					_, _ = c.Delete(id)
				case 5:
					_, err := c.Sync([]Worker{w})
					assert.NoError(t, err)
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
	require.Equal(t, c.Len(), len(all))
	n := 0
	for _, m := range c.Models() {
		n += len(c.ListModel(m))
		var want []string
		for _, r := range c.Schedulable(m) {
			want = append(want, r.Worker.ID)
		}
		require.Equal(t, want, targetIDs(c.AppendTargets(nil, m)), "targets match the schedulable records")
	}
	require.Equal(t, len(all), n, "each record in exactly one partition")
	for i, r := range all {
		if i > 0 {
			require.Less(t, all[i-1].Worker.ID, r.Worker.ID)
		}
		require.LessOrEqual(t, r.Version, c.Version())
		life, reasons := Evaluate(r.Worker, c.Requirements())
		if r.Lifecycle == Draining {
			require.Equal(t, append([]Reason{ReasonDraining}, reasons...), r.Reasons)
		} else {
			require.Equal(t, life, r.Lifecycle)
			require.Equal(t, reasons, r.Reasons)
		}
		require.NotContains(t, r.Worker.Labels, "x")
	}
}

func TestPartsString(t *testing.T) {
	require.Equal(t, "none", Parts(0).String())
	require.Equal(t, "endpoint|events|metadata", (PartEndpoint | PartEvents | PartMetadata).String())
	require.Equal(t, "draining|0x80", (PartDraining | 0x80).String())
	require.Equal(t, "unchanged", Change{}.String())
	require.Equal(t, "added schedulable", Change{Kind: Added, After: Schedulable}.String())
	require.Equal(t, "ChangeKind(9)", ChangeKind(9).String())
}
