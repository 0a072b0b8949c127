package manifest

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// Archive layout in a store (a local directory or an object prefix). The
// manifest is written last and is the commit point: without it the
// checkpoint does not exist.
const (
	ManifestName  = "manifest.json"
	SegmentPrefix = "segments/"
)

// SegmentName is the object name of segment i of the archive whose
// stream id is stream: segments/<stream id, 16 hex digits>-<i, 8 decimal
// digits>.gcs. The stream id is random per capture, so that captures
// racing to one location never write (or, failing, delete) one another's
// segments; readers take the names from the manifest.
func SegmentName(stream uint64, i int) string {
	return fmt.Sprintf("%s%016x-%08d.gcs", SegmentPrefix, stream, i)
}

// IsSegmentName reports whether name is what SegmentName makes, or a
// segment name of archives written before 2026-11-28 (segments/<i, 8
// decimal digits>.gcs, the same in every capture).
func IsSegmentName(name string) bool {
	_, ok := SegmentCapture(name)
	return ok
}

// SegmentCapture returns, for a segment name, what tells the capture that
// wrote it from others in one location: the stream id in hex, or "" for a
// segment of the old naming. ok is false for other names.
func SegmentCapture(name string) (capture string, ok bool) {
	rest, ok := strings.CutPrefix(name, SegmentPrefix)
	if !ok {
		return "", false
	}
	if rest, ok = strings.CutSuffix(rest, ".gcs"); !ok {
		return "", false
	}
	if id, num, found := strings.Cut(rest, "-"); found {
		return id, len(id) == 16 && isDigits(id, "0123456789abcdef") && len(num) == 8 && isDigits(num, "0123456789")
	}
	return "", len(rest) == 8 && isDigits(rest, "0123456789")
}

// CaptureLockName is the object name of the lock (store.Lock) that a
// writer of an archive holds beside its segments while it runs:
// segments/<16 hex digits>.lock, a capture's stream id (a cp's is
// random). gc leaves every segment beside a fresh lock, however old.
func CaptureLockName(stream uint64) string {
	return fmt.Sprintf("%s%016x.lock", SegmentPrefix, stream)
}

// CaptureOfLock returns, for a lock name (CaptureLockName), its 16 hex
// digits (a capture's stream id, as SegmentCapture gives it for its
// segments); ok is false for other names.
func CaptureOfLock(name string) (capture string, ok bool) {
	rest, ok := strings.CutPrefix(name, SegmentPrefix)
	if !ok {
		return "", false
	}
	if rest, ok = strings.CutSuffix(rest, ".lock"); !ok {
		return "", false
	}
	return rest, len(rest) == 16 && isDigits(rest, "0123456789abcdef")
}

func isDigits(s, digits string) bool {
	for _, c := range []byte(s) {
		if strings.IndexByte(digits, c) < 0 {
			return false
		}
	}
	return true
}

// Manifest describes one complete checkpoint: what files it holds, where
// every chunk lives, and how it was made.
type Manifest struct {
	Format      int               `json:"format"`
	ID          string            `json:"id"`
	Created     time.Time         `json:"created"`
	Tool        string            `json:"tool"`
	CRIUVersion string            `json:"criu_version,omitempty"`
	Host        string            `json:"host,omitempty"`
	Codec       string            `json:"codec"`
	ChunkSize   int               `json:"chunk_size"`
	Labels      map[string]string `json:"labels,omitempty"`
	Process     *Process          `json:"process,omitempty"`
	GPUs        []GPU             `json:"gpus,omitempty"`
	// CUDA records, per CUDA process, which path its device memory took.
	CUDA     []CUDAProcess `json:"cuda,omitempty"`
	Stats    Stats         `json:"stats"`
	Segments []Segment     `json:"segments,omitempty"`
	Files    []File        `json:"files"`
	// Encryption is set for an encrypted checkpoint (format 2).
	Encryption *Encryption `json:"encryption,omitempty"`
	// NoChunkHashes: the chunks carry only their CRC-32C, no BLAKE3 hash
	// (format 3; never encrypted).
	NoChunkHashes bool `json:"no_chunk_hashes,omitempty"`
	// SharedChunks: the chunks live in the shared chunk store of the
	// location that holds the checkpoint (format 4): Segments name its
	// packs, relative to that location, and every chunk's Hash is its id.
	SharedChunks bool `json:"shared_chunks,omitempty"`
	// MAC authenticates an encrypted checkpoint's manifest (MarshalMAC);
	// it must come right before Checksum.
	MAC string `json:"mac,omitempty"`
	// Checksum seals the document; it must stay the last field.
	Checksum string `json:"checksum"`
}

