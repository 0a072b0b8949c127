package criusock

// Images CRIU reads as files (issue 39). In stream mode CRIU reads every
// image from a pipe it makes itself (criu/img-streamer.c), and a few of its
// readers need a file instead; plain `criu restore -D` gives them one.
// Found in CRIU 4.2's restore paths (image descriptors opened through
// img_streamer_open, then used with fstat, pread/preadv, lseek or mmap):
//
//   - nftables-N.img: criu/net.c do_restore_nftables sizes it with
//     img_raw_size (fstat), 0 for a pipe, and applies an empty ruleset:
//     the namespace's rules are lost, CRIU's own network-lock rules among
//     them (TCP connections are then restored unlocked, and the unlock
//     fails: "iptables-restore: line 3 failed: Bad rule").
//   - pages-N.img asked for a second time: criu/mem.c prepare_vma_ios
//     opens it again for the mappings CRIU does not premap (MAP_HUGETLB,
//     and a plugin's), and the restorer (criu/pie/restorer.c,
//     preadv_limited) preadv()s their pages at offsets: ESPIPE on a pipe,
//     "Can't read pages data (-29)".
//
// Readers that stay on a pipe: iptables-N.img and ip6tables-N.img feed
// iptables-restore's standard input (criu/net.c restore_iptables; with an
// nftables backend CRIU dumps nftables-N.img instead), route, rule and
// ifaddr images `ip ... restore`, tmpfs images tar; init_pagemaps guesses a
// pagemap's size in stream mode instead of fstat (criu/pagemap.c); ghost
// files (criu/files-reg.c copy_file, copy_chunk_to_file) and pipe data
// (criu/pipes.c) are spliced from the image, which a splice into a regular
// file needs to be a pipe. amdgpu's images carry their size in their first
// 8 bytes (plugins/amdgpu/amdgpu_plugin_util.c).
//
// Such a file is made a memfd holding its bytes, sealed against any change
// (F_SEAL_WRITE, GROW, SHRINK, SEAL), or, beyond a quarter of the memory
// limit for all of them together, an unlinked file in the spill directory;
// fdgraft then hands it to the CRIU task that asked, in place of the read
// end of its pipe. Spilled rather than refused: CRIU reads a file on disk
// as well as a memfd, and a process with more huge pages than that share
// would otherwise not restore from a stream at all; a full disk fails the
// writing of it (spillFile), and so the serve, naming the image, before
// CRIU is handed anything. Every other image keeps the pipe and its splices: a
// memfd costs more than a pipe at every size (docs/bench-log/2026-12.md, "Images
// as files").

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"regexp"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/fdgraft"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
)

var (
	nftablesName = regexp.MustCompile(`^nftables-[0-9]+\.img$`)
	// ghostName: CRIU splices a ghost file's image into the file it makes,
	// which needs a pipe.
	ghostName = regexp.MustCompile(`^ghost-file-[0-9a-f]+\.img$`)
)

// smallAsFile serves every other image under this many bytes as a file
// too (pages images aside: their first read must leave pages out): none,
// as measured. A build with the gpucr_bench tag takes it from
// GPUCR_BENCH_SMALL_FILES (asfile_measure.go), for scripts/bench-files.sh.
var smallAsFile int64

// fileImages serves the images CRIU reads as files, for one serve.
type fileImages struct {
	src      source.Source
	spillDir string
	memory   int64 // what their memfds may hold together
	log      func(string)

	mu       sync.Mutex
	asked    map[string]int // CRIU's requests so far, by name
	inMemfds int64          // bytes in the memfds made so far
	// skips are the spans of pages images their first serve leaves out
	// (unpremapped.go), by name.
	skips map[string][]source.Span
}

func newFileImages(src source.Source, o ServeOptions) *fileImages {
	limit := o.MemoryLimit
	if limit <= 0 {
		limit = pipeline.DefaultMemoryLimit
	}
	dir := o.SpillDir
	if dir == "" {
		dir = os.TempDir()
	}
	return &fileImages{src: src, spillDir: dir, memory: limit / 4, log: o.Hooks.log,
		asked: map[string]int{}, skips: map[string][]source.Span{}}
}

// answer takes CRIU's request for name, an image of size bytes: it
// serves it as a file where CRIU needs one (done); otherwise it returns
// what the pipe that serves it leaves out (unpremapped.go).
func (fi *fileImages) answer(ctx context.Context, conn *net.UnixConn, name string, size int64) (done bool, omit []source.Span, err error) {
	if why := fi.why(name, size); why != "" {
		if err := fi.serve(ctx, conn, name, size); err != nil {
			return false, nil, fmt.Errorf("serve %s as a file (%s): %w", name, why, err)
		}
		return true, nil, nil
	}
	if err := fi.noteSkips(ctx, name); err != nil {
		return false, nil, err
	}
	return false, fi.firstSkips(name), nil
}

// copyOmitting writes name of src into w without the spans omit.
func copyOmitting(ctx context.Context, src source.Source, name string, w io.Writer, omit []source.Span) (int64, error) {
	if omit != nil {
		o, err := source.NewOmit(w, omit)
		if err != nil {
			return 0, err
		}
		w = o
	}
	return src.Copy(ctx, name, w)
}

