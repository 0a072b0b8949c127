package redact

import "strings"

// SecretEnv reports whether an environment variable carries a secret of
// gpucr-stream's or of S3's (GPUCR_KEY, AWS_SECRET_ACCESS_KEY,
// AWS_SESSION_TOKEN, an SSE-C key, any GPUCR_ or AWS_ variable named for a
// key, secret, token, password or credential) rather than a path to one
// (names ending in _FILE or _DIR) or a setting.
func SecretEnv(name string) bool {
	n := strings.ToUpper(name)
	if !strings.HasPrefix(n, "GPUCR_") && !strings.HasPrefix(n, "AWS_") {
		return false
	}
	if strings.HasSuffix(n, "_FILE") || strings.HasSuffix(n, "_DIR") || strings.HasSuffix(n, "_PATH") {
		return false
	}
	for _, w := range []string{"KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL"} {
		if strings.Contains(n, w) {
			return true
		}
	}
	return false
}

// Environ splits env (os.Environ's form) into what may be handed to a
// program gpucr-stream starts and the names of the secrets it drops:
// whatever a process holds in its environment lands in its checkpoints.
func Environ(env []string) (kept, dropped []string) {
	for _, e := range env {
		name, _, _ := strings.Cut(e, "=")
		if SecretEnv(name) {
			dropped = append(dropped, name)
			continue
		}
		kept = append(kept, e)
	}
	return kept, dropped
}
