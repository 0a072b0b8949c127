package criusock

// Restoring in place, where the checkpointed process ran: a listener of the
// image whose accepted connections left TIME_WAIT sockets on its port, and
// did not allow reuse, makes CRIU's bind fail with "Address already in
// use" for up to a minute (NCCL's bootstrap listeners do this; package
// tcpwait has the why). CRIU reads files.img before it creates a single
// socket, so the first read of files.img is where the ports it will bind
// are known and nothing is bound yet: the TIME_WAIT sockets on them are
// cleared then, whatever the source (an archive, a stream, a receiver).

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"sync"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/tcpwait"
)

// ClearTimeWait returns src, whose first read of files.img clears the
// TIME_WAIT sockets on the TCP ports that image binds and says so through
// log. A clear that fails (no CAP_NET_ADMIN, a kernel without
// SOCK_DESTROY) is logged, not fatal: CRIU's bind may still succeed.
func ClearTimeWait(src source.Source, log func(string)) source.Source {
	return &clearing{Source: src, log: log}
}

type clearing struct {
	source.Source
	log  func(string)
	once sync.Once
}

// Manifest forwards what it wraps (source.Manifester).
func (c *clearing) Manifest() *manifest.Manifest { return source.ManifestOf(c.Source) }

// CopyToFile keeps the underlying source's faster copy where it has one.
func (c *clearing) CopyToFile(ctx context.Context, name string, f *os.File) (int64, error) {
	if name != remappedFile {
		return source.CopyToFile(ctx, c.Source, name, f)
	}
	return c.Copy(ctx, name, f)
}

func (c *clearing) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	if name != remappedFile {
		return c.Source.Copy(ctx, name, w)
	}
	img, err := readImage(ctx, c.Source, name, maxFilesImg)
	if err != nil {
		return 0, err
	}
	c.once.Do(func() { c.clear(ctx, img) })
	n, err := w.Write(img)
	return int64(n), err
}

func (c *clearing) clear(ctx context.Context, img []byte) {
	ports, err := BoundTCPPorts(img)
	if err != nil || len(ports) == 0 {
		return // a damaged files.img is CRIU's to refuse
	}
	cl, err := tcpwait.Clear(ctx, ports)
	if err != nil {
		c.log(fmt.Sprintf("TIME_WAIT sockets on the ports the checkpoint binds not cleared (criu may fail with \"Address already in use\"): %v", err))
		return
	}
	if cl.Sockets > 0 {
		slices.Sort(cl.Ports)
		c.log(fmt.Sprintf("cleared %d TIME_WAIT sockets on ports %v, which would refuse criu's bind of the restored sockets", cl.Sockets, cl.Ports))
	}
}
