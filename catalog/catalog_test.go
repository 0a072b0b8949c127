package catalog

import "testing"

func TestCheckpointPrefix(t *testing.T) {
	tests := []struct {
		name, prefix string
		ok, man      bool
	}{
		{"manifest.json", "", true, true},
		{"a/b/manifest.json", "a/b/", true, true},
		{"segments/00000001.gcs", "", true, false},
		{"a/segments/00000001.gcs", "a/", true, false},
		{"a/xsegments/00000001.gcs", "", false, false},
		{"a/segments/0000001.gcs", "", false, false},
		{"a/segments/0000000a.gcs", "", false, false},
		{"a/segments/00000001.gcs.tmp", "", false, false},
		{"a/other.json", "", false, false},
	}
	for _, tc := range tests {
		p, ok, man := checkpointPrefix(tc.name)
		if p != tc.prefix || ok != tc.ok || man != tc.man {
			t.Errorf("checkpointPrefix(%q) = %q, %v, %v; want %q, %v, %v", tc.name, p, ok, man, tc.prefix, tc.ok, tc.man)
		}
	}
}
