package criusock

import (
	"bytes"
	"context"
	"errors"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
)

// TestConnectTimeout: Intake and Serve give up on a CRIU that never
// connects, naming the socket; one that connects in time is served, and
// ConnectTimeout < 0 waits as long as it takes.
func TestConnectTimeout(t *testing.T) {
	ctx := context.Background()
	const limit = 200 * time.Millisecond
	t.Run("intake, nobody", func(t *testing.T) {
		dir := shortDir(t)
		c, _ := newCapture(t, ctx)
		defer c.Abort(errors.New("test over"))
		_, err := IntakeWith(ctx, dir, c, IntakeOptions{ConnectTimeout: limit})
		if !errors.Is(err, ErrNoCRIU) || !strings.Contains(err.Error(), filepath.Join(dir, CaptureSocket)) {
			t.Fatalf("got %v, want ErrNoCRIU naming the socket", err)
		}
	})
	t.Run("serve, nobody", func(t *testing.T) {
		dir := shortDir(t)
		src := source.NewStreamSource(ctx, []io.Reader{bytes.NewReader(nil)}, []string{"empty"}, source.StreamSourceOptions{})
		defer src.Close()
		_, err := ServeWith(ctx, dir, src, ServeOptions{ConnectTimeout: limit})
		if !errors.Is(err, ErrNoCRIU) || !strings.Contains(err.Error(), filepath.Join(dir, ServeSocket)) {
			t.Fatalf("got %v, want ErrNoCRIU naming the socket", err)
		}
	})
	for _, tc := range []struct {
		name    string
		timeout time.Duration
	}{{"intake, criu in time", 5 * limit}, {"intake, no limit", -1}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := shortDir(t)
			c, _ := newCapture(t, ctx)
			in, err := StartIntakeWith(ctx, dir, c, IntakeOptions{ConnectTimeout: tc.timeout})
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(2 * limit) // longer than the shortest limit: only the limit given counts
			cl, err := Dial(ctx, dir)
			if err != nil {
				t.Fatal(err)
			}
			if err := cl.Push(ctx, "inventory.img", strings.NewReader("inv")); err != nil {
				t.Fatal(err)
			}
			cl.Close()
			if _, err := in.Wait(ctx); err != nil {
				t.Fatalf("a CRIU that came in time failed: %v", err)
			}
			if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
				t.Fatal(err)
			}
		})
	}
}
