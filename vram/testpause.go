package vram

import (
	"os"
	"strings"
	"time"
)

// testPause stops gpucr-stream for good at a named step of the fast path
// when GPUCR_TEST_PAUSE is STEP:FILE: it writes FILE and sleeps until it is
// killed. The end-to-end tests kill it there (SIGKILL) to prove that the
// library brings the program back without it. Steps: released (after the
// release, before the driver's lock), checkpointed (after the driver's
// checkpoint, before Detach), detached (before CRIU).
func testPause(step string) {
	v := os.Getenv("GPUCR_TEST_PAUSE")
	at, file, ok := strings.Cut(v, ":")
	if !ok || at != step {
		return
	}
	if err := os.WriteFile(file, []byte(step+"\n"), 0o600); err != nil {
		return
	}
	for {
		time.Sleep(time.Hour)
	}
}
