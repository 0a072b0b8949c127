// Package wire is the byte format of the live-migration transport
// (package tcp): the hello and reply that open each connection, and the
// records that follow. Every decoder here takes untrusted bytes.
package wire

// The TCP transport carries one checkpoint stream from a sender (capture,
// checkpoint, migrate) to a receiver (receive, serve/restore --from tcp://)
// over N parallel connections, one shard of the stream each. It is never
// open to the network: every connection is TLS 1.3, and each side proves
// that it holds the shared token with an HMAC over the TLS exporter, so the
// proof is bound to that one channel (a captured proof is worth nothing on
// another connection, and a man in the middle holds two channels with two
// exporters). Certificates (--tls-cert/--tls-key/--tls-ca) can replace or
// complement the token.
//
// Per connection, after the TLS handshake:
//
//	sender -> receiver  hello (64 bytes, below)
//	receiver -> sender  reply (50 bytes + refusal text)
//	sender -> receiver  records: DATA... EOS               the shard's bytes
//	receiver -> sender  ACK (or NAK)     every shard ended and the whole stream verified
//	sender -> receiver  COMMIT (or ABORT), connection 0    the source process is gone
//	receiver -> sender  REPORT, connection 0               restored PID, or why not
//
// Hello: "GPUCRMIG", u16 version (1), u16 flags, u16 shard index, u16 shard
// count, 16-byte session id, 32-byte proof = HMAC-SHA256(token, "gpucr-stream
// migrate v1 client" || exporter || hello[0:32]).
//
// Reply: "GPUCRMIG", u16 version, u16 status (0 accepted, 1 refused), u32
// flags (1: the receiver reports, 2: it restores), 32-byte proof =
// HMAC-SHA256(token, "gpucr-stream migrate v1 server" || exporter || hello ||
// reply[0:16]) (zero when refused), u16 length and the refusal text.
//
// Record: u8 type, 3 zero bytes, u32 length, then length bytes. All
// integers are little-endian. The exporter is 32 bytes of
// ExportKeyingMaterial("EXPORTER-gpucr-stream-migrate", nil, 32).

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"
)

const (
	// Magic opens every hello and reply.
	Magic = "GPUCRMIG"
	// Version is the protocol version both sides must speak.
	Version = 1
	// HelloSize and ReplyFixed are the sizes of a hello and of a reply's
	// fixed part; MaxRefusal bounds a refusal's text.
	HelloSize  = 64
	ReplyFixed = 50
	MaxRefusal = 1024
	// ExporterLabel is the TLS exporter label the proofs are bound to.
	ExporterLabel = "EXPORTER-gpucr-stream-migrate"
	// MaxStreams bounds a sender's connections.
	MaxStreams = 64

	// RecHeaderSize is a record header's size; the others bound records.
	RecHeaderSize    = 8
	MaxDataRecord    = 1 << 20
	MaxControlRecord = 64 << 10
)

// Record types. Sender to receiver: data, eos, abort, commit; receiver to
// sender: ack, nak, report.
const (
	RecData   = 1
	RecEOS    = 2
	RecAbort  = 3
	RecCommit = 4
	RecChunk  = 5 // pre-copy: a chunk for the receiver's cache (chunk.go)
	RecRef    = 6 // a DATA frame by reference to a cached chunk (chunk.go)
	RecAck    = 16
	RecNak    = 17
	RecReport = 18
)

// Reply flags.
const (
	ReplyReports  = 1
	ReplyRestores = 2
	// ReplyChunkCache: the receiver keeps CHUNK records and reads REF
	// records (pre-copy).
	ReplyChunkCache = 4
)

// Hello opens every connection of a sender.
type Hello struct {
	Flags   uint16
	Shard   uint16
	Count   uint16
	Session [16]byte
	Proof   [32]byte
}

// Marshal encodes the hello.
func (h Hello) Marshal() []byte {
	b := make([]byte, HelloSize)
	copy(b, Magic)
	binary.LittleEndian.PutUint16(b[8:], Version)
	binary.LittleEndian.PutUint16(b[10:], h.Flags)
	binary.LittleEndian.PutUint16(b[12:], h.Shard)
	binary.LittleEndian.PutUint16(b[14:], h.Count)
	copy(b[16:32], h.Session[:])
	copy(b[32:64], h.Proof[:])
	return b
}