// why counts a request of CRIU's for name, an image of size bytes, and
// says why CRIU reads it as a file this time; "" when a pipe serves.
func (fi *fileImages) why(name string, size int64) string {
	fi.mu.Lock()
	fi.asked[name]++
	n := fi.asked[name]
	fi.mu.Unlock()
	switch {
	case nftablesName.MatchString(name):
		return "criu sizes it with fstat"
	case n > 1 && pagesName.MatchString(name):
		return "criu's restorer reads it again with preadv, for a mapping it does not premap (MAP_HUGETLB)"
	case size < smallAsFile && !pagesName.MatchString(name) && !ghostName.MatchString(name):
		return "a small file"
	}
	return ""
}

// serve answers CRIU's request for name on conn with a file holding its
// size bytes in place of the pipe CRIU makes for it.
func (fi *fileImages) serve(ctx context.Context, conn *net.UnixConn, name string, size int64) error {
	f, where, err := fi.make(ctx, name, size)
	if err != nil {
		return err
	}
	defer f.Close()
	task, err := fdgraft.Stop(ctx, conn)
	if err != nil {
		return fmt.Errorf("find criu's task that asked: %w", err)
	}
	ino, err := task.Hand(ctx, f, func() error { return WriteReply(conn, true) })
	if err != nil {
		return err
	}
	p, err := RecvPipe(conn, name)
	if err != nil {
		return err
	}
	defer p.Close() // its read end is gone: nothing to write
	var st unix.Stat_t
	if err := unix.Fstat(int(p.Fd()), &st); err != nil || st.Ino != ino {
		return fmt.Errorf("criu sent pipe %d (%v), not pipe %d whose read end it was handed the file for", st.Ino, err, ino)
	}
	fi.log(fmt.Sprintf("%s: served as a file of %d bytes (%s) to criu's task %d", name, size, where, task.TID))
	return nil
}

// make writes name into a sealed memfd, or into an unlinked file in the
// spill directory when the memfds would hold more than their share of the
// memory limit; it says which. A pages image whose first serve left pages
// out gets only those: all the restorer reads of it (unpremapped.go).
func (fi *fileImages) make(ctx context.Context, name string, size int64) (*os.File, string, error) {
	fi.mu.Lock()
	only := fi.skips[name]
	need := size
	if only != nil {
		need = 0
		for _, s := range only {
			need += s.Len
		}
	}
	inMemory := fi.inMemfds+need <= fi.memory
	if inMemory {
		fi.inMemfds += need // until the serve ends: CRIU holds it as long as it likes
	}
	fi.mu.Unlock()
	var f *os.File
	var err error
	where := fmt.Sprintf("%d bytes written, in a sealed memfd", need)
	if inMemory {
		f, err = memfd(name)
	} else {
		where = fmt.Sprintf("%d bytes written, in an unlinked file in %s", need, fi.spillDir)
		f, err = spillFile(fi.spillDir, need, only == nil)
	}
	if err != nil {
		return nil, "", fmt.Errorf("%s: make a file for criu: %w", name, err)
	}
	err = fi.fill(ctx, f, name, size, only)
	if err == nil {
		_, err = f.Seek(0, io.SeekStart)
	}
	if err == nil && inMemory {
		_, err = unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SEAL|unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE)
	}
	if err != nil {
		f.Close()
		return nil, "", fmt.Errorf("%s: write it into a file for criu: %w", name, err)
	}
	return f, where, nil
}

// fill writes name, of size bytes, into f: whole, or only the spans only
// (holes elsewhere).
func (fi *fileImages) fill(ctx context.Context, f *os.File, name string, size int64, only []source.Span) error {
	var n int64
	var err error
	if only == nil {
		n, err = source.CopyToFile(ctx, fi.src, name, f)
	} else if err = f.Truncate(size); err == nil {
		n, err = fi.src.Copy(ctx, name, &spansWriter{f: f, spans: only})
	}
	if err == nil && n != size {
		err = fmt.Errorf("wrote %d bytes of %d", n, size)
	}
	return err
}

// spansWriter takes a file's bytes in order and writes those that lie in
// spans (sorted, disjoint) at their offsets in f.
type spansWriter struct {
	f     *os.File
	spans []source.Span
	pos   int64
}

func (w *spansWriter) Write(b []byte) (int, error) {
	start, end := w.pos, w.pos+int64(len(b))
	for len(w.spans) > 0 && w.spans[0].End() <= start {
		w.spans = w.spans[1:]
	}
	for _, s := range w.spans {
		if s.Off >= end {
			break
		}
		lo, hi := max(start, s.Off), min(end, s.End())
		if _, err := w.f.WriteAt(b[lo-start:hi-start], lo); err != nil {
			return 0, err
		}
	}
	w.pos = end
	return len(b), nil
}

func memfd(name string) (*os.File, error) {
	fd, err := unix.MemfdCreate("gpucr-stream:"+name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	return os.NewFile(uintptr(fd), name), nil
}

// spillFile is an unlinked file for size bytes, its blocks reserved when
// they will be written through a mapping (CopyToFile): a file system that
// fills fails here, not as a fault in the mapping.
func spillFile(dir string, size int64, mapped bool) (*os.File, error) {
	f, err := os.CreateTemp(dir, "gpucr-image-*")
	if err != nil {
		return nil, err
	}
	os.Remove(f.Name())
	if mapped && size > 0 {
		if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
			f.Close()
			return nil, fmt.Errorf("reserve %d bytes in %s: %w", size, dir, err)
		}
	}
	return f, nil
}
