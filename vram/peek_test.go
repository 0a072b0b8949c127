package vram

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/testwait"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
)

// TestReportCollectives: the report counts the NCCL collectives a program
// launched (pre-copy leaves such a program alone), none for one that
// launches none.
func TestReportCollectives(t *testing.T) {
	if n := vramtest.Start(t).Report(t).Collectives; n != 0 {
		t.Fatalf("a target without collectives reports %d", n)
	}
	tg := vramtest.Start(t, "GPUCR_FAKE_KERNEL_NAME=ncclKernel_AllGather")
	for end := time.Now().Add(testwait.Scale(5 * time.Second)); tg.Report(t).Collectives == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("a target launching collectives reports none")
		}
	}
}

// TestReportCached: the report of a process that marked nothing.
func TestReportCached(t *testing.T) {
	tg := vramtest.Start(t)
	p, err := preloadctl.Dial(context.Background(), tg.SockDir, tg.PID)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, err := p.Scan(context.Background()); err == nil || !strings.Contains(err.Error(), "not parked") {
		t.Fatalf("scan while running: %v, want refused", err)
	}
	if r, err := p.Report(context.Background()); err != nil || r.Cached != 0 || r.CacheRanges != 0 {
		t.Fatalf("report: %+v %v", r, err)
	}
}
