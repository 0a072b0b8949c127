//go:build gpucr_testhooks

package testhook

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestFault(t *testing.T) {
	t.Setenv("GPUCR_TEST_FAULT", "store")
	if err := Fault("store"); err == nil || !strings.Contains(err.Error(), "injected store failure") {
		t.Errorf("Fault(store) = %v", err)
	}
	if err := Fault("gpu-checkpoint"); err != nil {
		t.Errorf("Fault(gpu-checkpoint) with store asked for = %v", err)
	}
}

// Pause writes its file at the step asked for, and returns with ctx's cause.
func TestPause(t *testing.T) {
	file := filepath.Join(t.TempDir(), "paused")
	t.Setenv("GPUCR_TEST_PAUSE", "post-dump:"+file)
	if err := Pause(context.Background(), "released"); err != nil {
		t.Fatalf("Pause at another step: %v", err)
	}
	if _, err := os.Stat(file); err == nil {
		t.Fatal("another step wrote the file")
	}
	stop := errors.New("stopped")
	ctx, cancel := context.WithCancelCause(context.Background())
	done := make(chan error)
	go func() { done <- Pause(ctx, "post-dump") }()
	// Cancelled before or after it writes the file: it returns the cause.
	cancel(stop)
	if err := <-done; !errors.Is(err, stop) {
		t.Fatalf("Pause = %v, want the cause", err)
	}
	if b, err := os.ReadFile(file); err != nil || string(b) != "post-dump\n" {
		t.Fatalf("marker %q, %v", b, err)
	}
}
