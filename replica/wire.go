package replica

import (
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"unsafe"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/internal/binfmt"
	"github.com/kvselect/kvselect/selection"
)

// WireVersion is the format version a Replicator writes and the only one it
// reads.
const WireVersion = 2

// The format, version 2 (version 1 had no session), in internal/binfmt's
// encoding (little-endian integers; uv a uvarint, str a length-prefixed
// string).
//
//	message  magic "KVSR" | version u8 | type u8 | body
//	batch    type 1: flags u8 (bit 0 resync) | origin str | epoch u64 | seq uv | count uv | count x op
//	op       kind u8 | id str | then by kind:
//	           1 booked:  model str | worker str | rank uv | hashes: count uv, count x u64 |
//	                      private blocks uv | prefill tokens uv | expected output uv |
//	                      lease ms uv | remaining lease ms uv | session str
//	           2 settled: settlement u8 (1 prefill, 2 renew, 3 free, 4 one output block)
//	request  type 2: requester str | after str
//	page     type 3: flags u8 (bit 0 more) | origin str | epoch u64 | seq uv | count uv | count x booked op
//
// Bounds checked by every decode: the whole message is at most the
// receiver's MaxMessageBytes; origin and requester are valid replica IDs; id,
// model, worker and after are at most maxStr bytes, session at most
// selection.MaxSessionIDLen, id and worker non-empty;
// rank, private blocks, prefill and expected tokens and both leases at most
// math.MaxInt32; counts at most what the remaining bytes can hold; no byte
// after the body. A heartbeat is a batch with no ops.
const (
	wireMagic = "KVSR"

	msgBatch   = 1
	msgRequest = 2
	msgPage    = 3

	opBooked  = 1
	opSettled = 2

	flagResync = 1 << 0 // batch: take a snapshot of me
	flagMore   = 1 << 0 // page: ask again after the last entry

	maxStr    = 1024
	maxNumber = math.MaxInt32

	// headerReserve covers a batch or page header (magic, version, type,
	// flags, origin, epoch, seq, count) with room to spare.
	headerReserve = 128
	minSettledOp  = 4 // kind, id length, one id byte, settlement
	minBookedOp   = 1 + 2 + 1 + 2 + 1 + 1 + 5 + 1
)

// Decode errors. Every error of a decode wraps exactly one of them (binfmt's
// are mapped: see reader.end).
var (
	errTooLarge  = errors.New("replica: message exceeds MaxMessageBytes")
	errMagic     = errors.New("replica: not a replica message")
	errVersion   = errors.New("replica: unsupported wire version")
	errType      = errors.New("replica: unexpected message type")
	errTruncated = errors.New("replica: truncated message")
	errTrailing  = errors.New("replica: bytes after the message")
	errField     = errors.New("replica: field out of range")
)

// wireOp is one decoded operation.
type wireOp struct {
	kind        byte
	how         selection.Settlement
	id          string
	model       string
	worker      catalog.WorkerRank
	hashes      []uint64 // into the decoder's flat buffer
	hoff, hn    int      // where hashes are in it
	private     int
	prefill     int
	expected    int
	leaseMS     int64
	remainingMS int64
	session     string
}

// wireBatch is a decoded batch, reused across decodes.
type wireBatch struct {
	flags  byte
	origin string
	epoch  uint64
	seq    uint64
	ops    []wireOp
	flat   []uint64
}

// snapRequest is a decoded snapshot request.
type snapRequest struct {
	requester string
	after     string
}

// snapPage is a decoded snapshot page.
type snapPage struct {
	more    bool
	origin  string
	epoch   uint64
	seq     uint64
	entries []wireOp
	flat    []uint64
}

// --- encoding -------------------------------------------------------------

func appendHeader(dst []byte, typ byte) []byte {
	dst = append(dst, wireMagic...)
	return append(dst, WireVersion, typ)
}

// appendBatchHeader starts a batch of count ops.
func appendBatchHeader(dst []byte, flags byte, origin string, epoch, seq uint64, count int) []byte {
	return appendStreamHeader(dst, msgBatch, flags, origin, epoch, seq, count)
}

// appendStreamHeader starts a batch or a page, whose headers differ only in
// type and flags.
func appendStreamHeader(dst []byte, typ, flags byte, origin string, epoch, seq uint64, count int) []byte {
	dst = appendHeader(dst, typ)
	dst = append(dst, flags)
	dst = binfmt.AppendString(dst, origin)
	dst = binary.LittleEndian.AppendUint64(dst, epoch)
	dst = binary.AppendUvarint(dst, seq)
	return binary.AppendUvarint(dst, uint64(count))
}

// booked is the content of a booked op, as the encoder takes it.
type booked struct {
	id, model   string
	worker      catalog.WorkerRank
	hashes      []uint64
	private     int
	prefill     int
	expected    int
	leaseMS     int64
	remainingMS int64
	session     string
}

