package codec

import (
	"bytes"
	"os/exec"
	"testing"
)

// seedEncodings adds valid encodings of assorted data, so the decode fuzzer
// starts from inputs that get past the headers.
func seedEncodings(f *testing.F) {
	e := mustEncoder(f, "auto")
	for _, d := range dataKinds {
		for _, n := range []int{1, 7, 100, 5000, 70000} {
			raw := d.gen(n, uint64(n))
			raw[0] |= 1
			for _, p := range allPlans {
				id, stored := e.encodeAs(p, nil, raw)
				f.Add(uint8(id), bytes.Clone(stored), uint32(n))
			}
		}
	}
	f.Add(uint8(Zero), []byte{}, uint32(4096))
	f.Add(uint8(None), []byte("abc"), uint32(3))
	f.Add(uint8(7), []byte("abc"), uint32(3))
}

// FuzzDecode feeds arbitrary ids, bytes and raw lengths (up to 1 MiB) to
// Decode: it must return an error or fill dst completely, never panic, and
// never allocate beyond the raw length (bounded by the decoders' caps).
func FuzzDecode(f *testing.F) {
	seedEncodings(f)
	f.Fuzz(func(t *testing.T, id uint8, src []byte, rawLen uint32) {
		n := int(rawLen % (1<<20 + 1))
		cid := ID(id % 8) // mostly known ids, some unknown
		a := bytes.Repeat([]byte{0xA5}, n)
		errA := Decode(cid, a, src)
		if errA != nil {
			return
		}
		// Success must not depend on what dst held: every byte written.
		b := bytes.Repeat([]byte{0x5A}, n)
		if err := Decode(cid, b, src); err != nil {
			t.Fatalf("%v: second decode failed: %v", cid, err)
		}
		if !bytes.Equal(a, b) {
			t.Fatalf("%v: decode left bytes of dst unwritten", cid)
		}
		switch cid {
		case None:
			if !bytes.Equal(a, src) {
				t.Fatal("none: output differs from input")
			}
		case Zero:
			if !IsZero(a) {
				t.Fatal("zero: output not zero")
			}
		}
	})
}

// fuzzSpecs are the specs FuzzRoundTrip encodes every input with.
var fuzzSpecs = []string{"auto", "none", "lz4", "zstd", "zstd:3", "zstd:7", "zstd:19", "shuffle"}

// FuzzRoundTrip: encoding then decoding gives the input back, for every spec
// and every forced codec. grow tiles the input (each copy XORed with its
// index) so that chunks also reach the sizes where the auto chooser samples.
func FuzzRoundTrip(f *testing.F) {
	for _, d := range dataKinds {
		f.Add(d.gen(300, 1), uint16(0))
		f.Add(d.gen(1000, 2), uint16(40))
	}
	f.Add([]byte{}, uint16(0))
	f.Add([]byte{0, 0, 0, 1}, uint16(3))
	encoders := make([]*Encoder, len(fuzzSpecs))
	for i, s := range fuzzSpecs {
		encoders[i] = mustEncoder(f, s)
	}
	f.Fuzz(func(t *testing.T, data []byte, grow uint16) {
		raw := data
		if copies := int(grow % 128); copies > 0 && len(data) > 0 {
			raw = make([]byte, 0, len(data)*(copies+1))
			for c := range copies + 1 {
				for _, v := range data {
					raw = append(raw, v^byte(c))
				}
			}
		}
		for i, e := range encoders {
			var dst []byte
			if i%2 == 0 {
				dst = make([]byte, 0, e.MaxEncodedLen(len(raw)))
			}
			id, stored, err := e.Encode(dst, raw)
			if err != nil {
				t.Fatalf("%v: %v", e.Spec(), err)
			}
			checkEncoded(t, raw, id, stored)
		}
		if IsZero(raw) {
			return
		}
		for _, p := range allPlans {
			id, stored := encoders[0].encodeAs(p, nil, raw)
			checkEncoded(t, raw, id, stored)
		}
	})
}

// TestLitFrameReferenceDecoder checks literal-only frames against the
// reference zstd implementation, when its command line tool is installed.
func TestLitFrameReferenceDecoder(t *testing.T) {
	zstdCLI, err := exec.LookPath("zstd")
	if err != nil {
		t.Skip("zstd command not installed")
	}
	for _, d := range dataKinds {
		for _, n := range []int{1, 17, 300, 1023, 1024, 70000, 300000 + 5} {
			raw := d.gen(n, uint64(n))
			for _, k := range []int{1, 2, 4} {
				in := raw
				if k > 1 {
					in = make([]byte, n)
					shuffle(in, raw, k)
				}
				cmd := exec.Command(zstdCLI, "-d", "-c", "-q")
				cmd.Stdin = bytes.NewReader(litFrame(nil, in))
				out, err := cmd.Output()
				if err != nil || !bytes.Equal(out, in) {
					t.Fatalf("%s n=%d k=%d: reference zstd: %v (got %d bytes)", d.name, n, k, err, len(out))
				}
			}
		}
	}
}
