package manifest

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"strings"
	"sync"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// Frame is one decoded frame; Pos is the offset of its header in the stream.
type Frame struct {
	FrameHeader
	Payload []byte
	Pos     int64
	// Name is the name FILE bound to FileID (FILE, DATA, FILE-END): a
	// DATA frame decoded after its file's FILE-END still has it.
	Name string
	// Borrowed says Payload is memory the underlying reader lent
	// (PayloadLender): never written, by anyone, while it is referenced.
	Borrowed bool
	// Late says a DATA frame came after its file's FILE-END in this
	// stream (HeaderFlagLateData): from the first one on, no FILE frame
	// follows, so every file of the stream has been announced.
	Late bool
}

// PayloadLender is implemented by a reader that may have a DATA frame's
// whole payload already, in memory nobody writes again: a migration
// receiver's chunk cache, for a frame sent by reference. Copying those
// bytes into a frame buffer of their own was most of a pre-copy
// migration's downtime on the receiver; a Reader told to
// (BorrowPayloads) takes them as they are.
type PayloadLender interface {
	// LendPayload consumes the next n bytes and returns them as such
	// memory, or returns nil and consumes nothing.
	LendPayload(n int) []byte
}

// Reader decodes a stream frame by frame, checking structure as it goes.
// Payload checksums of DATA frames need the codec and are checked by the
// caller after decoding; every other check happens here.
type Reader struct {
	r      io.Reader
	name   string // for errors: "stdin", "shard 2", a segment name
	pos    int64
	header Header
	ended  bool
	// names holds the open files' names only: FILE-END forgets one, so
	// a stream that replaces a file again and again holds one name, and
	// openNames (their bytes) stays under MaxOpenNameBytes whatever the
	// input. It is read by the decode workers (for messages) while Next
	// changes it.
	mu        sync.RWMutex
	names     map[uint32]string
	openNames int
	hdr       [FrameSize]byte
	// transcript and endCheck: see Writer.SetEndTag.
	transcript hash.Hash
	endCheck   func(input []byte, tag [32]byte) error
	// lender, when set (BorrowPayloads), gives DATA payloads without a copy.
	lender PayloadLender
	// endedIDs are the files whose FILE-END was read, in a stream with
	// late data; late says one of their DATA frames was.
	endedIDs map[uint32]bool
	late     bool
}

// NewReader reads and checks the stream header.
func NewReader(r io.Reader, name string) (*Reader, error) {
	rd := &Reader{r: r, name: name, names: map[uint32]string{}}
	b := make([]byte, HeaderSize)
	if _, err := io.ReadFull(r, b); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%s: empty input, expected a gpucr-stream stream: %w", name, errdefs.ErrCorrupt)
		}
		return nil, fmt.Errorf("%s: reading stream header at offset 0: %w", name, truncated("stream truncated inside its header", err))
	}
	h, err := UnmarshalHeader(b)
	if err != nil {
		if !errors.Is(err, ErrNewerVersion) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrCorrupt)
		}
		return nil, fmt.Errorf("%s at offset 0: %w", name, err)
	}
	rd.header, rd.pos = h, HeaderSize
	if h.Version >= VersionEncrypted && h.Flags&HeaderFlagEncrypted != 0 {
		rd.transcript = sha256.New()
		rd.transcript.Write(b)
		fr, err := rd.next(nil)
		if err != nil {
			return nil, err
		}
		if fr.Type != FrameKey {
			return nil, rd.Errorf(fr.Pos, NoFile, "encrypted stream: %s frame where the KEY frame must be", fr.Type)
		}
		e := encryptionFromFrame(fr)
		if e.StreamID != h.StreamID {
			return nil, rd.Errorf(fr.Pos, NoFile, "KEY frame names stream %016x, the header %016x", e.StreamID, h.StreamID)
		}
		rd.header.Encryption = e
	}
	return rd, nil
}

// SetEndCheck makes the END frame of an encrypted stream fail unless
// check(EndTagInput(...), its hash) passes (Writer.SetEndTag). Call it
// before the first Next.
func (r *Reader) SetEndCheck(check func(input []byte, tag [32]byte) error) { r.endCheck = check }

// BorrowPayloads makes Next return the payloads that the underlying
// reader lends (PayloadLender) as they are, marked Frame.Borrowed, without
// calling alloc: for a caller that never writes a DATA payload (one that opens
// encrypted chunks in place does).
func (r *Reader) BorrowPayloads() {
	r.lender, _ = r.r.(PayloadLender)
}

// Header is the stream's header.
func (r *Reader) Header() Header { return r.header }

// Pos is the offset of the next frame.
func (r *Reader) Pos() int64 { return r.pos }

// MaxOpenNameBytes bounds the bytes of the names of files open at once
// (FILE read, FILE-END not yet) in one stream. CRIU keeps a few hundred
// short names open; a stream that opens files without ending them is
// refused here instead of growing without bound.
const MaxOpenNameBytes = 16 << 20

