package catalog

import (
	"testing"

	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/s3"
)

// The stores' extras are found by interface at run time: a signature that
// drifted would turn them off without a word.
var (
	_ tempRemover       = (*dir.Store)(nil)
	_ dirRemover        = (*dir.Store)(nil)
	_ incompleteRemover = (*s3.Store)(nil)
)

func TestCheckpointPrefix(t *testing.T) {
	tests := []struct {
		name, prefix string
		kind         objKind
	}{
		{"manifest.json", "", manifestObj},
		{"a/b/manifest.json", "a/b/", manifestObj},
		{"segments/00000001.gcs", "", segmentObj},
		{"a/segments/00000001.gcs", "a/", segmentObj},
		{"a/segments/8f3a09c2d4e1b7a6-00000001.gcs", "a/", segmentObj},
		{"a/segments/8f3a09c2d4e1b7a6.lock", "a/", lockObj},
		{"segments/8f3a09c2d4e1b7a6.lock", "", lockObj},
		{"a/segments/8f3a09c2d4e1b7a.lock", "", notOurs},
		{"a/segments/8F3A09C2D4E1B7A6.lock", "", notOurs},
		{"a/xsegments/00000001.gcs", "", notOurs},
		{"a/segments/0000001.gcs", "", notOurs},
		{"a/segments/0000000a.gcs", "", notOurs},
		{"a/segments/00000001.gcs.tmp", "", notOurs},
		{"a/other.json", "", notOurs},
	}
	for _, tc := range tests {
		p, kind := checkpointPrefix(tc.name)
		if p != tc.prefix || kind != tc.kind {
			t.Errorf("checkpointPrefix(%q) = %q, %v; want %q, %v", tc.name, p, kind, tc.prefix, tc.kind)
		}
	}
}
