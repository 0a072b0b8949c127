package codec

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"strings"
)

// Deterministic test data of the kinds a GPU checkpoint holds.

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)) }

// bf16Data: model weights from N(0, 0.02), stored as the upper 16 bits of
// float32 (bf16), little endian.
func bf16Data(n int, seed uint64) []byte {
	r := newRand(seed)
	b := make([]byte, n)
	for i := 0; i+2 <= n; i += 2 {
		f := float32(r.NormFloat64() * 0.02)
		binary.LittleEndian.PutUint16(b[i:], uint16(math.Float32bits(f)>>16))
	}
	if n%2 == 1 {
		b[n-1] = byte(r.Uint32())
	}
	return b
}

// fp32Data: weights from N(0, 0.02) as float32, little endian.
func fp32Data(n int, seed uint64) []byte {
	r := newRand(seed)
	b := make([]byte, n)
	for i := 0; i+4 <= n; i += 4 {
		binary.LittleEndian.PutUint32(b[i:], math.Float32bits(float32(r.NormFloat64()*0.02)))
	}
	for i := n &^ 3; i < n; i++ {
		b[i] = byte(r.Uint32())
	}
	return b
}

func randomData(n int, seed uint64) []byte {
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), 1, 2, 3})
	b := make([]byte, n)
	_, _ = r.Read(b)
	return b
}

var words = strings.Fields(`the of and to a in is it you that he was for on are with as I his they be at one
have this from or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long make thing
see him two has look more day could go come did number sound no most people my over know water than call
first who may down side been now find any new work part take get place made live where after back little only
round man year came show every good me give our under name very through just form sentence great think say
help low line differ turn cause much mean before move right boy old too same tell does set three want air well
also play small end put home read hand port large spell add even land here must big high such follow act why
ask men change went light kind off need house picture try us again animal point mother world near build self
earth father head stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north checkpoint restore process memory page kernel
device tensor stream chunk buffer socket pipe image dump error return value function struct pointer`)

// textData: English-like prose, words drawn from a Zipf distribution.
func textData(n int, seed uint64) []byte {
	r := newRand(seed)
	z := rand.NewZipf(r, 1.1, 2, uint64(len(words)-1))
	var sb strings.Builder
	sb.Grow(n + 64)
	col, sentence := 0, true
	for sb.Len() < n {
		w := words[z.Uint64()]
		if sentence {
			w = strings.ToUpper(w[:1]) + w[1:]
			sentence = false
		}
		sb.WriteString(w)
		col += len(w) + 1
		switch p := r.IntN(100); {
		case p < 7:
			sb.WriteString(". ")
			sentence = true
		case p < 12:
			sb.WriteString(", ")
		case p < 13:
			sb.WriteString(" 0x")
			sb.WriteString(strings.ToLower(strings.TrimLeft(fmtHex(r.Uint32()), "0")))
			sb.WriteByte(' ')
		default:
			sb.WriteByte(' ')
		}
		if col > 72 {
			sb.WriteByte('\n')
			col = 0
		}
	}
	return []byte(sb.String()[:n])
}

func fmtHex(v uint32) string {
	const digits = "0123456789ABCDEF"
	var b [8]byte
	for i := 7; i >= 0; i-- {
		b[i] = digits[v&15]
		v >>= 4
	}
	return string(b[:])
}

// pagesData imitates a process memory image: 4 KiB pages that are zero,
// text, heap-like records (small integers and pointers), bf16 or random.
func pagesData(n int, seed uint64) []byte {
	r := newRand(seed)
	b := make([]byte, 0, n)
	txt := textData(1<<20, seed+1)
	for len(b) < n {
		var p []byte
		switch k := r.IntN(100); {
		case k < 35:
			p = make([]byte, 4096)
		case k < 55:
			off := r.IntN(len(txt) - 4096)
			p = txt[off : off+4096]
		case k < 80:
			p = make([]byte, 4096)
			for i := 0; i < 4096; i += 32 {
				binary.LittleEndian.PutUint64(p[i:], 0x00007f0000000000|uint64(r.IntN(1<<20))<<4)
				binary.LittleEndian.PutUint32(p[i+8:], uint32(r.IntN(100)))
				binary.LittleEndian.PutUint32(p[i+12:], uint32(i))
				binary.LittleEndian.PutUint64(p[i+16:], 0x000055d000000000|uint64(r.IntN(1<<16))<<3)
			}
		case k < 90:
			p = bf16Data(4096, r.Uint64())
		default:
			p = randomData(4096, r.Uint64())
		}
		b = append(b, p...)
	}
	return b[:n]
}

type dataKind struct {
	name string
	gen  func(n int, seed uint64) []byte
}

var dataKinds = []dataKind{
	{"bf16", bf16Data},
	{"fp32", fp32Data},
	{"random", randomData},
	{"text", textData},
	{"pages", pagesData},
	{"zeros", func(n int, _ uint64) []byte { return make([]byte, n) }},
}