func (b *booked) size() int {
	return 1 + binfmt.StringLen(b.id) + binfmt.StringLen(b.model) + binfmt.StringLen(b.worker.WorkerID) +
		binfmt.UvarintLen(uint64(b.worker.Rank)) + binfmt.UvarintLen(uint64(len(b.hashes))) + 8*len(b.hashes) +
		binfmt.UvarintLen(uint64(b.private)) + binfmt.UvarintLen(uint64(b.prefill)) +
		binfmt.UvarintLen(uint64(b.expected)) + binfmt.UvarintLen(uint64(b.leaseMS)) +
		binfmt.UvarintLen(uint64(b.remainingMS)) + binfmt.StringLen(b.session)
}

// sendable reports whether every field of b is within the decoder's bounds.
func (b *booked) sendable() bool {
	return b.id != "" && len(b.id) <= maxStr && len(b.model) <= maxStr && b.worker.WorkerID != "" &&
		len(b.worker.WorkerID) <= maxStr && inNumber(b.worker.Rank) && inNumber(b.private) &&
		inNumber(b.prefill) && inNumber(b.expected) && b.leaseMS >= 0 && b.leaseMS <= maxNumber &&
		b.remainingMS >= 0 && b.remainingMS <= maxNumber && len(b.session) <= selection.MaxSessionIDLen
}

func inNumber(n int) bool { return n >= 0 && n <= maxNumber }

func appendBooked(dst []byte, b *booked) []byte {
	dst = append(dst, opBooked)
	dst = binfmt.AppendString(dst, b.id)
	dst = binfmt.AppendString(dst, b.model)
	dst = binfmt.AppendString(dst, b.worker.WorkerID)
	dst = binary.AppendUvarint(dst, uint64(b.worker.Rank))
	dst = binary.AppendUvarint(dst, uint64(len(b.hashes)))
	dst = appendHashes(dst, b.hashes)
	dst = binary.AppendUvarint(dst, uint64(b.private))
	dst = binary.AppendUvarint(dst, uint64(b.prefill))
	dst = binary.AppendUvarint(dst, uint64(b.expected))
	dst = binary.AppendUvarint(dst, uint64(b.leaseMS))
	dst = binary.AppendUvarint(dst, uint64(b.remainingMS))
	return binfmt.AppendString(dst, b.session)
}

// littleEndian is true when uint64 values are laid out little-endian in
// memory, so hashes are copied to and from the wire as bytes.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

func appendHashes(dst []byte, hs []uint64) []byte {
	if len(hs) == 0 {
		return dst
	}
	if littleEndian {
		return append(dst, unsafe.Slice((*byte)(unsafe.Pointer(&hs[0])), 8*len(hs))...)
	}
	n := len(dst)
	dst = slices.Grow(dst, 8*len(hs))[:n+8*len(hs)]
	for i, h := range hs {
		binary.LittleEndian.PutUint64(dst[n+8*i:], h)
	}
	return dst
}

func settledSize(id string) int { return 1 + binfmt.StringLen(id) + 1 }

func appendSettled(dst []byte, id string, how selection.Settlement) []byte {
	dst = append(dst, opSettled)
	dst = binfmt.AppendString(dst, id)
	return append(dst, byte(how))
}

func appendRequest(dst []byte, requester, after string) []byte {
	dst = appendHeader(dst, msgRequest)
	dst = binfmt.AppendString(dst, requester)
	return binfmt.AppendString(dst, after)
}

func appendPageHeader(dst []byte, more bool, origin string, epoch, seq uint64, count int) []byte {
	var flags byte
	if more {
		flags |= flagMore
	}
	return appendStreamHeader(dst, msgPage, flags, origin, epoch, seq, count)
}

// --- decoding -------------------------------------------------------------

// reader consumes a message's body; the first error sticks (binfmt.Decoder's
// latch), and end maps it to the wire's sentinels.
type reader struct{ binfmt.Decoder }

func newReader(body []byte) reader { return reader{binfmt.NewDecoder(body)} }

// hashes appends n little-endian u64s to *flat.
func (r *reader) hashes(n int, flat *[]uint64) {
	if r.Err() != nil || n == 0 {
		return
	}
	b := r.Next(8 * n)
	if b == nil {
		return
	}
	start := len(*flat)
	*flat = slices.Grow(*flat, n)[:start+n]
	if littleEndian {
		copy(unsafe.Slice((*byte)(unsafe.Pointer(&(*flat)[start])), 8*n), b)
	} else {
		for i := range n {
			(*flat)[start+i] = binary.LittleEndian.Uint64(b[8*i:])
		}
	}
}

func (r *reader) num() int { return int(r.Uvarint(maxNumber)) }

// replicaID reads a replica ID.
func (r *reader) replicaID() string {
	s := r.String(MaxIDLen)
	if r.Err() == nil && !validToken(s, MaxIDLen) {
		r.Fail(errField)
	}
	return s
}