// lateFileCost is what a file of a stream with late data counts beside its
// name against MaxOpenNameBytes: its name stays bound to the stream's end
// (and its id in endedIDs), so a hostile stream of tiny names would
// otherwise hold millions of map entries. About 250,000 files at most; a
// CRIU image has hundreds.
const lateFileCost = 64

// FileName returns the name a FILE frame bound to id while that file is
// open (until its FILE-END); Frame.Name keeps it beyond.
func (r *Reader) FileName(id uint32) string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.names[id]
}

// NoFile is the file id to pass to Errorf for frames that belong to none.
const NoFile = ^uint32(0)

// Errorf reports corrupt input with where in the stream it was found.
func (r *Reader) Errorf(pos int64, id uint32, format string, args ...any) error {
	return r.errorf(pos, r.FileName(id), format, args...)
}

// FrameErrorf is Errorf for fr, naming its file even after its FILE-END
// (a DATA frame decoded late).
func (r *Reader) FrameErrorf(fr Frame, format string, args ...any) error {
	return r.errorf(fr.Pos, fr.Name, format, args...)
}

func (r *Reader) errorf(pos int64, file string, format string, args ...any) error {
	where := fmt.Sprintf("%s at offset %d", r.name, pos)
	if file != "" {
		where += fmt.Sprintf(" (file %s)", PrintableName(file))
	}
	msg := strings.TrimSuffix(fmt.Sprintf(format, args...), ": "+errdefs.ErrCorrupt.Error())
	return fmt.Errorf("%s: %s: %w", where, msg, errdefs.ErrCorrupt)
}

// Alloc provides the payload buffer of a DATA frame, at least StoredLen
// bytes, once its header is checked; it may wait (for memory) and fail.
type Alloc func(fh FrameHeader) ([]byte, error)

// Next returns the next frame. alloc provides the payload buffer of DATA
// frames (nil means make). After the END frame and its tail it returns
// io.EOF; a stream that stops anywhere else is an error naming the offset.
func (r *Reader) Next(alloc Alloc) (Frame, error) {
	fr, err := r.next(alloc)
	if err == nil && fr.Type == FrameKey {
		return Frame{}, r.Errorf(fr.Pos, NoFile, "KEY frame anywhere but right after the stream header")
	}
	return fr, err
}

// next reads the next frame in three steps: read (its header, checked on
// its own, and its payload), authenticate (what covers it beyond its
// header), apply (what it changes of the reader's state).
func (r *Reader) next(alloc Alloc) (Frame, error) {
	if r.ended {
		return Frame{}, io.EOF
	}
	fr, err := r.read(alloc)
	if err != nil {
		return Frame{}, err
	}
	if err := r.authenticate(fr); err != nil {
		return Frame{}, err
	}
	r.pos += FrameSize + int64(fr.StoredLen)
	if err := r.apply(&fr); err != nil {
		return Frame{}, err
	}
	return fr, nil
}

// fileOf is the file id a frame's errors name: none for END.
func fileOf(fh FrameHeader) uint32 {
	if fh.Type == FrameEnd {
		return NoFile
	}
	return fh.FileID
}

// read reads the next frame's header into r.hdr and checks it on its own:
// its fields, and that a DATA or FILE-END frame names an open file. Then it
// reads the payload.
func (r *Reader) read(alloc Alloc) (Frame, error) {
	pos := r.pos
	if _, err := io.ReadFull(r.r, r.hdr[:]); err != nil {
		if errors.Is(err, io.EOF) {
			return Frame{}, fmt.Errorf("%s: stream truncated at offset %d: no END frame: %w", r.name, pos, errdefs.ErrCorrupt)
		}
		return Frame{}, fmt.Errorf("%s: reading frame at offset %d: %w", r.name, pos, truncated("stream truncated inside a frame header", err))
	}
	fh, err := UnmarshalFrameHeader(r.hdr[:])
	if err != nil {
		return Frame{}, r.Errorf(pos, fh.FileID, "%v", err)
	}
	fr := Frame{FrameHeader: fh, Pos: pos}
	if fh.Type != FrameEnd {
		fr.Name = r.FileName(fh.FileID)
	}
	if (fh.Type == FrameData || fh.Type == FrameFileEnd) && fr.Name == "" {
		return Frame{}, r.Errorf(pos, fh.FileID, "%s frame for file id %d that is not open (never opened, or ended)", fh.Type, fh.FileID)
	}
	if fr.Payload, fr.Borrowed, err = r.readPayload(fh, pos, alloc); err != nil {
		return Frame{}, err
	}
	return fr, nil
}

