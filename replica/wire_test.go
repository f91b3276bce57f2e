package replica

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/binfmt"
	"github.com/kvselect/kvselect/selection"
)

func sampleBooked() booked {
	return booked{
		id: "req-1", model: "m", worker: catalog.WorkerRank{WorkerID: "w1", Rank: 3}, hashes: []uint64{1, 2, 1 << 63},
		private: 1, prefill: 900, expected: 128, leaseMS: 300000, remainingMS: 299000, session: "conv-9",
	}
}

func sampleBatch(flags byte) []byte {
	b := sampleBooked()
	buf := appendBatchHeader(nil, flags, "replica-a", 7, 42, 3)
	buf = appendBooked(buf, &b)
	buf = appendSettled(buf, "req-0", selection.SettleFree)
	b.id, b.hashes = "req-2", nil
	return appendBooked(buf, &b)
}

func TestBatchRoundTrip(t *testing.T) {
	data := sampleBatch(flagResync)
	var got wireBatch
	require.NoError(t, decodeBatch(data, len(data), &got))
	require.Equal(t, byte(flagResync), got.flags)
	require.Equal(t, "replica-a", got.origin)
	require.Equal(t, uint64(7), got.epoch)
	require.Equal(t, uint64(42), got.seq)
	require.Len(t, got.ops, 3)
	want := sampleBooked()
	o := got.ops[0]
	require.Equal(t, byte(opBooked), o.kind)
	require.Equal(t, want.id, o.id)
	require.Equal(t, want.model, o.model)
	require.Equal(t, want.worker, o.worker)
	require.Equal(t, want.hashes, o.hashes)
	require.Equal(t, []int{1, 900, 128}, []int{o.private, o.prefill, o.expected})
	require.Equal(t, []int64{300000, 299000}, []int64{o.leaseMS, o.remainingMS})
	require.Equal(t, wireOp{kind: opSettled, id: "req-0", how: selection.SettleFree}, got.ops[1])
	require.Empty(t, got.ops[2].hashes)
	require.Equal(t, len(data)-len(appendBatchHeader(nil, flagResync, "replica-a", 7, 42, 3)),
		want.size()+settledSize("req-0")+want.size()-8*3, "size() is the encoded size")

	// A heartbeat is a batch without ops.
	hb := appendBatchHeader(nil, 0, "b", 1, 9, 0)
	require.NoError(t, decodeBatch(hb, len(hb), &got))
	require.Empty(t, got.ops)
	require.Equal(t, uint64(9), got.seq)
	require.LessOrEqual(t, len(appendBatchHeader(nil, 255, strings.Repeat("x", MaxIDLen), 1<<63, 1<<63, MaxBatchMax)), headerReserve)
}

func TestSnapshotRoundTrip(t *testing.T) {
	req := appendRequest(nil, "b", "req-1")
	q, err := decodeRequest(req, len(req))
	require.NoError(t, err)
	require.Equal(t, snapRequest{requester: "b", after: "req-1"}, q)

	b := sampleBooked()
	page := appendPageHeader(nil, true, "a", 5, 11, 1)
	page = appendBooked(page, &b)
	var got snapPage
	require.NoError(t, decodePage(page, len(page), &got))
	require.True(t, got.more)
	require.Equal(t, "a", got.origin)
	require.Equal(t, []uint64{5, 11}, []uint64{got.epoch, got.seq})
	require.Len(t, got.entries, 1)
	require.Equal(t, b.hashes, got.entries[0].hashes)
	require.LessOrEqual(t, len(appendPageHeader(nil, true, strings.Repeat("x", MaxIDLen), 1<<63, 1<<63, MaxBatchMax)), headerReserve)

	// A page carries booked ops only.
	bad := appendPageHeader(nil, false, "a", 5, 11, 1)
	bad = appendSettled(bad, "x", selection.SettleFree)
	require.ErrorIs(t, decodePage(bad, len(bad), &got), errField)
}

