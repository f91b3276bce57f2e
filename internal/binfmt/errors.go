package binfmt

import (
	"errors"
	"io"
)

// The failures of a decode. A Decoder's error, and ReadFull's and ReadN's
// for a stream that ends early, wraps exactly one of them.
var (
	// ErrTruncated: the input ends inside a value. The error latched names
	// the kind of value ("input ends inside a 64-bit value").
	ErrTruncated = errors.New("input ends early")
	// ErrOverflow: a varint does not fit in 64 bits.
	ErrOverflow = errors.New("varint overflows 64 bits")
	// ErrRange: a uvarint exceeds the bound its read was given, a length its
	// limit or a count what the bytes left can hold.
	ErrRange = errors.New("value out of range")
	// ErrTrailing: bytes are left after the end (Decoder.End).
	ErrTrailing = errors.New("bytes after the end")
)

// truncated is ErrTruncated naming what the input ended inside.
type truncated struct{ what string }

func (e *truncated) Error() string { return "input ends inside " + e.what }

func (e *truncated) Unwrap() error { return ErrTruncated }

// The latched failures, built once so that failing allocates nothing.
var (
	errShortByte   error = &truncated{"a byte"}
	errShortU32    error = &truncated{"a 32-bit value"}
	errShortU64    error = &truncated{"a 64-bit value"}
	errShortVarint error = &truncated{"a varint"}
	errShortBytes  error = &truncated{"a run of bytes"}
	errShortStream error = &streamEnded{}
)

// streamEnded is a reader's stream ending early: ErrTruncated, and
// io.ErrUnexpectedEOF for callers that test for it.
type streamEnded struct{}

func (*streamEnded) Error() string { return "input ends early: " + io.ErrUnexpectedEOF.Error() }

func (*streamEnded) Unwrap() []error { return []error{ErrTruncated, io.ErrUnexpectedEOF} }
