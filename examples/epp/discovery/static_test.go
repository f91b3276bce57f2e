package discovery_test

import (
	"context"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/examples/epp/discovery"
)

const yamlFile = `
workers:
  - id: b
    endpoint: 10.0.0.2:8000
    kv_events_endpoints: {0: "tcp://10.0.0.2:5557", 1: "tcp://10.0.0.2:5558"}
    dp_size: 2
    labels: {nvidia.com/role: prefill}
  - id: a
    identity: pod/a
    endpoint: "[fd00::1]:8000"
    model: llama
    kv_events_endpoint: tcp://[fd00::1]:5557
    replay_endpoint: tcp://[fd00::1]:5560
    block_size: 32
    total_kv_blocks: 100
    max_num_batched_tokens: 2048
    dp_start: 4
`

const jsonFile = `{"workers": [
  {"id": "a", "endpoint": "127.0.0.1:8001", "kv_events_endpoint": "tcp://127.0.0.1:5557"}
]}`

var testDefaults = discovery.Defaults{Model: "qwen3", BlockSize: 16, TotalKVBlocks: 4096, MaxNumBatchedTokens: 8192}

func TestParseWorkersYAML(t *testing.T) {
	ws, err := discovery.ParseWorkers([]byte(yamlFile), testDefaults)
	require.NoError(t, err)
	require.Equal(t, []catalog.Worker{
		{
			ID: "a", Identity: "pod/a", Model: "llama", Endpoint: "[fd00::1]:8000",
			DPStart: 4, DPSize: 1,
			KVEventEndpoints:    map[int]string{4: "tcp://[fd00::1]:5557"},
			ReplayEndpoint:      "tcp://[fd00::1]:5560",
			BlockSize:           32,
			TotalKVBlocks:       100,
			MaxNumBatchedTokens: 2048,
		},
		{
			ID: "b", Identity: "b", Model: "qwen3", Endpoint: "10.0.0.2:8000",
			DPStart: 0, DPSize: 2,
			KVEventEndpoints:    map[int]string{0: "tcp://10.0.0.2:5557", 1: "tcp://10.0.0.2:5558"},
			BlockSize:           16,
			TotalKVBlocks:       4096,
			MaxNumBatchedTokens: 8192,
			Labels:              map[string]string{"nvidia.com/role": "prefill"},
		},
	}, ws)
}

func TestParseWorkersJSON(t *testing.T) {
	ws, err := discovery.ParseWorkers([]byte(jsonFile), discovery.Defaults{})
	require.NoError(t, err)
	require.Equal(t, []catalog.Worker{{
		ID: "a", Identity: "a", Endpoint: "127.0.0.1:8001", DPSize: 1,
		KVEventEndpoints: map[int]string{0: "tcp://127.0.0.1:5557"},
	}}, ws)

	ws, err = discovery.ParseWorkers([]byte(`{"workers": []}`), discovery.Defaults{})
	require.NoError(t, err)
	require.Empty(t, ws)
}

func TestParseWorkersInvalid(t *testing.T) {
	cases := []struct {
		name string
		file string
		want []string
	}{
		{"empty file", ``, []string{`no "workers" list`}},
		{"truncated", `{"workers": [{"id": "a"`, []string{"discovery: invalid workers file"}},
		{"workers not a list", `workers: {id: a}`, []string{"cannot unmarshal"}},
		{"unknown top-level key", "worker:\n  - id: a\n", []string{`unknown field "worker"`}},
		{"unknown worker key", "workers:\n  - id: a\n    endpoint: h:1\n    blocksize: 16\n", []string{`unknown field "blocksize"`}},
		{"duplicate key", "workers:\n  - id: a\n    id: b\n    endpoint: h:1\n", []string{`"id"`}},
		{"missing id", "workers:\n  - endpoint: h:1\n", []string{"workers[0]: ", "id is empty"}},
		{"missing endpoint", "workers:\n  - id: a\n", []string{`workers[0] ("a"): endpoint is empty`}},
		{"endpoint with scheme", "workers:\n  - id: a\n    endpoint: http://h:1\n", []string{"without a scheme"}},
		{"endpoint port", "workers:\n  - id: a\n    endpoint: h:0\n", []string{"not in 1..65535"}},
		{"both event forms", "workers:\n  - id: a\n    endpoint: h:1\n    kv_events_endpoint: tcp://h:2\n    kv_events_endpoints: {0: tcp://h:2}\n",
			[]string{"kv_events_endpoint and kv_events_endpoints are both set"}},
		{"event endpoint scheme", "workers:\n  - id: a\n    endpoint: h:1\n    kv_events_endpoint: udp://h:2\n", []string{`scheme "udp"`}},
		{"event rank outside", "workers:\n  - id: a\n    endpoint: h:1\n    kv_events_endpoints: {1: tcp://h:2}\n", []string{"rank 1 outside ranks 0..0"}},
		{"dp size zero", "workers:\n  - id: a\n    endpoint: h:1\n    dp_size: 0\n", []string{"dp_size 0 is below 1"}},
		{"negative block size", "workers:\n  - id: a\n    endpoint: h:1\n    block_size: -4\n", []string{"block_size -4 is negative"}},
		{"bad replay", "workers:\n  - id: a\n    endpoint: h:1\n    replay_endpoint: h:2\n", []string{"replay endpoint"}},
		{"duplicate id", "workers:\n  - id: a\n    endpoint: h:1\n  - id: a\n    endpoint: h:2\n", []string{`workers[1] ("a"): id already used by workers[0]`}},
		{"every problem", "workers:\n  - id: a\n  - id: b\n    endpoint: h:1\n    dp_size: -1\n",
			[]string{`workers[0] ("a"): endpoint is empty`, `workers[1] ("b"): dp_size -1 is below 1`}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ws, err := discovery.ParseWorkers([]byte(c.file), discovery.Defaults{})
			require.Nil(t, ws)
			require.ErrorIs(t, err, discovery.ErrInvalidFile)
			for _, w := range c.want {
				require.ErrorContains(t, err, w)
			}
		})
	}
}

