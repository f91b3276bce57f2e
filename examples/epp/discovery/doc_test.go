package discovery_test

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/epp/discovery"
)

// TestWorkersFileDoc parses every example of docs/WORKERS_FILE.md, so the
// documented format cannot drift from the parser.
func TestWorkersFileDoc(t *testing.T) {
	raw, err := os.ReadFile("../../../docs/WORKERS_FILE.md")
	require.NoError(t, err)
	var blocks []string
	for rest := string(raw); ; {
		_, after, ok := strings.Cut(rest, "```yaml\n")
		if !ok {
			break
		}
		block, tail, ok := strings.Cut(after, "```")
		require.True(t, ok, "an unclosed yaml block")
		blocks, rest = append(blocks, block), tail
	}
	require.Len(t, blocks, 5, "one example per topology")
	d := discovery.Defaults{Model: "qwen3", BlockSize: 16}
	for i, b := range blocks {
		ws, err := discovery.ParseWorkers([]byte(b), d)
		require.NoError(t, err, "example %d:\n%s", i, b)
		require.NotEmpty(t, ws, "example %d", i)
	}
	dp, err := discovery.ParseWorkers([]byte(blocks[2]), d)
	require.NoError(t, err)
	require.Equal(t, 4, dp[0].DPSize)
	require.Len(t, dp[0].KVEventEndpoints, 4)
	pd, err := discovery.ParseWorkers([]byte(blocks[3]), d)
	require.NoError(t, err)
	require.Equal(t, "decode", pd[0].Labels["nvidia.com/dynamo-worker-role"])
}
