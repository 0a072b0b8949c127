package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/testwait"
)

func TestProgressLine(t *testing.T) {
	var c pipeline.Counters
	c.RawBytes.Store(1 << 30)
	c.StoredBytes.Store(1 << 29)
	c.StoredRaw.Store(1 << 30)
	tests := []struct {
		name    string
		total   int64
		final   bool
		want    []string
		notWant []string
	}{
		{"known size", 4 << 30, false, []string{"checkpoint 1.0 GiB / 4.0 GiB  25%", "512.0 MiB/s", "ETA 6s", "2.00x"}, []string{"p/s"}},
		{"unknown size", 0, false, []string{"checkpoint 1.0 GiB 512.0 MiB/s"}, []string{"%", "ETA"}},
		{"estimate passed", 1 << 29, false, []string{" 99%"}, []string{"ETA"}},
		// the command's summary times the whole: the bar does not
		{"done", 1 << 29, true, []string{"200%", "512.0 MiB/s"}, []string{"ETA", " in "}},
	}
	for _, tc := range tests {
		b := &bar{what: "checkpoint", c: &c, total: tc.total}
		got := b.line(2*time.Second, tc.final)
		for _, w := range tc.want {
			if !strings.Contains(got, w) {
				t.Errorf("%s: %q lacks %q", tc.name, got, w)
			}
		}
		for _, w := range tc.notWant {
			if strings.Contains(got, w) {
				t.Errorf("%s: %q has %q", tc.name, got, w)
			}
		}
	}
}

// TestProgressPrecopy: a receiver's line counts the chunks of pre-copy
// rounds as they arrive, which the stream's counters do not (it showed
// "receive 0 B" for the whole of them).
func TestProgressPrecopy(t *testing.T) {
	var c pipeline.Counters
	ahead := int64(0)
	b := &bar{what: "receive", c: &c, ahead: func() int64 { return ahead }}
	if got := b.line(time.Second, false); strings.Contains(got, "pre-copy") {
		t.Errorf("before any chunk arrived: %q", got)
	}
	ahead = 300 << 20
	if got := b.line(2*time.Second, false); !strings.Contains(got, "receive 0 B pre-copy 300.0 MiB") {
		t.Errorf("during the rounds: %q, want the bytes sent ahead", got)
	}
}

// TestProgressRatioAndRate: the ratio is of what is stored, even when the
// bytes read run far ahead (a Ctrl-C'd capture once showed 303936.25x);
// the rate is over the time bytes moved, not the wait after (receive
// waiting for CRIU).
func TestProgressRatioAndRate(t *testing.T) {
	var c pipeline.Counters
	c.RawBytes.Store(1 << 30)
	c.StoredBytes.Store(3 << 10)
	c.StoredRaw.Store(12 << 10)
	b := &bar{what: "capture", c: &c}
	if got := b.line(2*time.Second, false); !strings.Contains(got, " 4.00x") || !strings.Contains(got, "512.0 MiB/s") {
		t.Errorf("interrupted capture: %q, want 4.00x at 512.0 MiB/s", got)
	}
	if got := b.line(20*time.Second, true); !strings.Contains(got, "512.0 MiB/s") {
		t.Errorf("after 18 s without bytes: %q, want the rate of when they moved", got)
	}
	c.RawBytes.Store(2 << 30)
	if got := b.line(22*time.Second, false); !strings.Contains(got, "93.1 MiB/s") {
		t.Errorf("bytes again: %q, want the rate over all the time", got)
	}
}

// TestProgressZeroColumns: a terminal that reports 0 columns still gets
// the whole line (pb drew nothing there).
func TestProgressZeroColumns(t *testing.T) {
	tty := openPTY(t)
	if err := unix.IoctlSetWinsize(int(tty.Fd()), unix.TIOCSWINSZ, &unix.Winsize{Row: 0, Col: 0}); err != nil {
		t.Fatal(err)
	}
	var c pipeline.Counters
	c.RawBytes.Store(3 << 20)
	var out bytes.Buffer
	b := &bar{w: &out, tty: tty, what: "verify", c: &c, start: time.Now().Add(-time.Second)}
	b.draw(false)
	if !strings.Contains(out.String(), "verify 3.0 MiB") {
		t.Errorf("drew %q", out.String())
	}
	if err := unix.IoctlSetWinsize(int(tty.Fd()), unix.TIOCSWINSZ, &unix.Winsize{Row: 24, Col: 12}); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	b.draw(false)
	if line := strings.TrimPrefix(out.String(), "\r\033[K"); len(line) > 11 {
		t.Errorf("a 12-column terminal got %d characters: %q", len(line), line)
	}
}

// TestProgressPlainLines: with stderr not a terminal, a plain line every
// plainEvery; none where stderr carries criu-image-streamer's lines.
func TestProgressPlainLines(t *testing.T) {
	old := plainEvery
	plainEvery = 20 * time.Millisecond
	defer func() { plainEvery = old }()
	for _, tc := range []struct {
		name     string
		protocol bool
		want     bool
	}{{"checkpoint", false, true}, {"serve with -p 2", true, false}} {
		var errOut pipelinetest.SyncBuffer
		cfg := &cli{stderr: &errOut}
		cfg.progress, cfg.dropIn = &errOut, tc.protocol
		var c pipeline.Counters
		c.RawBytes.Store(5 << 20)
		b := startProgress(cfg, checkpoint.Progress{What: "checkpoint", Counters: &c, Total: 10 << 20})
		time.Sleep(testwait.Scale(150 * time.Millisecond))
		b.finish()
		lines := strings.Count(errOut.String(), "gpucr-stream: checkpoint 5.0 MiB / 10.0 MiB")
		if got := lines >= 2; got != tc.want {
			t.Errorf("%s: %d plain lines:\n%s", tc.name, lines, errOut.String())
		}
	}
}

// TestProgressVerifyExtract: verify and extract show progress; extract
// keeps stderr clean when it is the criu-image-streamer progress channel.
func TestProgressVerifyExtract(t *testing.T) {
	old := plainEvery
	plainEvery = 10 * time.Microsecond // shorter than any verify: a final line at least
	defer func() { plainEvery = old }()
	stream := fixtureDir + "/stream.img"
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"verify", stream}, "gpucr-stream: verify "},
		{[]string{"-D", t.TempDir(), "-p", "1", "extract", "--from", stream}, "gpucr-stream: extract "},
		{[]string{"-D", t.TempDir(), "extract", "--from", stream}, ""},
	} {
		var stdout, stderr bytes.Buffer
		if err := run(context.Background(), tc.args, strings.NewReader(""), &stdout, &stderr); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		got := stderr.String()
		if tc.want == "" && strings.Contains(got, "gpucr-stream: ") || tc.want != "" && !strings.Contains(got, tc.want) {
			t.Errorf("%v: stderr %q, want %q", tc.args, got, tc.want)
		}
	}
}
