// Package crypt encrypts checkpoints at rest: the master key (from a key
// file or the environment, never a flag), the keys derived from it for one
// checkpoint, the sealing and opening of chunks with AES-256-GCM, and the
// MACs that authenticate everything else (file ends, the manifest).
//
// Design: a master key never touches data. Each checkpoint (one stream, all
// its shards, or one archive, all its segments) draws a random 32-byte salt
// and a random stream id; HKDF-SHA256(master, salt) gives that checkpoint's
// AES-256-GCM key and HMAC-SHA256 key. A chunk's 96-bit nonce is its file id
// (u32) and its offset in the file (u64): the writer never writes two
// chunks at one (file id, offset) in a checkpoint (file ids are never
// reused, offsets only grow), and no two checkpoints share a key unless
// they drew the same 256-bit salt, so a nonce never repeats under a key.
// The associated data binds the chunk to its checkpoint (stream id), its
// file (id and name), its place (offset, raw length) and its codec, so a
// chunk moved, swapped or replayed from another checkpoint fails to open.
// Content hashes are BLAKE3 keyed with a key derived from the master key
// alone, so they reveal nothing about the data to whoever lacks the key
// and still identify equal chunks across checkpoints made with one key.
package crypt

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"syscall"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/knobs"
	"lukechampine.com/blake3"
)

// KeySize is the master key's length: 256 bits.
const KeySize = 32

// Cipher ids as written in a stream's KEY frame. Permanent, like codec ids.
const (
	CipherAES256GCM = 1
)

// CipherName is the manifest's name of CipherAES256GCM.
const CipherName = "aes-256-gcm"

// Overhead is what sealing adds to a chunk's payload: the GCM tag and the
// encrypted CRC-32C of the raw chunk.
const Overhead = 16 + 4

var (
	// ErrNoKey: the input is encrypted and no key was given.
	ErrNoKey = errors.New("checkpoint is encrypted and no key was given")
	// ErrWrongKey: the key given is not the one the checkpoint names.
	ErrWrongKey = errors.New("wrong key")
	// ErrNotEncrypted: a key was given for a checkpoint that is not
	// encrypted, hence not authenticated either.
	ErrNotEncrypted = errors.New("checkpoint is not encrypted")
	// ErrAuth: a chunk, file end or manifest failed authentication: it was
	// changed, moved, or made with another key.
	ErrAuth = fmt.Errorf("authentication failed (tampered, moved or damaged): %w", errdefs.ErrCorrupt)
	// ErrKeyFile: the key file or variable is unusable.
	ErrKeyFile = errors.New("unusable key")
)

// Key is a master key. Its ID names it in streams and manifests.
type Key struct {
	k  [KeySize]byte
	id KeyID
}

// KeyID is a key's public name: HMAC-SHA256(key, fixed label), truncated.
// It tells which key a checkpoint needs without revealing the key.
type KeyID [8]byte

func (id KeyID) String() string { return hex.EncodeToString(id[:]) }

// NewKey wraps 32 bytes of key material.
func NewKey(b []byte) (*Key, error) {
	if len(b) != KeySize {
		return nil, fmt.Errorf("%w: %d bytes, want %d", ErrKeyFile, len(b), KeySize)
	}
	k := &Key{}
	copy(k.k[:], b)
	m := hmac.New(sha256.New, k.k[:])
	m.Write([]byte("gpucr-stream key id v1"))
	copy(k.id[:], m.Sum(nil))
	return k, nil
}

// ID is the key's public name.
func (k *Key) ID() KeyID { return k.id }

// ParseKey reads a key written as 64 hex digits or as standard base64 (with
// or without padding); surrounding white space is ignored.
func ParseKey(text string) (*Key, error) {
	b, err := parseKeyBytes(text)
	if err != nil {
		return nil, err
	}
	return NewKey(b)
}

func parseKeyBytes(text string) ([]byte, error) {
	s := strings.TrimSpace(text)
	if b, err := hex.DecodeString(s); err == nil && len(b) == KeySize {
		return b, nil
	}
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		if b, err := enc.DecodeString(s); err == nil && len(b) == KeySize {
			return b, nil
		}
	}
	return nil, fmt.Errorf("%w: want %d bytes as 64 hex digits or base64", ErrKeyFile, KeySize)
}

// LoadKeyFile reads a key file (ReadKeyFile) as a master key.
func LoadKeyFile(path string) (*Key, error) {
	b, err := ReadKeyFile(path)
	if err != nil {
		return nil, err
	}
	return NewKey(b)
}

