package wire

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"testing"
)

// FuzzDecoders feeds arbitrary bytes to everything that reads the
// network: the hello, the reply, and a connection's records (shard data up
// to EOS, then control records). None may panic, allocate beyond the
// protocol's limits, or hand out more data than the DATA records declared.
func FuzzDecoders(f *testing.F) {
	h := Hello{Shard: 1, Count: 2, Session: [16]byte{1}}
	f.Add(h.Marshal())
	f.Add(Reply{Flags: 3, Message: "ok"}.Marshal())
	f.Add(Reply{Refused: true, Message: "authentication failed"}.Marshal())
	var recs bytes.Buffer
	WriteRecord(&recs, RecData, []byte("stream bytes"))
	WriteRecord(&recs, RecData, nil)
	WriteRecord(&recs, RecEOS, nil)
	WriteRecord(&recs, RecCommit, []byte(`{"left_running":false}`))
	f.Add(recs.Bytes())
	var abort bytes.Buffer
	WriteRecord(&abort, RecData, []byte("x"))
	WriteRecord(&abort, RecAbort, []byte("gone"))
	f.Add(abort.Bytes())
	var ack bytes.Buffer
	WriteRecord(&ack, RecAck, []byte(`{"files":3}`))
	WriteRecord(&ack, RecReport, []byte(`{"pid":7}`))
	f.Add(ack.Bytes())
	f.Add([]byte{RecData, 0, 0, 0, 0xff, 0xff, 0xff, 0xff})

	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) >= HelloSize {
			if h, err := ParseHello(b[:HelloSize]); err == nil {
				if h.Count == 0 || h.Count > MaxStreams || h.Shard >= h.Count {
					t.Fatalf("accepted hello %+v", h)
				}
				if !bytes.Equal(h.Marshal(), b[:HelloSize]) {
					t.Fatalf("hello does not round-trip")
				}
			}
		}
		if rep, fixed, err := ReadReply(bytes.NewReader(b)); err == nil {
			if len(rep.Message) > MaxRefusal || len(fixed) != ReplyFixed {
				t.Fatalf("reply %+v", rep)
			}
		}
		// Shard data, then control records, as the receiver reads them.
		declared := int64(0)
		for off := 0; off+RecHeaderSize <= len(b); {
			if b[off] == RecData && b[off+1]|b[off+2]|b[off+3] == 0 {
				n := int64(binary.LittleEndian.Uint32(b[off+4:]))
				declared += n
				off += RecHeaderSize + int(min(n, int64(len(b))))
				continue
			}
			break
		}
		sr := &ShardReader{br: bufio.NewReaderSize(bytes.NewReader(b), 16)}
		n, _ := io.Copy(io.Discard, sr)
		if n > declared || n > int64(len(b)) {
			t.Fatalf("shard reader produced %d bytes, records declared %d, input %d", n, declared, len(b))
		}
		if sr.Drain() == nil {
			for range 4 {
				h, p, err := ReadRecord(sr.br, true)
				if err != nil {
					break
				}
				if h.Type == RecData || len(p) > MaxControlRecord {
					t.Fatalf("control record %+v of %d bytes", h, len(p))
				}
			}
		}
		r := bufio.NewReader(bytes.NewReader(b))
		for range 4 {
			h, p, err := ReadRecord(r, false)
			if err != nil {
				break
			}
			if h.Type != RecAck && h.Type != RecNak && h.Type != RecReport || len(p) > MaxControlRecord {
				t.Fatalf("receiver record %+v of %d bytes", h, len(p))
			}
		}
	})
}

// FuzzChunkRecords feeds arbitrary bytes to a shard reader that keeps a
// chunk cache: CHUNK records go to the cache, REF records come back as the
// cached bytes. It may not panic, accept a malformed CHUNK or REF, or hand
// out more than the DATA records declared plus what the REFs stood for.
func FuzzChunkRecords(f *testing.F) {
	var ok bytes.Buffer
	c := Chunk{Codec: 2, RawLen: 4096, CRC: 7, ID: [32]byte{9}}
	WriteRecord(&ok, RecChunk, append(MarshalChunkHeader(c), "stored"...))
	WriteRecord(&ok, RecData, []byte("head"))
	hdr := make([]byte, RefFrameSize)
	hdr[28] = 9
	WriteRecord(&ok, RecRef, MarshalRef(hdr))
	WriteRecord(&ok, RecEOS, nil)
	f.Add(ok.Bytes())
	var bad bytes.Buffer
	WriteRecord(&bad, RecRef, MarshalRef(make([]byte, RefFrameSize)))
	f.Add(bad.Bytes())
	f.Add([]byte{RecChunk, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f})

	f.Fuzz(func(t *testing.T, b []byte) {
		cache := map[[32]byte][]byte{}
		var expanded int64
		lastRef := 0
		sr := &ShardReader{br: bufio.NewReaderSize(bytes.NewReader(b), 16)}
		sr.SetChunkCache(func(c Chunk) error {
			if c.RawLen == 0 || len(c.Stored) == 0 || len(c.Stored) > MaxChunkStored {
				t.Fatalf("accepted chunk %+v", c)
			}
			cache[c.ID] = append([]byte(nil), c.Stored...)
			return nil
		}, func(hdr []byte) ([]byte, bool, error) {
			if len(hdr) != RefFrameSize {
				t.Fatalf("REF header of %d bytes", len(hdr))
			}
			var id [32]byte
			copy(id[:], hdr[28:60])
			p, ok := cache[id]
			if !ok {
				return nil, false, fmt.Errorf("no chunk %x", id[:8])
			}
			expanded += int64(RefFrameSize + len(p))
			lastRef = len(p)
			return p, len(p)%2 == 0, nil
		}, func() {})
		if len(b)%3 == 0 {
			// As the cache does: CHUNK records read into memory it gives.
			sr.SetChunkAlloc(func(n int) []byte {
				if n < 0 || n > ChunkFixed+MaxChunkStored {
					t.Fatalf("alloc(%d) for a CHUNK record", n)
				}
				return make([]byte, n)
			})
		}
		// Read as manifest.Reader does, borrowing REF payloads
		// where the reader offers them.
		var n int64
		buf := make([]byte, RefFrameSize)
		for {
			if lastRef > 0 {
				n += int64(len(sr.LendPayload(lastRef)))
				lastRef = 0
			}
			k, err := sr.Read(buf)
			n += int64(k)
			if err != nil {
				break
			}
		}
		if n > int64(len(b))+expanded {
			t.Fatalf("shard reader produced %d bytes from %d input bytes and %d expanded", n, len(b), expanded)
		}
	})
}
