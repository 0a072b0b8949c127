package codec

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
)

func TestIDString(t *testing.T) {
	for _, tc := range []struct {
		id   ID
		want string
	}{
		{None, "none"}, {Zero, "zero"}, {LZ4, "lz4"}, {Zstd, "zstd"},
		{Shuffle2Zstd, "shuffle2+zstd"}, {Shuffle4Zstd, "shuffle4+zstd"},
		{6, "codec(6)"}, {255, "codec(255)"},
	} {
		if got := tc.id.String(); got != tc.want {
			t.Errorf("ID(%d).String() = %q, want %q", tc.id, got, tc.want)
		}
	}
}

// TestIDsPermanent pins the numbers written into archives.
func TestIDsPermanent(t *testing.T) {
	got := []ID{None, Zero, LZ4, Zstd, Shuffle2Zstd, Shuffle4Zstd}
	for i, id := range got {
		if int(id) != i || strings.HasPrefix(id.String(), "codec(") {
			t.Fatalf("codec %v has id %d, want %d", id, id, i)
		}
	}
	if ID(6).String() != "codec(6)" {
		t.Fatal("ID(6) known")
	}
}

func TestParseSpec(t *testing.T) {
	for _, tc := range []struct {
		in, want string // want "" means an error
	}{
		{"auto", "auto"}, {"none", "none"}, {"lz4", "lz4"}, {"zstd", "zstd"},
		{"zstd:1", "zstd"}, {"zstd:3", "zstd:3"}, {"zstd:19", "zstd:19"},
		{"shuffle", "shuffle"}, {" ZSTD:7 ", "zstd:7"}, {"Auto", "auto"},
		{"", ""}, {"gzip", ""}, {"zstd:0", ""}, {"zstd:20", ""}, {"zstd:", ""},
		{"zstd:x", ""}, {"zstd:-1", ""}, {"lz4:1", ""}, {"shuffle:2", ""}, {"zstd:3:1", ""},
	} {
		s, err := ParseSpec(tc.in)
		if tc.want == "" {
			if err == nil {
				t.Errorf("ParseSpec(%q) = %v, want an error", tc.in, s)
			} else if !strings.Contains(err.Error(), "codec:") {
				t.Errorf("ParseSpec(%q) error %q lacks context", tc.in, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("ParseSpec(%q): %v", tc.in, err)
			continue
		}
		if s.String() != tc.want {
			t.Errorf("ParseSpec(%q).String() = %q, want %q", tc.in, s, tc.want)
		}
		// The canonical form parses back to the same Spec.
		var u Spec
		if err := u.UnmarshalText([]byte(s.String())); err != nil || u != s {
			t.Errorf("round trip of %q: %v, %v", s, u, err)
		}
	}
	if (Spec{}).String() != "auto" {
		t.Errorf("zero Spec is %q, want auto", Spec{})
	}
}

// TestZstdLevelMapping checks the CLI levels land on klauspost's levels.
func TestZstdLevelMapping(t *testing.T) {
	for _, tc := range []struct {
		level int
		want  string
	}{{1, "fastest"}, {2, "fastest"}, {3, "default"}, {5, "default"}, {6, "better"}, {9, "better"}, {10, "best"}, {19, "best"}} {
		s, err := ParseSpec(fmt.Sprintf("zstd:%d", tc.level))
		if err != nil {
			t.Fatal(err)
		}
		if got := s.encoderLevel().String(); got != tc.want {
			t.Errorf("zstd:%d -> %s, want %s", tc.level, got, tc.want)
		}
	}
}

func TestShuffleMatchesGeneric(t *testing.T) {
	sizes := []int{0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1000, 4099, 65536 + 13}
	for _, k := range []int{2, 4} {
		for _, n := range sizes {
			src := randomData(n, uint64(n))
			want := make([]byte, n)
			shuffleGeneric(want, src, k)
			got := make([]byte, n)
			shuffle(got, src, k)
			if !bytes.Equal(got, want) {
				t.Fatalf("shuffle k=%d n=%d differs from reference", k, n)
			}
			back := make([]byte, n)
			unshuffle(back, got, k)
			if !bytes.Equal(back, src) {
				t.Fatalf("unshuffle k=%d n=%d does not invert shuffle", k, n)
			}
			unshuffleGeneric(back, got, k)
			if !bytes.Equal(back, src) {
				t.Fatalf("unshuffleGeneric k=%d n=%d does not invert shuffle", k, n)
			}
		}
	}
	// Layout: plane j holds byte j of each element, tail unshuffled.
	got := make([]byte, 11)
	shuffle(got, []byte{0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22}, 4)
	if want := []byte{0, 10, 1, 11, 2, 12, 3, 13, 20, 21, 22}; !bytes.Equal(got, want) {
		t.Fatalf("shuffle4 layout = %v, want %v", got, want)
	}
}

// testSpecs are all spec forms; slow levels are skipped for large inputs.
var testSpecs = []string{"auto", "none", "lz4", "zstd", "zstd:3", "zstd:7", "zstd:19", "shuffle"}

var testSizes = []int{0, 1, 3, 7, 8, 15, 16, 17, 33, 255, 256, 1000, 4095, 4097, 65535, 65537, 1<<20 + 3, 8 << 20}

func mustEncoder(tb testing.TB, spec string) *Encoder {
	tb.Helper()
	s, err := ParseSpec(spec)
	if err != nil {
		tb.Fatal(err)
	}
	e, err := NewEncoder(s)
	if err != nil {
		tb.Fatal(err)
	}
	return e
}

// checkEncoded checks Encode's rules for a result and that it decodes back.
func checkEncoded(tb testing.TB, raw []byte, id ID, stored []byte) {
	tb.Helper()
	switch {
	case IsZero(raw):
		if id != Zero || len(stored) != 0 {
			tb.Fatalf("all-zero chunk of %d bytes: got %v with %d bytes", len(raw), id, len(stored))
		}
	case id == None:
		if len(stored) != len(raw) || len(raw) > 0 && &stored[0] != &raw[0] {
			tb.Fatalf("None must return raw itself")
		}
	case id == Zero:
		tb.Fatalf("non-zero chunk encoded as Zero")
	default:
		if len(stored) >= len(raw) {
			tb.Fatalf("%v: stored %d bytes for %d raw", id, len(stored), len(raw))
		}
	}
	dst := make([]byte, len(raw))
	if len(raw) > 0 {
		dst[0] = 0xAA // Decode must overwrite, also for Zero
	}
	if err := Decode(id, dst, bytes.Clone(stored)); err != nil {
		tb.Fatalf("decode %v of %d bytes: %v", id, len(raw), err)
	}
	if !bytes.Equal(dst, raw) {
		tb.Fatalf("%v: round trip of %d bytes differs", id, len(raw))
	}
	if Checksum(dst) != Checksum(raw) {
		tb.Fatal("checksum differs")
	}
}

func TestRoundTrip(t *testing.T) {
	for _, spec := range testSpecs {
		e := mustEncoder(t, spec)
		for _, d := range dataKinds {
			for _, n := range testSizes {
				if n > 1<<20 && (testing.Short() || strings.HasPrefix(spec, "zstd:") || spec == "none") {
					continue
				}
				t.Run(fmt.Sprintf("%s/%s/%d", spec, d.name, n), func(t *testing.T) {
					raw := d.gen(n, uint64(n)+7)
					var dst []byte
					if n%2 == 1 {
						dst = make([]byte, 0, e.MaxEncodedLen(n))
					}
					id, stored, err := e.Encode(dst, raw)
					if err != nil {
						t.Fatal(err)
					}
					checkEncoded(t, raw, id, stored)
				})
			}
		}
	}
}

// allPlans are all ways the encoders can write a chunk.
var allPlans = []plan{
	{id: LZ4}, {id: Zstd}, {id: Zstd, lit: true},
	{id: Shuffle2Zstd}, {id: Shuffle2Zstd, lit: true},
	{id: Shuffle4Zstd}, {id: Shuffle4Zstd, lit: true},
}

// TestEveryCodec forces each codec on each kind of data, whatever auto would
// pick, so every decoder is exercised on every shape of input.
func TestEveryCodec(t *testing.T) {
	e := mustEncoder(t, "auto")
	for _, p := range allPlans {
		for _, d := range dataKinds {
			for _, n := range testSizes {
				if n > 1<<20 && testing.Short() {
					continue
				}
				raw := d.gen(n, uint64(n))
				if IsZero(raw) {
					raw = append(raw, 1) // encodeAs expects a non-zero chunk
				}
				got, stored := e.encodeAs(p, nil, raw)
				if got != p.id && got != None {
					t.Fatalf("encodeAs(%v) gave %v", p, got)
				}
				checkEncoded(t, raw, got, stored)
			}
		}
	}
}

// TestDstReuse: with cap(dst) >= MaxEncodedLen the output lands in dst.
func TestDstReuse(t *testing.T) {
	raw := textData(1<<20, 1)
	for _, spec := range []string{"lz4", "zstd", "zstd:19", "shuffle"} {
		e := mustEncoder(t, spec)
		dst := make([]byte, 0, e.MaxEncodedLen(len(raw)))
		id, stored, err := e.Encode(dst, raw)
		if err != nil || id == None {
			t.Fatalf("%s: %v %v", spec, id, err)
		}
		if &stored[:1][0] != &dst[:1][0] {
			t.Errorf("%s: output not written into dst", spec)
		}
	}
	// Worst case: incompressible input must fit the bound without growing.
	z, err := zstdEncoder(mustEncoder(t, "zstd").spec.encoderLevel())
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{1, 100, 1000, 70000, 1 << 20, 3<<20 + 1} {
		raw := randomData(n, 3)
		buf := make([]byte, 0, MaxEncodedLen(Zstd, n))
		if out := z.EncodeAll(raw, buf); cap(out) != cap(buf) {
			t.Errorf("zstd output of %d random bytes grew past MaxEncodedLen: %d > %d", n, len(out), cap(buf))
		}
	}
}

// skewedData: independent bytes of 6-bit entropy, no repeats worth an LZ
// match: only entropy coding gains.
func skewedData(n int, seed uint64) []byte {
	r := newRand(seed)
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.IntN(64)) + 'A'
	}
	return b
}

