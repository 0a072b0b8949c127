package preloadctl

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/testwait"
)

// fakeLibrary listens on this process's control socket in a new directory
// (so the peer check passes: this process listens) and answers every
// command with answer; it returns the directory.
func fakeLibrary(t *testing.T, answer func(c net.Conn)) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ctl") // short: a socket path has 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", Socket(dir, os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
		os.RemoveAll(dir)
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					if _, err := br.ReadString('\n'); err != nil {
						return
					}
					answer(c)
				}
			}()
		}
	}()
	return dir
}

// endless answers "ok " and then 64 MiB that never end the line (a
// process that means harm would send them forever).
func endless(c net.Conn) {
	c.Write([]byte("ok "))
	b := bytes.Repeat([]byte("x"), 64<<10)
	for range 1024 {
		if _, err := c.Write(b); err != nil {
			return
		}
	}
	c.Close()
}

// What the process's socket answers is read within a bound, and what is
// shown of it carries no control characters.
func TestPreloadHostileAnswers(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer func(net.Conn)
		check  func(t *testing.T, p *Conn, r Report, err error)
	}{
		{"endless line", endless, func(t *testing.T, p *Conn, _ Report, err error) {
			if !errors.Is(err, ErrBadAnswer) || !strings.Contains(err.Error(), "longer than 16384 bytes") {
				t.Fatalf("%v, want ErrBadAnswer saying how long an answer may be", err)
			}
			if !p.Broken() {
				t.Fatal("the connection is not marked out of step")
			}
		}},
		{"escapes in an error", func(c net.Conn) { c.Write([]byte("err \x1b]0;pwned\x07 boom\r\n")) }, func(t *testing.T, _ *Conn, _ Report, err error) {
			if err == nil || strings.ContainsAny(err.Error(), "\x1b\x07\r") || !strings.Contains(err.Error(), `\x1b]0;pwned\a boom\r`) {
				t.Fatalf("%q, want the message with its control characters escaped", err)
			}
		}},
		{"escapes in a report", func(c net.Conn) {
			c.Write([]byte(`ok {"pid":1,"reason":"\u001b[2J\u202eno","kept":["/k\u0007"]}` + "\n"))
		}, func(t *testing.T, _ *Conn, r Report, err error) {
			if err != nil {
				t.Fatal(err)
			}
			if r.Reason != `\x1b[2J\u202eno` || len(r.Kept) != 1 || r.Kept[0] != `/k\a` {
				t.Fatalf("reason %q, kept %q: want them escaped", r.Reason, r.Kept)
			}
		}},
		{"not the protocol", func(c net.Conn) { c.Write([]byte("SSH-2.0-x\n")) }, func(t *testing.T, _ *Conn, _ Report, err error) {
			if !errors.Is(err, ErrBadAnswer) {
				t.Fatalf("%v, want ErrBadAnswer", err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := fakeLibrary(t, tc.answer)
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
			defer cancel()
			p, err := Dial(ctx, dir, os.Getpid())
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			r, err := p.Report(ctx)
			runtime.ReadMemStats(&after)
			if n := after.TotalAlloc - before.TotalAlloc; n > 4<<20 {
				t.Errorf("reading the answer allocated %d bytes", n)
			}
			tc.check(t, p, r, err)
		})
	}
}
