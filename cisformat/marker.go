// Package cisformat (criu-image-streamer's format) reads streams written
// by criu-image-streamer 1.0.0, so that `serve` and `extract` accept
// images users captured with that tool.
//
// Its format (upstream proto/image.proto and src/capture.rs): each shard is a
// sequence of markers, each a 4-byte little-endian length and a protobuf
// `image.marker{seq, oneof body{filename, file_data, file_eof, image_eof}}`.
// A file_data marker is followed by that many raw bytes of the current file.
// seq is global across shards: the writer sends each marker to whichever
// shard has room, and a reader merges the shards by seq. A filename marker
// selects the file later data belongs to (opening it if it is not open), so
// files interleave; file_eof closes the current file; image_eof ends the
// image. There are no checksums: the structure is all that can be checked.
package cisformat

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// MaxMarkerLen bounds a marker's protobuf; the real tool refuses to write or
// read one of 10 KiB or more.
const MaxMarkerLen = 10 << 10

// Kind is the body of a marker.
type Kind uint8

const (
	// Filename selects the file that later data belongs to.
	Filename Kind = iota + 1
	// FileData announces Size bytes of the current file after the marker.
	FileData
	// FileEOF closes the current file.
	FileEOF
	// ImageEOF ends the image.
	ImageEOF
)

func (k Kind) String() string {
	switch k {
	case Filename:
		return "filename"
	case FileData:
		return "file_data"
	case FileEOF:
		return "file_eof"
	case ImageEOF:
		return "image_eof"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Marker is one decoded marker.
type Marker struct {
	Seq  uint64
	Kind Kind
	Name string // Filename
	Size uint32 // FileData
}

// Protobuf field numbers of image.marker.
const (
	fieldSeq      = 1
	fieldFilename = 2
	fieldFileData = 3
	fieldFileEOF  = 4
	fieldImageEOF = 5
)

// ParseMarker decodes a marker's protobuf (without its length prefix).
// Unknown fields are skipped as protobuf readers do; a marker without a
// body, or a false file_eof/image_eof, is malformed as it is for the real
// tool.
func ParseMarker(b []byte) (Marker, error) {
	var m Marker
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return m, fmt.Errorf("marker: bad field tag: %v: %w", protowire.ParseError(n), errdefs.ErrCorrupt)
		}
		b = b[n:]
		var v uint64
		var s []byte
		switch {
		case num >= fieldSeq && num <= fieldImageEOF && num != fieldFilename && typ == protowire.VarintType:
			v, n = protowire.ConsumeVarint(b)
		case num == fieldFilename && typ == protowire.BytesType:
			s, n = protowire.ConsumeBytes(b)
		case num >= fieldSeq && num <= fieldImageEOF:
			return m, fmt.Errorf("marker: field %d has wire type %d: %w", num, typ, errdefs.ErrCorrupt)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return m, fmt.Errorf("marker: field %d: %v: %w", num, protowire.ParseError(n), errdefs.ErrCorrupt)
		}
		b = b[n:]
		// In a oneof the last body field wins, as in any protobuf reader.
		switch num {
		case fieldSeq:
			m.Seq = v
		case fieldFilename:
			m.Kind, m.Name, m.Size = Filename, string(s), 0
		case fieldFileData:
			if v > 1<<32-1 {
				return m, fmt.Errorf("marker: file_data %d overflows uint32: %w", v, errdefs.ErrCorrupt)
			}
			m.Kind, m.Name, m.Size = FileData, "", uint32(v)
		case fieldFileEOF, fieldImageEOF:
			if v != 1 {
				return m, fmt.Errorf("marker: field %d is %d, want true: %w", num, v, errdefs.ErrCorrupt)
			}
			m.Kind, m.Name, m.Size = FileEOF, "", 0
			if num == fieldImageEOF {
				m.Kind = ImageEOF
			}
		}
	}
	if m.Kind == 0 {
		return m, fmt.Errorf("marker seq %d has no body: %w", m.Seq, errdefs.ErrCorrupt)
	}
	return m, nil
}

// AppendMarker appends m with its length prefix, as the real tool writes it
// (proto3: fields at their zero value are left out). Tests and fuzz seeds
// use it to build streams.
func AppendMarker(b []byte, m Marker) []byte {
	var body []byte
	if m.Seq != 0 {
		body = protowire.AppendTag(body, fieldSeq, protowire.VarintType)
		body = protowire.AppendVarint(body, m.Seq)
	}
	switch m.Kind {
	case Filename:
		body = protowire.AppendTag(body, fieldFilename, protowire.BytesType)
		body = protowire.AppendString(body, m.Name)
	case FileData:
		body = protowire.AppendTag(body, fieldFileData, protowire.VarintType)
		body = protowire.AppendVarint(body, uint64(m.Size))
	case FileEOF:
		body = protowire.AppendTag(body, fieldFileEOF, protowire.VarintType)
		body = protowire.AppendVarint(body, 1)
	case ImageEOF:
		body = protowire.AppendTag(body, fieldImageEOF, protowire.VarintType)
		body = protowire.AppendVarint(body, 1)
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(body)))
	return append(b, body...)
}

// PrefixLen is how many leading bytes Detect needs.
const PrefixLen = 5

// Detect reports whether a shard starting with prefix looks like
// criu-image-streamer's format: a plausible marker length, then the tag of
// one of the marker's fields. gpucr-stream's own magic can never match (read
// as a length it is far above MaxMarkerLen).
func Detect(prefix []byte) bool {
	if len(prefix) < PrefixLen {
		return false
	}
	n := binary.LittleEndian.Uint32(prefix)
	if n < 2 || n >= MaxMarkerLen {
		return false
	}
	switch prefix[4] {
	case 0x08, 0x12, 0x18, 0x20, 0x28: // fields 1-5 with their wire types
		return true
	}
	return false
}

// Sniff reads the first bytes of the first non-empty shard and reports
// whether the stream is criu-image-streamer's. The readers it returns give
// back what it read (and stay io.Closers where the originals were). The real
// tool may leave a shard empty, gpucr-stream never does.
func Sniff(shards []io.Reader) ([]io.Reader, bool, error) {
	out := append([]io.Reader(nil), shards...)
	for i, r := range shards {
		b := make([]byte, PrefixLen)
		n, err := io.ReadFull(r, b)
		if err != nil && err != io.EOF && err != io.ErrUnexpectedEOF {
			return nil, false, err
		}
		out[i] = replay(b[:n], r)
		if n > 0 {
			return out, Detect(b[:n]), nil
		}
	}
	return out, false, nil
}

type replayed struct {
	io.Reader
	io.Closer
}

func replay(prefix []byte, r io.Reader) io.Reader {
	mr := io.MultiReader(bytes.NewReader(prefix), r)
	if c, ok := r.(io.Closer); ok {
		return replayed{mr, c}
	}
	return mr
}