func TestAutoChoice(t *testing.T) {
	e := mustEncoder(t, "auto")
	kinds := append([]dataKind{{"skewed", skewedData}}, dataKinds...)
	for _, tc := range []struct {
		data string
		want plan
	}{
		{"bf16", plan{Shuffle2Zstd, true}}, {"fp32", plan{Shuffle4Zstd, true}},
		{"random", plan{id: None}}, {"text", plan{id: Zstd}}, {"pages", plan{id: Zstd}},
		{"skewed", plan{Zstd, true}}, {"zeros", plan{id: Zero}},
	} {
		for _, d := range kinds {
			if d.name != tc.data {
				continue
			}
			raw := d.gen(4<<20, 5)
			if tc.want.id != Zero {
				if p := planAuto(raw); p != tc.want {
					t.Errorf("auto plan for %s: %+v, want %+v", tc.data, p, tc.want)
				}
			}
			id, _, err := e.Encode(nil, raw)
			if err != nil || id != tc.want.id {
				t.Errorf("auto on %s: %v, %v; want %v", tc.data, id, err, tc.want.id)
			}
		}
	}
	// "shuffle" picks the element size.
	s := mustEncoder(t, "shuffle")
	if id, _, _ := s.Encode(nil, bf16Data(1<<20, 1)); id != Shuffle2Zstd {
		t.Errorf("shuffle on bf16: %v", id)
	}
	if id, _, _ := s.Encode(nil, fp32Data(1<<20, 1)); id != Shuffle4Zstd {
		t.Errorf("shuffle on fp32: %v", id)
	}
}

