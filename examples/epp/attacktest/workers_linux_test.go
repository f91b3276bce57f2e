package attacktest

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvselect/kvselect/examples/epp/internal/eppproc"
	"github.com/kvselect/kvselect/examples/internal/extproctest"
)

// The workers file of issue 27: 500 workers of dp_size 4,096, every field
// within its bound, 2,048,000 data-parallel ranks together (the default bound
// is 65,536). Before the bound, the EPP ran out of memory reading it at
// start-up, and a running one grew past 1.5 GB reloading it.
const (
	wideWorkers = 500
	wideDPSize  = 4096
	// rssCeiling is issue 27's acceptance bound: refused by name, or served
	// within 1 GB.
	rssCeiling = 1 << 30
	// tooManyRanks is discovery.ErrTooManyRanks's text.
	tooManyRanks = "discovery: too many worker ranks"
)

// writeWideFile writes issue 27's workers file to path (atomically: write,
// then rename, as a careful operator replaces a file a process watches).
func writeWideFile(t *testing.T, path string) {
	t.Helper()
	type entry struct {
		ID       string `json:"id"`
		Endpoint string `json:"endpoint"`
		DPSize   int    `json:"dp_size"`
	}
	ws := make([]entry, wideWorkers)
	for i := range ws {
		ws[i] = entry{ID: fmt.Sprintf("wide-%03d", i), Endpoint: fmt.Sprintf("127.0.%d.%d:8000", i/250, i%250+1), DPSize: wideDPSize}
	}
	writeWorkers(t, path, ws)
}

func writeWorkers(t *testing.T, path string, ws any) {
	t.Helper()
	raw, err := json.Marshal(map[string]any{"workers": ws})
	require.NoError(t, err)
	tmp := path + ".tmp"
	require.NoError(t, os.WriteFile(tmp, raw, 0o600))
	require.NoError(t, os.Rename(tmp, path))
}

// eppEnv is the environment startEPP gives the EPP, for a workers file the
// test keeps the path of.
func eppEnv(path, tokenizer string) map[string]string {
	return map[string]string{
		"DYN_MODEL_NAME":                model,
		"DYN_KV_CACHE_BLOCK_SIZE":       strconv.Itoa(blockSize),
		"DYN_EPP_TOKENIZER_SERVICE_URL": tokenizer,
		"DYN_EPP_WORKERS_FILE":          path,
		"DYN_SECURE_SERVING":            "false",
		"DYN_EPP_EXTPROC_ADDR":          "127.0.0.1:0",
		"DYN_EPP_HEALTH_ADDR":           "127.0.0.1:0",
		"DYN_EPP_METRICS_ADDR":          "127.0.0.1:0",
	}
}

// TestWorkersFileTooManyRanksAtStart: issue 27's file at start-up is a
// configuration error that names the bound, and the EPP exits at once. (Its
// peak RSS is not asserted here: the kernel's ru_maxrss of a child started
// with vfork carries the parent's high-water mark from before the exec,
// here the test process's own; the reload test samples the running EPP.)
func TestWorkersFileTooManyRanksAtStart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "workers.json")
	writeWideFile(t, path)
	p := launch(t, eppEnv(path, "http://127.0.0.1:1"))
	rec, ok := p.WaitLog(startTimeout, eppproc.MsgIs("epp stopped"))
	require.True(t, ok, "the EPP did not stop (exit: %v)", p.Err())
	require.Contains(t, rec.Str("err"), tooManyRanks)
	require.Contains(t, rec.Str("err"), "2048000 data-parallel ranks")
	<-p.Done()
	var exit *exec.ExitError
	require.True(t, errors.As(p.Err(), &exit), "exit: %v", p.Err())
	require.Equal(t, 1, exit.ExitCode())
}

// TestWorkersFileTooManyRanksReload: issue 27's file written over the
// workers file of a running EPP is refused whole and logged at ERROR with
// the reason; the EPP keeps its last good set (still routing to it, events
// still applied), its RSS stays bounded, and a good file afterwards is taken
// again.
func TestWorkersFileTooManyRanksReload(t *testing.T) {
	e := boundEngine(t, true)
	path := filepath.Join(t.TempDir(), "workers.json")
	good := []worker{{ID: "good", Endpoint: e.HTTPEndpoint(), KVEvents: e.PubEndpoint()}}
	writeWorkers(t, path, good)
	p := launch(t, eppEnv(path, "http://"+e.HTTPEndpoint()))
	addrs, ok := p.WaitListening(startTimeout)
	require.True(t, ok, "the EPP never listened (exit: %v)", p.Err())
	p.extproc, p.metricsAddr = addrs.ExtProc, addrs.Metrics
	_, ok = p.WaitLog(startTimeout, eppproc.MsgIs("discovery synced; serving"))
	require.True(t, ok, "discovery never synced (exit: %v)", p.Err())
	var err error
	p.conn, err = grpc.NewClient(p.extproc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	p.client, err = extproctest.NewClient(p.conn, extproctest.Options{})
	require.NoError(t, err)
	flow(t, p, e, "good")
	schedulable := func() float64 {
		return p.count("kvselect_workers", labels{"role": role, "lifecycle": "schedulable"})
	}
	require.Equal(t, 1.0, schedulable())
	rss0 := p.rss()

	writeWideFile(t, path)
	rec, ok := p.WaitLog(waitTimeout, eppproc.MsgIs("workers file rejected; keeping the last good set"))
	require.True(t, ok, "the reload was not refused (exit: %v)", p.Err())
	require.Equal(t, "ERROR", rec.Str("level"))
	require.Contains(t, rec.Str("error"), tooManyRanks)
	require.EqualValues(t, 1, rec.Num("workers"), "the last good set")
	require.Positive(t, p.count("kvselect_workers_file_rejected_total", nil), "the refusal counted")

	p.alive()
	require.Equal(t, 1.0, schedulable())
	d, err := p.pick(t.Context(), "still served")
	require.NoError(t, err)
	require.Equal(t, 200, d.Status, "%s", d.ImmediateBody)
	require.Equal(t, e.HTTPEndpoint(), d.Destination)
	flow(t, p, e, "good")
	rss1 := p.rss()
	t.Logf("refused on reload: %q; RSS %d MiB -> %d MiB", rec.Str("error"), rss0>>20, rss1>>20)
	require.Less(t, rss1, int64(rssCeiling))
	require.Less(t, rss1-rss0, int64(64<<20), "RSS grew by %d MiB", (rss1-rss0)>>20)

	// A good file is taken again: the poller did not stop at the refusal.
	writeWorkers(t, path, append(good, worker{ID: "second", Endpoint: "127.0.0.1:8002", KVEvents: "tcp://127.0.0.1:1"}))
	p.eventually("the next good file applied", waitTimeout, func() bool { return schedulable() == 2 })
	for _, r := range p.Logs().Find(eppproc.MsgIs("workers file rejected; keeping the last good set")) {
		require.True(t, strings.Contains(r.Str("error"), tooManyRanks), "only the wide file was refused: %v", r.M)
	}
}
