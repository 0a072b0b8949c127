package wire

import "testing"

// TestPrintable: control characters become spaces and bytes that are not
// UTF-8 become '?', so the text never grows past the bytes a bound was
// checked on (a fuzzed reply of 1024 bytes became 1.6 KB through U+FFFD).
func TestPrintable(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"", ""},
		{"plain text", "plain text"},
		{"a\nb\tc\x7fd\x00", "a b c d "},
		{"\xff\xfe", "??"},
		{"ok \xe2\x82", "ok ??"},
		{"été ✓ \ufffd", "été ✓ \ufffd"},
	} {
		got := Printable(c.in)
		if got != c.want {
			t.Errorf("Printable(%q) = %q, want %q", c.in, got, c.want)
		}
		if len(got) > len(c.in) {
			t.Errorf("Printable(%q) grew to %d bytes", c.in, len(got))
		}
	}
}