// TestShuffleRatio holds the ratio aimed at for bf16 weights.
func TestShuffleRatio(t *testing.T) {
	raw := bf16Data(4<<20, 9)
	id, stored, _ := mustEncoder(t, "shuffle").Encode(nil, raw)
	r := float64(len(raw)) / float64(len(stored))
	t.Logf("%v on bf16: ratio %.3f", id, r)
	if r < 1.35 {
		t.Errorf("shuffle ratio on bf16 %.3f < 1.35", r)
	}
}

func TestDecodeErrors(t *testing.T) {
	raw := textData(100<<10, 2)
	e := mustEncoder(t, "auto")
	type enc struct {
		id  ID
		src []byte
	}
	encoded := []enc{{None, raw}, {Zero, nil}}
	for _, p := range allPlans {
		got, stored := e.encodeAs(p, nil, raw)
		if got != p.id {
			t.Fatalf("%v did not compress text", p)
		}
		encoded = append(encoded, enc{got, stored})
	}
	for _, c := range encoded {
		id, src := c.id, c.src
		n := len(raw)
		if id == Zero {
			n = 1000
		}
		// The right length decodes; one byte more or less does not.
		if err := Decode(id, make([]byte, n), src); err != nil {
			t.Fatalf("%v: %v", id, err)
		}
		for _, m := range []int{0, n - 1, n + 1} {
			if id == Zero {
				break
			}
			if err := Decode(id, make([]byte, m), src); !errors.Is(err, errdefs.ErrCorrupt) {
				t.Errorf("%v with rawLen %d of %d: err %v, want errdefs.ErrCorrupt", id, m, n, err)
			}
		}
		// Truncations are errors.
		for _, cut := range []int{1, 2, 3, 5, 17, len(src) / 2, len(src) - 1} {
			if cut <= 0 || cut >= len(src) {
				continue
			}
			if err := Decode(id, make([]byte, n), src[:cut]); err == nil {
				t.Errorf("%v truncated to %d of %d bytes: no error", id, cut, len(src))
			}
		}
		// Corruption: no panic. (Some flips still decode; the checksum
		// catches those.)
		for i := 0; i < len(src); i += max(1, len(src)/97) {
			bad := bytes.Clone(src)
			bad[i] ^= 0x5a
			_ = Decode(id, make([]byte, n), bad)
		}
	}
	if err := Decode(Zero, make([]byte, 10), []byte{0}); !errors.Is(err, errdefs.ErrCorrupt) {
		t.Errorf("zero with payload: %v", err)
	}
	if err := Decode(ID(9), make([]byte, 10), raw[:10]); !errors.Is(err, ErrUnknownCodec) || !strings.Contains(err.Error(), "codec(9)") {
		t.Errorf("unknown codec: %v", err)
	}
	if err := Decode(Zero, make([]byte, MaxChunk+1), nil); !errors.Is(err, ErrTooLarge) {
		t.Errorf("rawLen > MaxChunk: %v", err)
	}
	if _, _, err := e.Encode(nil, make([]byte, MaxChunk+1)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("encode > MaxChunk: %v", err)
	}
	// A zstd frame that declares more than rawLen is refused before decoding.
	big, stored := e.encodeAs(plan{id: Zstd}, nil, textData(1<<20, 3))
	if big != Zstd {
		t.Fatal("text did not compress")
	}
	if err := Decode(Zstd, make([]byte, 1000), stored); !errors.Is(err, errdefs.ErrCorrupt) {
		t.Errorf("zstd frame larger than rawLen: %v", err)
	}
}

