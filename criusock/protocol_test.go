package criusock

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"

	imgstreamer "github.com/checkpoint-restore/go-criu/v7/crit/images/img-streamer"
	"google.golang.org/protobuf/proto"
)

func TestReadRequest(t *testing.T) {
	good, err := EncodeRequest("pages-1.img")
	if err != nil {
		t.Fatal(err)
	}
	lenOnly := func(n uint32) []byte { return binary.LittleEndian.AppendUint32(nil, n) }
	noName, _ := proto.Marshal(&imgstreamer.ImgStreamerReplyEntry{Exists: proto.Bool(true)})
	tests := []struct {
		name    string
		in      []byte
		want    string
		wantErr string
	}{
		{"good", good, "pages-1.img", ""},
		{"empty is EOF", nil, "", "EOF"},
		{"zero length", lenOnly(0), "", "length 0 out of range"},
		{"huge length", lenOnly(1 << 30), "", "out of range"},
		{"truncated length", []byte{5, 0}, "", "length"},
		{"truncated body", good[:len(good)-2], "", "body of"},
		{"not protobuf", append(lenOnly(3), 0xff, 0xff, 0xff), "", "criu request at socket offset 7"},
		{"missing required name", append(lenOnly(uint32(len(noName))), noName...), "", "criu request"},
		{"path in name", mustRequest(t, "../etc/passwd"), "", "invalid image name"},
		{"empty name", mustRequest(t, ""), "", "invalid image name"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ReadRequest(bytes.NewReader(tc.in), 7)
			if tc.wantErr == "" {
				if err != nil || got != tc.want {
					t.Fatalf("got %q, %v; want %q", got, err, tc.want)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("got %q, %v; want error containing %q", got, err, tc.wantErr)
			}
		})
	}
}

func mustRequest(t *testing.T, name string) []byte {
	t.Helper()
	b, err := proto.Marshal(&imgstreamer.ImgStreamerRequestEntry{Filename: proto.String(name)})
	if err != nil {
		t.Fatal(err)
	}
	return append(binary.LittleEndian.AppendUint32(nil, uint32(len(b))), b...)
}

// ReadRequest must consume exactly one request, leaving what follows (the
// byte that carries the next descriptor) in the reader.
func TestReadRequestReadsExactly(t *testing.T) {
	a, _ := EncodeRequest("inventory.img")
	b, _ := EncodeRequest("core-1.img")
	r := bytes.NewReader(append(append(a, 0), b...))
	if n, err := ReadRequest(r, 0); err != nil || n != "inventory.img" {
		t.Fatalf("first: %q %v", n, err)
	}
	if c, _ := r.ReadByte(); c != 0 {
		t.Fatalf("the descriptor byte was consumed")
	}
	if n, err := ReadRequest(r, 0); err != nil || n != "core-1.img" {
		t.Fatalf("second: %q %v", n, err)
	}
}

func TestWriteReply(t *testing.T) {
	for _, exists := range []bool{true, false} {
		var buf bytes.Buffer
		if err := WriteReply(&buf, exists); err != nil {
			t.Fatal(err)
		}
		n := binary.LittleEndian.Uint32(buf.Bytes())
		var rep imgstreamer.ImgStreamerReplyEntry
		if err := proto.Unmarshal(buf.Bytes()[4:], &rep); err != nil || int(n) != buf.Len()-4 || rep.GetExists() != exists {
			t.Fatalf("reply %v: %v %d %v", exists, err, n, rep.GetExists())
		}
	}
}

// FuzzReadRequest feeds arbitrary socket bytes to the request reader: it
// must never panic, never accept an unsafe name, and never read past the
// length it announced.
func FuzzReadRequest(f *testing.F) {
	for _, n := range []string{"inventory.img", "pages-1.img", "amdgpu-pages-1-2.img", "x"} {
		b, _ := EncodeRequest(n)
		f.Add(b)
	}
	f.Add([]byte{0, 0, 0, 0})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 1})
	f.Fuzz(func(t *testing.T, in []byte) {
		r := bytes.NewReader(in)
		for i := 0; i < 8; i++ {
			before := r.Len()
			name, err := ReadRequest(r, int64(len(in)-before))
			if err != nil {
				if errors.Is(err, io.EOF) && before != 0 {
					t.Fatalf("io.EOF with %d bytes left", before)
				}
				return
			}
			if !ValidImageName(name) {
				t.Fatalf("accepted unsafe name %q", name)
			}
			if used := before - r.Len(); used < 5 || used > 4+maxRequest {
				t.Fatalf("consumed %d bytes for one request", used)
			}
		}
	})
}
