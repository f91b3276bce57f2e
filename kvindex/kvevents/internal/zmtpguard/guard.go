package zmtpguard

import (
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Defaults of the zero fields of Limits.
const (
	DefaultMaxFrame         = 64 << 20
	DefaultMaxCommand       = 64 << 10
	DefaultMaxParts         = 64
	DefaultMaxTopic         = 1 << 10
	DefaultHandshakeTimeout = 5 * time.Second
	DefaultWriteTimeout     = 10 * time.Second
	DefaultMaxConns         = 256
)

// minCommand is the smallest MaxCommand accepted: a READY carrying Socket-Type and a
// 36-character Identity (what zmq4 and libzmq send) needs about 80 bytes.
const minCommand = 256

var (
	// ErrRefused is wrapped by every *RefusedError: the guard closed a connection
	// because its peer broke ZMTP 3.x or a limit or policy.
	ErrRefused = errors.New("zmtpguard: connection refused")
	// ErrInvalidLimits is returned by Register for a negative or inconsistent limit.
	ErrInvalidLimits = errors.New("zmtpguard: invalid limits")
	// ErrTopicTooLong is handed to Policy.Refused when a message's first frame is
	// longer than Limits.MaxTopic while a Policy.Message is set.
	ErrTopicTooLong = errors.New("zmtpguard: topic frame too long")
)

// Limits bounds what one peer may make the process hold. A zero field takes its
// default; negative fields are invalid.
type Limits struct {
	// MaxFrame is the largest data frame body accepted, in bytes. Default 64 MiB.
	// zmq4 allocates each frame whole, so this is what one frame can cost.
	MaxFrame int64
	// MaxMessage is the largest sum of the frame bodies of one multi-frame message.
	// zmq4 holds a message's frames together until its last one. Default 2*MaxFrame.
	MaxMessage int64
	// MaxParts is the most frames one message may have. Default 64.
	MaxParts int
	// MaxCommand is the largest command frame (READY, PING, SUBSCRIBE...), which the
	// guard buffers whole to check it. Default 64 KiB; at least 256.
	MaxCommand int
	// MaxTopic is the longest first frame of a message handed to Policy.Message;
	// longer ones drop their message. Used only when Policy.Message is set.
	// Default 1 KiB.
	MaxTopic int
	// HandshakeTimeout bounds the arrival of the peer's greeting and READY, counted
	// from accept or dial. Default 5 s.
	HandshakeTimeout time.Duration
	// MaxConns is the most accepted connections one listener holds open at once,
	// handshaking or handed to zmq4; more are closed at once. Default 256.
	MaxConns int
	// WriteTimeout bounds every write to a peer. zmq4 writes without a deadline
	// while holding its socket's lock, so a peer that stops reading would stall
	// every connection of the socket; a write that cannot finish in time closes
	// the connection (ReasonWriteTimeout). Default 10 s.
	WriteTimeout time.Duration
}

func (l Limits) resolve() (Limits, error) {
	var errs []error
	check := func(name string, neg bool) {
		if neg {
			errs = append(errs, fmt.Errorf("%w: %s is negative", ErrInvalidLimits, name))
		}
	}
	check("MaxFrame", l.MaxFrame < 0)
	check("MaxMessage", l.MaxMessage < 0)
	check("MaxParts", l.MaxParts < 0)
	check("MaxCommand", l.MaxCommand < 0)
	check("MaxTopic", l.MaxTopic < 0)
	check("HandshakeTimeout", l.HandshakeTimeout < 0)
	check("MaxConns", l.MaxConns < 0)
	check("WriteTimeout", l.WriteTimeout < 0)
	if len(errs) > 0 {
		return l, errors.Join(errs...)
	}
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	if l.MaxFrame == 0 {
		l.MaxFrame = DefaultMaxFrame
	}
	if l.MaxMessage == 0 {
		l.MaxMessage = 2 * l.MaxFrame
		if l.MaxMessage < 0 { // overflow
			l.MaxMessage = math.MaxInt64
		}
	}
	def(&l.MaxParts, DefaultMaxParts)
	def(&l.MaxCommand, DefaultMaxCommand)
	def(&l.MaxTopic, DefaultMaxTopic)
	def(&l.MaxConns, DefaultMaxConns)
	if l.HandshakeTimeout == 0 {
		l.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if l.WriteTimeout == 0 {
		l.WriteTimeout = DefaultWriteTimeout
	}
	if l.MaxCommand < minCommand {
		return l, fmt.Errorf("%w: MaxCommand %d is below %d", ErrInvalidLimits, l.MaxCommand, minCommand)
	}
	if l.MaxCommand > math.MaxInt32 {
		return l, fmt.Errorf("%w: MaxCommand %d is above 2 GiB", ErrInvalidLimits, l.MaxCommand)
	}
	return l, nil
}

// Policy is what the guard asks the caller. Its functions are called from the
// goroutine reading the connection (zmq4's reader, or the listener's handshake
// goroutine), must be safe for concurrent use and must not block.
type Policy struct {
	// Admit decides whether an accepted peer may speak at all; an error closes the
	// connection before a byte is read (ReasonNotAdmitted). Nil admits every peer.
	Admit func(remote net.Addr) error
	// Message, when set, sees the first frame (the topic) of every inbound data
	// message, on accepted and dialed connections alike. An error drops the whole
	// message (all its frames; ReasonTopicRefused) and the connection stays open.
	// Topic frames longer than Limits.MaxTopic are dropped the same way. The topic
	// slice is only valid during the call.
	Message func(remote net.Addr, topic []byte) error
	// Refused, when set, is called once for every refusal, with its reason, the
	// peer and the error (a *RefusedError, or the Message error / ErrTopicTooLong).
	Refused func(reason Reason, remote net.Addr, err error)
}

// Reason says why the guard refused a connection or a message.
type Reason uint8

// The reasons. All but ReasonTopicRefused close the connection.
const (
	ReasonBadGreeting      Reason = iota + 1 // signature, version or as-server byte
	ReasonBadMechanism                       // security mechanism is not NULL
	ReasonFrameTooLarge                      // data frame above MaxFrame
	ReasonMessageTooLarge                    // message above MaxMessage or MaxParts
	ReasonCommandTooLarge                    // command frame above MaxCommand
	ReasonBadFlags                           // reserved flag bits, or MORE on a command
	ReasonBadCommand                         // malformed command, command inside a message, READY twice
	ReasonBadReady                           // first frame not a well-formed READY
	ReasonIncompatible                       // peer's Socket-Type cannot talk to ours
	ReasonHandshakeTimeout                   // greeting + READY not in HandshakeTimeout
	ReasonHandshakeIO                        // peer hung up (or I/O failed) mid-handshake
	ReasonTooManyConns                       // listener already holds MaxConns
	ReasonNotAdmitted                        // Policy.Admit said no
	ReasonTopicRefused                       // Policy.Message said no, or topic too long
	ReasonWriteTimeout                       // the peer did not take a write within WriteTimeout

	// NumReasons bounds the Reason values, for arrays indexed by them.
	NumReasons
)

const numReasons = NumReasons

var reasonNames = [numReasons]string{
	ReasonBadGreeting:      "bad_greeting",
	ReasonBadMechanism:     "bad_mechanism",
	ReasonFrameTooLarge:    "frame_too_large",
	ReasonMessageTooLarge:  "message_too_large",
	ReasonCommandTooLarge:  "command_too_large",
	ReasonBadFlags:         "bad_flags",
	ReasonBadCommand:       "bad_command",
	ReasonBadReady:         "bad_ready",
	ReasonIncompatible:     "incompatible_peer",
	ReasonHandshakeTimeout: "handshake_timeout",
	ReasonHandshakeIO:      "handshake_io",
	ReasonTooManyConns:     "too_many_conns",
	ReasonNotAdmitted:      "not_admitted",
	ReasonTopicRefused:     "topic_refused",
	ReasonWriteTimeout:     "write_timeout",
}

// String returns the reason's snake_case name, fit for a metric label.
func (r Reason) String() string {
	if r > 0 && r < numReasons {
		return reasonNames[r]
	}
	return "reason(" + strconv.Itoa(int(r)) + ")"
}

// RefusedError is the error a refused connection's Read and Write return, and the
// one given to Policy.Refused. It wraps ErrRefused. It is a net.Error whose Timeout
// is false, so zmq4 treats it as a closed connection and drops the connection.
type RefusedError struct {
	Reason Reason
	Remote net.Addr
	Detail string
}

func (e *RefusedError) Error() string {
	remote := "<nil>"
	if e.Remote != nil {
		remote = e.Remote.String()
	}
	return fmt.Sprintf("zmtpguard: refused %s: %s: %s", remote, e.Reason, e.Detail)
}

// Unwrap returns ErrRefused.
func (e *RefusedError) Unwrap() error { return ErrRefused }

// Timeout is false, even for ReasonHandshakeTimeout: the connection is closed, not
// merely late (zmq4 keeps connections whose errors time out).
func (e *RefusedError) Timeout() bool { return false }

// Temporary is false.
func (e *RefusedError) Temporary() bool { return false }

var _ net.Error = (*RefusedError)(nil)

// Stats is a snapshot of one Transport's counters.
type Stats struct {
	Accepted        uint64            // TCP connections accepted by its listeners
	Dialed          uint64            // TCP connections dialed
	Handshakes      uint64            // peers whose greeting and READY validated
	Open            int64             // guarded connections open now
	CommandsDropped uint64            // valid commands after the handshake (PING, SUBSCRIBE...) kept from zmq4
	Refused         map[Reason]uint64 // refusals by reason; only non-zero entries
}

type counters struct {
	accepted, dialed, handshakes, commandsDropped atomic.Uint64
	open                                          atomic.Int64
	refused                                       [numReasons]atomic.Uint64
}

// Transport is one registered guarded zmq4 transport. Its methods are safe for
// concurrent use.
type Transport struct {
	scheme string
	lim    Limits
	pol    Policy
	c      counters
}

var schemeSeq atomic.Uint64

// Register validates l (zero fields take defaults), registers a new zmq4 transport
// under a fresh name ("kvtcp1", "kvtcp2", ...) and returns it. Sockets use it by
// dialing or listening on the endpoints Endpoint returns; it speaks TCP.
// zmq4 cannot unregister a transport, so register once per configuration, not per
// socket. It returns an error wrapping ErrInvalidLimits for bad limits, or zmq4's
// registration error.
func Register(l Limits, p Policy) (*Transport, error) {
	lim, err := l.resolve()
	if err != nil {
		return nil, err
	}
	t := &Transport{lim: lim, pol: p}
	for {
		t.scheme = "kvtcp" + strconv.FormatUint(schemeSeq.Add(1), 10)
		err := zmq4.RegisterTransport(t.scheme, zmqTransport{t})
		if err == nil {
			return t, nil
		}
		if !strings.Contains(err.Error(), "duplicate transport") {
			return nil, fmt.Errorf("zmtpguard: register %q: %w", t.scheme, err)
		}
	}
}

// Endpoint maps "tcp://host:port" to the guarded scheme; other endpoints are
// returned unchanged.
func (t *Transport) Endpoint(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return t.scheme + "://" + rest
	}
	return ep
}

// Stats returns a snapshot of the counters.
func (t *Transport) Stats() Stats {
	s := Stats{
		Accepted:        t.c.accepted.Load(),
		Dialed:          t.c.dialed.Load(),
		Handshakes:      t.c.handshakes.Load(),
		Open:            t.c.open.Load(),
		CommandsDropped: t.c.commandsDropped.Load(),
		Refused:         make(map[Reason]uint64),
	}
	for r := Reason(1); r < numReasons; r++ {
		if n := t.c.refused[r].Load(); n > 0 {
			s.Refused[r] = n
		}
	}
	return s
}

// refused counts a refusal and tells the policy.
func (t *Transport) refused(r Reason, remote net.Addr, err error) {
	t.c.refused[r].Add(1)
	if t.pol.Refused != nil {
		t.pol.Refused(r, remote, err)
	}
}
