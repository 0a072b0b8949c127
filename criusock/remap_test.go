package criusock

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	fdinfo "github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	skinet "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-inet"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/testwait"
)

func u32(v uint32) *uint32 { return &v }

// filesImg builds a files.img of TCP sockets: port -> state.
func filesImg(t testing.TB, socks [][2]uint32) ([]byte, [][]byte) {
	img := binary.LittleEndian.AppendUint32(nil, imgCommonMagic)
	img = binary.LittleEndian.AppendUint32(img, filesMagic)
	var raws [][]byte
	for i, s := range socks {
		typ := fdinfo.FdTypes_INETSK
		fe := &fdinfo.FileEntry{Type: &typ, Id: u32(uint32(i + 1)),
			Isk: &skinet.InetSkEntry{Id: u32(uint32(i + 1)), Proto: u32(ipprotoTCP), State: u32(s[1]), SrcPort: u32(s[0]), DstPort: u32(0)}}
		raw, err := (proto.MarshalOptions{AllowPartial: true}).Marshal(fe)
		if err != nil {
			t.Fatal(err)
		}
		raws = append(raws, raw)
		img = binary.LittleEndian.AppendUint32(img, uint32(len(raw)))
		img = append(img, raw...)
	}
	return img, raws
}

func ports(t *testing.T, img []byte) []uint32 {
	var out []uint32
	for off := 8; off < len(img); {
		n := int(binary.LittleEndian.Uint32(img[off:]))
		var fe fdinfo.FileEntry
		if err := (proto.UnmarshalOptions{AllowPartial: true}).Unmarshal(img[off+4:off+4+n], &fe); err != nil {
			t.Fatal(err)
		}
		out = append(out, fe.GetIsk().GetSrcPort())
		off += 4 + n
	}
	return out
}

func TestPatchTCPListen(t *testing.T) {
	const established = 1
	img, raws := filesImg(t, [][2]uint32{{8080, tcpListen}, {8080, established}, {22, tcpListen}})
	got, err := PatchTCPListen(img, map[uint16]uint16{8080: 9090})
	if err != nil {
		t.Fatal(err)
	}
	if p := ports(t, got); len(p) != 3 || p[0] != 9090 || p[1] != 8080 || p[2] != 22 {
		t.Errorf("ports after remap %v, want [9090 8080 22] (only the listening socket moves)", p)
	}
	// Untouched entries keep their bytes.
	if !bytes.Contains(got, raws[1]) || !bytes.Contains(got, raws[2]) {
		t.Error("an entry that did not change was re-encoded")
	}
	_, err = PatchTCPListen(img, map[uint16]uint16{8080: 9090, 7000: 7001})
	if err == nil || !strings.Contains(err.Error(), "[7000]") || !strings.Contains(err.Error(), "[22 8080]") {
		t.Errorf("a port nobody listens on: %v", err)
	}
	for _, bad := range [][]byte{nil, []byte("notcriu!"), img[:len(img)-3], append(append([]byte{}, img[:8]...), 0xff, 0xff, 0, 0, 1)} {
		if _, err := PatchTCPListen(bad, map[uint16]uint16{1: 2}); !errors.Is(err, errdefs.ErrCorrupt) {
			t.Errorf("%x: %v, want ErrCorrupt", bad, err)
		}
	}
}

func TestParseTCPRemap(t *testing.T) {
	tests := []struct {
		in   string
		want map[uint16]uint16
	}{
		{"8080:9090", map[uint16]uint16{8080: 9090}},
		{"1:2, 3:4", map[uint16]uint16{1: 2, 3: 4}},
		{"8080", nil}, {"a:b", nil}, {"70000:1", nil}, {"1:2,1:3", nil}, {"0:5", nil},
	}
	for _, tc := range tests {
		got, err := ParseTCPRemap(tc.in)
		if (err != nil) != (tc.want == nil) || len(got) != len(tc.want) {
			t.Errorf("ParseTCPRemap(%q) = %v, %v", tc.in, got, err)
		}
		for k, v := range tc.want {
			if got[k] != v {
				t.Errorf("ParseTCPRemap(%q)[%d] = %d, want %d", tc.in, k, got[k], v)
			}
		}
	}
}

// FuzzPatchTCPListen: any files.img is patched or refused, never a panic.
func FuzzPatchTCPListen(f *testing.F) {
	img, _ := filesImg(f, [][2]uint32{{8080, tcpListen}})
	f.Add(img)
	f.Fuzz(func(t *testing.T, b []byte) {
		out, err := PatchTCPListen(b, map[uint16]uint16{8080: 9090})
		if err == nil && len(out) < 8 {
			t.Fatalf("patched image of %d bytes", len(out))
		}
	})
}

// TestRemapTCPListenLater: over a stream still arriving, the remap reads
// nothing until files.img is asked for, then waits for it; the patched
// image is served, other files pass through, and a port no socket listens
// on fails the request for files.img.
func TestRemapTCPListenLater(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	img, _ := filesImg(t, [][2]uint32{{8080, tcpListen}})
	c, buf := newCapture(t, ctx)
	for name, b := range map[string][]byte{"files.img": img, "other.img": []byte("other")} {
		if _, err := c.WriteFile(name, bytes.NewReader(b), false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	want, err := PatchTCPListen(img, map[uint16]uint16{8080: 9090})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		remaps  map[uint16]uint16
		wantErr string
	}{
		{"remapped", map[uint16]uint16{8080: 9090}, ""},
		{"no such port", map[uint16]uint16{7000: 7001}, "[7000]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pr, pw := io.Pipe()
			src := source.NewStreamSource(ctx, []io.Reader{pr}, []string{"pipe"}, source.StreamSourceOptions{ServeEarly: true})
			defer src.Close()
			r := RemapTCPListenLater(src, tc.remaps) // must not block: nothing has arrived
			got := make(chan error, 1)
			var out bytes.Buffer
			go func() {
				_, err := r.Copy(ctx, "files.img", &out)
				got <- err
			}()
			select {
			case err := <-got:
				t.Fatalf("files.img served before the stream carried it: %v", err)
			case <-time.After(50 * time.Millisecond):
			}
			if _, err := pw.Write(buf.Bytes()); err != nil {
				t.Fatal(err)
			}
			pw.Close()
			err := <-got
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("files.img with a port nobody listens on: %v", err)
				}
				return
			}
			if err != nil || !bytes.Equal(out.Bytes(), want) {
				t.Fatalf("files.img: %v, %d bytes, want the patched %d", err, out.Len(), len(want))
			}
			if f, err := r.Stat(ctx, "files.img"); err != nil || f.Size != int64(len(want)) {
				t.Errorf("Stat(files.img) = %+v, %v; want the patched size %d", f, err, len(want))
			}
			var other bytes.Buffer
			if _, err := r.Copy(ctx, "other.img", &other); err != nil || other.String() != "other" {
				t.Errorf("other.img: %q, %v", other.String(), err)
			}
		})
	}
}
