package redact

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Text escapes what a peer's text could do to a terminal: control
// characters (escape sequences, carriage returns), other characters that
// do not print (bidirectional overrides) and bytes that are not UTF-8
// become Go escapes (\x1b, \u202e); the rest is left as it is.
func Text(s string) string {
	i := strings.IndexFunc(s, func(r rune) bool { return r == utf8.RuneError || !printable(r) })
	if i < 0 {
		return s
	}
	var b strings.Builder
	b.WriteString(s[:i])
	for s = s[i:]; s != ""; {
		r, size := utf8.DecodeRuneInString(s)
		switch {
		case r == utf8.RuneError && size <= 1:
			b.WriteString(`\x`)
			b.WriteString(strconv.FormatUint(uint64(s[0])>>4, 16))
			b.WriteString(strconv.FormatUint(uint64(s[0])&15, 16))
		case printable(r):
			b.WriteString(s[:size])
		default:
			q := strconv.QuoteRuneToASCII(r)
			b.WriteString(q[1 : len(q)-1])
		}
		s = s[size:]
	}
	return b.String()
}

func printable(r rune) bool { return r == ' ' || unicode.IsPrint(r) }
