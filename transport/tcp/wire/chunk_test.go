package wire

import (
	"bufio"
	"bytes"
	"io"
	"testing"
)

// A REF's payload is handed over as the cache's own memory only when the
// cache holds it there; a copy read back from its spill file is read as
// DATA is, and so is every payload when the caller does not ask.
func TestShardReaderLendPayload(t *testing.T) {
	hdr := bytes.Repeat([]byte{7}, RefFrameSize)
	cached := []byte("the cached chunk's stored bytes")
	var in bytes.Buffer
	WriteRecord(&in, RecRef, MarshalRef(hdr))
	WriteRecord(&in, RecData, []byte("tail"))
	WriteRecord(&in, RecEOS, nil)
	for _, c := range []struct {
		name           string
		lendable, take bool
	}{
		{"lendable, taken", true, true},
		{"lendable, read", true, false},
		{"spilled", false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			sr := NewShardReader(bufio.NewReader(bytes.NewReader(in.Bytes())), nil)
			sr.SetChunkCache(func(Chunk) error { return nil }, func(h []byte) ([]byte, bool, error) {
				if !bytes.Equal(h, hdr) {
					t.Fatalf("REF header %x", h)
				}
				return cached, c.lendable, nil
			}, func() {})
			got := make([]byte, RefFrameSize)
			if _, err := io.ReadFull(sr, got); err != nil || !bytes.Equal(got, hdr) {
				t.Fatalf("frame header: %x, %v", got, err)
			}
			if sr.LendPayload(len(cached)+1) != nil || sr.LendPayload(0) != nil {
				t.Fatal("LendPayload gave bytes that are not the whole payload")
			}
			var payload []byte
			if c.take {
				payload = sr.LendPayload(len(cached))
			}
			if lent := payload != nil; lent != (c.lendable && c.take) {
				t.Fatalf("LendPayload gave the payload: %v", lent)
			}
			if payload != nil && &payload[0] != &cached[0] {
				t.Fatal("LendPayload gave a copy")
			}
			if payload == nil {
				payload = make([]byte, len(cached))
				if _, err := io.ReadFull(sr, payload); err != nil {
					t.Fatal(err)
				}
			}
			rest, err := io.ReadAll(sr)
			if err != nil || !bytes.Equal(payload, cached) || string(rest) != "tail" {
				t.Fatalf("payload %q, then %q, %v", payload, rest, err)
			}
		})
	}
}
