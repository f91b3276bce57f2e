package trace

import (
	"errors"
	"io"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/stretchr/testify/require"
)

const goodTrace = `{"timestamp": 0, "input_length": 1024, "output_length": 6, "hash_ids": [0, 1]}
{"timestamp": 0, "input_length": 1030, "output_length": 0, "hash_ids": [0, 1, 2], "extra": "ignored"}

{"timestamp": 27.5, "input_length": 1, "output_length": 12, "hash_ids": [7]}` + "\r\n" +
	`{"timestamp": 3000, "input_length": 0, "output_length": 1, "hash_ids": []}`

func TestReadAllGood(t *testing.T) {
	reqs, err := ReadAll(strings.NewReader(goodTrace), ReaderOptions{})
	require.NoError(t, err)
	require.Equal(t, []Request{
		{Arrival: 0, InputTokens: 1024, OutputTokens: 6, Blocks: []uint64{0, 1}},
		{Arrival: 0, InputTokens: 1030, OutputTokens: 0, Blocks: []uint64{0, 1, 2}},
		{Arrival: 27500 * time.Microsecond, InputTokens: 1, OutputTokens: 12, Blocks: []uint64{7}},
		{Arrival: 3 * time.Second, InputTokens: 0, OutputTokens: 1, Blocks: []uint64{}},
	}, reqs)
}

func TestReaderBadLines(t *testing.T) {
	good := `{"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [1]}`
	cases := []struct {
		name, line string
		want       error  // extra sentinel, if any
		msg        string // part of the message
	}{
		{"not json", `{"timestamp": 5,`, nil, "not a valid JSON object"},
		{"array", `[1, 2]`, nil, "not a valid JSON object"},
		{"missing timestamp", `{"input_length": 512, "output_length": 1, "hash_ids": [1]}`, nil, "missing timestamp"},
		{"missing input", `{"timestamp": 5, "output_length": 1, "hash_ids": [1]}`, nil, "missing input_length"},
		{"missing output", `{"timestamp": 5, "input_length": 512, "hash_ids": [1]}`, nil, "missing output_length"},
		{"missing ids", `{"timestamp": 5, "input_length": 512, "output_length": 1}`, nil, "missing hash_ids"},
		{"negative input", `{"timestamp": 5, "input_length": -1, "output_length": 1, "hash_ids": []}`, ErrInvalidRequest, "input length -1 is negative"},
		{"negative output", `{"timestamp": 5, "input_length": 512, "output_length": -4, "hash_ids": [1]}`, ErrInvalidRequest, "output length -4"},
		{"fractional length", `{"timestamp": 5, "input_length": 5.5, "output_length": 1, "hash_ids": [1]}`, nil, "not a valid JSON object"},
		{"negative id", `{"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [-3]}`, nil, "hash_ids[0] = -3"},
		{"too few ids", `{"timestamp": 5, "input_length": 513, "output_length": 1, "hash_ids": [1]}`, ErrInvalidRequest, "want ceil(513/512) = 2"},
		{"too many ids", `{"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}`, ErrInvalidRequest, "2 block ids"},
		{"negative timestamp", `{"timestamp": -1, "input_length": 512, "output_length": 1, "hash_ids": [1]}`, nil, "timestamp -1"},
		{"huge timestamp", `{"timestamp": 1e300, "input_length": 512, "output_length": 1, "hash_ids": [1]}`, nil, "out of range"},
		{"decreasing", `{"timestamp": 4, "input_length": 512, "output_length": 1, "hash_ids": [1]}`, ErrOutOfOrder, "4 ms after 5 ms"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := good + "\n\n" + tc.line + "\n" + good + "\n"
			rd, err := NewReader(strings.NewReader(in), ReaderOptions{})
			require.NoError(t, err)
			_, err = rd.Next()
			require.NoError(t, err)
			_, err = rd.Next()
			var le *LineError
			require.ErrorAs(t, err, &le)
			require.Equal(t, 3, le.Line, "blank lines count")
			require.ErrorIs(t, err, ErrBadLine)
			if tc.want != nil {
				require.ErrorIs(t, err, tc.want)
			}
			require.Contains(t, err.Error(), "trace: line 3: ")
			require.Contains(t, err.Error(), tc.msg)
			// The reader goes on after a bad line.
			r, err := rd.Next()
			require.NoError(t, err)
			require.Equal(t, 5*time.Millisecond, r.Arrival)
			require.Equal(t, 4, rd.Line())
			_, err = rd.Next()
			require.ErrorIs(t, err, io.EOF)
			_, err = rd.Next()
			require.ErrorIs(t, err, io.EOF, "EOF is sticky")

			// ReadAll stops at the bad line.
			_, err = ReadAll(strings.NewReader(in), ReaderOptions{})
			require.ErrorAs(t, err, &le)
			require.Equal(t, 3, le.Line)
		})
	}
}

