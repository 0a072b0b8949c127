package manifest

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
)

func testMAC(key string) (mac func([]byte) []byte, check func(in, tag []byte) bool) {
	mac = func(in []byte) []byte {
		m := hmac.New(sha256.New, []byte(key))
		m.Write(in)
		return m.Sum(nil)
	}
	return mac, func(in, tag []byte) bool { return hmac.Equal(mac(in), tag) }
}

func sealedManifest(t testing.TB) *Manifest {
	return &Manifest{ID: "job", Tool: "test", Codec: "lz4", ChunkSize: 4096,
		Encryption: &Encryption{Cipher: 1, KeyID: KeyID{1, 2, 3, 4, 5, 6, 7, 8}, StreamID: 42},
		Labels:     map[string]string{"mac": "x", "checksum": "y"},
		Files:      []File{{Name: "a.img", ID: 3, Size: 1, Chunks: []Chunk{{RawLen: 1, Stored: 21, Codec: 0}}}}}
}

func TestManifestMAC(t *testing.T) {
	mac, check := testMAC("k")
	m := sealedManifest(t)
	doc, err := m.MarshalMAC(mac)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Marshal(); err == nil {
		t.Fatal("an encrypted manifest was marshalled without a MAC")
	}
	p, err := Parse(doc)
	if err != nil {
		t.Fatal(err)
	}
	if p.Format != VersionEncrypted || *p.Encryption != *m.Encryption || p.Files[0].ID != 3 {
		t.Fatalf("parsed %+v", p)
	}
	if err := CheckMAC(doc, check); err != nil {
		t.Fatal(err)
	}
	_, other := testMAC("other")
	if err := CheckMAC(doc, other); err == nil {
		t.Fatal("MAC accepted under another key")
	}
	// Every byte matters, except none: a flip anywhere fails the MAC or
	// the checksum.
	for i := range doc {
		b := bytes.Clone(doc)
		b[i] ^= 0x01
		if _, err := Parse(b); err == nil && CheckMAC(b, check) == nil {
			t.Fatalf("byte %d (%q) flipped, still authentic", i, doc[max(0, i-10):min(len(doc), i+10)])
		}
	}
	// Format 1 with an encryption member is corrupt.
	b := bytes.Replace(doc, []byte(`"format": 2`), []byte(`"format": 1`), 1)
	if _, err := Parse(fixChecksum(t, b)); !errors.Is(err, errdefs.ErrCorrupt) {
		t.Fatalf("format 1 with encryption: %v", err)
	}
}

// fixChecksum recomputes a document's CRC, as anyone can.
func fixChecksum(t testing.TB, b []byte) []byte {
	i := bytes.LastIndex(b, []byte(checksumKey)) + len(checksumKey)
	out := append([]byte(nil), b[:i]...)
	out = append(out, []byte(strings.Repeat("0", 8))...)
	copy(out[i:], []byte(hexCRC(b[:i])))
	return append(out, b[i+8:]...)
}

func hexCRC(b []byte) string {
	const digits = "0123456789abcdef"
	c := crc(b)
	out := make([]byte, 8)
	for i := 7; i >= 0; i-- {
		out[i] = digits[c&15]
		c >>= 4
	}
	return string(out)
}

// FuzzCheckMAC: any document, never a panic, never authentic unless it is
// the one sealed. The key is new each run: the fuzz cache keeps documents
// sealed by earlier runs (of older code, whose documents differ), and those
// are authentic under a fixed key.
func FuzzCheckMAC(f *testing.F) {
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		f.Fatal(err)
	}
	mac, check := testMAC(string(key))
	doc, err := sealedManifest(f).MarshalMAC(mac)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(doc)
	f.Add([]byte(`"mac": "` + `"checksum": "`))
	f.Add([]byte(`"mac": "0000", "checksum": "12345678"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if CheckMAC(b, check) == nil && !bytes.Equal(b, doc) {
			// Only the MAC's own digits' case could differ.
			in1, _ := macInput(b)
			in2, _ := macInput(doc)
			if !bytes.Equal(in1, in2) {
				t.Fatalf("a different document is authentic:\n%s", b)
			}
		}
	})
}
