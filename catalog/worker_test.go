package catalog

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// complete returns a worker that is Schedulable under every Requirements.
func complete(id string) Worker {
	return Worker{
		ID:                  id,
		Model:               "llama",
		Endpoint:            "10.0.0.5:8000",
		DPStart:             0,
		DPSize:              1,
		KVEventEndpoints:    map[int]string{0: "tcp://10.0.0.5:5557"},
		ReplayEndpoint:      "tcp://10.0.0.5:5558",
		BlockSize:           16,
		TotalKVBlocks:       1000,
		MaxNumBatchedTokens: 8192,
		Labels:              map[string]string{"app": "vllm"},
		Identity:            "pod-" + id,
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Worker)
		want   []string // substrings of the error; nil means valid
	}{
		{"complete", func(*Worker) {}, nil},
		{"nothing but an id", func(w *Worker) { *w = Worker{ID: "a"} }, nil},
		{"ipv6 endpoint", func(w *Worker) { w.Endpoint = "[fd00::5]:8000" }, nil},
		{"hostname endpoint", func(w *Worker) { w.Endpoint = "vllm-0.vllm.ns.svc:8000" }, nil},
		{"ipc events", func(w *Worker) { w.KVEventEndpoints = map[int]string{0: "ipc:///tmp/kv.sock"} }, nil},
		{"empty event endpoint is missing, not invalid", func(w *Worker) { w.KVEventEndpoints = map[int]string{0: ""} }, nil},
		{"dp size zero is missing, not invalid", func(w *Worker) { w.DPSize = 0; w.KVEventEndpoints = nil }, nil},
		{"multi-rank", func(w *Worker) {
			w.DPStart, w.DPSize = 4, 2
			w.KVEventEndpoints = map[int]string{4: "tcp://h:5557", 5: "tcp://h:5558"}
		}, nil},
		{"empty id", func(w *Worker) { w.ID = "" }, []string{"id is empty"}},
		{"endpoint with scheme", func(w *Worker) { w.Endpoint = "http://10.0.0.5:8000" }, []string{`endpoint "http://10.0.0.5:8000"`, "without a scheme"}},
		{"endpoint without port", func(w *Worker) { w.Endpoint = "10.0.0.5" }, []string{"missing port"}},
		{"endpoint without host", func(w *Worker) { w.Endpoint = ":8000" }, []string{"host is empty"}},
		{"endpoint port zero", func(w *Worker) { w.Endpoint = "h:0" }, []string{"not in 1..65535"}},
		{"endpoint port too big", func(w *Worker) { w.Endpoint = "h:65536" }, []string{"not in 1..65535"}},
		{"endpoint port not a number", func(w *Worker) { w.Endpoint = "h:http" }, []string{"not in 1..65535"}},
		{"endpoint host with a path", func(w *Worker) { w.Endpoint = "h/x:80" }, []string{"host contains '/'"}},
		{"endpoint host with a space", func(w *Worker) { w.Endpoint = "a b:80" }, []string{"host contains ' '"}},
		{"negative sizes", func(w *Worker) {
			w.DPStart, w.DPSize, w.BlockSize, w.TotalKVBlocks, w.MaxNumBatchedTokens = -1, -2, -3, -4, -5
			w.KVEventEndpoints = nil
		}, []string{"dp_start -1", "dp_size -2", "block_size -3", "total_kv_blocks -4", "max_num_batched_tokens -5"}},
		{"dp size too big", func(w *Worker) { w.DPSize = MaxDPSize + 1 }, []string{"exceeds 4096"}},
		{"rank overflow", func(w *Worker) { w.DPStart = 1<<31 - 1; w.KVEventEndpoints = nil }, []string{"overflow"}},
		{"event endpoint without scheme", func(w *Worker) { w.KVEventEndpoints = map[int]string{0: "10.0.0.5:5557"} }, []string{"rank 0", "want tcp://host:port"}},
		{"event endpoint bad scheme", func(w *Worker) { w.KVEventEndpoints = map[int]string{0: "udp://h:1"} }, []string{`scheme "udp"`}},
		{"event endpoint bad port", func(w *Worker) { w.KVEventEndpoints = map[int]string{0: "tcp://h:99999"} }, []string{"not in 1..65535"}},
		{"event endpoint empty ipc path", func(w *Worker) { w.KVEventEndpoints = map[int]string{0: "ipc://"} }, []string{"ipc path is empty"}},
		{"event rank outside range", func(w *Worker) {
			w.DPStart, w.DPSize = 2, 2
			w.KVEventEndpoints = map[int]string{1: "tcp://h:1", 2: "tcp://h:2", 4: "tcp://h:4"}
		}, []string{"rank 1 outside ranks 2..3", "rank 4 outside ranks 2..3"}},
		{"event endpoints with dp size zero: ranks unknown, not judged", func(w *Worker) { w.DPSize = 0 }, nil},
		{"bad replay endpoint", func(w *Worker) { w.ReplayEndpoint = "tcp://:5558" }, []string{"replay endpoint", "host is empty"}},
		{"every problem listed", func(w *Worker) {
			w.ID, w.Endpoint, w.BlockSize, w.ReplayEndpoint = "", "x", -1, "zmq"
		}, []string{"id is empty", `endpoint "x"`, "block_size -1", `replay endpoint "zmq"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := complete("ns/pod")
			tt.mutate(&w)
			err := w.Validate()
			if tt.want == nil {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrInvalidWorker)
			require.True(t, strings.HasPrefix(err.Error(), "catalog: invalid worker"), err.Error())
			for _, s := range tt.want {
				require.Contains(t, err.Error(), s)
			}
			if w.ID != "" {
				require.Contains(t, err.Error(), `"ns/pod"`)
			}
		})
	}
}

func TestWorkerRanks(t *testing.T) {
	w := Worker{ID: "a", DPStart: 4, DPSize: 3, KVEventEndpoints: map[int]string{4: "tcp://h:1", 5: "", 6: "tcp://h:3"}}
	require.Equal(t, []int{4, 5, 6}, w.Ranks())
	require.True(t, w.hasRank(4))
	require.True(t, w.hasRank(6))
	require.False(t, w.hasRank(3))
	require.False(t, w.hasRank(7))

	ep, ok := w.EventEndpoint(4)
	require.True(t, ok)
	require.Equal(t, "tcp://h:1", ep)
	_, ok = w.EventEndpoint(5) // empty counts as missing
	require.False(t, ok)
	_, ok = w.EventEndpoint(7) // not one of its ranks
	require.False(t, ok)

	require.Nil(t, Worker{DPSize: 0}.Ranks())
	require.Nil(t, Worker{DPSize: -1}.Ranks())
	require.Len(t, Worker{DPSize: 1 << 40}.Ranks(), MaxDPSize, "clamped")
	require.False(t, Worker{DPStart: 0, DPSize: 0}.hasRank(0))
}

func TestWorkerCloneAndEqual(t *testing.T) {
	w := complete("a")
	c := w.Clone()
	require.True(t, w.Equal(c))
	require.Equal(t, w, c)

	c.KVEventEndpoints[0] = "tcp://other:1"
	c.Labels["app"] = "sglang"
	require.Equal(t, "tcp://10.0.0.5:5557", w.KVEventEndpoints[0], "clone shares no map")
	require.Equal(t, "vllm", w.Labels["app"])
	require.False(t, w.Equal(c))

	// Empty and nil maps are equal; the default model equals "".
	a := Worker{ID: "x", Labels: map[string]string{}, KVEventEndpoints: map[int]string{}}
	b := Worker{ID: "x", Model: DefaultModel}
	require.True(t, a.Equal(b))
	require.Nil(t, a.Clone().Labels)
	require.Equal(t, DefaultModel, modelName(a.Model))
	require.Equal(t, "m", modelName("m"))

	// Every field takes part in Equal.
	fields := []func(*Worker){
		func(w *Worker) { w.ID = "b" },
		func(w *Worker) { w.Model = "other" },
		func(w *Worker) { w.Endpoint = "h:1" },
		func(w *Worker) { w.DPStart = 1 },
		func(w *Worker) { w.DPSize = 2 },
		func(w *Worker) { w.KVEventEndpoints = map[int]string{0: "tcp://x:1"} },
		func(w *Worker) { w.ReplayEndpoint = "" },
		func(w *Worker) { w.BlockSize = 32 },
		func(w *Worker) { w.TotalKVBlocks = 1 },
		func(w *Worker) { w.MaxNumBatchedTokens = 1 },
		func(w *Worker) { w.Labels = nil },
		func(w *Worker) { w.Identity = "x" },
	}
	for i, mutate := range fields {
		m := complete("a")
		mutate(&m)
		require.False(t, complete("a").Equal(m), "field %d", i)
	}
}

// FuzzValidate checks that no input panics and that a worker Validate accepts
// has a consistent rank range and evaluation.
func FuzzValidate(f *testing.F) {
	f.Add("ns/pod", "10.0.0.5:8000", 0, 1, 0, "tcp://10.0.0.5:5557", "", 16)
	f.Add("", "http://x:1", -1, 5000, 7, "udp://x", "ipc://", -3)
	f.Add("a", "[::1]:65535", 1<<31-2, 2, 1<<31-1, "tcp://[::1]:1", "tcp://*:2", 0)
	f.Fuzz(func(t *testing.T, id, endpoint string, start, size, rank int, evEP, replay string, bs int) {
		w := Worker{ID: id, Endpoint: endpoint, DPStart: start, DPSize: size,
			KVEventEndpoints: map[int]string{rank: evEP}, ReplayEndpoint: replay, BlockSize: bs}
		err := w.Validate()
		life, reasons := evaluate(w, Requirements{KVEvents: true, Queueing: true})
		require.True(t, life == Incomplete || life == Schedulable)
		require.Equal(t, life == Schedulable, len(reasons) == 0)
		if err != nil {
			require.True(t, errors.Is(err, ErrInvalidWorker))
			return
		}
		require.NotEmpty(t, id)
		require.Len(t, w.Ranks(), size)
		if size > 0 {
			require.True(t, w.hasRank(rank))
		}
	})
}
