package kvevents

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
)

func seq8(s uint64) []byte { return appendSeq(nil, s) }

func TestParseLiveFrames(t *testing.T) {
	cases := []struct {
		name    string
		frames  [][]byte
		want    frame
		wantErr bool
	}{
		{"ok", [][]byte{[]byte("kv@a@m"), seq8(7), []byte{0x93}}, frame{Topic: []byte("kv@a@m"), Seq: 7, Payload: []byte{0x93}}, false},
		{"empty topic", [][]byte{{}, seq8(0), []byte("p")}, frame{Topic: []byte{}, Seq: 0, Payload: []byte("p")}, false},
		{"big seq", [][]byte{{}, {0x01, 0, 0, 0, 0, 0, 0, 0x02}, []byte("p")}, frame{Topic: []byte{}, Seq: 1<<56 | 2, Payload: []byte("p")}, false},
		{"two frames", [][]byte{seq8(1), []byte("p")}, frame{}, true},
		{"four frames", [][]byte{{}, {}, seq8(1), []byte("p")}, frame{}, true},
		{"no frames", nil, frame{}, true},
		{"short seq", [][]byte{{}, {1, 2, 3}, []byte("p")}, frame{}, true},
		{"long seq", [][]byte{{}, make([]byte, 9), []byte("p")}, frame{}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseLiveFrames(tc.frames)
			if tc.wantErr {
				require.ErrorIs(t, err, errBadFrames)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestParseReplayFrames(t *testing.T) {
	end := seq8(replayEndSeq)
	cases := []struct {
		name    string
		frames  [][]byte
		want    frame
		wantEnd bool
		wantErr bool
	}{
		{"pre-0.26 batch", [][]byte{{}, seq8(3), []byte("p")}, frame{Seq: 3, Payload: []byte("p")}, false, false},
		{"0.26 batch", [][]byte{{}, []byte("t"), seq8(3), []byte("p")}, frame{Topic: []byte("t"), Seq: 3, Payload: []byte("p")}, false, false},
		{"pre-0.26 end", [][]byte{{}, end, {}}, frame{Seq: replayEndSeq, Payload: []byte{}}, true, false},
		{"0.26 end", [][]byte{{}, {}, end, {}}, frame{Topic: []byte{}, Seq: replayEndSeq, Payload: []byte{}}, true, false},
		{"end by seq only", [][]byte{{}, end, []byte("x")}, frame{Seq: replayEndSeq, Payload: []byte("x")}, true, false},
		{"end by empty payload", [][]byte{{}, seq8(9), {}}, frame{Seq: 9, Payload: []byte{}}, true, false},
		{"no delimiter", [][]byte{[]byte("t"), seq8(3), []byte("p")}, frame{}, false, true},
		{"delimiter only", [][]byte{{}}, frame{}, false, true},
		{"too many", [][]byte{{}, {}, {}, seq8(3), []byte("p")}, frame{}, false, true},
		{"bad seq", [][]byte{{}, {1}, []byte("p")}, frame{}, false, true},
		{"empty", nil, frame{}, false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, end, err := parseReplayFrames(tc.frames)
			if tc.wantErr {
				require.ErrorIs(t, err, errBadFrames)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			require.Equal(t, tc.wantEnd, end)
		})
	}
}

// splitFrames turns fuzz bytes into frames: each frame is a length byte followed by
// that many bytes (truncated at the end of the input).
func splitFrames(b []byte) [][]byte {
	var frames [][]byte
	for len(b) > 0 && len(frames) < 8 {
		n := int(b[0])
		b = b[1:]
		n = min(n, len(b))
		frames = append(frames, b[:n])
		b = b[n:]
	}
	return frames
}

func FuzzParseFrames(f *testing.F) {
	join := func(frames ...[]byte) []byte {
		var out []byte
		for _, fr := range frames {
			out = append(out, byte(len(fr)))
			out = append(out, fr...)
		}
		return out
	}
	f.Add(join([]byte("kv@a@m"), seq8(1), []byte{0x93, 0xcb}))
	f.Add(join(nil, seq8(2), []byte("p")))
	f.Add(join(nil, []byte("t"), seq8(replayEndSeq), nil))
	f.Add(join(nil, seq8(5)))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		frames := splitFrames(data)
		if fr, err := parseLiveFrames(frames); err == nil {
			require.Len(t, frames, 3)
			require.Equal(t, binary.BigEndian.Uint64(frames[1]), fr.Seq)
			require.Equal(t, frames[2], fr.Payload)
		} else {
			require.ErrorIs(t, err, errBadFrames)
		}
		if fr, end, err := parseReplayFrames(frames); err == nil {
			require.Empty(t, frames[0])
			require.Contains(t, []int{3, 4}, len(frames))
			require.Equal(t, fr.Payload, frames[len(frames)-1])
			require.Equal(t, fr.Seq == replayEndSeq || len(fr.Payload) == 0, end)
		} else {
			require.ErrorIs(t, err, errBadFrames)
		}
	})
}
