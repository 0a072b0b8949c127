package redact

import (
	"slices"
	"testing"
)

func TestSecretEnv(t *testing.T) {
	for _, tc := range []struct {
		name   string
		secret bool
	}{
		{"GPUCR_KEY", true},
		{"AWS_SECRET_ACCESS_KEY", true},
		{"AWS_SECRET_KEY", true},
		{"AWS_SESSION_TOKEN", true},
		{"AWS_SECURITY_TOKEN", true},
		{"AWS_ACCESS_KEY_ID", true},
		{"GPUCR_S3_SSE_KEY", true},
		{"GPUCR_S3_SSE_C_KEY", true},
		{"gpucr_key", true},
		{"GPUCR_TOKEN", true},
		{"GPUCR_PASSWORD", true},
		// Paths and settings the program (or the preload library) may need.
		{"GPUCR_KEY_FILE", false},
		{"GPUCR_TOKEN_FILE", false},
		{"GPUCR_S3_SSE_KEY_FILE", false},
		{"AWS_SHARED_CREDENTIALS_FILE", false},
		{"GPUCR_PRELOAD_DIR", false},
		{"GPUCR_LIBCUDA", false},
		{"GPUCR_CODEC", false},
		{"AWS_REGION", false},
		{"AWS_ENDPOINT_URL", false},
		{"HOME", false},
		{"MY_KEY", false}, // not ours: the program's own business
	} {
		if got := SecretEnv(tc.name); got != tc.secret {
			t.Errorf("SecretEnv(%q) = %v, want %v", tc.name, got, tc.secret)
		}
	}
}

func TestEnviron(t *testing.T) {
	kept, dropped := Environ([]string{"HOME=/root", "GPUCR_KEY=0011", "AWS_SECRET_ACCESS_KEY=abc=def", "GPUCR_PRELOAD_DIR=/run/x", "AWS_SESSION_TOKEN="})
	if want := []string{"HOME=/root", "GPUCR_PRELOAD_DIR=/run/x"}; !slices.Equal(kept, want) {
		t.Errorf("kept %q, want %q", kept, want)
	}
	if want := []string{"GPUCR_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}; !slices.Equal(dropped, want) {
		t.Errorf("dropped %q, want %q", dropped, want)
	}
}
