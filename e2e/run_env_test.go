package e2e

import (
	"os/exec"
	"strings"
	"testing"
)

// `gpucr-stream run` keeps gpucr-stream's and S3's secrets out of the
// program's environment, where every checkpoint of it would carry them
// (issue 25 L3); what the preload library needs still gets through.
func TestRunStripsSecretsFromEnvironment(t *testing.T) {
	e := setupFast(t)
	secrets := map[string]string{
		"GPUCR_KEY":             "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff",
		"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY",
		"AWS_SESSION_TOKEN":     "FwoGZXIvYXdzEXAMPLETOKEN",
		"GPUCR_S3_SSE_KEY":      "c3NlLWMta2V5LWZvci10ZXN0cy1vbmx5LTMyYnl0ZQ",
	}
	cmd := exec.Command(e.gcs, "run", "--", "env")
	cmd.Env = e.env()
	for k, v := range secrets {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("run -- env: %v\n%s", err, stderr.String())
	}
	for k, v := range secrets {
		if strings.Contains(stdout.String(), v) || strings.Contains(stdout.String(), k+"=") {
			t.Errorf("the program's environment carries %s", k)
		}
		if !strings.Contains(stderr.String(), k) {
			t.Errorf("stderr does not say %s was dropped: %q", k, stderr.String())
		}
		if strings.Contains(stderr.String(), v) {
			t.Errorf("stderr carries the value of %s", k)
		}
	}
	for _, keep := range []string{"GPUCR_PRELOAD_DIR=" + e.sockDir, "LD_PRELOAD="} {
		if !strings.Contains(stdout.String(), keep) {
			t.Errorf("the program's environment lacks %s", keep)
		}
	}
}
