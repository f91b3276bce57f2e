package zmtpguard

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/go-zeromq/zmq4"
)

// inbound is the read side of a guarded connection: a pull parser over the TCP byte
// stream. next parses one step (the greeting, the READY, one frame header with the
// body of a command or topic frame) and either queues the validated bytes in ready
// or, for the body of a data frame, sets left so that read streams it straight
// through. Nothing reaches ready or the caller before the frame's header (and, for
// buffered frames, its body) passed the checks.
//
// Memory is bounded: raw is fixed (rawSize), body holds at most one command or topic
// (MaxCommand or MaxTopic bytes), ready at most a greeting plus a READY.
type inbound struct {
	c   *conn
	lim *Limits

	raw  []byte // read-ahead; raw[r:w] is read but not yet parsed
	r, w int

	ready []byte // validated bytes not yet handed out, from roff
	roff  int

	hdr     [9]byte
	body    []byte // reused buffer of a command or topic frame
	left    int64  // bytes of the current data frame body still to pass (or skip)
	discard bool   // left bytes are skipped, not passed

	greeted, handshook bool
	inMsg              bool  // the last data frame had MORE
	dropping           bool  // the current message was refused by Policy.Message
	parts              int   // frames of the current message so far
	msgBytes           int64 // body bytes of the current message so far
}

// read hands out validated bytes: queued ones first, then the streaming body of a
// data frame, then whatever next produces.
func (in *inbound) read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for {
		if f := in.c.failed.Load(); f != nil {
			return 0, f
		}
		if in.roff < len(in.ready) {
			n := copy(p, in.ready[in.roff:])
			in.roff += n
			return n, nil
		}
		if in.left > 0 && !in.discard {
			k := int(min(int64(len(p)), in.left))
			if in.w > in.r {
				n := copy(p[:k], in.raw[in.r:in.w])
				in.r += n
				in.left -= int64(n)
				return n, nil
			}
			n, err := in.c.nc.Read(p[:k])
			in.left -= int64(n)
			if n > 0 {
				return n, nil
			}
			if err != nil {
				return 0, in.c.ioErr(err)
			}
			continue
		}
		if err := in.next(); err != nil {
			return 0, err
		}
	}
}

func (in *inbound) next() error {
	if in.roff == len(in.ready) {
		in.ready, in.roff = in.ready[:0], 0
	}
	switch {
	case in.left > 0:
		return in.skip()
	case !in.greeted:
		return in.greeting()
	case !in.handshook:
		return in.readyCommand()
	default:
		return in.frame()
	}
}

// fill makes raw hold at least n unparsed bytes (n <= len(raw)).
func (in *inbound) fill(n int) error {
	for in.w-in.r < n {
		if in.r == in.w {
			in.r, in.w = 0, 0
		} else if len(in.raw)-in.r < n {
			in.w = copy(in.raw, in.raw[in.r:in.w])
			in.r = 0
		}
		m, err := in.c.nc.Read(in.raw[in.w:])
		in.w += m
		if in.w-in.r >= n {
			return nil
		}
		if err != nil {
			return in.c.ioErr(err)
		}
	}
	return nil
}

func (in *inbound) refuse(r Reason, format string, args ...any) error {
	return in.c.refuse(r, format, args...)
}

// greeting checks the peer's 64-byte greeting, rejecting non-ZMTP bytes as soon as
// the first byte that proves it arrives.
func (in *inbound) greeting() error {
	if err := in.fill(1); err != nil {
		return err
	}
	if b := in.raw[in.r]; b != 0xFF {
		return in.refuse(ReasonBadGreeting, "signature starts with %#02x, not 0xff", b)
	}
	if err := in.fill(11); err != nil {
		return err
	}
	if b := in.raw[in.r+9]; b != 0x7F {
		return in.refuse(ReasonBadGreeting, "signature ends with %#02x, not 0x7f", b)
	}
	if v := in.raw[in.r+10]; v != 3 {
		return in.refuse(ReasonBadGreeting, "ZMTP major version %d, want 3", v)
	}
	if err := in.fill(greetingLen); err != nil {
		return err
	}
	g := in.raw[in.r : in.r+greetingLen]
	if !bytes.Equal(g[12:32], nullMechanism[:]) {
		return in.refuse(ReasonBadMechanism, "mechanism %q, want NULL", bytes.TrimRight(g[12:32], "\x00"))
	}
	if g[32] > 1 {
		return in.refuse(ReasonBadGreeting, "as-server byte %#02x", g[32])
	}
	in.ready = append(in.ready, g...)
	in.r += greetingLen
	in.greeted = true
	return nil
}

