package vram

import (
	"context"
	"errors"
	"os"
	"strings"
	"time"
)

// testPause stops gpucr-stream for good at a named step of the fast path
// when GPUCR_TEST_PAUSE is STEP:FILE: it writes FILE and sleeps until it is
// killed. The end-to-end tests kill it there (SIGKILL) to prove that the
// library brings the program back without it. Steps: released (after the
// release, the store started, before the driver's lock), checkpointed
// (after the driver's checkpoint, before Detach), detached (before CRIU),
// post-dump (CRIU's post-dump action: every image taken, the process still
// frozen, nothing committed; PauseForTest from checkpoint).
// While a pause is asked for, the store never ends (testHoldStore): every
// step is then one where gpucr-stream dies with VRAM files in flight.
func testPause(step string) { PauseForTest(context.Background(), step) }

// PauseForTest is testPause for the steps other packages reach (the
// checkpoint's post-dump); it does nothing unless GPUCR_TEST_PAUSE names
// step. There it returns only when ctx ends, with its cause: an
// interrupted checkpoint gets past it.
func PauseForTest(ctx context.Context, step string) error {
	v := os.Getenv("GPUCR_TEST_PAUSE")
	at, file, ok := strings.Cut(v, ":")
	if !ok || at != step {
		return nil
	}
	if err := os.WriteFile(file, []byte(step+"\n"), 0o600); err != nil {
		return nil
	}
	<-ctx.Done()
	return context.Cause(ctx)
}

// testHoldStore blocks a store goroutine for good while GPUCR_TEST_PAUSE
// is set (testPause).
func testHoldStore() {
	if os.Getenv("GPUCR_TEST_PAUSE") == "" {
		return
	}
	for {
		time.Sleep(time.Hour)
	}
}

// testStoreFault fails the store of every VRAM file when GPUCR_TEST_FAULT
// is "store": the end-to-end tests' destination failure after the release.
func testStoreFault() error {
	if os.Getenv("GPUCR_TEST_FAULT") == "store" {
		return errors.New("injected store failure (GPUCR_TEST_FAULT=store)")
	}
	return nil
}