// ReadKeyFile reads 32 key bytes (hex or base64) from a secret file
// (ReadSecretFile). It also reads SSE-C keys for S3.
func ReadKeyFile(path string) ([]byte, error) {
	b, err := ReadSecretFile(path, 1024)
	if err != nil {
		return nil, fmt.Errorf("key file %w", err)
	}
	k, err := parseKeyBytes(string(b))
	clear(b)
	if err != nil {
		return nil, fmt.Errorf("key file %s: %w", path, err)
	}
	return k, nil
}

// ErrSecretFile: a file that holds a secret (key, token, TLS key) is not a
// regular file or other users may read or write it.
var ErrSecretFile = errors.New("unusable secret file")

// ReadSecretFile reads at most limit bytes of a file that holds a secret,
// refusing one that group or others may read or write (they would hold the
// secret too: it protects nothing) and anything but a regular file. The
// one reader of secret files: keys here, tokens and TLS keys in
// transport/tcp.
func ReadSecretFile(path string, limit int64) ([]byte, error) {
	// O_NONBLOCK: a FIFO in place of the file must not hang the command;
	// it is refused below as not a regular file.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", SecretPath(path), pathless(err))
	}
	defer f.Close()
	// It opened: a file's name, not a secret pasted in its place.
	where := path
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, pathless(err))
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: %w: not a regular file", where, ErrSecretFile)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("%s: %w: it holds a secret but other users may read or write it (mode %04o): chmod 600 %s", where, ErrSecretFile, perm, where)
	}
	// A regular file: reads do not block, whatever O_NONBLOCK says.
	b, err := io.ReadAll(io.LimitReader(f, limit))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, pathless(err))
	}
	return b, nil
}

// SecretPath names the path of a secret file that cannot be opened in
// messages without showing it: the path may be the secret itself, pasted
// by mistake (--key-file=$(cat key)). Its length tells a user which
// argument it was. A path that opens is shown: it names a file.
func SecretPath(path string) string {
	return fmt.Sprintf("(path of %d bytes, not shown)", len(path))
}

// pathless is err without the path an *os.PathError carries (errors.Is
// still sees its cause).
func pathless(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return fmt.Errorf("%s: %w", pe.Op, pe.Err)
	}
	return err
}

// LoadKey returns the key from path when it is set, else from GPUCR_KEY,
// else nil (no encryption).
func LoadKey(path string) (*Key, error) {
	if path != "" {
		return LoadKeyFile(path)
	}
	if v := knobs.Key.Value(); v != "" {
		k, err := ParseKey(v)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", knobs.Key.Name, err)
		}
		return k, nil
	}
	return nil, nil
}

