package trace

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"time"
)

// DefaultMaxLineBytes bounds one line of a trace unless ReaderOptions says
// otherwise.
const DefaultMaxLineBytes = 16 << 20

// maxSkipped is how many skipped-line errors a Reader keeps for inspection.
const maxSkipped = 16

// maxTimestampMs keeps a timestamp representable as a time.Duration.
const maxTimestampMs = float64(math.MaxInt64/int64(time.Millisecond)) - 1

// ReaderOptions configure a Reader. The zero value means the defaults.
type ReaderOptions struct {
	// BlockSize is the trace's tokens per block. 0 means DefaultBlockSize (512);
	// negative is invalid.
	BlockSize int
	// SkipBad makes Next skip bad lines (counting them, see Skipped) instead of
	// returning them as *LineError. Default false.
	SkipBad bool
	// AllowUnordered accepts timestamps that decrease; ReadAll then sorts the
	// requests stably by arrival. Default false: a decreasing timestamp is a bad
	// line (ErrOutOfOrder).
	AllowUnordered bool
	// MaxLineBytes bounds a line, newline included. 0 means DefaultMaxLineBytes;
	// negative is invalid. A longer line is a bad line (ErrLineTooLong).
	MaxLineBytes int
}

func (o ReaderOptions) withDefaults() (ReaderOptions, error) {
	var errs []error
	if o.BlockSize < 0 {
		errs = append(errs, fmt.Errorf("%w: BlockSize %d is negative", ErrInvalidOptions, o.BlockSize))
	}
	if o.MaxLineBytes < 0 {
		errs = append(errs, fmt.Errorf("%w: MaxLineBytes %d is negative", ErrInvalidOptions, o.MaxLineBytes))
	}
	if len(errs) > 0 {
		return o, errors.Join(errs...)
	}
	if o.BlockSize == 0 {
		o.BlockSize = DefaultBlockSize
	}
	if o.MaxLineBytes == 0 {
		o.MaxLineBytes = DefaultMaxLineBytes
	}
	return o, nil
}

// Reader streams the requests of a Mooncake-format JSONL trace, one line at a
// time, validating each. It is not safe for concurrent use.
type Reader struct {
	br      *bufio.Reader
	opts    ReaderOptions
	buf     []byte
	line    int
	last    time.Duration
	started bool
	skipped int
	errs    []*LineError
	err     error // sticky I/O error or io.EOF
}

// NewReader returns a Reader of r. Errors: ErrInvalidOptions.
func NewReader(r io.Reader, opts ReaderOptions) (*Reader, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	if r == nil {
		return nil, fmt.Errorf("%w: nil io.Reader", ErrInvalidOptions)
	}
	return &Reader{br: bufio.NewReaderSize(r, 64<<10), opts: o}, nil
}

// Next returns the next request. At the end it returns io.EOF. A bad line is a
// *LineError (wrapping ErrBadLine and the cause: ErrOutOfOrder, ErrLineTooLong,
// or a description of the problem), after which Next may be called again to go
// on; with SkipBad bad lines are counted and skipped instead. A read error of the
// underlying reader is returned wrapped and ends the stream.
func (r *Reader) Next() (Request, error) {
	for {
		if r.err != nil {
			return Request{}, r.err
		}
		raw, tooLong, err := r.readLine()
		if err != nil {
			if errors.Is(err, io.EOF) {
				r.err = io.EOF
			} else {
				r.err = fmt.Errorf("trace: reading line %d: %w", r.line+1, err)
			}
			return Request{}, r.err
		}
		r.line++
		var req Request
		var cause error
		if tooLong {
			cause = fmt.Errorf("%w: more than %d bytes", ErrLineTooLong, r.opts.MaxLineBytes)
		} else {
			if len(bytes.TrimSpace(raw)) == 0 {
				continue
			}
			req, cause = r.parse(raw)
		}
		if cause == nil {
			r.started, r.last = true, req.Arrival
			return req, nil
		}
		le := &LineError{Line: r.line, Err: cause}
		if !r.opts.SkipBad {
			return Request{}, le
		}
		r.skipped++
		if len(r.errs) < maxSkipped {
			r.errs = append(r.errs, le)
		}
	}
}

