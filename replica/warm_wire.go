package replica

import (
	"encoding/binary"
	"hash/crc32"
	"math"

	"github.com/kvselect/kvselect/internal/binfmt"
)

// The index transfer's messages, on <Subject>.index.<ID>, in the envelope of
// every replica message (magic, WireVersion, type):
//
//	index request  type 0x10: requester str | flags u8 (bit 0 release) |
//	               transfer u64 (0: start one) | offset uv
//	index chunk    type 0x11: status u8 | origin str | transfer u64 |
//	               total uv | total CRC-32C u32 | offset uv |
//	               data: length uv, bytes | data CRC-32C u32
//
// A transfer is one encoding of the serving replica's index snapshot
// (selection.EventPlane.WriteSnapshot), total bytes long, served
// in chunks by offset; every chunk carries the transfer's length and
// checksum and its own data's checksum, so a torn or damaged chunk, or a
// transfer that changed under the reader, is detected. A chunk with a status
// other than indexOK carries no data. The types are far from the booking
// stream's so that both can grow.
const (
	msgIndexRequest = 0x10
	msgIndexChunk   = 0x11

	flagRelease = 1 << 0 // request: the transfer is done, drop it

	// indexChunkReserve is what a chunk needs besides its data.
	indexChunkReserve = 128
)

// Index chunk statuses.
const (
	indexOK         = 0 // data follows
	indexNotServing = 1 // the replica is not serving (not synced yet): ask another
	indexBusy       = 2 // too many transfers at once: ask again later, or another
	indexUnknown    = 3 // no such transfer (expired, released): start again
	indexTooLarge   = 4 // the snapshot exceeds MaxIndexBytes
	indexFailed     = 5 // the snapshot could not be written
	indexReleased   = 6 // the answer to a release
	numIndexStatus  = 7
)

// castagnoli is for warm.go's checksum of a whole transfer; the wire's own
// checksums are binfmt's.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// indexRequest is a decoded index request.
type indexRequest struct {
	requester string
	release   bool
	transfer  uint64
	offset    uint64
}

// indexChunk is a decoded index chunk; data aliases the message.
type indexChunk struct {
	status   byte
	origin   string
	transfer uint64
	total    uint64
	crc      uint32
	offset   uint64
	data     []byte
}

func appendIndexRequest(dst []byte, q indexRequest) []byte {
	dst = appendHeader(dst, msgIndexRequest)
	dst = binfmt.AppendString(dst, q.requester)
	var flags byte
	if q.release {
		flags |= flagRelease
	}
	dst = append(dst, flags)
	dst = binary.LittleEndian.AppendUint64(dst, q.transfer)
	return binary.AppendUvarint(dst, q.offset)
}

func appendIndexChunk(dst []byte, c *indexChunk) []byte {
	dst = appendHeader(dst, msgIndexChunk)
	dst = append(dst, c.status)
	dst = binfmt.AppendString(dst, c.origin)
	dst = binary.LittleEndian.AppendUint64(dst, c.transfer)
	dst = binary.AppendUvarint(dst, c.total)
	dst = binary.LittleEndian.AppendUint32(dst, c.crc)
	dst = binary.AppendUvarint(dst, c.offset)
	dst = binfmt.AppendBytes(dst, c.data)
	return binfmt.AppendChecksum(dst, c.data)
}

func decodeIndexRequest(data []byte, maxBytes int) (indexRequest, error) {
	typ, body, err := header(data, maxBytes)
	if err != nil {
		return indexRequest{}, err
	}
	if typ != msgIndexRequest {
		return indexRequest{}, errType
	}
	r := newReader(body)
	q := indexRequest{requester: r.replicaID()}
	flags := r.U8()
	q.release = flags&flagRelease != 0
	q.transfer = r.U64()
	q.offset = r.Uvarint(math.MaxInt64)
	if r.Err() == nil && flags&^flagRelease != 0 {
		r.Fail(errField)
	}
	return q, r.end()
}

// decodeIndexChunk decodes a chunk and checks its own consistency: a known
// status, data only with indexOK and within total, and the data's checksum.
func decodeIndexChunk(data []byte, maxBytes int) (indexChunk, error) {
	typ, body, err := header(data, maxBytes)
	if err != nil {
		return indexChunk{}, err
	}
	if typ != msgIndexChunk {
		return indexChunk{}, errType
	}
	r := newReader(body)
	var c indexChunk
	c.status = r.U8()
	c.origin = r.replicaID()
	c.transfer = r.U64()
	c.total = r.Uvarint(math.MaxInt64)
	c.crc = r.U32()
	c.offset = r.Uvarint(math.MaxInt64)
	c.data = r.Bytes(math.MaxInt)
	sum := r.U32()
	if err := r.end(); err != nil {
		return indexChunk{}, err
	}
	switch {
	case c.status >= numIndexStatus:
		return indexChunk{}, errField
	case c.status != indexOK && len(c.data) > 0:
		return indexChunk{}, errField
	case c.offset > c.total || uint64(len(c.data)) > c.total-c.offset:
		return indexChunk{}, errField
	case binfmt.Checksum(c.data) != sum:
		return indexChunk{}, errChecksum
	}
	return c, nil
}