// GenerateKey returns a new random key, hex encoded.
func GenerateKey() string {
	var b [KeySize]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Params are a checkpoint's public encryption parameters, written in every
// stream header's KEY frame and in the manifest.
type Params struct {
	Cipher   uint8
	KeyID    KeyID
	Salt     [32]byte
	StreamID uint64
}

// Session holds one checkpoint's derived keys. Safe for concurrent use.
type Session struct {
	p       Params
	aead    cipher.AEAD
	macKey  []byte
	hashKey []byte
	// sharedKey seals the chunks of a shared chunk store (SealShared): from
	// K alone, as every checkpoint of K reads them.
	sharedKey []byte

	zmu   sync.Mutex
	zeros map[int][32]byte // keyed hashes of zero chunks, by length
}

// NewSession starts a new checkpoint under k: a random salt and stream id.
func NewSession(k *Key) (*Session, error) {
	p := Params{Cipher: CipherAES256GCM, KeyID: k.id}
	rand.Read(p.Salt[:])
	var id [8]byte
	for p.StreamID == 0 { // 0 is avoided by writers (FORMAT.md)
		rand.Read(id[:])
		p.StreamID = binary.LittleEndian.Uint64(id[:])
	}
	return open(k, p)
}

// Open derives the session of an existing checkpoint. It fails with
// ErrNoKey when k is nil and ErrWrongKey when k is not the key p names.
func Open(k *Key, p Params) (*Session, error) {
	if k == nil {
		return nil, fmt.Errorf("%w: it needs key %s (--key-file or %s)", ErrNoKey, p.KeyID, knobs.Key.Name)
	}
	if k.id != p.KeyID {
		return nil, fmt.Errorf("%w: checkpoint is encrypted with key %s, the key given is %s", ErrWrongKey, p.KeyID, k.id)
	}
	if p.Cipher != CipherAES256GCM {
		return nil, fmt.Errorf("cipher %d unknown to this gpucr-stream: %w", p.Cipher, errdefs.ErrCorrupt)
	}
	return open(k, p)
}

func derive(k *Key, salt []byte, label string) []byte {
	b, err := hkdf.Key(sha256.New, k.k[:], salt, label, 32)
	if err != nil {
		panic(err) // only for lengths out of range; 32 is not
	}
	return b
}

func open(k *Key, p Params) (*Session, error) {
	var sid [8]byte
	binary.LittleEndian.PutUint64(sid[:], p.StreamID)
	// The stream id is in the info as well as in every chunk's associated
	// data: the keys of two checkpoints differ even if salts collide.
	ck := derive(k, p.Salt[:], "gpucr-stream v2 aes-256-gcm chunk key "+string(sid[:]))
	block, err := aes.NewCipher(ck)
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &Session{
		p:         p,
		aead:      aead,
		macKey:    derive(k, p.Salt[:], "gpucr-stream v2 hmac-sha256 metadata key "+string(sid[:])),
		hashKey:   derive(k, nil, "gpucr-stream v2 blake3 content hash key"),
		sharedKey: derive(k, nil, "gpucr-stream v4 shared chunk master key"),
		zeros:     map[int][32]byte{},
	}, nil
}

// Params are the session's public parameters.
func (s *Session) Params() Params { return s.p }

// StreamID is the checkpoint's stream id, bound into every chunk.
func (s *Session) StreamID() uint64 { return s.p.StreamID }

// Chunk is what a sealed chunk is bound to.
type Chunk struct {
	FileID uint32
	Name   string
	Offset uint64
	RawLen uint32
	Codec  uint8
}

func (s *Session) nonce(c Chunk) []byte {
	n := make([]byte, 12)
	binary.LittleEndian.PutUint32(n, c.FileID)
	binary.LittleEndian.PutUint64(n[4:], c.Offset)
	return n
}

func (s *Session) ad(c Chunk) []byte {
	b := make([]byte, 0, 32+len(c.Name))
	b = append(b, "gpucr-stream v2 chunk\x00"...)
	b = binary.LittleEndian.AppendUint64(b, s.p.StreamID)
	b = binary.LittleEndian.AppendUint32(b, c.FileID)
	b = binary.LittleEndian.AppendUint64(b, c.Offset)
	b = binary.LittleEndian.AppendUint32(b, c.RawLen)
	b = append(b, c.Codec)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(c.Name)))
	return append(b, c.Name...)
}

// Seal encrypts an encoded chunk and the CRC-32C of its raw bytes,
// appending to dst. dst may be encoded[:0] (in place) when cap(encoded) is
// at least len(encoded)+Overhead.
func (s *Session) Seal(dst, encoded []byte, rawCRC uint32, c Chunk) []byte {
	n := len(encoded)
	pt := binary.LittleEndian.AppendUint32(encoded, rawCRC)
	return s.aead.Seal(dst, s.nonce(c), pt[:n+4], s.ad(c))
}

// OpenChunk authenticates and decrypts a sealed payload in place, returning
// the encoded chunk (a prefix of sealed) and the raw bytes' CRC-32C.
func (s *Session) OpenChunk(sealed []byte, c Chunk) ([]byte, uint32, error) {
	if len(sealed) < Overhead {
		return nil, 0, fmt.Errorf("sealed chunk of %d bytes, shorter than its tag: %w", len(sealed), ErrAuth)
	}
	pt, err := s.aead.Open(sealed[:0], s.nonce(c), sealed, s.ad(c))
	if err != nil {
		return nil, 0, ErrAuth
	}
	n := len(pt) - 4
	return pt[:n], binary.LittleEndian.Uint32(pt[n:]), nil
}

// Hash is the keyed BLAKE3-256 of a raw chunk, in place of the plain one
// (on the calling goroutine, as codec.ContentHash).
func (s *Session) Hash(raw []byte) [32]byte {
	return codec.KeyedHash((*[32]byte)(s.hashKey), raw)
}

// ZeroHash is Hash of n zero bytes, cached for up to maxZeroHashes
// lengths: zero chunks are common and have a few lengths in an honest
// image, while a hostile one may declare a new length in every frame.
func (s *Session) ZeroHash(n int) [32]byte {
	s.zmu.Lock()
	h, ok := s.zeros[n]
	s.zmu.Unlock()
	if !ok {
		if n < 0 || n > codec.MaxChunk {
			return [32]byte{}
		}
		h = codec.KeyedZeroHash((*[32]byte)(s.hashKey), n)
		s.zmu.Lock()
		if len(s.zeros) < maxZeroHashes {
			s.zeros[n] = h
		}
		s.zmu.Unlock()
	}
	return h
}

