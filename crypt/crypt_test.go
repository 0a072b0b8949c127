package crypt

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/knobs"
)

func key(t testing.TB, b byte) *Key {
	t.Helper()
	k, err := NewKey(bytes.Repeat([]byte{b}, KeySize))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestParseKey(t *testing.T) {
	raw := make([]byte, KeySize)
	for i := range raw {
		raw[i] = byte(i * 9)
	}
	want, _ := NewKey(raw)
	for _, tc := range []struct {
		what, text string
		ok         bool
	}{
		{"hex", hex.EncodeToString(raw), true},
		{"hex, upper case and a newline", strings.ToUpper(hex.EncodeToString(raw)) + "\n", true},
		{"base64", base64.StdEncoding.EncodeToString(raw), true},
		{"base64 without padding", base64.RawStdEncoding.EncodeToString(raw), true},
		{"base64url", base64.URLEncoding.EncodeToString(raw), true},
		{"31 bytes", hex.EncodeToString(raw[:31]), false},
		{"33 bytes", hex.EncodeToString(append(raw, 0)), false},
		{"passphrase", "correct horse battery staple", false},
		{"empty", "", false},
	} {
		k, err := ParseKey(tc.text)
		if tc.ok != (err == nil) {
			t.Errorf("%s: %v", tc.what, err)
			continue
		}
		if err == nil && k.ID() != want.ID() {
			t.Errorf("%s: key id %s, want %s", tc.what, k.ID(), want.ID())
		}
		if err != nil && (!errors.Is(err, ErrKeyFile) || strings.Contains(err.Error(), tc.text) && tc.text != "") {
			t.Errorf("%s: error %q does not wrap ErrKeyFile or echoes the input", tc.what, err)
		}
	}
}

func TestKeyID(t *testing.T) {
	a, b := key(t, 1), key(t, 2)
	if a.ID() == b.ID() || a.ID() != key(t, 1).ID() {
		t.Fatalf("key ids %s %s", a.ID(), b.ID())
	}
	// The id is not a piece of the key.
	if bytes.Contains(bytes.Repeat([]byte{1}, KeySize), a.id[:]) {
		t.Fatal("key id is part of the key")
	}
	if len(a.ID().String()) != 16 {
		t.Fatalf("key id %q", a.ID())
	}
}

func TestLoadKeyFile(t *testing.T) {
	dir := t.TempDir()
	text := GenerateKey()
	for _, tc := range []struct {
		what string
		mode os.FileMode
		ok   bool
	}{
		{"0600", 0o600, true},
		{"0400", 0o400, true},
		{"0640: group may read", 0o640, false},
		{"0604: others may read", 0o604, false},
		{"0620: group may write", 0o620, false},
	} {
		p := filepath.Join(dir, strings.ReplaceAll(tc.what, " ", "_"))
		if err := os.WriteFile(p, []byte(text+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, tc.mode); err != nil {
			t.Fatal(err)
		}
		k, err := LoadKeyFile(p)
		if tc.ok != (err == nil) {
			t.Errorf("%s: %v", tc.what, err)
		}
		if err != nil && (!strings.Contains(err.Error(), p) || strings.Contains(err.Error(), text)) {
			t.Errorf("%s: error %q does not name the file or shows the key", tc.what, err)
		}
		if err == nil {
			want, _ := ParseKey(text)
			if k.ID() != want.ID() {
				t.Errorf("%s: wrong key", tc.what)
			}
		}
	}
	if _, err := LoadKeyFile(dir); err == nil {
		t.Error("a directory was read as a key file")
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadKeyFile(fifo); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("a FIFO as key file: %v", err)
	}
	// LoadKey: the file first, then GPUCR_KEY, else no key.
	t.Setenv(knobs.Key.Name, "")
	if k, err := LoadKey(""); k != nil || err != nil {
		t.Errorf("LoadKey with nothing set: %v, %v", k, err)
	}
	t.Setenv(knobs.Key.Name, text)
	if k, err := LoadKey(""); k == nil || err != nil {
		t.Errorf("LoadKey from %s: %v", knobs.Key.Name, err)
	}
	t.Setenv(knobs.Key.Name, "nonsense")
	if _, err := LoadKey(""); err == nil || !strings.Contains(err.Error(), knobs.Key.Name) || strings.Contains(err.Error(), "nonsense") {
		t.Errorf("LoadKey with a bad %s: %v", knobs.Key.Name, err)
	}
}

func TestOpenSession(t *testing.T) {
	a, b := key(t, 1), key(t, 2)
	s, err := NewSession(a)
	if err != nil {
		t.Fatal(err)
	}
	p := s.Params()
	if _, err := Open(nil, p); !errors.Is(err, ErrNoKey) || !strings.Contains(err.Error(), a.ID().String()) {
		t.Errorf("no key: %v", err)
	}
	if _, err := Open(b, p); !errors.Is(err, ErrWrongKey) || !strings.Contains(err.Error(), a.ID().String()) || !strings.Contains(err.Error(), b.ID().String()) {
		t.Errorf("wrong key: %v", err)
	}
	q := p
	q.Cipher = 9
	if _, err := Open(a, q); !errors.Is(err, errdefs.ErrCorrupt) {
		t.Errorf("unknown cipher: %v", err)
	}
	s2, err := NewSession(a)
	if err != nil {
		t.Fatal(err)
	}
	if s2.Params().Salt == p.Salt || s2.Params().StreamID == p.StreamID {
		t.Fatal("two sessions drew the same salt or stream id")
	}
}

func TestSealOpen(t *testing.T) {
	k := key(t, 1)
	s, _ := NewSession(k)
	r, _ := Open(k, s.Params())
	other, _ := NewSession(k)
	enc := []byte("the encoded chunk, compressed or not")
	crc := crc32.Checksum([]byte("raw"), crc32.MakeTable(crc32.Castagnoli))
	c := Chunk{FileID: 3, Name: "pages-1.img", Offset: 4 << 20, RawLen: 1 << 20, Codec: 2}
	buf := make([]byte, len(enc), len(enc)+Overhead)
	copy(buf, enc)
	sealed := s.Seal(buf[:0], buf, crc, c)
	if len(sealed) != len(enc)+Overhead || &sealed[0] != &buf[0] {
		t.Fatalf("sealed %d bytes, in place %v", len(sealed), &sealed[0] == &buf[0])
	}
	if bytes.Contains(sealed, enc[:8]) {
		t.Fatal("sealed bytes hold the plain text")
	}
	fresh := func() []byte { return append([]byte(nil), sealed...) }
	got, gotCRC, err := r.OpenChunk(fresh(), c)
	if err != nil || !bytes.Equal(got, enc) || gotCRC != crc {
		t.Fatalf("open: %q %08x %v", got, gotCRC, err)
	}
	// Anything the chunk is bound to, changed, fails.
	for _, tc := range []struct {
		what string
		c    Chunk
		s    *Session
	}{
		{"file id", Chunk{4, c.Name, c.Offset, c.RawLen, c.Codec}, r},
		{"name", Chunk{c.FileID, "pages-2.img", c.Offset, c.RawLen, c.Codec}, r},
		{"offset", Chunk{c.FileID, c.Name, c.Offset + 1, c.RawLen, c.Codec}, r},
		{"raw length", Chunk{c.FileID, c.Name, c.Offset, c.RawLen - 1, c.Codec}, r},
		{"codec", Chunk{c.FileID, c.Name, c.Offset, c.RawLen, 3}, r},
		{"checkpoint", c, other},
	} {
		if _, _, err := tc.s.OpenChunk(fresh(), tc.c); !errors.Is(err, ErrAuth) || !errors.Is(err, errdefs.ErrCorrupt) {
			t.Errorf("%s changed: %v", tc.what, err)
		}
	}
	for i := range sealed {
		b := fresh()
		b[i] ^= 0x80
		if _, _, err := r.OpenChunk(b, c); !errors.Is(err, ErrAuth) {
			t.Fatalf("byte %d flipped: %v", i, err)
		}
	}
	for n := range Overhead {
		if _, _, err := r.OpenChunk(fresh()[:n], c); !errors.Is(err, ErrAuth) {
			t.Fatalf("%d bytes: %v", n, err)
		}
	}
	if _, _, err := r.OpenChunk(fresh()[:len(sealed)-1], c); !errors.Is(err, ErrAuth) {
		t.Fatalf("truncated: %v", err)
	}
}

func TestHashesAreKeyed(t *testing.T) {
	a, _ := NewSession(key(t, 1))
	a2, _ := NewSession(key(t, 1))
	b, _ := NewSession(key(t, 2))
	data := []byte("1234")
	if a.Hash(data) != a2.Hash(data) {
		t.Error("one key, two checkpoints: content hashes differ (they identify chunks across checkpoints)")
	}
	if a.Hash(data) == b.Hash(data) {
		t.Error("two keys give the same content hash")
	}
	if a.ZeroHash(10) != a.Hash(make([]byte, 10)) {
		t.Error("ZeroHash differs from Hash of zeros")
	}
	h := a.Hash(data)
	if a.Digest(h[:], 4) == b.Digest(h[:], 4) || a.Digest(h[:], 4) == a.Digest(h[:], 5) {
		t.Error("digest not keyed or not bound to the size")
	}
	m := a.MAC("manifest", data)
	if !a.CheckMAC("manifest", data, m[:]) || a.CheckMAC("other", data, m[:]) || a2.CheckMAC("manifest", data, m[:]) {
		t.Error("MAC not bound to its label or checkpoint")
	}
}

// FuzzOpenChunk: whatever the sealed bytes and the chunk identity, opening
// never panics, and succeeds only for what was sealed.
func FuzzOpenChunk(f *testing.F) {
	k, _ := NewKey(bytes.Repeat([]byte{7}, KeySize))
	s, _ := NewSession(k)
	c := Chunk{FileID: 1, Name: "a.img", Offset: 0, RawLen: 5, Codec: 2}
	good := s.Seal(nil, []byte("hello"), 99, c)
	f.Add(good, uint32(1), "a.img", uint64(0), uint32(5), uint8(2))
	f.Add(good[:Overhead], uint32(1), "a.img", uint64(0), uint32(5), uint8(2))
	f.Add([]byte{}, uint32(0), "", uint64(0), uint32(0), uint8(0))
	f.Fuzz(func(t *testing.T, b []byte, id uint32, name string, off uint64, raw uint32, cd uint8) {
		ch := Chunk{id, name, off, raw, cd}
		in := append([]byte(nil), b...)
		enc, crc, err := s.OpenChunk(in, ch)
		if err != nil {
			if !errors.Is(err, ErrAuth) {
				t.Fatalf("error %v is not ErrAuth", err)
			}
			return
		}
		if ch != c || !bytes.Equal(b, good) || string(enc) != "hello" || crc != 99 {
			t.Fatalf("opened something never sealed: %+v %q", ch, enc)
		}
	})
}

// TestVector is docs/FORMAT.md section 15.2's test vector.
func TestVector(t *testing.T) {
	kb := make([]byte, KeySize)
	for i := range kb {
		kb[i] = byte(i)
	}
	k, _ := NewKey(kb)
	p := Params{Cipher: CipherAES256GCM, KeyID: k.ID(), StreamID: 0x0102030405060708}
	for i := range p.Salt {
		p.Salt[i] = 0xaa
	}
	s, err := Open(k, p)
	if err != nil {
		t.Fatal(err)
	}
	raw := []byte("hello, world")
	crc := crc32.Checksum(raw, crc32.MakeTable(crc32.Castagnoli))
	sealed := s.Seal(nil, raw, crc, Chunk{Name: "a.img", RawLen: uint32(len(raw))})
	h := s.Hash(raw)
	for _, c := range []struct{ what, got, want string }{
		{"key id", k.ID().String(), "83a457ffea7efbdc"},
		{"crc", hex.EncodeToString([]byte{byte(crc >> 24), byte(crc >> 16), byte(crc >> 8), byte(crc)}), "6999a41f"},
		{"payload", hex.EncodeToString(sealed), "d825df9b688ebda9de711d073ac12847a608197af216bb8c71a0eccab9016755"},
		{"keyed hash", hex.EncodeToString(h[:]), "09add0e948c7493c64ff4b9055cad35af37fd6d9f938b2c25f6f701158e8e8f9"},
	} {
		if c.got != c.want {
			t.Errorf("%s: %s, want %s", c.what, c.got, c.want)
		}
	}
}

// ZeroHash of many lengths (a hostile stream declares a new one in every
// frame) keeps at most maxZeroHashes of them, and is right for all.
func TestZeroHashBounded(t *testing.T) {
	s, err := NewSession(key(t, 3))
	if err != nil {
		t.Fatal(err)
	}
	for n := 1; n <= 3*maxZeroHashes; n++ {
		if got, want := s.ZeroHash(n*512), s.Hash(make([]byte, n*512)); got != want {
			t.Fatalf("ZeroHash(%d) wrong", n*512)
		}
	}
	if len(s.zeros) > maxZeroHashes {
		t.Fatalf("%d zero lengths cached, want at most %d", len(s.zeros), maxZeroHashes)
	}
}

// A secret file's path that does not open never reaches a message: it may
// be the secret itself (--key-file=$(cat key) printed the key in "no such
// file"). The message says the path's length instead.
func TestSecretFileErrorsHideThePath(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	key := GenerateKey()
	for _, tc := range []struct {
		what  string
		setup func(path string)
	}{
		{"missing", func(string) {}},
		{"in a missing directory", func(string) {}},
		{"too long", func(string) {}},
	} {
		path := key + "-" + strings.ReplaceAll(tc.what, " ", "-")
		switch tc.what {
		case "in a missing directory":
			path = key + "/" + key
		case "too long":
			path = strings.Repeat(key, 5)
		}
		tc.setup(path)
		_, err := ReadKeyFile(path)
		if err == nil {
			t.Fatalf("%s: read", tc.what)
		}
		if strings.Contains(err.Error(), key[:16]) {
			t.Errorf("%s: the message shows the path: %q", tc.what, err)
		}
		if !strings.Contains(err.Error(), fmt.Sprintf("path of %d bytes", len(path))) {
			t.Errorf("%s: the message does not say which path: %q", tc.what, err)
		}
	}
	if _, err := ReadSecretFile(key, 1); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing: %v, want one that is os.ErrNotExist", err)
	}
}

// TestSealShared: a chunk sealed for a chunk store opens in any checkpoint
// of the key (another session), not under another key, and not as another
// id, length or codec; each sealing draws its own salt.
func TestSealShared(t *testing.T) {
	k := key(t, 1)
	s, _ := NewSession(k)
	other, _ := NewSession(k) // another checkpoint of the same key
	foreign, _ := NewSession(key(t, 2))
	enc := []byte("the encoded chunk, compressed or not")
	id := [32]byte{1, 2, 3}
	sealed := s.SealShared(nil, enc, 0xdeadbeef, id, 1<<20, 2)
	if len(sealed) != len(enc)+PackOverhead || bytes.Contains(sealed, enc[:8]) {
		t.Fatalf("sealed %d bytes for %d (plain text inside: %v)", len(sealed), len(enc), bytes.Contains(sealed, enc[:8]))
	}
	if again := s.SealShared(nil, enc, 0xdeadbeef, id, 1<<20, 2); bytes.Equal(again, sealed) {
		t.Fatal("two sealings of one chunk are equal: the salt is not fresh")
	}
	fresh := func() []byte { return append([]byte(nil), sealed...) }
	got, crc, err := other.OpenShared(fresh(), id, 1<<20, 2)
	if err != nil || !bytes.Equal(got, enc) || crc != 0xdeadbeef {
		t.Fatalf("open in another checkpoint of the key: %q %08x %v", got, crc, err)
	}
	for _, tc := range []struct {
		what  string
		s     *Session
		id    [32]byte
		raw   uint32
		codec uint8
	}{
		{"key", foreign, id, 1 << 20, 2},
		{"id", s, [32]byte{1, 2, 4}, 1 << 20, 2},
		{"raw length", s, id, 1<<20 - 1, 2},
		{"codec", s, id, 1 << 20, 3},
	} {
		if _, _, err := tc.s.OpenShared(fresh(), tc.id, tc.raw, tc.codec); !errors.Is(err, ErrAuth) {
			t.Errorf("%s changed: %v", tc.what, err)
		}
	}
	for i := range sealed {
		b := fresh()
		b[i] ^= 0x80
		if _, _, err := s.OpenShared(b, id, 1<<20, 2); !errors.Is(err, ErrAuth) {
			t.Fatalf("byte %d flipped: %v", i, err)
		}
	}
	for n := range PackOverhead {
		if _, _, err := s.OpenShared(fresh()[:n], id, 1<<20, 2); !errors.Is(err, ErrAuth) {
			t.Fatalf("%d bytes: %v", n, err)
		}
	}
}

// TestVectorShared is FORMAT.md section 17.7's test vector.
func TestVectorShared(t *testing.T) {
	kb := make([]byte, KeySize)
	for i := range kb {
		kb[i] = byte(i)
	}
	k, _ := NewKey(kb)
	s, err := NewSession(k)
	if err != nil {
		t.Fatal(err)
	}
	raw := []byte("hello, world")
	crc := crc32.Checksum(raw, crc32.MakeTable(crc32.Castagnoli))
	id := s.Hash(raw)
	var salt [packSaltSize]byte
	for i := range salt {
		salt[i] = 0xbb
	}
	sealed := s.sealSharedSalt(nil, raw, crc, id, uint32(len(raw)), 0, salt)
	want := "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbcff3daff5f053ae9ad3f316e056a478b8ba7d1a65ee1529619e81c7a40ea123f" // also computed from FORMAT.md alone, with Python's cryptography
	if got := hex.EncodeToString(sealed); got != want {
		t.Errorf("payload %s, want %s", got, want)
	}
	if enc, c, err := s.OpenShared(sealed, id, uint32(len(raw)), 0); err != nil || string(enc) != "hello, world" || c != crc {
		t.Errorf("open: %q %08x %v", enc, c, err)
	}
}

// ZeroHash is Hash of that many zero bytes, cached or not.
func TestZeroHash(t *testing.T) {
	s, err := NewSession(key(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{0, 1, 4096, 16<<10 + 1, 4 << 20} {
		want := s.Hash(make([]byte, n))
		for range 2 { // computed, then cached
			if got := s.ZeroHash(n); got != want {
				t.Errorf("ZeroHash(%d) = %x, want %x", n, got, want)
			}
		}
	}
}
