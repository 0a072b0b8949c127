package redact

import "testing"

func TestText(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"plain text, 100% (ok)", "plain text, 100% (ok)"},
		{"", ""},
		{"x\x1b]0;pwned\x07y", `x\x1b]0;pwned\ay`},
		{"a\r\nb\tc", `a\r\nb\tc`},
		{"del\x7f c1\u009b", `del\x7f c1\u009b`},
		{"bidi \u202eevil", `bidi \u202eevil`},
		{"bad \xff\xfe utf8", `bad \xff\xfe utf8`},
		{"über ✓ 日本", "über ✓ 日本"},
		{"\uFFFD literal", "\uFFFD literal"},
	} {
		if got := Text(tc.in); got != tc.want {
			t.Errorf("Text(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}