// readPayload reads fh's payload: as the underlying reader lends it
// (BorrowPayloads), into alloc's buffer (DATA), or into one of its own.
func (r *Reader) readPayload(fh FrameHeader, pos int64, alloc Alloc) (payload []byte, borrowed bool, err error) {
	if fh.StoredLen == 0 {
		return nil, false, nil
	}
	if r.lender != nil && fh.Type == FrameData {
		if payload = r.lender.LendPayload(int(fh.StoredLen)); payload != nil {
			return payload, true, nil
		}
	}
	if alloc != nil && fh.Type == FrameData {
		if payload, err = alloc(fh); err != nil {
			return nil, false, err
		}
		payload = payload[:fh.StoredLen]
	} else {
		payload = make([]byte, fh.StoredLen)
	}
	if _, err := io.ReadFull(r.r, payload); err != nil {
		return nil, false, fmt.Errorf("%w: %w", r.Errorf(pos, fileOf(fh), "%s frame payload of %d bytes truncated", fh.Type, fh.StoredLen), unexpected(err))
	}
	return payload, false, nil
}

// authenticate checks what covers fr beyond its header: its payload
// checksum (but for DATA, whose checksum is of the raw bytes, checked by
// the caller once decoded), and in an encrypted stream the transcript of
// every frame, which the END frame's tag covers (Writer.SetEndTag).
func (r *Reader) authenticate(fr Frame) error {
	if fr.Type != FrameData {
		if got := PayloadChecksum(fr.Payload); got != fr.Checksum {
			return r.Errorf(fr.Pos, fileOf(fr.FrameHeader), "%s frame payload checksum mismatch (stored %08x, computed %08x)", fr.Type, fr.Checksum, got)
		}
	}
	switch {
	case r.transcript == nil:
	case fr.Type != FrameEnd:
		r.transcript.Write(r.hdr[:])
		if fr.Type != FrameData {
			r.transcript.Write(fr.Payload)
		}
	case r.endCheck != nil:
		if err := r.endCheck(EndTagInput(r.transcript.Sum(nil), fr.Payload), fr.Hash); err != nil {
			return r.Errorf(fr.Pos, NoFile, "END frame: %v", err)
		}
	}
	return nil
}

// apply changes the reader's state by fr, one case per frame type (a KEY
// frame changes nothing here: NewReader takes it).
func (r *Reader) apply(fr *Frame) error {
	switch fr.Type {
	case FrameFile:
		return r.openFile(fr)
	case FrameData:
		fr.Late = r.endedIDs[fr.FileID]
		r.late = r.late || fr.Late
	case FrameFileEnd:
		r.endFile(fr)
	case FrameEnd:
		return r.end(fr)
	}
	return nil
}

// openFile binds fr's name to its file id until its FILE-END, within
// MaxOpenNameBytes.
func (r *Reader) openFile(fr *Frame) error {
	if r.late {
		return r.Errorf(fr.Pos, fr.FileID, "FILE frame after a file's late DATA: every file is announced before any")
	}
	name := string(fr.Payload)
	if fr.Name != "" {
		if fr.Name != name {
			return r.Errorf(fr.Pos, fr.FileID, "file id %d reopened as %s", fr.FileID, PrintableName(name))
		}
		return nil // announced again: nothing new to hold
	}
	cost := len(name)
	if r.header.LateData {
		// Never forgotten: each costs its bookkeeping too.
		cost += lateFileCost
	}
	if r.openNames+cost > MaxOpenNameBytes {
		return r.Errorf(fr.Pos, fr.FileID, "FILE frame: more than %d bytes of names of files open at once (%d files)", MaxOpenNameBytes, len(r.names))
	}
	r.mu.Lock()
	r.names[fr.FileID] = name
	r.openNames += cost
	r.mu.Unlock()
	fr.Name = name
	return nil
}

// endFile forgets fr's file name, unless its DATA may still come (late
// data).
func (r *Reader) endFile(fr *Frame) {
	if r.header.LateData {
		// Its DATA may still come: the name stays bound.
		if r.endedIDs == nil {
			r.endedIDs = map[uint32]bool{}
		}
		r.endedIDs[fr.FileID] = true
		return
	}
	r.mu.Lock()
	delete(r.names, fr.FileID)
	r.openNames -= len(fr.Name)
	r.mu.Unlock()
}

// end reads and checks the tail after the END frame fr: the stream ends.
func (r *Reader) end(fr *Frame) error {
	var tail [TailSize]byte
	if _, err := io.ReadFull(r.r, tail[:]); err != nil {
		return fmt.Errorf("%s: stream truncated after END frame at offset %d: %v: %w", r.name, fr.Pos, unexpected(err), errdefs.ErrCorrupt)
	}
	off, err := UnmarshalTail(tail[:])
	if err != nil || off != uint64(fr.Pos) {
		return fmt.Errorf("%s: bad stream tail at offset %d: %w", r.name, r.pos, errdefs.ErrCorrupt)
	}
	r.pos += TailSize
	r.ended = true
	return nil
}

// truncated marks input that ends inside a header as corrupt (FORMAT.md:
// every cut of a stream is), keeping a reader's own errors as they are.
func truncated(what string, err error) error {
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return fmt.Errorf("%s: %w: %w", what, io.ErrUnexpectedEOF, errdefs.ErrCorrupt)
	}
	return err
}

func unexpected(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}