const maxZeroHashes = 64

// Digest is a file's digest in an encrypted checkpoint: keyed, so that no
// one without the key can make a digest for a truncated or reordered list
// of chunk hashes.
func (s *Session) Digest(chunkHashes []byte, size int64) [32]byte {
	h := blake3.New(32, s.hashKey)
	h.Write([]byte("gpucr-stream v2 file digest\x00"))
	h.Write(chunkHashes)
	h.Write(binary.LittleEndian.AppendUint64(nil, uint64(size)))
	var out [32]byte
	h.Sum(out[:0])
	return out
}

// MAC is HMAC-SHA256 with the checkpoint's metadata key over label and b.
func (s *Session) MAC(label string, b []byte) [32]byte {
	m := hmac.New(sha256.New, s.macKey)
	m.Write([]byte(label))
	m.Write([]byte{0})
	m.Write(b)
	var out [32]byte
	m.Sum(out[:0])
	return out
}

// CheckMAC compares in constant time.
func (s *Session) CheckMAC(label string, b []byte, tag []byte) bool {
	want := s.MAC(label, b)
	return hmac.Equal(want[:], tag)
}

// PackOverhead is what sealing adds to a chunk of a shared chunk store
// (format 4): the chunk's salt, the GCM tag and the encrypted CRC-32C.
const PackOverhead = packSaltSize + Overhead

const packSaltSize = 32

// A chunk of a shared chunk store is read by every checkpoint that
// references it, so its sealing cannot depend on one checkpoint's keys, or
// on a place in a pack (readers read chunks by range, never a pack's
// header). Each sealing draws a fresh 256-bit salt, stored in front of the
// ciphertext, and derives a key used for that one chunk only: a nonce of
// zeros is then never reused under a key. The associated data binds the
// sealed bytes to the chunk's keyed id, raw length and codec.

// SealShared seals an encoded chunk and the CRC-32C of its raw bytes for a
// chunk store, appending to dst (never in place: the salt comes first).
func (s *Session) SealShared(dst, encoded []byte, rawCRC uint32, id [32]byte, rawLen uint32, codecID uint8) []byte {
	var salt [packSaltSize]byte
	rand.Read(salt[:])
	return s.sealSharedSalt(dst, encoded, rawCRC, id, rawLen, codecID, salt)
}

func (s *Session) sealSharedSalt(dst, encoded []byte, rawCRC uint32, id [32]byte, rawLen uint32, codecID uint8, salt [packSaltSize]byte) []byte {
	aead := s.sharedAEAD(salt[:])
	dst = append(dst, salt[:]...)
	pt := binary.LittleEndian.AppendUint32(encoded, rawCRC)
	return aead.Seal(dst, make([]byte, 12), pt, sharedAD(id, rawLen, codecID))
}

// OpenShared authenticates and decrypts a chunk sealed by SealShared, in
// place, returning the encoded chunk (inside sealed) and the raw bytes'
// CRC-32C.
func (s *Session) OpenShared(sealed []byte, id [32]byte, rawLen uint32, codecID uint8) ([]byte, uint32, error) {
	if len(sealed) < PackOverhead {
		return nil, 0, fmt.Errorf("sealed chunk of %d bytes, shorter than its salt and tag: %w", len(sealed), ErrAuth)
	}
	aead := s.sharedAEAD(sealed[:packSaltSize])
	ct := sealed[packSaltSize:]
	pt, err := aead.Open(ct[:0], make([]byte, 12), ct, sharedAD(id, rawLen, codecID))
	if err != nil {
		return nil, 0, ErrAuth
	}
	n := len(pt) - 4
	return pt[:n], binary.LittleEndian.Uint32(pt[n:]), nil
}

func (s *Session) sharedAEAD(salt []byte) cipher.AEAD {
	k, err := hkdf.Key(sha256.New, s.sharedKey, salt, "gpucr-stream v4 aes-256-gcm shared chunk key", 32)
	if err != nil {
		panic(err) // only for lengths out of range; 32 is not
	}
	block, err := aes.NewCipher(k)
	if err != nil {
		panic(err) // 32-byte keys are valid
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		panic(err)
	}
	return aead
}

func sharedAD(id [32]byte, rawLen uint32, codecID uint8) []byte {
	b := make([]byte, 0, 64)
	b = append(b, "gpucr-stream v4 shared chunk\x00"...)
	b = append(b, id[:]...)
	b = binary.LittleEndian.AppendUint32(b, rawLen)
	return append(b, codecID)
}
