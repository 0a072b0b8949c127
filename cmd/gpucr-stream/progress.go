package main

// Progress on stderr: on a terminal one line redrawn in place (cut to the
// terminal's width, whole where the width is unknown or 0); elsewhere a
// plain line every plainEvery, so logs show long work going on. Where the
// size is known (a process's memory, an archive's manifest) the line has
// the total, percentage and ETA. Drivers of criu-image-streamer parse
// stderr when it is the progress channel (--progress-fd 2): there no plain
// lines are written.

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/pipeline"
)

// plainEvery is how often a plain progress line is written when stderr is
// not a terminal.
var plainEvery = 5 * time.Second

type bar struct {
	w        io.Writer
	tty      *os.File // nil: plain lines
	what     string
	c        *pipeline.Counters
	total    int64
	uploaded func() int64
	ahead    func() int64
	start    time.Time
	drawn    bool
	// lastRaw and active: the raw bytes at the last draw and when they
	// last grew, so that the rate is over the time bytes moved (receive
	// waits for CRIU after the transfer).
	lastRaw int64
	active  time.Duration

	stop chan struct{}
	wg   sync.WaitGroup
	once sync.Once
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

func startProgress(c *cli, p checkpoint.Progress) *bar {
	b := &bar{w: c.stderr, what: p.What, c: p.Counters, total: p.Total, uploaded: p.Uploaded, ahead: p.Ahead, start: time.Now()}
	if p.Counters == nil || c.noProgress || c.json {
		return b
	}
	every := plainEvery
	if f, ok := c.stderr.(*os.File); ok && isTerminal(f) {
		b.tty, every = f, 200*time.Millisecond
	} else if c.progress == c.stderr && c.dropIn {
		return b // stderr carries criu-image-streamer's lines
	}
	b.stop = make(chan struct{})
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-b.stop:
				return
			case <-t.C:
				b.draw(false)
			}
		}
	}()
	return b
}

// draw writes the line: in place on a terminal, else as a new line.
func (b *bar) draw(final bool) {
	line := b.line(time.Since(b.start), final)
	if b.tty == nil {
		fmt.Fprintf(b.w, "gpucr-stream: %s\n", line)
		return
	}
	if width := termWidth(b.tty); width > 1 && len(line) > width-1 {
		line = line[:width-1]
	}
	fmt.Fprintf(b.w, "\r\033[K%s", line)
	b.drawn = true
	if final {
		fmt.Fprintln(b.w)
	}
}

// line is what the bar says after elapsed.
func (b *bar) line(elapsed time.Duration, final bool) string {
	raw := b.c.RawBytes.Load()
	var s strings.Builder
	fmt.Fprintf(&s, "%s %s", b.what, humanBytes(raw))
	if b.total > 0 {
		pct := float64(raw) * 100 / float64(b.total)
		if !final {
			pct = min(pct, 99) // the total is an estimate for a process
		}
		fmt.Fprintf(&s, " / %s %3.0f%%", humanBytes(b.total), pct)
	}
	if raw != b.lastRaw {
		b.lastRaw, b.active = raw, elapsed
	}
	secs := b.active.Seconds()
	if secs > 0 {
		rate := float64(raw) / secs
		fmt.Fprintf(&s, " %s/s", humanBytes(int64(rate)))
		if b.total > raw && rate > 0 && !final {
			eta := time.Duration(float64(b.total-raw) / rate * float64(time.Second))
			fmt.Fprintf(&s, " ETA %s", eta.Round(time.Second))
		}
	}
	// Of what is stored: bytes read run ahead of it by the chunks in
	// flight, all the more when interrupted.
	if st, sr := b.c.StoredBytes.Load(), b.c.StoredRaw.Load(); st > 0 && sr > 0 {
		fmt.Fprintf(&s, " %.2fx", float64(sr)/float64(st))
	}
	if b.ahead != nil {
		// A receiver's pre-copy rounds: the stream's counters see none of
		// it until the final dump.
		if a := b.ahead(); a > 0 {
			fmt.Fprintf(&s, " pre-copy %s", humanBytes(a))
		}
	}
	if b.uploaded != nil {
		// Bytes the object store acknowledged: they trail the captured
		// bytes by the parts in flight.
		fmt.Fprintf(&s, " uploaded %s", humanBytes(b.uploaded()))
	}
	// No time of its own when final: the bar covers the data's part of a
	// command, whose summary times the whole.
	return s.String()
}

// termWidth is the terminal's width in columns; 0 when unknown.
func termWidth(f *os.File) int {
	ws, err := unix.IoctlGetWinsize(int(f.Fd()), unix.TIOCGWINSZ)
	if err != nil {
		return 0
	}
	return int(ws.Col)
}

// finish stops the bar and, where it drew, leaves the final totals; it may
// be called more than once.
func (b *bar) finish() {
	b.once.Do(func() {
		if b.stop == nil {
			return
		}
		close(b.stop)
		b.wg.Wait()
		if b.tty != nil || time.Since(b.start) >= plainEvery {
			b.draw(true)
		}
	})
}
