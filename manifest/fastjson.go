package manifest

// A manifest's file and chunk index is most of it: a deduplicated
// checkpoint of a 13 GB GPU process lists about 40,000 chunks (10 MB of
// JSON), and encoding/json took 0.2 s of the restore's "open source" on the
// GPU machine to decode them, scanning every byte twice before reflection
// decoded it. Parse finds the top-level "files" array with a scan of its
// own, reads it in one pass where it is in the manifest's own form (the
// keys the manifest writes, plain ASCII names, decimal integers, hashes as
// 64 hex digits, any spacing), and leaves the rest of the document, with
// an empty array in its place, to encoding/json. Anything else (another
// key, an escape, a key that encoding/json would match without regard to
// case, a number with a fraction or an exponent, null) and the whole
// document goes to encoding/json, which then decides as it always did.
// Chunk decodes itself the same way wherever encoding/json meets one.
// FuzzFastDecode and FuzzChunkJSON hold the two to the same answers.

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"math"
	"strings"
)

// chunkFields is Chunk without its methods, for encoding/json.
type chunkFields Chunk

// UnmarshalJSON implements json.Unmarshaler.
func (c *Chunk) UnmarshalJSON(b []byte) error {
	if fast, ok := parseChunk(b, *c); ok {
		*c = fast
		return nil
	}
	return json.Unmarshal(b, (*chunkFields)(c))
}

// parseChunk reads a chunk object in the manifest's own form into c (the
// keys it lacks keep c's values, as with encoding/json); ok is false for
// anything else.
func parseChunk(b []byte, c Chunk) (Chunk, bool) {
	p := fastParser{b: b}
	ok := p.chunk(&c)
	p.space()
	return c, ok && p.i == len(p.b)
}

// chunk reads a chunk object at p.i into c.
func (p *fastParser) chunk(c *Chunk) bool {
	if !p.byte('{') {
		return false
	}
	if p.byte('}') {
		return true
	}
	for {
		key, ok := p.key()
		if !ok || !p.byte(':') {
			return false
		}
		switch string(key) {
		case "off":
			c.Offset, ok = p.int(math.MinInt64, math.MaxInt64)
		case "raw":
			c.RawLen, ok = p.uint32()
		case "stored":
			c.Stored, ok = p.uint32()
		case "codec":
			var v int64
			v, ok = p.int(0, math.MaxUint8)
			c.Codec = uint8(v)
		case "crc":
			c.Checksum, ok = p.uint32()
		case "hash":
			ok = p.hash(&c.Hash)
		case "seg":
			var v int64
			v, ok = p.int(math.MinInt, math.MaxInt)
			c.Segment = int(v)
		case "pos":
			c.Pos, ok = p.int(math.MinInt64, math.MaxInt64)
		default:
			return false
		}
		if !ok {
			return false
		}
		if p.byte('}') {
			return true
		}
		if !p.byte(',') {
			return false
		}
	}
}

// fastParser reads the manifest's own form of JSON at b[i:].
type fastParser struct {
	b []byte
	i int
}

func (p *fastParser) space() {
	for p.i < len(p.b) && isSpace(p.b[p.i]) {
		p.i++
	}
}

