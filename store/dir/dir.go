// Package dir is a store.Store in a local directory: objects are files,
// written under a temporary name and renamed into place on Commit.
package dir

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/store"
)

// Store is a store.Store in a local directory. Objects are written to a temporary
// name and renamed on commit, after fsync, so a crash never leaves a
// half-written object under its real name.
type Store struct {
	root string
	// volatile: commits rename without fsync (NewVolatile).
	volatile bool
	// made is the highest directory this Store created for its root (the
	// root, or the first of its parents that was missing); "" when the
	// root was there. Guarded by mu.
	mu   sync.Mutex
	made string
}

// New returns a Store rooted at root; the directory (and its missing
// parents) is created on the first write, and removed again when the last
// object in it is deleted or aborted: a failed checkpoint into a new
// directory leaves none behind. A root that was there stays.
func New(root string) *Store { return &Store{root: filepath.Clean(root)} }

// NewVolatile is New for a copy that needs to outlive a process, not the
// host: a commit renames the object into place without syncing it, which
// on a disk would cost its whole write in the caller's time (migrate's
// kept copy of the image, written during the downtime).
func NewVolatile(root string) *Store { return &Store{root: filepath.Clean(root), volatile: true} }

// Parent is the store of the directory that holds this one, and this
// one's name in it; ok is false at the file system's root.
func (d *Store) Parent() (parent store.Store, name string, ok bool) {
	abs, err := filepath.Abs(d.root)
	if err != nil || filepath.Dir(abs) == abs {
		return nil, "", false
	}
	return &Store{root: filepath.Dir(abs), volatile: d.volatile}, filepath.Base(abs), true
}

// String implements store.Store.
func (d *Store) String() string { return d.root }

func (d *Store) path(name string) (string, error) {
	if err := store.CheckName(name); err != nil {
		return "", fmt.Errorf("%s: %w", d.root, err)
	}
	return filepath.Join(d.root, filepath.FromSlash(name)), nil
}

// dirWriter is one object being written. It works through descriptors:
// the directories of a name are opened one component at a time from the
// root with O_NOFOLLOW (and made, where missing, with mkdirat), and the
// temporary file is created, renamed, removed and its directory synced
// through the last one. A symlink planted below the root (a segments/
// linked elsewhere) is refused, never written through, and a directory
// swapped for one while the writer runs changes nothing it does.
type dirWriter struct {
	d     *Store
	dir   *os.File // the object's directory
	base  string   // the object's name in dir
	f     *os.File // the temporary file, in dir
	tmp   string   // its name in dir
	final string   // the object's path, for messages
	fd    int      // f's descriptor
	n     int64
	// flushed is how far writeback has been started (writeBehind).
	flushed int64
	done    bool
}

// writeBehind is how much a writer lets pile up in the page cache before
// it starts the disk writing it (sync_file_range, which does not wait):
// the commit's fsync then waits for the last of it only, not for every
// byte of a pack or segment written while CRIU dumped (a deduplicated
// GPU checkpoint's 1.1 GB of new packs took 0.56-0.58 s to commit onto
// the GPU machine's disk; docs/bench-log/2026-11.md).
const writeBehind = 8 << 20

// Create implements store.Store.
func (d *Store) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	p, err := d.path(name)
	if err != nil {
		return nil, err
	}
	// gc removes directories it finds empty: one may go between opening
	// it and creating the file in it, which then fails with ENOENT and is
	// tried again in a new one.
	for attempt := 0; ; attempt++ {
		w, err := d.create(name, p)
		if errors.Is(err, unix.ENOENT) && attempt < 3 {
			continue
		}
		return w, err
	}
}

func (d *Store) create(name, p string) (store.ObjectWriter, error) {
	dir, base, err := d.openParent(name, true)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", p, err)
	}
	for range 100 {
		tmp := "." + base + tempInfix + strconv.FormatUint(uint64(rand.Uint32()), 10)
		fd, err := unix.Openat(int(dir.Fd()), tmp, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if errors.Is(err, unix.EEXIST) {
			continue
		}
		if err != nil {
			dir.Close()
			return nil, fmt.Errorf("create %s: %w", p, err)
		}
		f := os.NewFile(uintptr(fd), filepath.Join(filepath.Dir(p), tmp))
		return &dirWriter{d: d, dir: dir, base: base, f: f, fd: fd, tmp: tmp, final: p}, nil
	}
	dir.Close()
	return nil, fmt.Errorf("create %s: no free temporary name", p)
}

