package binfmt

import (
	"encoding/binary"
	"hash/crc32"
	"math/bits"
)

// UvarintLen returns the encoded size of x as a uvarint.
func UvarintLen(x uint64) int { return (bits.Len64(x|1) + 6) / 7 }

// StringLen returns the encoded size of s with its length prefix.
func StringLen(s string) int { return UvarintLen(uint64(len(s))) + len(s) }

// AppendString appends s with its uvarint length prefix.
func AppendString(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

// AppendBytes appends b with its uvarint length prefix.
func AppendBytes(dst, b []byte) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(b)))
	return append(dst, b...)
}

// castagnoli is crc32's own Castagnoli table (MakeTable returns the shared
// one), which Checksum needs for the hardware-accelerated path.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum returns the CRC-32C (Castagnoli) of b.
func Checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// AppendChecksum appends Checksum(b), little-endian. b may alias dst: the
// checksum is taken before dst grows.
func AppendChecksum(dst, b []byte) []byte {
	return binary.LittleEndian.AppendUint32(dst, Checksum(b))
}
