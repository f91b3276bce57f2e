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

// apply carries out a plan the way its callers do: deletes, then upserts.
func apply(t *testing.T, c *Catalog, p Plan) {
	t.Helper()
	for _, id := range p.Deletes {
		_, err := c.Delete(id)
		require.NoError(t, err)
	}
	for _, w := range p.Upserts {
		_, err := c.Upsert(w)
		require.NoError(t, err)
	}
}

func TestReconcile(t *testing.T) {
	c, _ := newCatalog(t, Requirements{KVEvents: true})
	for _, id := range []string{"keep", "change", "gone", "was-bad"} {
		_, err := c.Upsert(complete(id))
		require.NoError(t, err)
	}
	deleted, err := c.Delete("gone") // a deleted record passed in current is ignored
	require.NoError(t, err)
	_, err = c.Upsert(complete("gone2"))
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
	require.Equal(t, before, c.List(), "Reconcile only plans")

	// The plan holds copies: mutating the inputs afterwards does not change it.
	changed.Labels["app"] = "evil" // desired[1] shares this map
	require.Equal(t, "vllm", plan.Upserts[0].Labels["app"])
	changed.Labels["app"] = "vllm"

	apply(t, c, plan)
	require.Equal(t, []string{"change", "gone", "keep", "new", "was-bad"}, ids(c.List()))
	got, _ := c.Get("was-bad")
	require.Equal(t, "10.0.0.5:8000", got.Worker.Endpoint, "an invalid update keeps the current record")
	got, _ = c.Get("change")
	require.Equal(t, "10.0.0.7:8000", got.Worker.Endpoint)

	// Reconciling again converges: nothing left to do.
	plan, err = Reconcile(c.List(), desired)
	require.NoError(t, err)
	require.Empty(t, plan.Upserts)
	require.Empty(t, plan.Deletes)
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
}