// Process is the checkpointed process (the root of the dumped tree).
type Process struct {
	PID     int      `json:"pid"`
	Cmdline []string `json:"cmdline,omitempty"`
}

// GPU records a device whose memory is in the checkpoint.
type GPU struct {
	UUID   string `json:"uuid"`
	Name   string `json:"name,omitempty"`
	Driver string `json:"driver,omitempty"`
	PID    int    `json:"pid,omitempty"`
	Bytes  int64  `json:"bytes,omitempty"`
}

// CUDA process paths: the driver's checkpoint (device memory inside the
// process's CRIU image), or the fast path (device memory in Files, written
// by libgpucr-preload; docs/PRODUCERS.md).
const (
	CUDAPathDriver  = "driver"
	CUDAPathPreload = "preload"
)

// CUDAProcess records how one CUDA process of the checkpoint was saved.
type CUDAProcess struct {
	PID int `json:"pid"`
	// NSPID is its PID in its own PID namespace (a container's), where
	// that is not PID: what CRIU gives it back, while a restore into a
	// new namespace (runc restore) gives it a new PID on the host.
	NSPID int    `json:"ns_pid,omitempty"`
	Path  string `json:"path"`
	// Files hold its device memory (fast path), Bytes their total.
	Files []string `json:"files,omitempty"`
	Bytes int64    `json:"bytes,omitempty"`
	// Hashes is the file of its Files' block hashes (a --dedup
	// checkpoint's; docs/PRODUCERS.md, "Blocks an earlier checkpoint
	// holds").
	Hashes string `json:"hashes,omitempty"`
	// Handles is the file of its handle table: what a restore's filler
	// fills ahead of the driver's restore (docs/PRODUCERS.md, "What a
	// restore overlaps").
	Handles string `json:"handles,omitempty"`
}

// Stats sums the checkpoint.
type Stats struct {
	RawBytes    int64                 `json:"raw_bytes"`
	StoredBytes int64                 `json:"stored_bytes"`
	Chunks      int64                 `json:"chunks"`
	ByCodec     map[string]CodecStats `json:"by_codec,omitempty"`
	// NewChunks and NewStoredBytes (format 4) count the chunks this
	// checkpoint added to its location's chunk store, and their payload
	// bytes: what it cost beyond what the location already held.
	NewChunks      int64 `json:"new_chunks,omitempty"`
	NewStoredBytes int64 `json:"new_stored_bytes,omitempty"`
}

// CodecStats sums the chunks one codec stored.
type CodecStats struct {
	Chunks      int64 `json:"chunks"`
	RawBytes    int64 `json:"raw_bytes"`
	StoredBytes int64 `json:"stored_bytes"`
}

// Add counts one chunk.
func (s *Stats) Add(codecName string, raw, stored int64) {
	s.RawBytes += raw
	s.StoredBytes += stored
	s.Chunks++
	if s.ByCodec == nil {
		s.ByCodec = map[string]CodecStats{}
	}
	c := s.ByCodec[codecName]
	c.Chunks++
	c.RawBytes += raw
	c.StoredBytes += stored
	s.ByCodec[codecName] = c
}

// Ratio is raw over stored bytes (1 when empty).
func (s Stats) Ratio() float64 {
	if s.StoredBytes == 0 {
		return 1
	}
	return float64(s.RawBytes) / float64(s.StoredBytes)
}

// Segment is one data object.
type Segment struct {
	Name string `json:"name"`
	Size int64  `json:"size"`
}

// File is one image file and the index of its chunks, in offset order.
type File struct {
	Name string `json:"name"`
	// ID is the file id of the file's frames (absent when 0): an encrypted
	// chunk is bound to it, so a reader of an archive must know it.
	ID       uint32 `json:"id,omitempty"`
	Size     int64  `json:"size"`
	Digest   Hash   `json:"digest"`
	External bool   `json:"external,omitempty"`
	// Carried: a file of the images dir, written back there on restore
	// (FileFlagCarried).
	Carried bool    `json:"carried,omitempty"`
	Chunks  []Chunk `json:"chunks"`
}

