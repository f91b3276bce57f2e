package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// errBadFrames reports a ZeroMQ message whose frame layout is not one the feed
// understands: a live message that is not exactly [topic, seq, payload], a replay reply
// without its empty delimiter or with the wrong number of frames, or a sequence frame
// that is not 8 bytes long. The feed counts such messages and skips them.
var errBadFrames = errors.New("kvevents: malformed frames")

// replayEndSeq is the sequence number an engine's replay server puts in the message
// that ends a replay stream (-1 as a signed 64-bit integer).
const replayEndSeq = ^uint64(0)

// seqLen is the length of a sequence frame: an unsigned 64-bit big-endian integer.
const seqLen = 8

// frame is one batch as it travels over ZeroMQ: the publisher's topic, the batch
// sequence number and the msgpack payload. Topic and Payload alias the frames they were
// parsed from; the parsers copy nothing.
type frame struct {
	Topic   []byte
	Seq     uint64
	Payload []byte
}

// parseLiveFrames parses a message received on a SUB socket. A live message is exactly
// three frames: topic, sequence (8 bytes, big-endian, unsigned) and payload. Any other
// shape returns an error wrapping errBadFrames. parseLiveFrames is a pure function, safe
// for concurrent use.
func parseLiveFrames(frames [][]byte) (frame, error) {
	if len(frames) != 3 {
		return frame{}, fmt.Errorf("%w: live message has %d frames, want 3 [topic, seq, payload]", errBadFrames, len(frames))
	}
	seq, err := parseSeq(frames[1])
	if err != nil {
		return frame{}, err
	}
	return frame{Topic: frames[0], Seq: seq, Payload: frames[2]}, nil
}

// parseReplayFrames parses one reply received on a DEALER socket from an engine's
// replay server (a ROUTER). The first frame must be the empty delimiter the ROUTER sends
// back; after it, two layouts are accepted:
//
//   - [seq, payload]: vLLM before v0.26 and SGLang;
//   - [topic, seq, payload]: vLLM v0.26 and later.
//
// end is true for the marker that closes a replay stream: a sequence equal to
// replayEndSeq or an empty payload. When end is true the returned frame carries whatever
// the marker held and must not be applied. Any other shape returns an error wrapping
// errBadFrames. parseReplayFrames is a pure function, safe for concurrent use.
func parseReplayFrames(frames [][]byte) (f frame, end bool, err error) {
	if len(frames) == 0 || len(frames[0]) != 0 {
		return frame{}, false, fmt.Errorf("%w: replay reply does not start with an empty delimiter frame", errBadFrames)
	}
	rest := frames[1:]
	switch len(rest) {
	case 2:
		f.Payload = rest[1]
		f.Seq, err = parseSeq(rest[0])
	case 3:
		f.Topic, f.Payload = rest[0], rest[2]
		f.Seq, err = parseSeq(rest[1])
	default:
		return frame{}, false, fmt.Errorf("%w: replay reply has %d frames after the delimiter, want 2 or 3", errBadFrames, len(rest))
	}
	if err != nil {
		return frame{}, false, err
	}
	return f, f.Seq == replayEndSeq || len(f.Payload) == 0, nil
}

// appendSeq appends the 8-byte big-endian encoding of seq to dst, the layout of a
// sequence frame and of a replay request's start sequence.
func appendSeq(dst []byte, seq uint64) []byte {
	return binary.BigEndian.AppendUint64(dst, seq)
}

func parseSeq(b []byte) (uint64, error) {
	if len(b) != seqLen {
		return 0, fmt.Errorf("%w: sequence frame is %d bytes, want %d", errBadFrames, len(b), seqLen)
	}
	return binary.BigEndian.Uint64(b), nil
}