// openParent opens the directory that holds name, below the root, without
// following a symlink on the way; with create it makes the root and the
// directories that are missing. It returns the directory and name's last
// component.
func (d *Store) openParent(name string, create bool) (*os.File, string, error) {
	parts := strings.Split(name, "/")
	base := parts[len(parts)-1]
	if base == "" || base == "." {
		return nil, "", fmt.Errorf("invalid object name %q", name)
	}
	dir, err := d.openDirs(parts[:len(parts)-1], create)
	return dir, base, err
}

// openDirs opens the directory at the path parts below the root, one
// component at a time, refusing symlinks.
func (d *Store) openDirs(parts []string, create bool) (*os.File, error) {
	if create {
		if err := d.makeRoot(); err != nil {
			return nil, err
		}
	}
	fd, err := unix.Open(d.root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: d.root, Err: err}
	}
	at := d.root
	for _, c := range parts {
		if c == "" || c == "." {
			continue
		}
		at = filepath.Join(at, c)
		if create {
			if err := unix.Mkdirat(fd, c, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
				unix.Close(fd)
				return nil, &fs.PathError{Op: "mkdir", Path: at, Err: err}
			}
		}
		next, err := unix.Openat(fd, c, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil && (errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR)) {
			var st unix.Stat_t
			mode := fs.ModeIrregular
			if unix.Fstatat(fd, c, &st, unix.AT_SYMLINK_NOFOLLOW) == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
				mode = fs.ModeSymlink
			}
			unix.Close(fd)
			return nil, notRegular(at, mode)
		}
		unix.Close(fd)
		if err != nil {
			return nil, wrapNotExist(&fs.PathError{Op: "open", Path: at, Err: err})
		}
		fd = next
	}
	return os.NewFile(uintptr(fd), at), nil
}

func (w *dirWriter) Write(b []byte) (int, error) {
	n, err := w.f.Write(b)
	w.n += int64(n)
	if w.n-w.flushed >= writeBehind && !w.d.volatile {
		// Best effort (a file system may not support it): the commit's
		// fsync is what makes the object durable.
		_ = unix.SyncFileRange(w.fd, w.flushed, w.n-w.flushed, unix.SYNC_FILE_RANGE_WRITE)
		w.flushed = w.n
	}
	return n, err
}

func (w *dirWriter) Commit(ctx context.Context) error { return w.commit(ctx, false) }

// CommitNew renames with RENAME_NOREPLACE, which the kernel decides
// atomically; where the filesystem has no such rename (EINVAL), a hard
// link, which fails on an existing name just as atomically, then the
// removal of the temporary name.
func (w *dirWriter) CommitNew(ctx context.Context) error { return w.commit(ctx, true) }

// renameat2 is unix.Renameat2; a test replaces it to take the link path.
var renameat2 = unix.Renameat2

func (w *dirWriter) commit(ctx context.Context, exclusive bool) error {
	if w.done {
		return errors.New("commit: object already finished")
	}
	w.done = true
	defer w.dir.Close()
	fail := func(err error) error {
		w.f.Close()
		unix.Unlinkat(int(w.dir.Fd()), w.tmp, 0)
		w.d.prune(w.dir.Name())
		return fmt.Errorf("commit %s: %w", w.final, err)
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	st, err := w.f.Stat()
	if err != nil {
		return fail(err)
	}
	if st.Size() != w.n {
		return fail(fmt.Errorf("wrote %d bytes but the file holds %d", w.n, st.Size()))
	}
	if !w.d.volatile {
		if err := w.f.Sync(); err != nil {
			return fail(err)
		}
	}
	if err := w.f.Close(); err != nil {
		return fail(err)
	}
	dfd := int(w.dir.Fd())
	if !exclusive {
		err = unix.Renameat(dfd, w.tmp, dfd, w.base)
	} else if err = renameat2(dfd, w.tmp, dfd, w.base, unix.RENAME_NOREPLACE); errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		if err = unix.Linkat(dfd, w.tmp, dfd, w.base, 0); err == nil {
			unix.Unlinkat(dfd, w.tmp, 0) // the object is committed; a leftover name is gc's
		}
	}
	if errors.Is(err, unix.EEXIST) {
		return fail(errdefs.ErrExists)
	}
	if err != nil {
		return fail(err)
	}
	if w.d.volatile {
		return nil
	}
	if err := w.dir.Sync(); err != nil && !errors.Is(err, os.ErrInvalid) {
		return fmt.Errorf("sync %s: %w", w.dir.Name(), err)
	}
	return nil
}

