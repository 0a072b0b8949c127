package s3

import (
	"context"
	"strings"
	"testing"
	"time"
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

// A plain http endpoint carries process memory in clear: said once.
func TestS3PlainHTTPWarnsOnce(t *testing.T) {
	clearAWSEnv(t)
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "secretsecret")
	var warnings []string
	warn := func(m string) { warnings = append(warnings, m) }
	for _, ep := range []string{"http://127.0.0.1:1", "http://127.0.0.1:1", "https://127.0.0.1:2"} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		s, err := New(ctx, Config{Endpoint: ep, Bucket: "b", Region: "us-east-1", MaxRetries: -1, Warn: warn})
		cancel()
		if err == nil {
			s.Close()
		}
	}
	if len(warnings) != 1 || !strings.Contains(warnings[0], "plain http") || !strings.Contains(warnings[0], "127.0.0.1:1") {
		t.Fatalf("warnings %q, want one about the plain http endpoint", warnings)
	}
}