// ParseHello decodes and checks a hello.
func ParseHello(b []byte) (Hello, error) {
	var h Hello
	if len(b) != HelloSize {
		return h, fmt.Errorf("Hello of %d bytes, want %d", len(b), HelloSize)
	}
	if string(b[:8]) != Magic {
		return h, errors.New("not a gpucr-stream sender (bad Hello magic)")
	}
	if v := binary.LittleEndian.Uint16(b[8:]); v != Version {
		return h, fmt.Errorf("sender speaks protocol version %d; this receiver speaks %d (use the same gpucr-stream version on both sides)", v, Version)
	}
	h.Flags = binary.LittleEndian.Uint16(b[10:])
	h.Shard = binary.LittleEndian.Uint16(b[12:])
	h.Count = binary.LittleEndian.Uint16(b[14:])
	copy(h.Session[:], b[16:32])
	copy(h.Proof[:], b[32:64])
	if h.Count == 0 || h.Count > MaxStreams || h.Shard >= h.Count {
		return h, fmt.Errorf("Hello names stream %d of %d (want 1..%d streams)", h.Shard, h.Count, MaxStreams)
	}
	if h.Session == ([16]byte{}) {
		return h, errors.New("Hello with an empty session id")
	}
	return h, nil
}

// Reply answers a hello: accepted (with the receiver's proof) or refused.
type Reply struct {
	Refused bool
	Flags   uint32
	Proof   [32]byte
	Message string
}

// Marshal encodes the reply; a long message is cut to MaxRefusal bytes.
func (r Reply) Marshal() []byte {
	msg := r.Message
	if len(msg) > MaxRefusal {
		msg = msg[:MaxRefusal]
	}
	b := make([]byte, ReplyFixed+len(msg))
	copy(b, Magic)
	binary.LittleEndian.PutUint16(b[8:], Version)
	if r.Refused {
		binary.LittleEndian.PutUint16(b[10:], 1)
	}
	binary.LittleEndian.PutUint32(b[12:], r.Flags)
	copy(b[16:48], r.Proof[:])
	binary.LittleEndian.PutUint16(b[48:], uint16(len(msg)))
	copy(b[50:], msg)
	return b
}

// ReadReply reads and checks a reply; fixed is its first ReplyFixed bytes
// (covered by the receiver's proof).
func ReadReply(r io.Reader) (rep Reply, fixed []byte, err error) {
	fixed = make([]byte, ReplyFixed)
	if _, err := io.ReadFull(r, fixed); err != nil {
		return rep, nil, fmt.Errorf("no Reply from the receiver: %w", err)
	}
	if string(fixed[:8]) != Magic {
		return rep, nil, errors.New("the peer is not a gpucr-stream receiver (bad Reply magic)")
	}
	if v := binary.LittleEndian.Uint16(fixed[8:]); v != Version {
		return rep, nil, fmt.Errorf("receiver speaks protocol version %d, this sender %d", v, Version)
	}
	switch binary.LittleEndian.Uint16(fixed[10:]) {
	case 0:
	case 1:
		rep.Refused = true
	default:
		return rep, nil, errors.New("Reply with an unknown status")
	}
	rep.Flags = binary.LittleEndian.Uint32(fixed[12:])
	copy(rep.Proof[:], fixed[16:48])
	n := int(binary.LittleEndian.Uint16(fixed[48:]))
	if n > MaxRefusal {
		return rep, nil, fmt.Errorf("Reply message of %d bytes", n)
	}
	msg := make([]byte, n)
	if _, err := io.ReadFull(r, msg); err != nil {
		return rep, nil, fmt.Errorf("Reply message: %w", err)
	}
	rep.Message = Printable(string(msg))
	return rep, fixed, nil
}