func (w *dirWriter) Abort(ctx context.Context) error {
	if w.done {
		return nil
	}
	w.done = true
	defer w.dir.Close()
	w.f.Close()
	if err := unix.Unlinkat(int(w.dir.Fd()), w.tmp, 0); err != nil {
		return fmt.Errorf("abort %s: %w", w.final, err)
	}
	w.d.prune(w.dir.Name())
	return nil
}

// prune removes dir (a path below the root) and its parents while they
// are empty, up to (not including) the root: an aborted or deleted object
// leaves no empty directories (a failed checkpoint's segments/) behind.
// Each is removed through its parent, opened as openDirs does.
func (d *Store) prune(dir string) {
	rel, err := filepath.Rel(d.root, dir)
	if err != nil || strings.HasPrefix(rel, "..") {
		return
	}
	if rel != "." {
		parts := strings.Split(filepath.ToSlash(rel), "/")
		for i := len(parts); i > 0; i-- {
			if !d.removeDir(parts[:i]) {
				return // not empty, or gone
			}
		}
	}
	d.unmakeRoot()
}

// makeRoot creates the root and its missing parents, noting the highest
// one it made.
func (d *Store) makeRoot() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	top := ""
	for p := d.root; ; p = filepath.Dir(p) {
		if _, err := os.Lstat(p); err == nil || !errors.Is(err, fs.ErrNotExist) {
			break
		}
		top = p
		if filepath.Dir(p) == p {
			break
		}
	}
	if top == "" {
		return nil
	}
	if err := os.MkdirAll(d.root, 0o755); err != nil {
		return err
	}
	if d.made == "" {
		d.made = top
	}
	return nil
}

// unmakeRoot removes the directories makeRoot made, root first, while
// they are empty (rmdir fails on one that is not, and on a symlink).
func (d *Store) unmakeRoot() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.made == "" {
		return
	}
	for p := d.root; ; p = filepath.Dir(p) {
		if unix.Rmdir(p) != nil {
			return
		}
		if p == d.made || filepath.Dir(p) == p {
			d.made = ""
			return
		}
	}
}

// removeDir removes the directory at parts below the root if it is empty.
func (d *Store) removeDir(parts []string) bool {
	parent, err := d.openDirs(parts[:len(parts)-1], false)
	if err != nil {
		return false
	}
	defer parent.Close()
	return unix.Unlinkat(int(parent.Fd()), parts[len(parts)-1], unix.AT_REMOVEDIR) == nil
}

// sectionReader also reads at offsets in its section (io.ReaderAt): a
// reader of several frames of a pack steps over those between.
type sectionReader struct {
	*io.SectionReader
	f *os.File
}

func (s sectionReader) Close() error { return s.f.Close() }

// Open implements store.Store.
func (d *Store) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	p, err := d.path(name)
	if err != nil {
		return nil, err
	}
	f, st, err := d.openRegular(name, p)
	if err != nil {
		return nil, err
	}
	if length < 0 {
		length = st.Size() - off
	}
	return sectionReader{SectionReader: io.NewSectionReader(f, off, length), f: f}, nil
}

// ErrNotRegular marks an object that is not a regular file: a symlink
// planted in an archive (it would read its target), a FIFO (it would block
// forever), a device. Nothing but regular files is ever read.
var ErrNotRegular = errors.New("not a regular file")

func notRegular(p string, m fs.FileMode) error {
	return fmt.Errorf("%s: %w (%s): refused: %w", p, ErrNotRegular, m.Type(), errdefs.ErrCorrupt)
}

// openRegular opens name (at path p) for reading if it is a regular file
// inside the root. openat2 with RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS refuses
// a symlink anywhere below the root, a planted segments/ directory link
// included; where the kernel lacks openat2 (before 5.6), O_NOFOLLOW refuses
// one in the last component. O_NONBLOCK keeps the open of a FIFO from
// waiting for a writer (deaf to signals meanwhile); once the file is known
// to be regular the flag is cleared again.
func (d *Store) openRegular(name, p string) (*os.File, fs.FileInfo, error) {
	f, err := d.openBeneath(name)
	if errors.Is(err, unix.ENOSYS) {
		f, err = os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	}
	if err != nil {
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV) {
			return nil, nil, notRegular(p, fs.ModeSymlink)
		}
		return nil, nil, wrapNotExist(err)
	}
	st, err := f.Stat()
	if err == nil && !st.Mode().IsRegular() {
		err = notRegular(p, st.Mode())
	}
	if err == nil {
		err = unix.SetNonblock(int(f.Fd()), false)
	}
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return f, st, nil
}

