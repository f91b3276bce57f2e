package httproute

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Data lines are counted wherever the reads split them, and only at the start
// of a line.
func TestSSECounterAcrossReads(t *testing.T) {
	stream := "data: a\n\n: comment data: no\n\nevent: x\ndata: b\ndata:c\n\nid: 1 data:\ndata: [DONE]\n\n"
	for split := range len(stream) {
		var c sseCounter
		c.scan([]byte(stream[:split]))
		c.scan([]byte(stream[split:]))
		require.Equal(t, 4, c.events, "split at %d", split)
	}
	var c sseCounter
	require.False(t, c.scan([]byte("dat")))
	require.True(t, c.scan([]byte("a: x")))
	require.False(t, c.scan([]byte(" more data: not a line start\n")))
}
