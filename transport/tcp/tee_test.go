package tcp

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
)

// The capture writes each connection's shard, and the local copy, on
// goroutines of their own.
var _ streamer.AsyncOutput = (*Output)(nil)

// errDiskFull is what a failing local copy's writer returns.
var errDiskFull = errors.New("disk full")

// fullDisk takes limit bytes, then fails.
type fullDisk struct {
	limit int
	buf   bytes.Buffer
}

func (d *fullDisk) Write(p []byte) (int, error) {
	if d.buf.Len()+len(p) > d.limit {
		return 0, errDiskFull
	}
	return d.buf.Write(p)
}

// migrate's tee (the connections and a local copy) over 1 and 3 streams:
// the receiver and the copy both hold every file; a copy that fails stops
// the transfer, naming it, and the receiver serves nothing.
func TestTCPTeeKeepCopy(t *testing.T) {
	for _, tc := range []struct {
		streams int
		limit   int // of the local copy; 0: none
	}{{1, 0}, {3, 0}, {1, 1 << 20}, {3, 1 << 20}} {
		t.Run(fmt.Sprintf("streams=%d/limit=%d", tc.streams, tc.limit), func(t *testing.T) {
			r := startReceiver(t, tokenAuth(goodToken))
			out, err := Dial(testCtx(t), r.addr(), SendOptions{Auth: tokenAuth(goodToken), Streams: tc.streams, Timeout: 3 * time.Second, AutoCommit: true})
			if err != nil {
				t.Fatal(err)
			}
			defer out.Close()
			disk := &fullDisk{limit: tc.limit}
			if tc.limit == 0 {
				disk.limit = 1 << 30
			}
			keep, err := streamer.NewStreamOutput([]io.Writer{disk})
			if err != nil {
				t.Fatal(err)
			}
			files := testFiles()
			err = send(t, streamer.TeeOutput{Primary: out, Copy: keep}, files)
			if tc.limit > 0 {
				if !errors.Is(err, errDiskFull) || !strings.Contains(err.Error(), "shard 0") {
					t.Fatalf("send = %v, want %v naming shard 0", err, errDiskFull)
				}
				if _, err := r.src.WaitCommitted(testCtx(t)); err == nil {
					t.Fatal("the receiver committed a transfer whose local copy failed")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			checkFiles(t, r.src, files)
			copySrc := source.NewStreamSource(testCtx(t), []io.Reader{bytes.NewReader(disk.buf.Bytes())}, []string{"copy"}, source.StreamSourceOptions{})
			defer copySrc.Close()
			checkFiles(t, copySrc, files)
		})
	}
}
