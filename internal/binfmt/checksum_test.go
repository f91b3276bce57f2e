package binfmt_test

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/binfmt"
)

// Checksum is CRC-32C: the check value of its catalogue entry, and
// AppendChecksum writes it little-endian after the bytes, also when they
// alias the destination.
func TestChecksum(t *testing.T) {
	require.Equal(t, uint32(0xe3069283), binfmt.Checksum([]byte("123456789")))
	require.Zero(t, binfmt.Checksum(nil))

	buf := make([]byte, 0, 64)
	buf = append(buf, "123456789"...)
	buf = binfmt.AppendChecksum(buf, buf)
	require.Len(t, buf, 13)
	require.Equal(t, uint32(0xe3069283), binary.LittleEndian.Uint32(buf[9:]))
}