// TestConcurrent shares one Encoder across goroutines (run with -race).
func TestConcurrent(t *testing.T) {
	e := mustEncoder(t, "auto")
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 6 {
				d := dataKinds[(g+i)%len(dataKinds)]
				raw := d.gen(256<<10+g, uint64(g*10+i))
				id, stored, err := e.Encode(nil, raw)
				if err != nil {
					t.Error(err)
					return
				}
				dst := make([]byte, len(raw))
				if err := Decode(id, dst, stored); err != nil || !bytes.Equal(dst, raw) {
					t.Errorf("%v round trip failed: %v", id, err)
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestDecodeChecked(t *testing.T) {
	raw := textData(10000, 1)
	id, stored, err := mustEncoder(t, "lz4").Encode(nil, raw)
	if err != nil || id != LZ4 {
		t.Fatal(id, err)
	}
	dst := make([]byte, len(raw))
	if err := DecodeChecked(id, dst, stored, Checksum(raw)); err != nil {
		t.Fatal(err)
	}
	if err := DecodeChecked(id, dst, stored, Checksum(raw)^1); !errors.Is(err, ErrChecksum) {
		t.Fatalf("wrong checksum: %v", err)
	}
	// A flipped literal byte decodes to the right length; the CRC catches it.
	bad := bytes.Clone(stored)
	bad[len(bad)-1] ^= 1
	if err := DecodeChecked(id, dst, bad, Checksum(raw)); !errors.Is(err, ErrChecksum) {
		t.Fatalf("corrupt literal: %v", err)
	}
}

func TestChecksums(t *testing.T) {
	if got := Checksum([]byte("123456789")); got != 0xe3069283 {
		t.Errorf("CRC-32C check value %#x, want 0xe3069283", got)
	}
	h := ContentHash(nil)
	if got := hex.EncodeToString(h[:]); got != "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262" {
		t.Errorf("BLAKE3 of empty input %s", got)
	}
}

func TestIsZero(t *testing.T) {
	for _, n := range []int{0, 1, 7, 8, 9, 63, 64, 65, 4096, len(zeroBlock) - 1, len(zeroBlock), len(zeroBlock) + 1, 3*len(zeroBlock) + 5} {
		b := make([]byte, n)
		if !IsZero(b) {
			t.Fatalf("IsZero(%d zeros) = false", n)
		}
		for _, i := range []int{0, 1, 7, 8, n / 2, len(zeroBlock) - 1, len(zeroBlock), n - 1} {
			if i < 0 || i >= n {
				continue
			}
			b[i] = 1
			if IsZero(b) {
				t.Fatalf("IsZero true with byte %d of %d set", i, n)
			}
			b[i] = 0
		}
	}
}