// Every malformed message fails with its sentinel, never a panic.
func TestDecodeErrors(t *testing.T) {
	batch := sampleBatch(0)
	mutate := func(f func([]byte) []byte) []byte { return f(append([]byte(nil), batch...)) }
	hdr := func(origin string, count uint64) []byte {
		b := appendHeader(nil, msgBatch)
		b = append(b, 0)
		b = binfmt.AppendString(b, origin)
		b = binary.LittleEndian.AppendUint64(b, 1)
		b = binary.AppendUvarint(b, 1)
		return binary.AppendUvarint(b, count)
	}
	long := func(n int) []byte {
		b := hdr("a", 1)
		b = append(b, opSettled)
		b = binary.AppendUvarint(b, uint64(n))
		return append(append(b, strings.Repeat("x", n)...), byte(selection.SettleFree))
	}
	longSession := func(n int) []byte {
		b := sampleBooked()
		b.session = strings.Repeat("s", n)
		return appendBooked(hdr("a", 1), &b)
	}
	require.NoError(t, decodeBatch(longSession(selection.MaxSessionIDLen), 1<<20, &wireBatch{}))
	for _, tc := range []struct {
		name string
		data []byte
		max  int
		want error
	}{
		{"too large", batch, len(batch) - 1, errTooLarge},
		{"session too long", longSession(selection.MaxSessionIDLen + 1), 0, errField},
		{"empty", nil, 0, errTruncated},
		{"bad magic", mutate(func(b []byte) []byte { b[0] = 'X'; return b }), 0, errMagic},
		{"short bad magic", []byte("XXXX"), 0, errMagic},
		{"version", mutate(func(b []byte) []byte { b[4] = WireVersion + 1; return b }), 0, errVersion},
		{"old version", mutate(func(b []byte) []byte { b[4] = WireVersion - 1; return b }), 0, errVersion},
		{"type", mutate(func(b []byte) []byte { b[5] = msgPage; return b }), 0, errType},
		{"truncated", batch[:len(batch)-1], 0, errTruncated},
		{"trailing", append(append([]byte(nil), batch...), 0), 0, errTrailing},
		{"bad origin", hdr("a.b", 0), 0, errField},
		{"empty origin", hdr("", 0), 0, errField},
		{"count beyond bytes", hdr("a", 1<<40), 0, errField},
		{"unknown op", append(hdr("a", 1), 9, 1, 'x'), 0, errField},
		{"empty id", append(hdr("a", 1), opSettled, 0, 3), 0, errField},
		{"bad settlement", append(hdr("a", 1), opSettled, 1, 'x', byte(selection.SettleOutputBlock+1)), 0, errField},
		{"id too long", long(maxStr + 1), 0, errField},
		{"varint overflow", append(hdr("a", 1), opSettled, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01), 0, errField},
	} {
		t.Run(tc.name, func(t *testing.T) {
			limit := tc.max
			if limit == 0 {
				limit = MessageBytesLimit
			}
			var b wireBatch
			err := decodeBatch(tc.data, limit, &b)
			require.ErrorIs(t, err, tc.want)
			require.True(t, isDecodeError(err), "%v is a sentinel", err)
		})
	}
	require.NoError(t, decodeBatch(long(maxStr), MessageBytesLimit, &wireBatch{}))
	_, err := decodeRequest(append(appendRequest(nil, "a", ""), 0), MessageBytesLimit)
	require.ErrorIs(t, err, errTrailing)
}

var decodeErrors = []error{errTooLarge, errMagic, errVersion, errType, errTruncated, errTrailing, errField}

func isDecodeError(err error) bool {
	for _, e := range decodeErrors {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// The portable path (big-endian machines) encodes and decodes the same bytes.
func TestHashesPortablePath(t *testing.T) {
	fast := sampleBatch(0)
	littleEndian = false
	defer func() { littleEndian = true }()
	require.Equal(t, fast, sampleBatch(0))
	var got wireBatch
	require.NoError(t, decodeBatch(fast, len(fast), &got))
	require.Equal(t, sampleBooked().hashes, got.ops[0].hashes)
}

// BenchmarkWire is the codec alone: a batch of 64 ops (half booked with 128
// hashes, half settled) encoded into a reused buffer and decoded into a
// reused wireBatch, and an index chunk of 64 KiB each way. Both directions
// allocate nothing once their buffers have grown; decoding copies the
// strings (ids, models, workers), which is what allocs/op counts there.
func BenchmarkWire(b *testing.B) {
	bk := sampleBooked()
	bk.hashes = make([]uint64, 128)
	for i := range bk.hashes {
		bk.hashes[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	encode := func(dst []byte) []byte {
		dst = appendBatchHeader(dst[:0], 0, "replica-a", 7, 42, 64)
		for i := range 32 {
			dst = appendBooked(dst, &bk)
			dst = appendSettled(dst, "req-0", selection.Settlement(1+i%4))
		}
		return dst
	}
	msg := encode(nil)
	b.Run("encode-batch", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(msg)))
		buf := make([]byte, 0, len(msg))
		for b.Loop() {
			buf = encode(buf)
		}
	})
	b.Run("decode-batch", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(msg)))
		var got wireBatch
		for b.Loop() {
			if err := decodeBatch(msg, len(msg), &got); err != nil {
				b.Fatal(err)
			}
		}
	})
	chunk := &indexChunk{origin: "replica-a", transfer: 9, total: 1 << 20, crc: 1, offset: 1 << 16, data: make([]byte, 1<<16)}
	cmsg := appendIndexChunk(nil, chunk)
	b.Run("encode-chunk", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(chunk.data)))
		buf := make([]byte, 0, len(cmsg))
		for b.Loop() {
			buf = appendIndexChunk(buf[:0], chunk)
		}
	})
	b.Run("decode-chunk", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(chunk.data)))
		for b.Loop() {
			if _, err := decodeIndexChunk(cmsg, len(cmsg)); err != nil {
				b.Fatal(err)
			}
		}
	})
}
