package binfmt

import (
	"errors"
	"io"
	"slices"
)

// ReadFull reads exactly len(b) bytes from r. A stream that ends first is
// ErrTruncated (and io.ErrUnexpectedEOF), even before its first byte; r's
// other errors are returned as they are.
func ReadFull(r io.Reader, b []byte) error {
	if _, err := io.ReadFull(r, b); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return errShortStream
		}
		return err
	}
	return nil
}

// ReadN reads exactly n bytes from r, as ReadFull, into a new slice that
// grows only as they arrive: step bytes first, then doubling, never beyond
// n (a step below 1 counts as 1). So a length an input claims but does not
// hold costs memory in proportion to what the input holds, not to n.
func ReadN(r io.Reader, n, step int) ([]byte, error) {
	step = max(step, 1)
	buf := make([]byte, 0, min(n, step))
	for len(buf) < n {
		if len(buf) == cap(buf) {
			buf = slices.Grow(buf, min(n-len(buf), max(cap(buf), step)))
		}
		m := min(cap(buf), n)
		if err := ReadFull(r, buf[len(buf):m]); err != nil {
			return nil, err
		}
		buf = buf[:m]
	}
	return buf, nil
}
