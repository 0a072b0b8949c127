package s3

import (
	"strings"
	"testing"
)

// A malformed endpoint never echoes the credentials in it: without a
// scheme it was printed raw, with a bad %zz escape twice.
func TestS3EndpointNeverEchoesCredentials(t *testing.T) {
	clearAWSEnv(t)
	for _, ep := range []string{
		"user:secret@host:9000",
		"http://user:secret@host%zz:9000",
		"https://user:secret@host:9000",
		"user:secret@host%zz",
	} {
		_, _, _, err := s3Endpoint(Config{Endpoint: ep})
		if err == nil {
			t.Errorf("endpoint %s accepted", ep)
			continue
		}
		if strings.Contains(err.Error(), "secret") {
			t.Errorf("endpoint %s: error shows the secret: %v", ep, err)
		}
	}
}
