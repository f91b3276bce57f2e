package tokenize

import (
	"bytes"
	"errors"
	"math"
)

// Reasons a token id array is rejected. They are wrapped into ErrUpstream (an
// answer from the service) or ErrBadRequest (token ids in the client's prompt).
var (
	errNotArray   = errors.New("token ids are not a JSON array")
	errNotInteger = errors.New("token id is not an integer")
	errNegative   = errors.New("token id is negative")
	errTooLarge   = errors.New("token id does not fit in 32 bits")
	errTrailing   = errors.New("unexpected bytes after the token id array")
	// errTooMany: the array holds more ids than the caller's limit; the
	// callers turn it into ErrPromptTooLong.
	errTooMany = errors.New("more token ids than the limit")
)

// parseTokenIDs decodes a JSON array of token ids, such as [1, 22, 333], into
// uint32 values. It accepts only plain JSON integers in [0, 2^32-1] ("-0" is 0);
// a fraction, an exponent, a sign on a non-zero value, a value above 2^32-1, null
// or any other JSON type is an error. More than limit ids is errTooMany, found
// before more than limit ids are stored. It never panics, whatever raw holds,
// and it allocates only the result, sized exactly (one counting pass over
// commas) and never above limit ids.
//
// It is the hot part of parsing a service's answer: encoding/json would decode
// each id through reflection; this is a single forward scan.
func parseTokenIDs(raw []byte, limit int) ([]uint32, error) {
	i := skipSpace(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return nil, errNotArray
	}
	i = skipSpace(raw, i+1)
	if i < len(raw) && raw[i] == ']' {
		if skipSpace(raw, i+1) != len(raw) {
			return nil, errTrailing
		}
		return []uint32{}, nil
	}
	out := make([]uint32, 0, min(bytes.Count(raw, []byte{','})+1, limit))
	for {
		i = skipSpace(raw, i)
		v, next, err := parseUint32(raw, i)
		if err != nil {
			return nil, err
		}
		if len(out) == limit {
			return nil, errTooMany
		}
		out = append(out, v)
		i = skipSpace(raw, next)
		if i >= len(raw) {
			return nil, errNotArray
		}
		switch raw[i] {
		case ',':
			i++
		case ']':
			if skipSpace(raw, i+1) != len(raw) {
				return nil, errTrailing
			}
			return out, nil
		default:
			return nil, errNotArray
		}
	}
}

// parseUint32 reads one JSON integer starting at raw[i] and returns its value and
// the index after it.
func parseUint32(raw []byte, i int) (uint32, int, error) {
	neg := false
	if i < len(raw) && raw[i] == '-' {
		neg = true
		i++
	}
	start := i
	var v uint64
	for i < len(raw) && raw[i] >= '0' && raw[i] <= '9' {
		if v > math.MaxUint32 {
			// Keep scanning so the error names the right cause, but stop
			// accumulating: v already exceeds the range.
			i++
			continue
		}
		v = v*10 + uint64(raw[i]-'0')
		i++
	}
	digits := i - start
	switch {
	case digits == 0:
		if i < len(raw) && !neg && (raw[i] == '"' || raw[i] == '[' || raw[i] == '{' || raw[i] == 't' || raw[i] == 'f' || raw[i] == 'n') {
			return 0, i, errNotInteger
		}
		return 0, i, errNotArray
	case digits > 1 && raw[start] == '0':
		return 0, i, errNotInteger // leading zero: not JSON
	case i < len(raw) && (raw[i] == '.' || raw[i] == 'e' || raw[i] == 'E'):
		return 0, i, errNotInteger
	case neg && v != 0:
		return 0, i, errNegative
	case v > math.MaxUint32:
		return 0, i, errTooLarge
	}
	return uint32(v), i, nil
}

func skipSpace(raw []byte, i int) int {
	for i < len(raw) {
		switch raw[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}