// header reads and checks one frame header; it returns the header bytes (valid
// until the next call), the flags and the declared size.
func (in *inbound) header() ([]byte, byte, uint64, error) {
	if err := in.fill(1); err != nil {
		return nil, 0, 0, err
	}
	fl := in.raw[in.r]
	if fl&flagReserved != 0 {
		return nil, 0, 0, in.refuse(ReasonBadFlags, "reserved flag bits set (%#02x)", fl)
	}
	n := 2
	if fl&flagLong != 0 {
		n = 9
	}
	if err := in.fill(n); err != nil {
		return nil, 0, 0, err
	}
	h := in.hdr[:n]
	copy(h, in.raw[in.r:in.r+n])
	in.r += n
	size := uint64(h[1])
	if n == 9 {
		size = binary.BigEndian.Uint64(h[1:])
	}
	return h, fl, size, nil
}

// readBody reads a whole frame body of n bytes, n already checked against a limit.
func (in *inbound) readBody(n int) ([]byte, error) {
	if cap(in.body) < n {
		in.body = make([]byte, n)
	}
	b := in.body[:n]
	k := copy(b, in.raw[in.r:in.w])
	in.r += k
	for k < n {
		m, err := in.c.nc.Read(b[k:])
		k += m
		if k < n && err != nil {
			return nil, in.c.ioErr(err)
		}
	}
	return b, nil
}

// command reads and checks a command frame's header fields and body.
func (in *inbound) command(fl byte, size uint64) ([]byte, []byte, error) {
	if fl&flagMore != 0 {
		return nil, nil, in.refuse(ReasonBadFlags, "MORE flag set on a command frame")
	}
	if size > uint64(in.lim.MaxCommand) {
		return nil, nil, in.refuse(ReasonCommandTooLarge, "command frame of %d bytes exceeds MaxCommand %d", size, in.lim.MaxCommand)
	}
	body, err := in.readBody(int(size))
	if err != nil {
		return nil, nil, err
	}
	name, _, err := parseCommand(body)
	if err != nil {
		return nil, nil, in.refuse(ReasonBadCommand, "%v", err)
	}
	return body, name, nil
}

// readyCommand checks the frame after the greeting: a READY whose properties fill
// its body exactly and name a Socket-Type.
func (in *inbound) readyCommand() error {
	h, fl, size, err := in.header()
	if err != nil {
		return err
	}
	if fl&flagCommand == 0 {
		return in.refuse(ReasonBadReady, "first frame after the greeting is not a command")
	}
	hdrLen := len(h)
	var hdr [9]byte
	copy(hdr[:], h)
	body, name, err := in.command(fl, size)
	if err != nil {
		return err
	}
	if string(name) != zmq4.CmdReady {
		return in.refuse(ReasonBadReady, "first command is %q, not READY", name)
	}
	typ, err := parseProperties(body[1+len(name):])
	if err != nil {
		return in.refuse(ReasonBadReady, "%v", err)
	}
	if err := in.c.setType(true, typ); err != nil {
		return err
	}
	in.ready = append(in.ready, hdr[:hdrLen]...)
	in.ready = append(in.ready, body...)
	in.handshook = true
	in.c.t.c.handshakes.Add(1)
	if !in.c.server {
		// The dialer's handshake deadline; the listener clears its own.
		if err := in.c.nc.SetReadDeadline(time.Time{}); err != nil {
			return in.c.ioErr(err)
		}
	}
	return nil
}

// frame handles one frame after the handshake.
func (in *inbound) frame() error {
	h, fl, size, err := in.header()
	if err != nil {
		return err
	}
	if fl&flagCommand != 0 {
		if in.inMsg {
			return in.refuse(ReasonBadCommand, "command frame inside a multi-frame message")
		}
		_, name, err := in.command(fl, size)
		if err != nil {
			return err
		}
		if string(name) == zmq4.CmdReady {
			return in.refuse(ReasonBadCommand, "READY after the handshake")
		}
		// zmq4 acts on no command after the handshake; its socket readers would hand
		// it to the application (or, on PUB, wedge), so it goes no further.
		in.c.t.c.commandsDropped.Add(1)
		return nil
	}
	if size > uint64(in.lim.MaxFrame) {
		return in.refuse(ReasonFrameTooLarge, "data frame of %d bytes exceeds MaxFrame %d", size, in.lim.MaxFrame)
	}
	first := !in.inMsg
	if first {
		in.parts, in.msgBytes, in.dropping = 0, 0, false
	}
	in.parts++
	if in.parts > in.lim.MaxParts {
		return in.refuse(ReasonMessageTooLarge, "message of more than MaxParts %d frames", in.lim.MaxParts)
	}
	if int64(size) > in.lim.MaxMessage-in.msgBytes {
		return in.refuse(ReasonMessageTooLarge, "message of more than MaxMessage %d bytes", in.lim.MaxMessage)
	}
	in.msgBytes += int64(size)
	in.inMsg = fl&flagMore != 0

	if first && in.c.t.pol.Message != nil {
		if size > uint64(in.lim.MaxTopic) {
			in.refuseTopic(fmt.Errorf("%w: %d bytes, MaxTopic %d", ErrTopicTooLong, size, in.lim.MaxTopic))
			in.left, in.discard = int64(size), true
			return nil
		}
		var hdr [9]byte
		hdrLen := copy(hdr[:], h)
		topic, err := in.readBody(int(size))
		if err != nil {
			return err
		}
		if err := in.c.t.pol.Message(in.c.remote, topic); err != nil {
			in.refuseTopic(err)
			return nil
		}
		in.ready = append(in.ready, hdr[:hdrLen]...)
		in.ready = append(in.ready, topic...)
		return nil
	}
	in.left, in.discard = int64(size), in.dropping
	if !in.dropping {
		in.ready = append(in.ready, h...)
	}
	return nil
}