// header checks the envelope and returns the message type and its body.
func header(data []byte, maxBytes int) (byte, []byte, error) {
	if len(data) > maxBytes {
		return 0, nil, errTooLarge
	}
	if len(data) < len(wireMagic)+2 {
		if len(data) >= len(wireMagic) && string(data[:len(wireMagic)]) != wireMagic {
			return 0, nil, errMagic
		}
		return 0, nil, errTruncated
	}
	if string(data[:len(wireMagic)]) != wireMagic {
		return 0, nil, errMagic
	}
	if data[len(wireMagic)] != WireVersion {
		return 0, nil, errVersion
	}
	return data[len(wireMagic)+1], data[len(wireMagic)+2:], nil
}

// op reads one op into o, its hashes appended to *flat (o.hashes is set by
// ops once flat stops growing).
func (r *reader) op(o *wireOp, flat *[]uint64, onlyBooked bool) {
	*o = wireOp{kind: r.U8()}
	o.id = r.String(maxStr)
	if r.Err() == nil && o.id == "" {
		r.Fail(errField)
	}
	switch {
	case r.Err() != nil:
	case o.kind == opBooked:
		o.model = r.String(maxStr)
		o.worker.WorkerID = r.String(maxStr)
		if r.Err() == nil && o.worker.WorkerID == "" {
			r.Fail(errField)
		}
		o.worker.Rank = r.num()
		n := r.Count(8)
		o.hoff, o.hn = len(*flat), n
		r.hashes(n, flat)
		o.private, o.prefill, o.expected = r.num(), r.num(), r.num()
		o.leaseMS, o.remainingMS = int64(r.num()), int64(r.num())
		o.session = r.String(selection.MaxSessionIDLen)
	case o.kind == opSettled && !onlyBooked:
		o.how = selection.Settlement(r.U8())
		if r.Err() == nil && (o.how < selection.SettlePrefill || o.how > selection.SettleOutputBlock) {
			r.Fail(errField)
		}
	default:
		r.Fail(errField)
	}
}

// ops reads count ops into *ops and their hashes into *flat (both reused).
func (r *reader) ops(ops *[]wireOp, flat *[]uint64, onlyBooked bool) {
	minSize := minSettledOp
	if onlyBooked {
		minSize = minBookedOp
	}
	n := r.Count(minSize)
	*ops, *flat = (*ops)[:0], (*flat)[:0]
	for i := 0; i < n && r.Err() == nil; i++ {
		*ops = append(*ops, wireOp{})
		r.op(&(*ops)[i], flat, onlyBooked)
	}
	if r.Err() != nil {
		*ops = (*ops)[:0]
		return
	}
	for i := range *ops {
		if o := &(*ops)[i]; o.kind == opBooked {
			o.hashes = (*flat)[o.hoff : o.hoff+o.hn : o.hoff+o.hn]
		}
	}
}

// end checks that the body is consumed and returns the first error as the
// wire's sentinel: the body ending inside a value is errTruncated, bytes
// after it errTrailing, a varint over 64 bits or over its bound (a length,
// a count) errField; the reader's own (errField) as they are.
func (r *reader) end() error {
	err := r.End()
	switch {
	case err == nil:
		return nil
	case errors.Is(err, binfmt.ErrTruncated):
		return errTruncated
	case errors.Is(err, binfmt.ErrTrailing):
		return errTrailing
	case errors.Is(err, binfmt.ErrOverflow), errors.Is(err, binfmt.ErrRange):
		return errField
	}
	return err
}

// decodeBatch decodes a batch message into dst (whose buffers it reuses).
func decodeBatch(data []byte, maxBytes int, dst *wireBatch) error {
	typ, body, err := header(data, maxBytes)
	if err != nil {
		return err
	}
	if typ != msgBatch {
		return errType
	}
	r := newReader(body)
	dst.flags = r.U8()
	dst.origin = r.replicaID()
	dst.epoch = r.U64()
	dst.seq = r.Uvarint(math.MaxUint64)
	r.ops(&dst.ops, &dst.flat, false)
	return r.end()
}

// decodeRequest decodes a snapshot request.
func decodeRequest(data []byte, maxBytes int) (snapRequest, error) {
	typ, body, err := header(data, maxBytes)
	if err != nil {
		return snapRequest{}, err
	}
	if typ != msgRequest {
		return snapRequest{}, errType
	}
	r := newReader(body)
	q := snapRequest{requester: r.replicaID(), after: r.String(maxStr)}
	return q, r.end()
}

// decodePage decodes a snapshot page into dst (whose buffers it reuses).
func decodePage(data []byte, maxBytes int, dst *snapPage) error {
	typ, body, err := header(data, maxBytes)
	if err != nil {
		return err
	}
	if typ != msgPage {
		return errType
	}
	r := newReader(body)
	dst.more = r.U8()&flagMore != 0
	dst.origin = r.replicaID()
	dst.epoch = r.U64()
	dst.seq = r.Uvarint(math.MaxUint64)
	r.ops(&dst.entries, &dst.flat, true)
	return r.end()
}
