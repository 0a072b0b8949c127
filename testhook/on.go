//go:build gpucr_testhooks

package testhook

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/knobs"
)

// Enabled says whether this build has the hooks.
const Enabled = true

// Fault is the injected failure of the step named fault when
// GPUCR_TEST_FAULT names it, else nil. Steps: store (the fast path's
// store of every VRAM file), gpu-checkpoint (the driver's checkpoint of a
// tree, before it reaches the driver; the refusal of trees the driver
// cannot undo is skipped), lazy-pages (criu lazy-pages is killed right
// after the restore).
func Fault(fault string) error {
	if knobs.TestFault.Value() != fault {
		return nil
	}
	return fmt.Errorf("injected %s failure (%s=%s)", fault, knobs.TestFault.Name, fault)
}

// Pause stops at step when GPUCR_TEST_PAUSE is STEP:FILE naming it: it
// writes FILE and returns only when ctx ends, with its cause (the tests
// kill gpucr-stream there, or interrupt it). Steps: released (the fast
// path released the device memory and started its store, before the
// driver's lock), checkpointed (after the driver's checkpoint, before
// Detach), detached (before CRIU), post-dump (CRIU's post-dump action:
// every image taken, the process still frozen, nothing committed).
func Pause(ctx context.Context, step string) error {
	at, file, ok := strings.Cut(knobs.TestPause.Value(), ":")
	if !ok || at != step {
		return nil
	}
	if err := os.WriteFile(file, []byte(step+"\n"), 0o600); err != nil {
		return nil
	}
	<-ctx.Done()
	return context.Cause(ctx)
}

// HoldWhilePausing blocks for good while GPUCR_TEST_PAUSE asks for a
// pause at any step: the fast path's store goroutines call it, so that
// every pause is one where gpucr-stream dies with VRAM files in flight.
func HoldWhilePausing() {
	if knobs.TestPause.Value() == "" {
		return
	}
	for {
		time.Sleep(time.Hour)
	}
}
