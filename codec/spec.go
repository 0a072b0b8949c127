package codec

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/klauspost/compress/zstd"
)

// specKind is what a Spec asks for. The zero value is auto, so Spec{} is the
// default choice.
type specKind uint8

const (
	specAuto specKind = iota
	specNone
	specLZ4
	specZstd
	specShuffle
)

// Spec is a user's codec choice: "auto", "none", "lz4", "zstd",
// "zstd:LEVEL" or "shuffle". The zero Spec is "auto". Specs are comparable.
type Spec struct {
	kind  specKind
	level int // zstd level 1..19 for "zstd"; 0 elsewhere
}

// Zstd levels accepted in "zstd:LEVEL", as on the zstd command line.
const (
	MinZstdLevel     = 1
	MaxZstdLevel     = 19
	DefaultZstdLevel = 1
)

// ParseSpec parses a codec choice:
//
//	auto        per-chunk choice by sampling (see Encoder)
//	none        store raw (all-zero chunks still become Zero)
//	lz4         LZ4 block
//	zstd        zstd level 1
//	zstd:LEVEL  zstd LEVEL 1..19, as on the zstd command line, mapped onto
//	            klauspost's four levels: 1-2 fastest, 3-5 default,
//	            6-9 better, 10-19 best
//	shuffle     byte-plane shuffle then zstd level 1; the element size (2 or
//	            4 bytes) is picked per chunk
//
// Case and surrounding space are ignored.
func ParseSpec(s string) (Spec, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	switch t {
	case "auto":
		return Spec{kind: specAuto}, nil
	case "none":
		return Spec{kind: specNone}, nil
	case "lz4":
		return Spec{kind: specLZ4}, nil
	case "zstd":
		return Spec{kind: specZstd, level: DefaultZstdLevel}, nil
	case "shuffle":
		return Spec{kind: specShuffle}, nil
	}
	if lv, ok := strings.CutPrefix(t, "zstd:"); ok {
		n, err := strconv.Atoi(lv)
		if err != nil || n < MinZstdLevel || n > MaxZstdLevel {
			return Spec{}, fmt.Errorf("codec: invalid zstd level %q in %q: want an integer %d..%d", lv, s, MinZstdLevel, MaxZstdLevel)
		}
		return Spec{kind: specZstd, level: n}, nil
	}
	return Spec{}, fmt.Errorf("codec: unknown codec %q: want auto, none, lz4, zstd, zstd:LEVEL (%d..%d) or shuffle", s, MinZstdLevel, MaxZstdLevel)
}

// String returns the canonical form, which ParseSpec accepts: "zstd" for
// zstd level 1, "zstd:N" for other levels.
func (s Spec) String() string {
	switch s.kind {
	case specAuto:
		return "auto"
	case specNone:
		return "none"
	case specLZ4:
		return "lz4"
	case specZstd:
		if lv := s.zstdLevel(); lv != DefaultZstdLevel {
			return "zstd:" + strconv.Itoa(lv)
		}
		return "zstd"
	case specShuffle:
		return "shuffle"
	}
	return "invalid"
}

// MarshalText and UnmarshalText let a Spec be a flag (flag.TextVar) or a
// JSON/manifest field.
func (s Spec) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

func (s *Spec) UnmarshalText(b []byte) error {
	v, err := ParseSpec(string(b))
	if err != nil {
		return err
	}
	*s = v
	return nil
}

// zstdLevel is the zstd CLI level the spec uses for its zstd stage.
func (s Spec) zstdLevel() int {
	if s.kind == specZstd && s.level != 0 {
		return s.level
	}
	return DefaultZstdLevel
}

// encoderLevel maps the CLI level onto klauspost's levels.
func (s Spec) encoderLevel() zstd.EncoderLevel {
	return zstd.EncoderLevelFromZstd(s.zstdLevel())
}
