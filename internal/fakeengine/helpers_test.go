package fakeengine

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
	"github.com/tinylib/msgp/msgp"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(LeakyZMQFunction))
}

// testTimeout bounds every network wait in this package's tests.
const testTimeout = 10 * time.Second

// pollInterval is the polling period of require.Eventually waits on network delivery.
const pollInterval = 2 * time.Millisecond

// decoded is a test-side view of one batch, decoded generically.
type decoded struct {
	ts     float64
	events []map[string]any // array events are converted to maps by position
	dp     any              // nil when absent
	hasDP  bool
}

var storedFields = storedKeys[:]
var removedFields = []string{"type", "block_hashes", "medium", "group_idx"}

// decodeBatch decodes a payload in any of the engine's formats.
func decodeBatch(t testing.TB, payload []byte) decoded {
	t.Helper()
	v, rest, err := msgp.ReadIntfBytes(payload)
	require.NoError(t, err)
	require.Empty(t, rest, "trailing bytes after the batch")
	var d decoded
	var rawEvents any
	switch b := v.(type) {
	case []any:
		require.True(t, len(b) == 2 || len(b) == 3, "batch array of %d", len(b))
		d.ts = b[0].(float64)
		rawEvents = b[1]
		if len(b) == 3 {
			d.dp, d.hasDP = b[2], true
		}
	case map[string]any:
		d.ts = b["ts"].(float64)
		rawEvents = b["events"]
		d.dp, d.hasDP = b["data_parallel_rank"]
	default:
		t.Fatalf("batch is %T", v)
	}
	for _, re := range rawEvents.([]any) {
		switch ev := re.(type) {
		case map[string]any:
			d.events = append(d.events, ev)
		case []any:
			m := map[string]any{}
			names := storedFields
			if ev[0] == "BlockRemoved" {
				names = removedFields
			}
			require.LessOrEqual(t, len(ev), len(names))
			for i, f := range ev {
				m[names[i]] = f
			}
			d.events = append(d.events, m)
		default:
			t.Fatalf("event is %T", re)
		}
	}
	return d
}

// asHash normalises a wire hash like a consumer would.
func asHash(t testing.TB, v any) uint64 {
	t.Helper()
	switch h := v.(type) {
	case uint64:
		return h
	case int64:
		return uint64(h)
	case []byte:
		require.GreaterOrEqual(t, len(h), 8)
		return binary.BigEndian.Uint64(h[len(h)-8:])
	default:
		t.Fatalf("hash is %T", v)
		return 0
	}
}

func asHashes(t testing.TB, v any) []uint64 {
	t.Helper()
	var out []uint64
	for _, h := range v.([]any) {
		out = append(out, asHash(t, h))
	}
	return out
}

func asInt(t testing.TB, v any) int64 {
	t.Helper()
	switch n := v.(type) {
	case int64:
		return n
	case uint64:
		return int64(n)
	default:
		t.Fatalf("int is %T", v)
		return 0
	}
}

// asTokens reads token_ids, flat or in the bigram form, which it flattens the
// way kvselect's decoder does (kvindex/kvevents readTokens): both elements of the
// first pair, then the second element of every later pair. It also requires
// each pair to start with the token the previous pair ended on.
func asTokens(t testing.TB, v any) []uint32 {
	t.Helper()
	var out []uint32
	var ahead uint32
	for i, x := range v.([]any) {
		pair, ok := x.([]any)
		if !ok {
			out = append(out, uint32(asInt(t, x)))
			continue
		}
		// A bigram per token: the token is the first element, the second looks
		// ahead and must be the next pair's first.
		require.Len(t, pair, 2, "bigram %d", i)
		first := uint32(asInt(t, pair[0]))
		if i > 0 {
			require.Equal(t, ahead, first, "bigram %d does not chain", i)
		}
		out = append(out, first)
		ahead = uint32(asInt(t, pair[1]))
	}
	return out
}

// seqTokens returns n tokens start, start+1, ...
func seqTokens(start, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(start + i)
	}
	return out
}

func be64(v uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], v)
	return b[:]
}

// startEngine builds and starts an engine, closing it at test end.
func startEngine(t *testing.T, o Options) *Engine {
	t.Helper()
	e, err := New(o)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() { require.NoError(t, e.Close()) })
	return e
}

// subscribe dials a SUB to the engine's PUB, subscribes to everything and waits
// until the engine sees the subscription. The socket's context bounds every Recv.
func subscribe(t *testing.T, e *Engine) zmq4.Socket {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	sub := zmq4.NewSub(ctx)
	t.Cleanup(func() {
		_ = sub.Close()
		cancel()
	})
	require.NoError(t, sub.Dial(e.PubEndpoint()))
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	require.NoError(t, e.WaitSubscribed(ctx))
	return sub
}

// dealer dials a DEALER to the engine's replay ROUTER.
func dealer(t *testing.T, e *Engine) zmq4.Socket {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	d := zmq4.NewDealer(ctx)
	t.Cleanup(func() {
		_ = d.Close()
		cancel()
	})
	require.NoError(t, d.Dial(e.ReplayEndpoint()))
	return d
}

func recv(t *testing.T, s zmq4.Socket) [][]byte {
	t.Helper()
	msg, err := s.Recv()
	require.NoError(t, err)
	return msg.Frames
}

// recvLive receives one live message and checks its framing.
func recvLive(t *testing.T, s zmq4.Socket, topic string) (uint64, []byte) {
	t.Helper()
	f := recv(t, s)
	require.Len(t, f, 3)
	require.Equal(t, topic, string(f[0]))
	require.Len(t, f[1], 8)
	return binary.BigEndian.Uint64(f[1]), f[2]
}

type replayed struct {
	seq     uint64
	payload []byte
}

// requestReplay asks for everything from start and collects the reply up to the
// end marker, checking the layout.
func requestReplay(t *testing.T, d zmq4.Socket, start uint64, layout ReplayLayout, topic string) []replayed {
	t.Helper()
	require.NoError(t, d.Send(zmq4.NewMsgFrom([]byte{}, be64(start))))
	return collectReplay(t, d, layout, topic)
}

func collectReplay(t *testing.T, d zmq4.Socket, layout ReplayLayout, topic string) []replayed {
	t.Helper()
	var out []replayed
	for {
		f := recv(t, d)
		require.Empty(t, f[0], "delimiter frame")
		f = f[1:]
		if layout == ReplayWithTopic {
			require.Len(t, f, 3)
			seq := binary.BigEndian.Uint64(f[1])
			if seq == EndSeq {
				require.Empty(t, f[0], "end marker topic")
				require.Empty(t, f[2], "end marker payload")
				return out
			}
			require.Equal(t, topic, string(f[0]))
			out = append(out, replayed{seq, f[2]})
			continue
		}
		require.Len(t, f, 2)
		require.Len(t, f[0], 8)
		seq := binary.BigEndian.Uint64(f[0])
		if seq == EndSeq {
			require.Empty(t, f[1], "end marker payload")
			return out
		}
		out = append(out, replayed{seq, f[1]})
	}
}
