package location

import (
	"strings"
	"testing"
)

// Credentials in a location are refused, never echoed, never dropped
// silently.
func TestParseRefusesCredentials(t *testing.T) {
	for _, s := range []string{"s3://user:secret@bucket/fleet/job1", "tcp://user:secret@10.0.0.2:7000", "s3://user:secret@bucket%zz/x"} {
		_, err := Parse(s)
		if err == nil {
			t.Errorf("%s accepted", s)
			continue
		}
		if strings.Contains(err.Error(), "secret") {
			t.Errorf("%s: error shows the secret: %v", s, err)
		}
	}
	if l, err := Parse("s3://bucket/fleet/job1"); err != nil || l.Kind != S3 || l.Path != "bucket/fleet/job1" {
		t.Fatalf("plain s3 location: %+v %v", l, err)
	}
}
