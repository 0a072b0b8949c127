package vram

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
)

// TestPeek: a copy out while the program runs (a migration's pre-copy)
// holds every region with its pattern, in the files and layout of the
// parked copy out that follows, and the program runs on, its memory
// intact; a peek is refused while the program is parked (as the parked
// copy out leaves it).
func TestPeek(t *testing.T) {
	tg := startTarget(t)
	ctx := context.Background()
	dir := openTempDir(t)
	st := newStore()
	n, err := Peek(ctx, tg.sockDir, dir, []int{tg.pid}, 3, st.put)
	if err != nil {
		t.Fatal(err)
	}
	if want := tg.written(t, false); n != want {
		t.Fatalf("peeked %d bytes, the program wrote %d", n, want)
	}
	checkRecords(t, tg, st.files)
	if ents, _ := dir.ReadDir(-1); len(ents) != 0 {
		t.Fatalf("peek left files: %v", ents)
	}
	if r := tg.report(t); r.Parked {
		t.Fatal("the program is parked after a peek")
	}
	tg.mustBeIntact(t)

	// The parked copy out: the same files, each the same length, the
	// same records at the same offsets (the counter's bytes differ).
	parked, _ := fastSuspended(t, tg, false)
	for name, b := range parked.files {
		p, ok := st.files[name]
		if !ok || len(p) != len(b) {
			t.Fatalf("%s: %d bytes peeked, %d copied out parked", name, len(p), len(b))
		}
		if !slices.Equal(parseRecords(t, name, p), parseRecords(t, name, b)) {
			t.Fatalf("%s: the peek's records differ from the copy out's", name)
		}
	}

	p, err := preloadctl.Dial(ctx, tg.sockDir, tg.pid)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	f, err := os.CreateTemp(t.TempDir(), "peek")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Peek(ctx, []*os.File{f}); err == nil || !strings.Contains(err.Error(), "parked") {
		t.Fatalf("peek while parked: %v", err)
	}
}

// TestReportCollectives: the report counts the NCCL collectives a program
// launched (pre-copy leaves such a program alone), none for one that
// launches none.
func TestReportCollectives(t *testing.T) {
	if n := startTarget(t).report(t).Collectives; n != 0 {
		t.Fatalf("a target without collectives reports %d", n)
	}
	tg := startTarget(t, "GPUCR_FAKE_KERNEL_NAME=ncclKernel_AllGather")
	for end := time.Now().Add(5 * time.Second); tg.report(t).Collectives == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("a target launching collectives reports none")
		}
	}
}
