package binfmt_test

import (
	"bytes"
	"errors"
	"io"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/binfmt"
)

// ReadFull reads exactly its buffer, leaving the rest; a stream that ends
// first, even before its first byte, is ErrTruncated and
// io.ErrUnexpectedEOF; the reader's own errors come back as they are.
func TestReadFull(t *testing.T) {
	r := strings.NewReader("headerrest")
	b := make([]byte, 6)
	require.NoError(t, binfmt.ReadFull(iotest.OneByteReader(r), b))
	require.Equal(t, "header", string(b))
	require.Equal(t, 4, r.Len())

	for _, in := range []string{"", "abc"} {
		err := binfmt.ReadFull(strings.NewReader(in), make([]byte, 4))
		require.ErrorIs(t, err, binfmt.ErrTruncated, "%q", in)
		require.ErrorIs(t, err, io.ErrUnexpectedEOF, "%q", in)
		require.True(t, wrapsOne(err))
	}
	boom := errors.New("boom")
	err := binfmt.ReadFull(iotest.ErrReader(boom), make([]byte, 4))
	require.ErrorIs(t, err, boom)
	require.NotErrorIs(t, err, binfmt.ErrTruncated)
}

// ReadN reads exactly n bytes through any split of the stream, fails like
// ReadFull, and allocates in proportion to what arrives, not to n.
func TestReadN(t *testing.T) {
	data := bytes.Repeat([]byte("0123456789"), 1000)
	for _, step := range []int{-1, 1, 7, 64, 1 << 16} {
		r := bytes.NewReader(append(bytes.Clone(data), "more"...))
		got, err := binfmt.ReadN(iotest.HalfReader(r), len(data), step)
		require.NoError(t, err, "step %d", step)
		require.Equal(t, data, got, "step %d", step)
		require.Equal(t, 4, r.Len(), "step %d: the rest is left", step)
	}
	got, err := binfmt.ReadN(strings.NewReader(""), 0, 16)
	require.NoError(t, err)
	require.Empty(t, got)

	_, err = binfmt.ReadN(bytes.NewReader(data), len(data)+1, 64)
	require.ErrorIs(t, err, binfmt.ErrTruncated)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)
	boom := errors.New("boom")
	_, err = binfmt.ReadN(io.MultiReader(bytes.NewReader(data), iotest.ErrReader(boom)), len(data)+1, 64)
	require.ErrorIs(t, err, boom)

	// A claim of 1 GiB over 100 bytes costs about the first step.
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err = binfmt.ReadN(bytes.NewReader(make([]byte, 100)), 1<<30, 1<<16)
	runtime.ReadMemStats(&after)
	require.ErrorIs(t, err, binfmt.ErrTruncated)
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20))
}