// Line returns the number of lines read so far (the line of the last request or
// error returned).
func (r *Reader) Line() int { return r.line }

// Skipped returns how many bad lines were skipped (SkipBad).
func (r *Reader) Skipped() int { return r.skipped }

// SkippedErrors returns the first few skipped lines' errors (at most 16).
func (r *Reader) SkippedErrors() []*LineError { return slices.Clone(r.errs) }

// readLine returns the next line without its newline. tooLong reports a line
// over the limit (its bytes are discarded). It returns io.EOF only when no bytes
// remain.
func (r *Reader) readLine() (line []byte, tooLong bool, err error) {
	r.buf = r.buf[:0]
	got := false
	for {
		chunk, err := r.br.ReadSlice('\n')
		if len(chunk) > 0 {
			got = true
		}
		if !tooLong {
			if len(r.buf)+len(chunk) > r.opts.MaxLineBytes {
				tooLong, r.buf = true, r.buf[:0]
			} else {
				r.buf = append(r.buf, chunk...)
			}
		}
		switch {
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case errors.Is(err, io.EOF):
			if !got {
				return nil, false, io.EOF
			}
			return r.buf, tooLong, nil
		case err != nil:
			return nil, false, err
		}
		return bytes.TrimSuffix(r.buf, []byte{'\n'}), tooLong, nil
	}
}

// line is the JSON shape of one trace line; pointers detect missing fields.
type line struct {
	Timestamp    *float64 `json:"timestamp"`
	InputLength  *int     `json:"input_length"`
	OutputLength *int     `json:"output_length"`
	HashIDs      *[]int64 `json:"hash_ids"`
}

func (r *Reader) parse(raw []byte) (Request, error) {
	var l line
	if err := json.Unmarshal(raw, &l); err != nil {
		return Request{}, fmt.Errorf("not a valid JSON object: %w", err)
	}
	switch {
	case l.Timestamp == nil:
		return Request{}, errors.New("missing timestamp")
	case l.InputLength == nil:
		return Request{}, errors.New("missing input_length")
	case l.OutputLength == nil:
		return Request{}, errors.New("missing output_length")
	case l.HashIDs == nil:
		return Request{}, errors.New("missing hash_ids")
	}
	ts := *l.Timestamp
	if math.IsNaN(ts) || ts < 0 || ts > maxTimestampMs {
		return Request{}, fmt.Errorf("timestamp %v ms is negative or out of range", ts)
	}
	req := Request{
		Arrival:      time.Duration(math.Round(ts * float64(time.Millisecond))),
		InputTokens:  *l.InputLength,
		OutputTokens: *l.OutputLength,
		Blocks:       make([]uint64, len(*l.HashIDs)),
	}
	for i, id := range *l.HashIDs {
		if id < 0 {
			return Request{}, fmt.Errorf("hash_ids[%d] = %d is negative", i, id)
		}
		req.Blocks[i] = uint64(id)
	}
	if err := req.Validate(r.opts.BlockSize); err != nil {
		return Request{}, err
	}
	if r.started && req.Arrival < r.last && !r.opts.AllowUnordered {
		return Request{}, fmt.Errorf("%w: %v ms after %v ms", ErrOutOfOrder,
			float64(req.Arrival)/float64(time.Millisecond), float64(r.last)/float64(time.Millisecond))
	}
	return req, nil
}

// ReadAll reads every request of r. It stops at the first bad line (a
// *LineError) unless opts.SkipBad; with opts.AllowUnordered the result is sorted
// stably by arrival.
func ReadAll(r io.Reader, opts ReaderOptions) ([]Request, error) {
	rd, err := NewReader(r, opts)
	if err != nil {
		return nil, err
	}
	var out []Request
	for {
		req, err := rd.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		out = append(out, req)
	}
	if rd.opts.AllowUnordered {
		slices.SortStableFunc(out, func(a, b Request) int { return cmp.Compare(a.Arrival, b.Arrival) })
	}
	return out, nil
}

// ReadFile reads every request of the trace file at path (see ReadAll).
func ReadFile(path string, opts ReaderOptions) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	defer f.Close()
	reqs, err := ReadAll(f, opts)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return reqs, nil
}
