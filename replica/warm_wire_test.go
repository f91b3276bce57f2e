package replica

import (
	"bytes"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestIndexWireRoundTrip(t *testing.T) {
	q := indexRequest{requester: "r-1", release: true, transfer: 1 << 60, offset: 12345}
	got, err := decodeIndexRequest(appendIndexRequest(nil, q), MinMessageBytes)
	require.NoError(t, err)
	require.Equal(t, q, got)

	c := indexChunk{status: indexOK, origin: "peer", transfer: 7, total: 10, crc: 0xdeadbeef, offset: 4, data: []byte("abcdef")}
	msg := appendIndexChunk(nil, &c)
	gc, err := decodeIndexChunk(msg, MinMessageBytes)
	require.NoError(t, err)
	require.Equal(t, c, gc)

	for name, tc := range map[string]struct {
		msg  []byte
		want error
	}{
		"flipped data":     {flip(msg, len(msg)-6), errChecksum},
		"torn":             {msg[:len(msg)-3], errTruncated},
		"trailing":         {append(bytes.Clone(msg), 0), errTrailing},
		"too large":        {append(bytes.Clone(msg), make([]byte, MinMessageBytes)...), errTooLarge},
		"past total":       {appendIndexChunk(nil, &indexChunk{origin: "p", total: 3, offset: 1, data: []byte("abc")}), errField},
		"data refused":     {appendIndexChunk(nil, &indexChunk{status: indexBusy, origin: "p", total: 3, data: []byte("a")}), errField},
		"unknown status":   {appendIndexChunk(nil, &indexChunk{status: numIndexStatus, origin: "p"}), errField},
		"bad origin":       {appendIndexChunk(nil, &indexChunk{origin: "no spaces"}), errField},
		"request as chunk": {appendIndexRequest(nil, q), errType},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := decodeIndexChunk(tc.msg, MinMessageBytes)
			require.ErrorIs(t, err, tc.want)
		})
	}
	bad := appendIndexRequest(nil, q)
	bad[7+len(q.requester)] |= 0x80 // an unknown flag
	_, err = decodeIndexRequest(bad, MinMessageBytes)
	require.ErrorIs(t, err, errField)
}

func flip(b []byte, i int) []byte {
	out := bytes.Clone(b)
	out[i] ^= 0x01
	return out
}

// FuzzIndexWire: the index transfer's decoders never panic, fail only with
// the wire's sentinels, and what they accept reads back the same once
// written again.
func FuzzIndexWire(f *testing.F) {
	f.Add(appendIndexRequest(nil, indexRequest{requester: "a", transfer: 3, offset: 9}))
	f.Add(appendIndexChunk(nil, &indexChunk{origin: "b", transfer: 3, total: 5, crc: 1, data: []byte("hello")}))
	f.Add(appendIndexChunk(nil, &indexChunk{status: indexNotServing, origin: "b"}))
	sentinels := []error{errTooLarge, errMagic, errVersion, errType, errTruncated, errTrailing, errField, errChecksum}
	isSentinel := func(err error) bool {
		for _, s := range sentinels {
			if errors.Is(err, s) {
				return true
			}
		}
		return false
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		// Varints may come overlong: what is accepted must mean, written
		// again canonically, the same.
		if q, err := decodeIndexRequest(b, MinMessageBytes); err == nil {
			again, err := decodeIndexRequest(appendIndexRequest(nil, q), MinMessageBytes)
			require.NoError(t, err)
			require.Equal(t, q, again)
		} else {
			require.True(t, isSentinel(err), "unexpected error %v", err)
		}
		if c, err := decodeIndexChunk(b, MinMessageBytes); err == nil {
			require.LessOrEqual(t, uint64(len(c.data)), c.total-c.offset)
			again, err := decodeIndexChunk(appendIndexChunk(nil, &c), MinMessageBytes)
			require.NoError(t, err)
			require.Equal(t, c, again)
		} else {
			require.True(t, isSentinel(err), "unexpected error %v", err)
		}
	})
}
