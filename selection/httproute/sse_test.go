package httproute_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/selection/httproute"
)

// Data lines are counted wherever the reads split them, and only at the start
// of a line.
func TestSSECounterAcrossReads(t *testing.T) {
	stream := "data: a\n\n: comment data: no\n\nevent: x\ndata: b\ndata:c\n\nid: 1 data:\ndata: [DONE]\n\n"
	for split := range len(stream) {
		var c httproute.SSECounter
		c.Scan([]byte(stream[:split]))
		c.Scan([]byte(stream[split:]))
		require.Equal(t, 4, c.Events(), "split at %d", split)
	}
	var c httproute.SSECounter
	require.False(t, c.Scan([]byte("dat")))
	require.True(t, c.Scan([]byte("a: x")))
	require.False(t, c.Scan([]byte(" more data: not a line start\n")))
}