// refuseTopic drops the current message and counts it; the connection stays open.
func (in *inbound) refuseTopic(err error) {
	in.dropping = true
	in.c.t.refused(ReasonTopicRefused, in.c.remote, err)
}

// skip discards the rest of a dropped data frame.
func (in *inbound) skip() error {
	for in.left > 0 {
		if in.w > in.r {
			k := int(min(int64(in.w-in.r), in.left))
			in.r += k
			in.left -= int64(k)
			continue
		}
		m, err := in.c.nc.Read(in.raw)
		in.r, in.w = 0, m
		if m == 0 && err != nil {
			return in.c.ioErr(err)
		}
	}
	in.discard = false
	return nil
}

// parseCommand splits a command body into its name and data (RFC 23: a name of 1 to
// 255 ALPHA characters, length-prefixed).
func parseCommand(body []byte) (name, data []byte, err error) {
	if len(body) == 0 {
		return nil, nil, errors.New("empty command frame")
	}
	n := int(body[0])
	if n == 0 {
		return nil, nil, errors.New("empty command name")
	}
	if n > len(body)-1 {
		return nil, nil, fmt.Errorf("command name length %d past the end of a %d-byte frame", n, len(body))
	}
	name = body[1 : 1+n]
	for _, b := range name {
		if !(b >= 'A' && b <= 'Z' || b >= 'a' && b <= 'z') {
			return nil, nil, fmt.Errorf("command name %q is not alphabetic", name)
		}
	}
	return name, body[1+n:], nil
}

// parseReady parses a whole READY command body and returns its Socket-Type.
func parseReady(body []byte) (string, error) {
	name, data, err := parseCommand(body)
	if err != nil {
		return "", err
	}
	if string(name) != zmq4.CmdReady {
		return "", fmt.Errorf("command %q is not READY", name)
	}
	return parseProperties(data)
}

const socketTypeProp = "Socket-Type"

// parseProperties checks READY metadata: properties (name length, name, 4-byte
// value length, value) that fill p exactly, with exactly one Socket-Type naming a
// known socket type. zmq4 looks the property up by this exact spelling, which
// libzmq, JeroMQ and zmq4 all send.
func parseProperties(p []byte) (string, error) {
	var (
		typ   string
		found bool
	)
	for len(p) > 0 {
		n := int(p[0])
		p = p[1:]
		if n == 0 {
			return "", errors.New("empty property name")
		}
		if n > len(p) {
			return "", fmt.Errorf("property name length %d past the end of the READY", n)
		}
		name := p[:n]
		p = p[n:]
		for _, b := range name {
			if !isNameChar(b) {
				return "", fmt.Errorf("property name %q has a character outside [A-Za-z0-9-_.+]", name)
			}
		}
		if len(p) < 4 {
			return "", fmt.Errorf("value length of property %q past the end of the READY", name)
		}
		v := binary.BigEndian.Uint32(p)
		p = p[4:]
		if uint64(v) > uint64(len(p)) {
			return "", fmt.Errorf("value of property %q (%d bytes) past the end of the READY", name, v)
		}
		value := p[:v]
		p = p[v:]
		if bytes.EqualFold(name, []byte(socketTypeProp)) {
			if string(name) != socketTypeProp {
				return "", fmt.Errorf("property %q must be spelled %s", name, socketTypeProp)
			}
			if found {
				return "", errors.New("two Socket-Type properties")
			}
			typ, found = string(value), true
		}
	}
	if !found {
		return "", errors.New("no Socket-Type property")
	}
	switch zmq4.SocketType(typ) {
	case zmq4.Pair, zmq4.Pub, zmq4.Sub, zmq4.Req, zmq4.Rep, zmq4.Dealer, zmq4.Router,
		zmq4.Pull, zmq4.Push, zmq4.XPub, zmq4.XSub:
		return typ, nil
	}
	return "", fmt.Errorf("unknown Socket-Type %q", typ)
}

func isNameChar(b byte) bool {
	return b >= 'A' && b <= 'Z' || b >= 'a' && b <= 'z' || b >= '0' && b <= '9' ||
		b == '-' || b == '_' || b == '.' || b == '+'
}
