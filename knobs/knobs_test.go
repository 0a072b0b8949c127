package knobs

import (
	"strings"
	"testing"
)

// The table names each variable once, under gpucr-stream's prefix, with
// its meaning; flags' variables are not in it.
func TestTable(t *testing.T) {
	seen := map[string]bool{}
	for _, k := range All() {
		if !strings.HasPrefix(k.Name, Prefix) || k.Meaning == "" || seen[k.Name] {
			t.Errorf("knob %+v: want a unique name under %s and a meaning", k, Prefix)
		}
		seen[k.Name] = true
		if k.Name == FlagVar("key-file") {
			t.Errorf("%s is a flag's variable", k.Name)
		}
	}
	if !seen[Key.Name] || !Key.Secret {
		t.Errorf("GPUCR_KEY is not in the table as a secret")
	}
}

func TestAccessors(t *testing.T) {
	for _, tc := range []struct {
		value string
		set   bool
		on    bool
		n     int
	}{{"1", true, true, 1}, {"0", true, false, 0}, {"8", true, false, 8}, {"x", true, false, 0}, {"", false, false, 0}} {
		if tc.set {
			t.Setenv(ReadAhead.Name, tc.value)
		} else {
			t.Setenv(ReadAhead.Name, "")
		}
		if v := ReadAhead.Value(); v != tc.value || ReadAhead.On() != tc.on || ReadAhead.Int() != tc.n {
			t.Errorf("%s=%q: Value %q, On %v, Int %d", ReadAhead.Name, tc.value, v, ReadAhead.On(), ReadAhead.Int())
		}
	}
	if got := FlagVar("s3-sse-key-file"); got != "GPUCR_S3_SSE_KEY_FILE" {
		t.Errorf("FlagVar(s3-sse-key-file) = %s", got)
	}
	t.Setenv("GPUCR_CHUNK_SIZE", "1MiB")
	if v, ok := FlagValue("chunk-size"); !ok || v != "1MiB" {
		t.Errorf("FlagValue(chunk-size) = %q, %v", v, ok)
	}
}