// byte consumes c after any space.
func (p *fastParser) byte(c byte) bool {
	p.space()
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

// key reads a string of plain lower-case letters (the keys it knows).
func (p *fastParser) key() ([]byte, bool) {
	if !p.byte('"') {
		return nil, false
	}
	start := p.i
	for p.i < len(p.b) && p.b[p.i] >= 'a' && p.b[p.i] <= 'z' {
		p.i++
	}
	if p.i == len(p.b) || p.b[p.i] != '"' {
		return nil, false
	}
	p.i++
	return p.b[start : p.i-1], true
}

// int reads a JSON integer in [lo, hi]: an optional minus, then digits
// without a leading zero.
func (p *fastParser) int(lo, hi int64) (int64, bool) {
	p.space()
	neg := p.i < len(p.b) && p.b[p.i] == '-'
	if neg {
		if lo >= 0 { // encoding/json refuses even -0 for an unsigned field
			return 0, false
		}
		p.i++
	}
	start := p.i
	var v uint64
	for p.i < len(p.b) && p.b[p.i] >= '0' && p.b[p.i] <= '9' {
		if p.i-start >= 19 { // 19 digits fit; more may not
			return 0, false
		}
		v = v*10 + uint64(p.b[p.i]-'0')
		p.i++
	}
	n := p.i - start
	if n == 0 || n > 1 && p.b[start] == '0' {
		return 0, false
	}
	if p.i < len(p.b) && (p.b[p.i] == '.' || p.b[p.i] == 'e' || p.b[p.i] == 'E') {
		return 0, false
	}
	if v > math.MaxInt64 {
		return 0, false
	}
	x := int64(v)
	if neg {
		x = -x
	}
	if x < lo || x > hi {
		return 0, false
	}
	return x, true
}

func (p *fastParser) uint32() (uint32, bool) {
	v, ok := p.int(0, math.MaxUint32)
	return uint32(v), ok
}

// hash reads the hash as a string of exactly 64 hex digits.
func (p *fastParser) hash(h *Hash) bool {
	if !p.byte('"') || p.i+2*len(h)+1 > len(p.b) || p.b[p.i+2*len(h)] != '"' {
		return false
	}
	if _, err := hex.Decode(h[:], p.b[p.i:p.i+2*len(h)]); err != nil {
		return false
	}
	p.i += 2*len(h) + 1
	return true
}

// fastDecode decodes b into m where its "files" array is in the
// manifest's own form; ok is false (m then holds nothing of use) where
// encoding/json must decode the whole of it.
func fastDecode(b []byte, m *Manifest) bool {
	start, end, files, ok := topFiles(b)
	if !ok {
		return false
	}
	rest := make([]byte, 0, len(b)-(end-start)+2)
	rest = append(append(append(rest, b[:start]...), "[]"...), b[end:]...)
	if json.Unmarshal(rest, m) != nil {
		return false
	}
	m.Files = files
	return true
}

// topFiles reads the value of the top-level key "files", an array in the
// manifest's own form, when it is the only top-level key encoding/json
// would take for it: no other key spelled "files" in another case, none
// escaped. start and end delimit the array in b.
func topFiles(b []byte) (start, end int, files []File, ok bool) {
	depth, found := 0, false
	expectKey := false // at depth 1, the next string is a key
	for i := 0; i < len(b); i++ {
		switch c := b[i]; c {
		case '{', '[':
			depth++
			expectKey = depth == 1 && c == '{'
		case '}', ']':
			depth--
		case ',':
			expectKey = depth == 1
		case '"':
			j := i + 1
			escaped := false
			for ; j < len(b) && b[j] != '"'; j++ {
				if b[j] == '\\' {
					escaped = true
					j++
				}
			}
			if j >= len(b) {
				return 0, 0, nil, false
			}
			if depth == 1 && expectKey {
				key := b[i+1 : j]
				switch {
				case escaped:
					return 0, 0, nil, false
				case string(key) == "files":
					p := fastParser{b: b, i: j + 1}
					if found || !p.byte(':') {
						return 0, 0, nil, false
					}
					p.space()
					start = p.i
					if !p.files(&files) {
						return 0, 0, nil, false
					}
					found, end = true, p.i
					i = end - 1
					expectKey = false
					continue
				case strings.EqualFold(string(key), "files"):
					return 0, 0, nil, false
				}
				expectKey = false
			}
			i = j
		}
	}
	return start, end, files, found
}

func isSpace(c byte) bool { return c == ' ' || c == '\n' || c == '\t' || c == '\r' }

// files reads an array of file objects.
func (p *fastParser) files(fs *[]File) bool { return array(p, fs, p.file) }

// array reads a JSON array into out (empty, not nil, for "[]", as
// encoding/json), each element by elem.
func array[T any](p *fastParser, out *[]T, elem func(*T) bool) bool {
	if !p.byte('[') {
		return false
	}
	*out = []T{}
	if p.byte(']') {
		return true
	}
	for {
		var v T
		if !elem(&v) {
			return false
		}
		*out = append(*out, v)
		if p.byte(']') {
			return true
		}
		if !p.byte(',') {
			return false
		}
	}
}

// file reads a file object; a key twice sends it to encoding/json.
func (p *fastParser) file(f *File) bool {
	if !p.byte('{') {
		return false
	}
	if p.byte('}') {
		return true
	}
	var seen [7]bool
	for {
		key, ok := p.key()
		if !ok || !p.byte(':') {
			return false
		}
		k := -1
		switch string(key) {
		case "name":
			k = 0
			f.Name, ok = p.plainString()
		case "id":
			k = 1
			f.ID, ok = p.uint32()
		case "size":
			k = 2
			f.Size, ok = p.int(math.MinInt64, math.MaxInt64)
		case "digest":
			k = 3
			ok = p.hash(&f.Digest)
		case "external":
			k = 4
			f.External, ok = p.bool()
		case "chunks":
			k = 5
			ok = p.chunks(&f.Chunks)
		case "carried":
			k = 6
			f.Carried, ok = p.bool()
		}
		if k < 0 || !ok || seen[k] {
			return false
		}
		seen[k] = true
		if p.byte('}') {
			return true
		}
		if !p.byte(',') {
			return false
		}
	}
}

// chunks reads an array of chunk objects.
func (p *fastParser) chunks(cs *[]Chunk) bool { return array(p, cs, p.chunk) }

// plainString reads a string of printable ASCII without escapes, which
// encoding/json decodes to the same bytes.
func (p *fastParser) plainString() (string, bool) {
	if !p.byte('"') {
		return "", false
	}
	start := p.i
	for p.i < len(p.b) && p.b[p.i] >= 0x20 && p.b[p.i] < 0x7f && p.b[p.i] != '"' && p.b[p.i] != '\\' {
		p.i++
	}
	if p.i == len(p.b) || p.b[p.i] != '"' {
		return "", false
	}
	p.i++
	return string(p.b[start : p.i-1]), true
}

func (p *fastParser) bool() (bool, bool) {
	p.space()
	switch {
	case bytes.HasPrefix(p.b[p.i:], []byte("true")):
		p.i += 4
		return true, true
	case bytes.HasPrefix(p.b[p.i:], []byte("false")):
		p.i += 5
		return false, true
	}
	return false, false
}
