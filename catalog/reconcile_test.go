package catalog

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func upsertIDs(p Plan) []string {
	var ids []string
	for _, w := range p.Upserts {
		ids = append(ids, w.ID)
	}
	return ids
}

func TestReconcile(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true})
	for _, id := range []string{"keep", "change", "gone", "was-bad"} {
		_, _, err := c.Upsert(complete(id))
		require.NoError(t, err)
	}
	deleted, err := c.Delete("gone") // a deleted record passed in current is ignored
	require.NoError(t, err)
	_, _, err = c.Upsert(complete("gone2"))
	require.NoError(t, err)

	changed := complete("change")
	changed.Endpoint = "10.0.0.7:8000"
	bad := complete("was-bad")
	bad.Endpoint = "http://oops"
	sameButDefaultModel := complete("keep")
	desired := []Worker{
		complete("new"),
		changed,
		sameButDefaultModel,
		bad,
		{Endpoint: "h:1"}, // no id
		complete("gone"),  // re-added after its delete
	}
	current := append(c.List(), deleted)
	before := c.List()

	plan, err := Reconcile(current, desired)
	require.NoError(t, err)
	require.Equal(t, []string{"change", "gone", "new"}, upsertIDs(plan))
	require.Equal(t, []string{"gone2"}, plan.Deletes)
	require.Len(t, plan.Invalid, 2)
	require.Equal(t, "", plan.Invalid[0].ID)
	require.ErrorIs(t, plan.Invalid[0].Err, ErrInvalidWorker)
	require.Equal(t, "was-bad", plan.Invalid[1].ID)
	require.ErrorIs(t, plan.Invalid[1].Err, ErrInvalidWorker)
	require.False(t, plan.Empty())
	require.Equal(t, "upserts=3 deletes=1 invalid=2", plan.String())
	require.Equal(t, before, c.List(), "Reconcile only plans")

	// The plan holds copies: mutating the inputs afterwards does not change it.
	changed.Labels["app"] = "evil" // desired[1] shares this map
	require.Equal(t, "vllm", plan.Upserts[0].Labels["app"])
	changed.Labels["app"] = "vllm"

	recs, err := c.Apply(plan)
	require.NoError(t, err)
	require.Len(t, recs, 4)
	require.Equal(t, "gone2", recs[0].Worker.ID)
	require.Equal(t, Unschedulable, recs[0].Lifecycle)

	var ids []string
	for _, r := range c.List() {
		ids = append(ids, r.Worker.ID)
	}
	require.Equal(t, []string{"change", "gone", "keep", "new", "was-bad"}, ids)
	got, _ := c.Get("was-bad")
	require.Equal(t, "10.0.0.5:8000", got.Worker.Endpoint, "an invalid update keeps the current record")
	got, _ = c.Get("change")
	require.Equal(t, "10.0.0.7:8000", got.Worker.Endpoint)

	// Reconciling again converges: nothing left to do.
	plan, err = Reconcile(c.List(), desired)
	require.NoError(t, err)
	require.True(t, plan.Empty())
	require.Len(t, plan.Invalid, 2)

	// An empty desired set deletes everything.
	plan, err = Reconcile(c.List(), nil)
	require.NoError(t, err)
	require.Empty(t, plan.Upserts)
	require.Equal(t, []string{"change", "gone", "keep", "new", "was-bad"}, plan.Deletes)
}

func TestReconcileDuplicates(t *testing.T) {
	current := []Record{{Worker: complete("x"), Lifecycle: Schedulable}}
	bad := complete("b")
	bad.BlockSize = -1
	desired := []Worker{complete("a"), complete("b"), complete("c"), bad, complete("a"), complete("a"), {}, {}}
	plan, err := Reconcile(current, desired)
	require.ErrorIs(t, err, ErrDuplicateID)
	require.Equal(t, `catalog: duplicate worker id: "a", "b"`, err.Error(), "empty ids are invalid, not duplicates")
	require.Equal(t, Plan{}, plan, "nothing planned")

	c, _ := newCatalog(t, Requirements{})
	_, _, err = c.Upsert(complete("x"))
	require.NoError(t, err)
	plan, err = c.Sync(desired)
	require.ErrorIs(t, err, ErrDuplicateID)
	require.Equal(t, Plan{}, plan)
	require.Equal(t, 1, c.Len(), "nothing applied")
	require.Equal(t, uint64(1), c.Version())
}

func TestApply(t *testing.T) {
	c, _ := newCatalog(t, Requirements{})
	_, _, err := c.Upsert(complete("a"))
	require.NoError(t, err)
	bad := complete("bad")
	bad.Endpoint = "nope"
	recs, err := c.Apply(Plan{
		Deletes: []string{"a", "missing"}, // missing counts as done
		Upserts: []Worker{complete("b"), bad, complete("a")},
		Invalid: []Invalid{{ID: "ignored"}},
	})
	require.ErrorIs(t, err, ErrInvalidWorker)
	require.Contains(t, err.Error(), `"bad"`)
	require.Len(t, recs, 3)
	require.Equal(t, Unschedulable, recs[0].Lifecycle)
	require.Equal(t, uint64(2), recs[0].Version)
	require.Equal(t, "b", recs[1].Worker.ID)
	require.Equal(t, "a", recs[2].Worker.ID)
	require.Equal(t, uint64(4), recs[2].Version, "deleted then re-added")
	require.Equal(t, 2, c.Len())

	// Records returned by Apply are copies.
	recs[1].Worker.Labels["app"] = "evil"
	got, _ := c.Get("b")
	require.Equal(t, "vllm", got.Worker.Labels["app"])

	// Applying an empty plan is harmless.
	recs, err = c.Apply(Plan{})
	require.NoError(t, err)
	require.Empty(t, recs)
}

func TestSync(t *testing.T) {
	var changes []Change
	c, err := New(Options{Requirements: Requirements{KVEvents: true}, OnChange: func(_ Record, ch Change) {
		changes = append(changes, ch)
	}})
	require.NoError(t, err)
	noEvents := complete("b")
	noEvents.KVEventEndpoints = nil
	plan, err := c.Sync([]Worker{complete("a"), noEvents})
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b"}, upsertIDs(plan))
	require.Len(t, c.Schedulable("llama"), 1)
	got, _ := c.Get("b")
	require.Equal(t, Incomplete, got.Lifecycle)

	// The returned plan does not alias the catalog.
	plan.Upserts[0].Labels["app"] = "evil"
	got, _ = c.Get("a")
	require.Equal(t, "vllm", got.Worker.Labels["app"])

	plan, err = c.Sync([]Worker{complete("a"), noEvents})
	require.NoError(t, err)
	require.True(t, plan.Empty(), "converged")

	plan, err = c.Sync([]Worker{complete("b")})
	require.NoError(t, err)
	require.Equal(t, []string{"b"}, upsertIDs(plan))
	require.Equal(t, []string{"a"}, plan.Deletes)
	got, _ = c.Get("b")
	require.Equal(t, Schedulable, got.Lifecycle)
	require.Equal(t, []ChangeKind{Added, Added, Deleted, Updated}, kinds(changes))
	require.True(t, changes[3].EventsChanged())
	require.Equal(t, Incomplete, changes[3].Before)
	require.Equal(t, Schedulable, changes[3].After)
}

func kinds(chs []Change) []ChangeKind {
	var out []ChangeKind
	for _, ch := range chs {
		out = append(out, ch.Kind)
	}
	return out
}
