package tcp

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/streamer"
)

// BenchmarkTCPTransfer moves 256 MiB of incompressible data through a
// capture, the TCP transport over loopback and a receiving stream source:
// the transport's own throughput, without CRIU.
func BenchmarkTCPTransfer(b *testing.B) {
	const size = 256 << 20
	block := make([]byte, 4<<20)
	rand.Read(block)
	spec, _ := codec.ParseSpec("none")
	for _, streams := range []int{1, 2, 4} {
		b.Run(fmt.Sprint(streams), func(b *testing.B) {
			b.SetBytes(size)
			for range b.N {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				l, err := Listen(ctx, "127.0.0.1:0", ListenOptions{Auth: tokenAuth(goodToken)})
				if err != nil {
					b.Fatal(err)
				}
				src := NewSource(ctx, l, streamer.StreamOptions{Options: streamer.Options{MemoryLimit: 1 << 30}})
				out, err := Dial(ctx, l.Addr().String(), SendOptions{Auth: tokenAuth(goodToken), Streams: streams, AutoCommit: true})
				if err != nil {
					b.Fatal(err)
				}
				c, err := streamer.NewCapture(ctx, out, streamer.Options{Codec: spec})
				if err != nil {
					b.Fatal(err)
				}
				r, w := io.Pipe()
				go func() {
					for n := 0; n < size; n += len(block) {
						w.Write(block)
					}
					w.Close()
				}()
				if _, err := c.WriteFile("pages-1.img", r, false); err != nil {
					b.Fatal(err)
				}
				if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
					b.Fatal(err)
				}
				if _, err := src.WaitCommitted(ctx); err != nil {
					b.Fatal(err)
				}
				src.Close()
				out.Close()
				cancel()
			}
		})
	}
}
