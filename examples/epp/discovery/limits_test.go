package discovery_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
	"github.com/kvselect/kvselect/internal/logtest"
	"github.com/kvselect/kvselect/tokenize"
)

// wideFile is a workers file of n workers of dpSize ranks each, every field
// within its own bound (issue 27: 500 x 4,096 is a 32 KB file).
func wideFile(t *testing.T, n, dpSize int) string {
	t.Helper()
	type entry struct {
		ID       string `json:"id"`
		Endpoint string `json:"endpoint"`
		DPSize   int    `json:"dp_size"`
	}
	ws := make([]entry, n)
	for i := range ws {
		ws[i] = entry{ID: fmt.Sprintf("w%03d", i), Endpoint: fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250+1), DPSize: dpSize}
	}
	raw, err := json.Marshal(map[string]any{"workers": ws})
	require.NoError(t, err)
	return string(raw)
}

func TestParseWorkersLimits(t *testing.T) {
	// Issue 27's file: refused whole, by name, and small.
	big := wideFile(t, 500, catalog.MaxDPSize)
	require.Less(t, len(big), 40<<10)
	ws, err := discovery.ParseWorkers([]byte(big), discovery.Defaults{})
	require.Nil(t, ws)
	require.ErrorIs(t, err, discovery.ErrInvalidFile)
	require.ErrorIs(t, err, discovery.ErrTooManyRanks)
	require.ErrorContains(t, err, "500 workers have 2048000 data-parallel ranks together (the sum of their dp_size), above the bound of 65536")

	// At the default bound exactly: accepted.
	ws, err = discovery.ParseWorkers([]byte(wideFile(t, catalog.DefaultMaxRanks/catalog.MaxDPSize, catalog.MaxDPSize)), discovery.Defaults{})
	require.NoError(t, err)
	require.Equal(t, catalog.DefaultMaxRanks, catalog.TotalRanks(ws))

	// A dp_size left out counts one rank; the bounds are knobs.
	three := `{"workers": [{"id": "a", "endpoint": "h:1"}, {"id": "b", "endpoint": "h:2", "dp_size": 2}]}`
	_, err = discovery.ParseWorkersWithin([]byte(three), discovery.Defaults{}, discovery.Limits{MaxRanks: 2})
	require.ErrorIs(t, err, discovery.ErrTooManyRanks)
	require.ErrorContains(t, err, "2 workers have 3 data-parallel ranks")
	ws, err = discovery.ParseWorkersWithin([]byte(three), discovery.Defaults{}, discovery.Limits{MaxRanks: 3})
	require.NoError(t, err)
	require.Len(t, ws, 2)
	_, err = discovery.ParseWorkersWithin([]byte(three), discovery.Defaults{}, discovery.Limits{MaxWorkers: 1})
	require.ErrorIs(t, err, discovery.ErrInvalidFile)
	require.ErrorIs(t, err, discovery.ErrTooManyWorkers)
	require.ErrorContains(t, err, "2 workers, above the bound of 1")

	// The worker bound's default: one entry more is refused before any entry
	// is looked at (these have no endpoint, which would be an error too).
	many := make([]map[string]string, discovery.DefaultMaxWorkers+1)
	for i := range many {
		many[i] = map[string]string{"id": fmt.Sprint(i)}
	}
	raw, err := json.Marshal(map[string]any{"workers": many})
	require.NoError(t, err)
	_, err = discovery.ParseWorkers(raw, discovery.Defaults{})
	require.ErrorIs(t, err, discovery.ErrTooManyWorkers)
	require.NotContains(t, err.Error(), "endpoint is empty")
}

func TestStaticLimits(t *testing.T) {
	dir := t.TempDir()
	_, err := discovery.NewStatic(discovery.StaticOptions{Path: "x", Limits: discovery.Limits{MaxWorkers: -1, MaxRanks: -2}})
	require.ErrorIs(t, err, discovery.ErrInvalidOptions)
	require.ErrorContains(t, err, "Limits.MaxWorkers -1 is negative")
	require.ErrorContains(t, err, "Limits.MaxRanks -2 is negative")

	// At start: NewStatic fails, by name.
	path := filepath.Join(dir, "workers.json")
	writeFile(t, path, wideFile(t, 500, catalog.MaxDPSize))
	_, err = discovery.NewStatic(discovery.StaticOptions{Path: path})
	require.ErrorIs(t, err, discovery.ErrTooManyRanks)
	require.ErrorContains(t, err, path)
	writeFile(t, path, wideFile(t, 3, 1))
	_, err = discovery.NewStatic(discovery.StaticOptions{Path: path, Limits: discovery.Limits{MaxWorkers: 2}})
	require.ErrorIs(t, err, discovery.ErrTooManyWorkers)
}

// TestStaticReloadPastLimits: a reload past the bound on ranks is refused
// whole and logged at ERROR with the reason; the last good set stays, and a
// good file afterwards is taken again.
func TestStaticReloadPastLimits(t *testing.T) {
	e := startStatic(t, jsonFile)
	require.Equal(t, []string{"a"}, ids(e.next(t)))

	writeFile(t, e.path, wideFile(t, 500, catalog.MaxDPSize))
	e.poll(t)
	e.none(t)
	recs := e.logs.records(t, "workers file rejected; keeping the last good set")
	require.Len(t, recs, 1)
	require.Equal(t, slog.LevelError.String(), recs[0]["level"])
	require.Contains(t, recs[0]["error"], discovery.ErrTooManyRanks.Error())
	require.Contains(t, recs[0]["error"], "2048000 data-parallel ranks")
	require.EqualValues(t, 1, recs[0]["workers"], "the last good set")

	writeFile(t, e.path, wideFile(t, 2, 4))
	e.poll(t)
	s := e.next(t)
	require.Equal(t, []string{"w000", "w001"}, ids(s))
	require.Equal(t, 8, catalog.TotalRanks(s.Workers))
}

// A pool larger than MaxTokenizers gives its tokenizer pool the first
// MaxTokenizers workers (by id, the snapshot's order), one endpoint each,
// and says how many it left out.
func TestTokenizersBounded(t *testing.T) {
	pool, err := tokenize.NewClientPool(tokenize.Options{Protocol: tokenize.ProtocolVLLMRender}, nil, tokenize.PoolOptions{})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	var log logtest.Buffer
	tk := discovery.NewTokenizers(pool, "", tokenize.ProtocolVLLMRender, slog.New(slog.NewTextHandler(&log, nil)))
	ws := make([]catalog.Worker, discovery.MaxTokenizers+6)
	for i := range ws {
		ws[i] = catalog.Worker{ID: fmt.Sprintf("w%03d", i), Endpoint: fmt.Sprintf("10.0.0.%d:8000", i+1)}
	}
	tk.Follow(ws, true)
	eps := pool.Stats().Endpoints
	require.Len(t, eps, discovery.MaxTokenizers)
	require.Equal(t, "http://10.0.0.1:8000", eps[0].Name)
	require.Equal(t, fmt.Sprintf("http://10.0.0.%d:8000", discovery.MaxTokenizers), eps[len(eps)-1].Name)
	require.Contains(t, log.String(), "past its bound")
	require.Contains(t, log.String(), "left_out=6")
}
