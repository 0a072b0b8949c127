package tcp

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"io"
	"testing"
)

// FuzzTCPDecoders feeds arbitrary bytes to everything that reads the
// network: the hello, the reply, and a connection's records (shard data up
// to EOS, then control records). None may panic, allocate beyond the
// protocol's limits, or hand out more data than the DATA records declared.
func FuzzTCPDecoders(f *testing.F) {
	h := hello{Shard: 1, Count: 2, Session: [16]byte{1}}
	f.Add(h.marshal())
	f.Add(reply{Flags: 3, Message: "ok"}.marshal())
	f.Add(reply{Refused: true, Message: "authentication failed"}.marshal())
	var recs bytes.Buffer
	writeRecord(&recs, recData, []byte("stream bytes"))
	writeRecord(&recs, recData, nil)
	writeRecord(&recs, recEOS, nil)
	writeRecord(&recs, recCommit, []byte(`{"left_running":false}`))
	f.Add(recs.Bytes())
	var abort bytes.Buffer
	writeRecord(&abort, recData, []byte("x"))
	writeRecord(&abort, recAbort, []byte("gone"))
	f.Add(abort.Bytes())
	var ack bytes.Buffer
	writeRecord(&ack, recAck, []byte(`{"files":3}`))
	writeRecord(&ack, recReport, []byte(`{"pid":7}`))
	f.Add(ack.Bytes())
	f.Add([]byte{recData, 0, 0, 0, 0xff, 0xff, 0xff, 0xff})

	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) >= helloSize {
			if h, err := parseHello(b[:helloSize]); err == nil {
				if h.Count == 0 || h.Count > MaxStreams || h.Shard >= h.Count {
					t.Fatalf("accepted hello %+v", h)
				}
				if !bytes.Equal(h.marshal(), b[:helloSize]) {
					t.Fatalf("hello does not round-trip")
				}
			}
		}
		if rep, fixed, err := readReply(bytes.NewReader(b)); err == nil {
			if len(rep.Message) > maxRefusal || len(fixed) != replyFixed {
				t.Fatalf("reply %+v", rep)
			}
		}
		// Shard data, then control records, as the receiver reads them.
		declared := int64(0)
		for off := 0; off+recHeaderSize <= len(b); {
			if b[off] == recData && b[off+1]|b[off+2]|b[off+3] == 0 {
				n := int64(binary.LittleEndian.Uint32(b[off+4:]))
				declared += n
				off += recHeaderSize + int(min(n, int64(len(b))))
				continue
			}
			break
		}
		sr := &shardReader{br: bufio.NewReaderSize(bytes.NewReader(b), 16)}
		n, _ := io.Copy(io.Discard, sr)
		if n > declared || n > int64(len(b)) {
			t.Fatalf("shard reader produced %d bytes, records declared %d, input %d", n, declared, len(b))
		}
		if sr.drain() == nil {
			for range 4 {
				h, p, err := readRecord(sr.br, true)
				if err != nil {
					break
				}
				if h.Type == recData || len(p) > maxControlRecord {
					t.Fatalf("control record %+v of %d bytes", h, len(p))
				}
			}
		}
		r := bufio.NewReader(bytes.NewReader(b))
		for range 4 {
			h, p, err := readRecord(r, false)
			if err != nil {
				break
			}
			if h.Type != recAck && h.Type != recNak && h.Type != recReport || len(p) > maxControlRecord {
				t.Fatalf("receiver record %+v of %d bytes", h, len(p))
			}
		}
	})
}