// writeFile replaces path atomically (write, then rename), as a careful
// operator would: a poll still in flight then sees the old or the new
// content, never a torn write.
func writeFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	require.NoError(t, os.WriteFile(tmp, []byte(content), 0o600))
	require.NoError(t, os.Rename(tmp, path))
}

func TestNewStaticErrors(t *testing.T) {
	dir := t.TempDir()
	_, err := discovery.NewStatic(discovery.StaticOptions{})
	require.ErrorIs(t, err, discovery.ErrInvalidOptions)
	require.ErrorContains(t, err, "Path is empty")

	_, err = discovery.NewStatic(discovery.StaticOptions{Path: "x", Poll: -time.Second, Defaults: discovery.Defaults{BlockSize: -1}})
	require.ErrorIs(t, err, discovery.ErrInvalidOptions)
	require.ErrorContains(t, err, "Poll -1s is negative")
	require.ErrorContains(t, err, "Defaults.BlockSize -1 is negative")

	_, err = discovery.NewStatic(discovery.StaticOptions{Path: filepath.Join(dir, "missing.yaml")})
	require.ErrorIs(t, err, fs.ErrNotExist)

	bad := filepath.Join(dir, "bad.yaml")
	writeFile(t, bad, "workers:\n  - id: a\n")
	_, err = discovery.NewStatic(discovery.StaticOptions{Path: bad})
	require.ErrorIs(t, err, discovery.ErrInvalidFile)
	require.ErrorContains(t, err, bad)

	big := filepath.Join(dir, "big.yaml")
	writeFile(t, big, "workers: []\n"+strings.Repeat("#", discovery.MaxFileSize))
	_, err = discovery.NewStatic(discovery.StaticOptions{Path: big})
	require.ErrorIs(t, err, discovery.ErrInvalidFile)
	require.ErrorContains(t, err, "larger than")
}

// staticEnv runs a Static source whose polls the test triggers one at a time.
type staticEnv struct {
	path  string
	tick  chan time.Time
	snaps chan discovery.Snapshot
	logs  *logBuf
	src   *discovery.Static
}

func startStatic(t *testing.T, content string) *staticEnv {
	t.Helper()
	e := &staticEnv{
		path:  filepath.Join(t.TempDir(), "workers.yaml"),
		tick:  make(chan time.Time), // unbuffered: a send returns once the previous poll has finished
		snaps: make(chan discovery.Snapshot, 16),
		logs:  &logBuf{},
	}
	writeFile(t, e.path, content)
	src, err := discovery.NewStatic(discovery.StaticOptions{
		Path: e.path, Tick: e.tick, Defaults: testDefaults, RoleLabel: "nvidia.com/role",
		Logger: slog.New(slog.NewJSONHandler(e.logs, nil)),
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, func(s discovery.Snapshot) { e.snaps <- s }) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.ErrorIs(t, err, context.Canceled)
		case <-time.After(waitFor):
			t.Fatal("Run did not return after cancel")
		}
	})
	e.src = src
	return e
}

// poll triggers a poll and waits until it has been processed: the second
// send on the unbuffered channel is accepted only after the first poll
// returned (and called the sink, if it did). The second poll may still be
// running when poll returns; it sees the same file, so it emits and logs
// nothing, and the next poll call waits for it.
func (e *staticEnv) poll(t *testing.T) {
	t.Helper()
	for range 2 {
		select {
		case e.tick <- time.Now():
		case <-time.After(waitFor):
			t.Fatal("poll not accepted")
		}
	}
}

func (e *staticEnv) next(t *testing.T) discovery.Snapshot {
	t.Helper()
	select {
	case s := <-e.snaps:
		return s
	case <-time.After(waitFor):
		t.Fatal("no snapshot")
		return discovery.Snapshot{}
	}
}

func (e *staticEnv) none(t *testing.T) {
	t.Helper()
	select {
	case s := <-e.snaps:
		t.Fatalf("unexpected snapshot %+v", s)
	default:
	}
}