// openBeneath opens name relative to the root without following any
// symlink on the way.
func (d *Store) openBeneath(name string) (*os.File, error) {
	fd, err := d.openat2(name, unix.O_RDONLY|unix.O_NONBLOCK)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), filepath.Join(d.root, name)), nil
}

// statBeneath is Lstat of name (at path p) that, like openBeneath, follows
// no symlink below the root.
func (d *Store) statBeneath(name, p string) (fs.FileInfo, error) {
	fd, err := d.openat2(name, unix.O_PATH)
	if errors.Is(err, unix.ENOSYS) {
		return os.Lstat(p)
	}
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), p)
	defer f.Close()
	return f.Stat()
}

func (d *Store) openat2(name string, flags uint64) (int, error) {
	root, err := unix.Open(d.root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, &fs.PathError{Op: "open", Path: d.root, Err: err}
	}
	defer unix.Close(root)
	fd, err := unix.Openat2(root, filepath.FromSlash(name), &unix.OpenHow{
		Flags:   flags | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS,
	})
	if err != nil {
		return -1, &fs.PathError{Op: "open", Path: filepath.Join(d.root, name), Err: err}
	}
	return fd, nil
}

func wrapNotExist(err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: %w", errdefs.ErrNotFound, err)
	}
	return err
}

// Stat implements store.Store.
func (d *Store) Stat(ctx context.Context, name string) (store.ObjectInfo, error) {
	if err := ctx.Err(); err != nil {
		return store.ObjectInfo{}, err
	}
	p, err := d.path(name)
	if err != nil {
		return store.ObjectInfo{}, err
	}
	st, err := d.statBeneath(name, p)
	if err != nil {
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV) {
			return store.ObjectInfo{}, notRegular(p, fs.ModeSymlink)
		}
		return store.ObjectInfo{}, wrapNotExist(err)
	}
	if st.IsDir() {
		return store.ObjectInfo{}, fmt.Errorf("%s is a directory: %w", p, errdefs.ErrNotFound)
	}
	if !st.Mode().IsRegular() {
		return store.ObjectInfo{}, notRegular(p, st.Mode())
	}
	return store.ObjectInfo{Name: name, Size: st.Size(), Modified: st.ModTime()}, nil
}

// List implements store.Store. Temporary files of unfinished writes are
// not objects and are not listed.
func (d *Store) List(ctx context.Context, prefix string) ([]store.ObjectInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var out []store.ObjectInfo
	err := filepath.WalkDir(d.root, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			// The root not there yet, or an object or directory deleted
			// while the walk passed it: not listed, as if listed before.
			if errors.Is(err, fs.ErrNotExist) {
				return filepath.SkipDir
			}
			return err
		}
		// Only regular files are objects: a symlink or FIFO is never one.
		if !e.Type().IsRegular() || strings.HasPrefix(e.Name(), ".") {
			return nil
		}
		rel, err := filepath.Rel(d.root, p)
		if err != nil {
			return err
		}
		name := filepath.ToSlash(rel)
		if !strings.HasPrefix(name, prefix) {
			return nil
		}
		info, err := e.Info()
		if errors.Is(err, fs.ErrNotExist) {
			return nil // deleted since the directory was read
		}
		if err != nil {
			return err
		}
		out = append(out, store.ObjectInfo{Name: name, Size: info.Size(), Modified: info.ModTime()})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", d.root, err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Delete implements store.Store. Like a writer it works through the
// object's directory, so a symlink below the root is never followed.
func (d *Store) Delete(ctx context.Context, name string) error {
	p, err := d.path(name)
	if err != nil {
		return err
	}
	dir, base, err := d.openParent(name, false)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete %s: %w", p, err)
	}
	defer dir.Close()
	err = unix.Unlinkat(int(dir.Fd()), base, 0)
	if errors.Is(err, unix.EISDIR) {
		err = unix.Unlinkat(int(dir.Fd()), base, unix.AT_REMOVEDIR)
	}
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("delete %s: %w", p, err)
	}
	d.prune(dir.Name())
	return nil
}
