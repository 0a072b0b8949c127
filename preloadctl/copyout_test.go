package preloadctl

import (
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// notifyingLibrary listens on this process's control socket in a new
// directory and answers one copyout: it sends says on the socket that
// came last with the command, closes it unless keep, and answers answer.
func notifyingLibrary(t *testing.T, says []byte, keep bool, answer string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ctl") // short: a socket path has 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: Socket(dir, os.Getpid()), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var kept []int
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
		for _, fd := range kept {
			syscall.Close(fd)
		}
		os.RemoveAll(dir)
	})
	wg.Go(func() {
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		b, oob := make([]byte, 1024), make([]byte, syscall.CmsgSpace(65*4))
		_, oobn, _, _, err := c.ReadMsgUnix(b, oob)
		if err != nil {
			return
		}
		msgs, _ := syscall.ParseSocketControlMessage(oob[:oobn])
		var fds []int
		for _, m := range msgs {
			rights, _ := syscall.ParseUnixRights(&m)
			fds = append(fds, rights...)
		}
		if len(fds) == 0 {
			return
		}
		notify := fds[len(fds)-1]
		for _, fd := range fds[:len(fds)-1] {
			syscall.Close(fd)
		}
		syscall.Write(notify, says)
		if keep {
			kept = append(kept, notify)
		} else {
			syscall.Close(notify)
		}
		c.Write([]byte(answer + "\n"))
	})
	return dir
}

// What a library says of its files as they are written: each file is
// heard of once, all of them by a copy that succeeded, none beyond the
// files sent (a hostile library fails the copy, never a store of a file
// that is not there).
func TestCopyOutEach(t *testing.T) {
	for _, tc := range []struct {
		name   string
		says   []byte
		keep   bool // the library keeps its end of the socket open
		answer string
		heard  []int
		bad    bool
	}{
		{"every file, in the order written", []byte{2, 0, 1}, false, `ok {"bytes":3}`, []int{2, 0, 1}, false},
		{"twice the same file", []byte{1, 1, 1}, false, `ok {"bytes":3}`, []int{1, 0, 2}, false},
		{"nothing said", nil, false, `ok {"bytes":3}`, []int{0, 1, 2}, false},
		{"its end kept open", []byte{2}, true, `ok {"bytes":3}`, []int{2, 0, 1}, false},
		{"the copy failed", []byte{0}, false, "err copy to host: CUresult 2", []int{0}, false},
		{"a file that was not sent", []byte{0, 3}, false, `ok {"bytes":3}`, []int{0}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := notifyingLibrary(t, tc.says, tc.keep, tc.answer)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			p, err := Dial(ctx, dir, os.Getpid())
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			var files []*os.File
			for range 3 {
				f, err := os.CreateTemp(t.TempDir(), "f")
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				files = append(files, f)
			}
			var mu sync.Mutex
			var heard []int
			_, err = p.CopyOutEach(ctx, files, func(k int) {
				mu.Lock()
				heard = append(heard, k)
				mu.Unlock()
			})
			failed := strings.HasPrefix(tc.answer, "err")
			if (err != nil) != (failed || tc.bad) || tc.bad != errors.Is(err, ErrBadAnswer) {
				t.Fatalf("copyout: %v", err)
			}
			if !slices.Equal(heard, tc.heard) {
				t.Fatalf("heard of files %v, want %v", heard, tc.heard)
			}
		})
	}
}