// Printable keeps a peer's text from carrying control characters into logs.
// It never makes the text longer, so a bound checked on the bytes read
// holds for what is shown: a byte that is not UTF-8 becomes '?', where
// strings.Map would write the three-byte U+FFFD.
func Printable(s string) string {
	var b strings.Builder
	b.Grow(len(s))
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			b.WriteByte('?')
		case r < 0x20 || r == 0x7f:
			b.WriteByte(' ')
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

// RecordHeader opens every record.
type RecordHeader struct {
	Type uint8
	Len  uint32
}

// PutRecordHeader encodes a record header into b[:RecHeaderSize].
func PutRecordHeader(b []byte, typ uint8, n int) {
	b[0], b[1], b[2], b[3] = typ, 0, 0, 0
	binary.LittleEndian.PutUint32(b[4:], uint32(n))
}

// ParseRecordHeader checks a record header against the types one direction
// may carry.
func ParseRecordHeader(b []byte, fromSender bool) (RecordHeader, error) {
	h := RecordHeader{Type: b[0], Len: binary.LittleEndian.Uint32(b[4:])}
	if b[1]|b[2]|b[3] != 0 {
		return h, errors.New("record header with non-zero reserved bytes")
	}
	limit := uint32(MaxControlRecord)
	switch h.Type {
	case RecData:
		limit = MaxDataRecord
		if !fromSender {
			return h, errors.New("DATA record from the receiver")
		}
	case RecEOS:
		limit = 0
		if !fromSender {
			return h, errors.New("EOS record from the receiver")
		}
	case RecChunk, RecRef:
		limit = ChunkFixed + MaxChunkStored
		if h.Type == RecRef {
			limit = RefSize
		}
		if !fromSender {
			return h, fmt.Errorf("record type %d from the receiver", h.Type)
		}
	case RecAbort, RecCommit:
		if !fromSender {
			return h, fmt.Errorf("record type %d from the receiver", h.Type)
		}
	case RecAck, RecNak, RecReport:
		if fromSender {
			return h, fmt.Errorf("record type %d from the sender", h.Type)
		}
	default:
		return h, fmt.Errorf("unknown record type %d", h.Type)
	}
	if h.Len > limit {
		return h, fmt.Errorf("record type %d of %d bytes (limit %d)", h.Type, h.Len, limit)
	}
	return h, nil
}

// ReadRecord reads one control record (DATA is streamed by ShardReader).
func ReadRecord(r io.Reader, fromSender bool) (RecordHeader, []byte, error) {
	var hb [RecHeaderSize]byte
	if _, err := io.ReadFull(r, hb[:]); err != nil {
		return RecordHeader{}, nil, err
	}
	h, err := ParseRecordHeader(hb[:], fromSender)
	if err != nil {
		return h, nil, err
	}
	if h.Type == RecData || h.Type == RecChunk || h.Type == RecRef {
		return h, nil, fmt.Errorf("record type %d where a control record belongs", h.Type)
	}
	p := make([]byte, h.Len)
	if _, err := io.ReadFull(r, p); err != nil {
		return h, nil, fmt.Errorf("record type %d: %w", h.Type, UnexpectedEOF(err))
	}
	return h, p, nil
}

// WriteRecord writes one record in one Write.
func WriteRecord(w io.Writer, typ uint8, payload []byte) error {
	b := make([]byte, RecHeaderSize+len(payload))
	PutRecordHeader(b, typ, len(payload))
	copy(b[RecHeaderSize:], payload)
	_, err := w.Write(b)
	return err
}

// UnexpectedEOF is err, io.ErrUnexpectedEOF where a record was cut short.
func UnexpectedEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// ShardReader gives the bytes of a connection's DATA records as one
// stream, up to the EOS record (io.EOF). The control records that follow
// are read from the same buffered reader.
type ShardReader struct {
	br     *bufio.Reader
	left   uint32
	eos    bool
	err    error
	counts *atomic.Int64
	// conn, when set, gets a read deadline of idle before every read.
	conn net.Conn
	idle time.Duration
	// Pre-copy (chunk.go): chunks takes each CHUNK record, ref gives the
	// payload of the frame a REF record stands for. The frame's header and
	// then that payload (never written to; lendable: the cache's own bytes)
	// are read before the next record.
	chunks         func(Chunk) error
	alloc          func(n int) []byte
	ref            func(hdr []byte) (payload []byte, lendable bool, err error)
	begin          func()
	begun          bool
	pending, after []byte
	afterLendable  bool
}

// SetChunkCache makes s take CHUNK records (chunks owns each) and REF
// records (ref returns the frame's payload, which s only reads, whether
// it is memory the cache holds and counts, or why not); without it either
// record fails the stream. begin is called once,
// at the first record of the stream itself (DATA, REF or EOS): a sender
// sends every CHUNK of a connection before its stream, so once every
// connection's reader has begun, the cache holds every chunk a REF may
// name.
func (s *ShardReader) SetChunkCache(chunks func(Chunk) error, ref func(hdr []byte) (payload []byte, lendable bool, err error), begin func()) {
	s.chunks, s.ref, s.begin = chunks, ref, begin
}

// SetChunkAlloc makes s read each CHUNK record into memory alloc gives
// for its n bytes (the cache's own, where it keeps the chunk) instead of
// memory of its own.
func (s *ShardReader) SetChunkAlloc(alloc func(n int) []byte) { s.alloc = alloc }

// record reads a CHUNK or REF record's payload of n bytes and hands it on.
func (s *ShardReader) record(typ uint8, n uint32) error {
	if s.chunks == nil {
		return fmt.Errorf("record type %d inside the stream (this receiver keeps no chunk cache)", typ)
	}
	var p []byte
	if typ == RecChunk && s.alloc != nil {
		p = s.alloc(int(n))
	} else {
		p = make([]byte, n)
	}
	s.deadline()
	if _, err := io.ReadFull(s.br, p); err != nil {
		return s.broke(fmt.Sprintf("record type %d", typ), err)
	}
	if typ == RecChunk {
		c, err := ParseChunk(p)
		if err != nil {
			return err
		}
		return s.chunks(c)
	}
	hdr, err := ParseRef(p)
	if err != nil {
		return err
	}
	payload, lendable, err := s.ref(hdr)
	if err != nil {
		return err
	}
	s.pending, s.after, s.afterLendable = hdr, payload, lendable
	return nil
}

// SetIdleTimeout makes every read of s fail once conn has been silent for
// idle: a sender that stays connected and sends nothing is a dead link.
func (s *ShardReader) SetIdleTimeout(conn net.Conn, idle time.Duration) {
	s.conn, s.idle = conn, idle
}

func (s *ShardReader) deadline() {
	if s.conn != nil {
		_ = s.conn.SetReadDeadline(time.Now().Add(s.idle))
	}
}

// broke describes a failed read, saying so when the sender fell silent.
func (s *ShardReader) broke(what string, err error) error {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return fmt.Errorf("%s: the sender sent nothing for %v: %w", what, s.idle, err)
	}
	return fmt.Errorf("%s: %w", what, UnexpectedEOF(err))
}

