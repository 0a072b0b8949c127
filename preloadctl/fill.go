package preloadctl

// A restore's fill (preload/fill.c): the handle table a checkpoint keeps,
// the filler that fills a process's device memory while CRIU restores it,
// and the adoption of that memory by the restored process.

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// MaxHandleTable bounds a handle table, as the library does.
const MaxHandleTable = 64 << 20

// AdoptBatch is the most handles one adopt hands over (the library takes
// 65 descriptors a command, the table's among them).
const AdoptBatch = 64

// Handles returns the process's handle table (parked, before the
// release): what its copy out copies, by handle.
func (p *Conn) Handles(ctx context.Context) ([]byte, error) {
	fd, err := unix.MemfdCreate("gpucr-handles", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("process %d: handles: memfd: %w", p.PID, err)
	}
	f := os.NewFile(uintptr(fd), "gpucr-handles")
	defer f.Close()
	if _, err := p.do(ctx, "handles", []*os.File{f}); err != nil {
		return nil, err
	}
	b, err := io.ReadAll(io.NewSectionReader(f, 0, MaxHandleTable+1))
	if err == nil && len(b) > MaxHandleTable {
		err = fmt.Errorf("longer than %d bytes", MaxHandleTable)
	}
	if err != nil {
		return nil, fmt.Errorf("process %d: handles: %w", p.PID, err)
	}
	return b, nil
}

// Adopt has the library map handles (filled by a filler from table, the
// h rows from row from on) where its own handles were; the library first
// checks that table is its own. It returns how many it adopted.
func (p *Conn) Adopt(ctx context.Context, table *os.File, from int, handles []*os.File) (int, error) {
	r, err := ask[struct {
		Adopted int `json:"adopted"`
	}](ctx, p, "adopt "+strconv.Itoa(from), append([]*os.File{table}, handles...))
	if err != nil {
		return 0, err
	}
	return r.Adopted, nil
}

// FillerConn is the connection c to a filler (gpucr-stream gpu fill, one
// end of a socket pair) that fills process pid's memory.
func FillerConn(c *net.UnixConn, pid int) *Conn {
	return newConn(c, pid)
}

// FillTable hands the filler the handle table: it creates the handles
// and maps them, if each GPU has room for the process's memory (its
// handles, or used, the device memory it was recorded to use, if more)
// and margin bytes more. It returns how many handles, and their bytes.
func (p *Conn) FillTable(ctx context.Context, table *os.File, used, margin int64) (int, int64, error) {
	r, err := ask[struct {
		Handles int   `json:"handles"`
		Bytes   int64 `json:"bytes"`
	}](ctx, p, "table "+strconv.FormatInt(used, 10)+" "+strconv.FormatInt(margin, 10), []*os.File{table})
	if err != nil {
		return 0, 0, err
	}
	return r.Handles, r.Bytes, nil
}

// FillExport has the filler export the handles of rows from on (up to
// 256) and returns the descriptors' numbers in the filler, open until the
// next command: take them with pidfd_getfd first.
func (p *Conn) FillExport(ctx context.Context, from int) ([]int, error) {
	r, err := ask[struct {
		FDs []int `json:"fds"`
	}](ctx, p, "export "+strconv.Itoa(from), nil)
	if err != nil {
		return nil, err
	}
	return r.FDs, nil
}