func ids(s discovery.Snapshot) []string {
	out := make([]string, len(s.Workers))
	for i, w := range s.Workers {
		out[i] = w.ID
	}
	return out
}

func TestStaticRunWatchesFile(t *testing.T) {
	e := startStatic(t, jsonFile)
	s := e.next(t)
	require.True(t, s.Synced)
	require.Equal(t, []string{"a"}, ids(s))
	require.Equal(t, "qwen3", s.Workers[0].Model, "defaults applied")
	require.ErrorIs(t, e.src.Run(context.Background(), func(discovery.Snapshot) {}), discovery.ErrAlreadyRun)

	// Unchanged content (even rewritten): nothing is emitted.
	e.poll(t)
	writeFile(t, e.path, jsonFile)
	e.poll(t)
	e.none(t)

	// A change is emitted, as YAML this time.
	writeFile(t, e.path, yamlFile)
	e.poll(t)
	s = e.next(t)
	require.Equal(t, []string{"a", "b"}, ids(s))
	require.Equal(t, "llama", s.Workers[0].Model)

	// A broken file is logged once and the last good set stays.
	writeFile(t, e.path, "workers:\n  - id: a\n")
	e.poll(t)
	e.poll(t)
	e.none(t)
	recs := e.logs.records(t, "workers file rejected; keeping the last good set")
	require.Len(t, recs, 1)
	require.Contains(t, recs[0]["error"], "endpoint is empty")
	require.EqualValues(t, 2, recs[0]["workers"])

	// So does a missing file.
	require.NoError(t, os.Remove(e.path))
	e.poll(t)
	e.none(t)
	recs = e.logs.records(t, "workers file rejected; keeping the last good set")
	require.Len(t, recs, 2)
	require.Contains(t, recs[1]["error"], "file does not exist")

	// Restoring the last good content emits nothing: the set did not change.
	writeFile(t, e.path, yamlFile)
	e.poll(t)
	e.none(t)

	// An empty set is a valid change, and crosses zero in the census.
	writeFile(t, e.path, "workers: []\n")
	e.poll(t)
	s = e.next(t)
	require.True(t, s.Synced)
	require.Empty(t, s.Workers)
	census := e.logs.records(t, "discovery census")
	require.Len(t, census, 3) // start, the prefill role appearing, the set emptying
	require.EqualValues(t, 1, census[0]["workers"])
	require.Equal(t, map[string]any{"(none)": float64(1), "prefill": float64(1)}, census[1]["roles"])
	require.EqualValues(t, 0, census[2]["workers"])
	require.Equal(t, map[string]any{"(none)": float64(0), "prefill": float64(0)}, census[2]["roles"])
}

func TestStaticPollsWithTicker(t *testing.T) {
	path := filepath.Join(t.TempDir(), "workers.json")
	writeFile(t, path, jsonFile)
	src, err := discovery.NewStatic(discovery.StaticOptions{Path: path, Poll: time.Millisecond})
	require.NoError(t, err)
	snaps := make(chan discovery.Snapshot, 16)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, func(s discovery.Snapshot) { snaps <- s }) }()
	defer func() {
		cancel()
		require.ErrorIs(t, <-done, context.Canceled)
	}()
	recv := func() discovery.Snapshot {
		select {
		case s := <-snaps:
			return s
		case <-time.After(waitFor):
			t.Fatal("no snapshot")
			return discovery.Snapshot{}
		}
	}
	require.Equal(t, []string{"a"}, ids(recv()))
	writeFile(t, path, yamlFile)
	require.Equal(t, []string{"a", "b"}, ids(recv()))
}

func TestStaticWorkers(t *testing.T) {
	in := []catalog.Worker{
		{ID: "w2", Endpoint: "10.0.0.2:8000", DPSize: 1, Labels: map[string]string{"k": "v"}},
		{ID: "w1", Endpoint: "10.0.0.1:8000", DPSize: 1},
	}
	src := discovery.StaticWorkers(in)
	in[0].Labels["k"] = "changed" // the source copied its input

	snaps := make(chan discovery.Snapshot, 4)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, func(s discovery.Snapshot) { snaps <- s }) }()
	s := <-snaps
	require.True(t, s.Synced)
	require.Equal(t, []string{"w1", "w2"}, ids(s))
	require.Equal(t, "v", s.Workers[1].Labels["k"])
	require.ErrorIs(t, src.Run(ctx, func(discovery.Snapshot) {}), discovery.ErrAlreadyRun)
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	require.Empty(t, snaps, "emitted once")

	bad := discovery.StaticWorkers([]catalog.Worker{{ID: "x", DPSize: 1}, {ID: "x", Endpoint: "http://h:1"}})
	err := bad.Run(context.Background(), func(discovery.Snapshot) { t.Fatal("invalid set emitted") })
	require.ErrorIs(t, err, discovery.ErrInvalidWorkers)
	require.ErrorContains(t, err, `id "x" already used by worker 0`)
	require.ErrorContains(t, err, "without a scheme")
}