// NewShardReader reads a connection's DATA records from br (the control
// records that follow are read from br too), adding the bytes to counts
// where it is not nil.
func NewShardReader(br *bufio.Reader, counts *atomic.Int64) *ShardReader {
	return &ShardReader{br: br, counts: counts}
}

// Read implements io.Reader: io.EOF at the EOS record.
func (s *ShardReader) Read(p []byte) (int, error) {
	if len(s.pending) == 0 && len(s.after) > 0 {
		s.pending, s.after = s.after, nil
	}
	if len(s.pending) > 0 {
		n := copy(p, s.pending)
		s.pending = s.pending[n:]
		if s.counts != nil {
			s.counts.Add(int64(n))
		}
		return n, nil
	}
	for s.left == 0 {
		if s.err != nil {
			return 0, s.err
		}
		if s.eos {
			return 0, io.EOF
		}
		var hb [RecHeaderSize]byte
		s.deadline()
		if _, err := io.ReadFull(s.br, hb[:]); err != nil {
			s.err = s.broke("stream ended without its end marker", err)
			return 0, s.err
		}
		h, err := ParseRecordHeader(hb[:], true)
		if err != nil {
			s.err = err
			return 0, err
		}
		// An empty DATA record is a keepalive (pre-copy): it does not
		// begin the stream.
		if !s.begun && (h.Type == RecData && h.Len > 0 || h.Type == RecRef || h.Type == RecEOS) {
			s.begun = true
			if s.begin != nil {
				s.begin()
			}
		}
		switch h.Type {
		case RecData:
			s.left = h.Len
		case RecEOS:
			s.eos = true
		case RecChunk, RecRef:
			if err := s.record(h.Type, h.Len); err != nil {
				s.err = err
				return 0, err
			}
			if len(s.pending) > 0 {
				return s.Read(p)
			}
		case RecAbort:
			msg := make([]byte, h.Len)
			if _, err := io.ReadFull(s.br, msg); err != nil {
				s.err = fmt.Errorf("sender aborted: %w", UnexpectedEOF(err))
			} else {
				s.err = fmt.Errorf("sender aborted: %s", Printable(string(msg)))
			}
		default:
			s.err = fmt.Errorf("record type %d inside the stream", h.Type)
		}
	}
	if uint32(len(p)) > s.left {
		p = p[:s.left]
	}
	s.deadline()
	n, err := s.br.Read(p)
	s.left -= uint32(n)
	if s.counts != nil {
		s.counts.Add(int64(n))
	}
	if err != nil {
		s.err = s.broke("stream broke", err)
		if n > 0 {
			return n, nil
		}
		return 0, s.err
	}
	return n, nil
}

// LendPayload gives the payload of the REF record being read when the next
// n bytes are all of it and the chunk cache holds it in memory: the
// cache's own bytes, never written again (manifest.PayloadLender), instead
// of a copy. A chunk read back from the cache's spill file is not: its
// copy is read like DATA, into memory the reader's budget counts.
func (s *ShardReader) LendPayload(n int) []byte {
	if len(s.pending) > 0 || n == 0 || len(s.after) != n || !s.afterLendable {
		return nil
	}
	p := s.after
	s.after = nil
	if s.counts != nil {
		s.counts.Add(int64(n))
	}
	return p
}

// Drain reads to the EOS record; DATA after the stream's end is an error.
func (s *ShardReader) Drain() error {
	var b [1]byte
	for !s.eos {
		n, err := s.Read(b[:])
		if n > 0 {
			return errors.New("data after the end of the stream")
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
	}
	return nil
}