func TestReaderSkipBad(t *testing.T) {
	in := strings.Join([]string{
		`{"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [1]}`,
		`garbage`,
		`{"timestamp": 2, "input_length": 1024, "output_length": 1, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [9]}`,
		`{"timestamp": 3, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}`,
	}, "\n")
	rd, err := NewReader(strings.NewReader(in), ReaderOptions{SkipBad: true})
	require.NoError(t, err)
	var got []Request
	for {
		r, err := rd.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		got = append(got, r)
	}
	require.Len(t, got, 2)
	require.Equal(t, []uint64{1, 2}, got[1].Blocks)
	require.Equal(t, 3, rd.Skipped())
	var lines []int
	for _, e := range rd.SkippedErrors() {
		lines = append(lines, e.Line)
	}
	require.Equal(t, []int{2, 3, 4}, lines)
	require.ErrorIs(t, rd.SkippedErrors()[2], ErrOutOfOrder)
}

func TestReadAllUnorderedSortsStably(t *testing.T) {
	in := `{"timestamp": 10, "input_length": 1, "output_length": 1, "hash_ids": [1]}
{"timestamp": 5, "input_length": 1, "output_length": 2, "hash_ids": [2]}
{"timestamp": 10, "input_length": 1, "output_length": 3, "hash_ids": [3]}
{"timestamp": 5, "input_length": 1, "output_length": 4, "hash_ids": [4]}`
	reqs, err := ReadAll(strings.NewReader(in), ReaderOptions{AllowUnordered: true})
	require.NoError(t, err)
	var ids []uint64
	for _, r := range reqs {
		ids = append(ids, r.Blocks[0])
	}
	require.Equal(t, []uint64{2, 4, 1, 3}, ids)
}

func TestReaderLineTooLongAndBlockSize(t *testing.T) {
	long := `{"timestamp": 1, "input_length": 16, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]}`
	in := long + "\n" + `{"timestamp": 2, "input_length": 2, "output_length": 1, "hash_ids": [1, 2]}` + "\n"
	rd, err := NewReader(strings.NewReader(in), ReaderOptions{BlockSize: 1, MaxLineBytes: 90})
	require.NoError(t, err)
	_, err = rd.Next()
	var le *LineError
	require.ErrorAs(t, err, &le)
	require.Equal(t, 1, le.Line)
	require.ErrorIs(t, err, ErrLineTooLong)
	r, err := rd.Next()
	require.NoError(t, err)
	require.Equal(t, []uint64{1, 2}, r.Blocks)
	require.Equal(t, 2, rd.Line())
}

func TestReaderIOErrorAndOptions(t *testing.T) {
	boom := errors.New("disk on fire")
	rd, err := NewReader(io.MultiReader(strings.NewReader(`{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}`+"\n"), iotest.ErrReader(boom)), ReaderOptions{})
	require.NoError(t, err)
	_, err = rd.Next()
	require.NoError(t, err)
	_, err = rd.Next()
	require.ErrorIs(t, err, boom)
	require.Contains(t, err.Error(), "reading line 2")
	_, err = rd.Next()
	require.ErrorIs(t, err, boom, "read errors are sticky")

	_, err = NewReader(strings.NewReader(""), ReaderOptions{BlockSize: -1, MaxLineBytes: -2})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.Contains(t, err.Error(), "BlockSize -1")
	require.Contains(t, err.Error(), "MaxLineBytes -2")
	_, err = NewReader(nil, ReaderOptions{})
	require.ErrorIs(t, err, ErrInvalidOptions)

	reqs, err := ReadAll(strings.NewReader(""), ReaderOptions{})
	require.NoError(t, err)
	require.Empty(t, reqs)

	_, err = ReadFile("does-not-exist.jsonl", ReaderOptions{})
	require.Error(t, err)
}

func TestReadFile(t *testing.T) {
	path := t.TempDir() + "/t.jsonl"
	require.NoError(t, writeFile(path, goodTrace))
	reqs, err := ReadFile(path, ReaderOptions{})
	require.NoError(t, err)
	require.Len(t, reqs, 4)

	require.NoError(t, writeFile(path, goodTrace+"\n{}"))
	_, err = ReadFile(path, ReaderOptions{})
	var le *LineError
	require.ErrorAs(t, err, &le)
	require.Equal(t, 6, le.Line)
	require.Contains(t, err.Error(), path)
}

func FuzzReader(f *testing.F) {
	f.Add([]byte(goodTrace))
	f.Add([]byte(`{"timestamp": 1e400}` + "\n" + `{"hash_ids": [1,2,3]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		rd, err := NewReader(strings.NewReader(string(data)), ReaderOptions{SkipBad: true, MaxLineBytes: 1 << 12})
		require.NoError(t, err)
		last := time.Duration(-1)
		for i := 0; ; i++ {
			r, err := rd.Next()
			if errors.Is(err, io.EOF) {
				return
			}
			require.NoError(t, err)
			require.NoError(t, r.Validate(DefaultBlockSize))
			require.GreaterOrEqual(t, r.Arrival, last)
			last = r.Arrival
		}
	})
}