// Chunk locates one DATA frame: segment index and the offset of its header.
type Chunk struct {
	Offset   int64  `json:"off"`
	RawLen   uint32 `json:"raw"`
	Stored   uint32 `json:"stored"`
	Codec    uint8  `json:"codec"`
	Checksum uint32 `json:"crc"`
	Hash     Hash   `json:"hash,omitzero"` // zero, and left out, without chunk hashes
	Segment  int    `json:"seg"`
	Pos      int64  `json:"pos"`
}

// Hash is a 32-byte digest written as hex in JSON.
type Hash [32]byte

func (h Hash) String() string { return hex.EncodeToString(h[:]) }

// MarshalText implements encoding.TextMarshaler.
func (h Hash) MarshalText() ([]byte, error) { return []byte(h.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (h *Hash) UnmarshalText(b []byte) error {
	if hex.DecodedLen(len(b)) != len(h) {
		return fmt.Errorf("hash: want %d hex digits, got %d", 2*len(h), len(b))
	}
	_, err := hex.Decode(h[:], b)
	return err
}

// ValidName accepts file names that are one path component: what CRIU and
// GPU dumpers name images, and safe to create in a directory.
func ValidName(name string) bool {
	return name != "" && name != "." && name != ".." && len(name) <= MaxNameLen && !strings.ContainsAny(name, "/\x00")
}

// PrintableName is name as it may be shown on a terminal or in a log: as
// it is when it is printable UTF-8, else Go-quoted, so that a hostile name
// carries no escape sequence, NUL or line break into the output.
func PrintableName(name string) string {
	for _, r := range name {
		if r == utf8.RuneError || !unicode.IsPrint(r) {
			return strconv.Quote(name)
		}
	}
	return name
}

// checksumKey ends the document: the CRC-32C of every byte before its value
// follows it, so that a flipped byte anywhere in the manifest (a file name,
// an offset) is caught while the file stays plain JSON.
const checksumKey = `"checksum": "`

// FormatVersion is the format version the manifest is written with.
func (m *Manifest) FormatVersion() int {
	if m.SharedChunks {
		return VersionSharedChunks
	}
	return int(VersionOf(m.Encryption != nil, m.NoChunkHashes))
}

// Marshal encodes an unencrypted manifest as indented JSON, sealed with its
// checksum.
func (m *Manifest) Marshal() ([]byte, error) { return m.MarshalMAC(nil) }

// MarshalMAC encodes the manifest; an encrypted one (Encryption set) also
// carries mac(input) in hex, input being what CheckMAC hands its check.
func (m *Manifest) MarshalMAC(mac func(input []byte) []byte) ([]byte, error) {
	c := *m
	c.Checksum = ""
	c.MAC = ""
	c.Format = m.FormatVersion()
	if m.Encryption != nil {
		if mac == nil {
			return nil, errors.New("manifest: encrypted manifest needs a MAC key")
		}
		c.MAC = strings.Repeat("0", macLen)
	}
	b, err := marshalIndent(&c)
	if err != nil {
		return nil, err
	}
	if m.Encryption != nil {
		in, err := macInput(b)
		if err != nil {
			return nil, err
		}
		i := bytes.LastIndex(b, []byte(macKey)) + len(macKey)
		copy(b[i:], hex.EncodeToString(mac(in)))
	}
	i := bytes.LastIndex(b, []byte(checksumKey))
	if i < 0 {
		return nil, errors.New("manifest: checksum field missing")
	}
	i += len(checksumKey)
	sum := fmt.Sprintf("%08x", crc(b[:i]))
	return append(append(append([]byte{}, b[:i]...), sum...), b[i:]...), nil
}

func checkSum(b []byte) error {
	i := bytes.LastIndex(b, []byte(checksumKey))
	if i < 0 {
		return errors.New("manifest: no checksum")
	}
	i += len(checksumKey)
	if len(b) < i+8 {
		return errors.New("manifest: truncated checksum")
	}
	if want := fmt.Sprintf("%08x", crc(b[:i])); string(b[i:i+8]) != want {
		return fmt.Errorf("manifest: checksum mismatch (stored %s, computed %s)", b[i:i+8], want)
	}
	return nil
}

// Parse decodes a manifest and checks that it is self-consistent, so that
// nothing downstream indexes out of range on a damaged document.
func Parse(b []byte) (*Manifest, error) {
	// One decoding of the whole document (a deduplicated GPU checkpoint's
	// is 10 MB: fastjson.go); only when it fails is the format read on its
	// own, so that a newer format is named as such whatever else it
	// changed.
	m := &Manifest{}
	var decodeErr error
	if !fastDecode(b, m) {
		m = &Manifest{}
		decodeErr = json.Unmarshal(b, m)
	}
	format := m.Format
	if decodeErr != nil {
		var probe struct {
			Format int `json:"format"`
		}
		if err := json.Unmarshal(b, &probe); err != nil {
			return nil, fmt.Errorf("manifest: not valid JSON: %v: %w", err, errdefs.ErrCorrupt)
		}
		format = probe.Format
	}
	if format < 1 {
		return nil, fmt.Errorf("manifest: format %d is not a gpucr-stream manifest: %w", format, errdefs.ErrCorrupt)
	}
	if format > DocumentVersion {
		return nil, fmt.Errorf("manifest: %w: format %d, this build reads up to %d", ErrNewerVersion, format, DocumentVersion)
	}
	if err := checkSum(b); err != nil {
		return nil, fmt.Errorf("%w: %w", err, errdefs.ErrCorrupt)
	}
	if decodeErr != nil {
		return nil, fmt.Errorf("manifest: %v: %w", decodeErr, errdefs.ErrCorrupt)
	}
	if m.Encryption != nil && m.Format < VersionEncrypted {
		return nil, fmt.Errorf("manifest: format %d cannot be encrypted: %w", m.Format, errdefs.ErrCorrupt)
	}
	if m.NoChunkHashes && (m.Format < VersionNoChunkHashes || m.Encryption != nil) {
		return nil, fmt.Errorf("manifest: no_chunk_hashes in a format %d manifest (encrypted: %t): %w", m.Format, m.Encryption != nil, errdefs.ErrCorrupt)
	}
	if m.SharedChunks && (m.Format < VersionSharedChunks || m.NoChunkHashes) {
		return nil, fmt.Errorf("manifest: shared_chunks in a format %d manifest (no chunk hashes: %t): %w", m.Format, m.NoChunkHashes, errdefs.ErrCorrupt)
	}
	if m.Format >= VersionSharedChunks && !m.SharedChunks {
		return nil, fmt.Errorf("manifest: format %d without shared_chunks: %w", m.Format, errdefs.ErrCorrupt)
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", err, errdefs.ErrCorrupt)
	}
	return m, nil
}

// Validate checks chunk ranges and segment references.
func (m *Manifest) Validate() error {
	for i, s := range m.Segments {
		// A negative size would wrap the bound checks below.
		if s.Size < 0 {
			return fmt.Errorf("manifest: segment %d has size %d", i, s.Size)
		}
	}
	seen := map[string]bool{}
	for _, f := range m.Files {
		// The names extract would refuse are refused here, so that verify
		// and inspect never pass an archive extract cannot write.
		if !ValidName(f.Name) {
			n := f.Name
			if len(n) > 64 {
				n = n[:64] + "..."
			}
			return fmt.Errorf("manifest: file with an empty or over-long name, or one that is not a single path component (., .., /, NUL): %s", PrintableName(n))
		}
		if seen[f.Name] {
			return fmt.Errorf("manifest: file %s listed twice", PrintableName(f.Name))
		}
		seen[f.Name] = true
		name := PrintableName(f.Name)
		var next int64
		for i, c := range f.Chunks {
			switch {
			case c.Offset != next:
				return fmt.Errorf("manifest: file %s chunk %d at offset %d, want %d", name, i, c.Offset, next)
			case c.RawLen == 0 || c.RawLen > MaxPayload || c.Stored > MaxPayload:
				return fmt.Errorf("manifest: file %s chunk %d has impossible length", name, i)
			case m.Segments != nil && (c.Segment < 0 || c.Segment >= len(m.Segments)):
				return fmt.Errorf("manifest: file %s chunk %d names segment %d of %d", name, i, c.Segment, len(m.Segments))
			case c.Pos < 0 || (m.Segments != nil && c.Pos > m.Segments[c.Segment].Size-FrameSize-int64(c.Stored)):
				return fmt.Errorf("manifest: file %s chunk %d lies outside its segment", name, i)
			}
			next += int64(c.RawLen)
		}
		if next != f.Size {
			return fmt.Errorf("manifest: file %s has %d bytes in chunks, size says %d", name, next, f.Size)
		}
	}
	return nil
}

// Lookup returns the file with that name.
func (m *Manifest) Lookup(name string) (*File, bool) {
	for i := range m.Files {
		if m.Files[i].Name == name {
			return &m.Files[i], true
		}
	}
	return nil, false
}
