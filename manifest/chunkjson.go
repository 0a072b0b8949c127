package manifest

// A manifest's chunk index is most of it: a deduplicated checkpoint of a
// 13 GB GPU process lists about 40,000 chunks (10 MB of JSON), and
// encoding/json's reflection decoded them in 0.16 s of the restore's 0.2 s
// "open source" on the GPU machine. Chunk decodes itself: a single pass
// over the object as the manifest writes it (the eight keys, decimal
// integers, the hash as 64 hex digits); anything else (other spacing is
// fine, but other keys, case, escapes, numbers with a fraction or an
// exponent, null) goes to encoding/json, which then decides as it always
// did. FuzzChunkJSON holds the two to the same answers.

import (
	"encoding/hex"
	"encoding/json"
	"math"
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
	p := chunkParser{b: b}
	if !p.byte('{') {
		return c, false
	}
	if p.byte('}') {
		p.space()
		return c, p.i == len(p.b)
	}
	for {
		key, ok := p.key()
		if !ok || !p.byte(':') {
			return c, false
		}
		switch key {
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
			return c, false
		}
		if !ok {
			return c, false
		}
		if p.byte('}') {
			p.space()
			return c, p.i == len(p.b)
		}
		if !p.byte(',') {
			return c, false
		}
	}
}

type chunkParser struct {
	b []byte
	i int
}

func (p *chunkParser) space() {
	for p.i < len(p.b) && (p.b[p.i] == ' ' || p.b[p.i] == '\n' || p.b[p.i] == '\t' || p.b[p.i] == '\r') {
		p.i++
	}
}

// byte consumes c after any space.
func (p *chunkParser) byte(c byte) bool {
	p.space()
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

// key reads a string of plain lower-case letters (the keys it knows).
func (p *chunkParser) key() (string, bool) {
	if !p.byte('"') {
		return "", false
	}
	start := p.i
	for p.i < len(p.b) && p.b[p.i] >= 'a' && p.b[p.i] <= 'z' {
		p.i++
	}
	if p.i == len(p.b) || p.b[p.i] != '"' {
		return "", false
	}
	p.i++
	return string(p.b[start : p.i-1]), true
}

// int reads a JSON integer in [lo, hi]: an optional minus, then digits
// without a leading zero.
func (p *chunkParser) int(lo, hi int64) (int64, bool) {
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

func (p *chunkParser) uint32() (uint32, bool) {
	v, ok := p.int(0, math.MaxUint32)
	return uint32(v), ok
}

// hash reads the hash as a string of exactly 64 hex digits.
func (p *chunkParser) hash(h *Hash) bool {
	if !p.byte('"') || p.i+2*len(h)+1 > len(p.b) || p.b[p.i+2*len(h)] != '"' {
		return false
	}
	if _, err := hex.Decode(h[:], p.b[p.i:p.i+2*len(h)]); err != nil {
		return false
	}
	p.i += 2*len(h) + 1
	return true
}
