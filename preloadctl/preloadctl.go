// Package preloadctl is the Go side of the control protocol of
// libgpucr-preload (preload/control.c), the library a GPU process loads for
// the fast path: finding a process's control socket and checking that the
// process itself listens there, the commands and their answers, and
// starting a program with the library (gpucr-stream run). What the
// commands are for is package vram's; in which order they run and what
// undoes them, package gpuckpt's.
package preloadctl

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gpucr/gpucr-stream/knobs"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/redact"
	"golang.org/x/sys/unix"
)

// The control channel: one text line per command, one line back: "ok JSON" or "err MESSAGE". copyout and copyin
// carry descriptors (SCM_RIGHTS) with their line. The library keeps its
// state (parked, released) between connections, so a connection is closed
// before CRIU dumps the process (CRIU refuses a socket connected to a
// process outside the tree) and dialled again after the restore.

// maxAnswer bounds an answer line, newline included: the library writes
// each into a buffer of this size (preload/control.c). The socket belongs
// to the checkpointed process, which may be anyone's: an answer that does
// not end within it fails the command (one that never ended grew root's
// gpucr-stream to 4.1 GB).
const maxAnswer = 16 << 10

// Library is the file name of the library.
const Library = "libgpucr-preload.so"

// ErrBadAnswer says the control socket answered something that is not
// the library's protocol.
var ErrBadAnswer = errors.New("not an answer of the library")

// ErrNotLoaded says a process does not have the library loaded (or its
// control socket is not there): it takes the driver-only path.
var ErrNotLoaded = errors.New("the fast-path library is not loaded in the process")

// Dir is the directory of the control sockets: GPUCR_PRELOAD_DIR,
// else /run/gpucr-stream (the library uses the same rule).
func Dir() string {
	if d := knobs.PreloadDir.Value(); d != "" {
		return d
	}
	return "/run/gpucr-stream"
}

// Socket is the control socket of pid in dir, as the process
// names it: by its pid in its own namespace (proc.NSPID).
func Socket(dir string, pid int) string {
	return filepath.Join(dir, "preload-"+strconv.Itoa(pid)+".sock")
}

// socketOf is where gpucr-stream reaches the control socket of pid (a pid
// of its own namespace): named by the process's own pid, in dir as the
// process sees it (through /proc/PID/root when its mount namespace is
// not ours).
func socketOf(dir string, pid int) string {
	name := Socket(dir, proc.NSPID(pid))
	self, err1 := os.Readlink(filepath.Join(proc.Root, "self", "ns", "mnt"))
	its, err2 := os.Readlink(filepath.Join(proc.Root, strconv.Itoa(pid), "ns", "mnt"))
	if err1 == nil && err2 == nil && self != its {
		return filepath.Join(proc.Root, strconv.Itoa(pid), "root", name)
	}
	return name
}

// SameOwner says whether processes a and b run with the same user ids
// (real, effective, saved, file system), as /proc shows them.
func SameOwner(a, b int) bool {
	ua, ub := proc.StatusField(a, "Uid:"), proc.StatusField(b, "Uid:")
	return len(ua) == 4 && slices.Equal(ua, ub)
}

// ErrNotTheProcess says the control socket found for a process is served
// by another: someone else's listener in its place.
var ErrNotTheProcess = errors.New("the control socket is not the process's own")

// checkPeer checks that the listener of c is pid itself (SO_PEERCRED: the
// pid is the kernel's, in our namespace), with pid's effective uid.
func checkPeer(c *net.UnixConn, pid int, path string) error {
	if proc.Root != "/proc" {
		// A fake /proc (unit tests of other rooms) describes no real
		// listener: the kernel's answer has nothing to be compared with.
		return nil
	}
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("process %d: %s: who listens: %w", pid, path, cerr)
	}
	uid := proc.StatusField(pid, "Uid:")
	if int(cred.Pid) != pid || len(uid) < 2 || uid[1] != strconv.FormatUint(uint64(cred.Uid), 10) {
		return fmt.Errorf("process %d: %s is served by process %d (uid %d): %w", pid, path, cred.Pid, cred.Uid, ErrNotTheProcess)
	}
	return nil
}

// Loaded says whether pid maps the library.
func Loaded(pid int) bool {
	b, err := os.ReadFile(filepath.Join(proc.Root, strconv.Itoa(pid), "maps"))
	return err == nil && strings.Contains(string(b), Library)
}

// Report is what the library says of its process.
type Report struct {
	PID int `json:"pid"`
	// Capable: every device allocation can be released and recreated.
	Capable bool `json:"capable"`
	// Reason says why not.
	Reason   string `json:"reason"`
	Bytes    int64  `json:"bytes"`
	Mappings int    `json:"mappings"`
	Handles  int    `json:"handles"`
	Allocs   int    `json:"allocs"`
	Contexts int    `json:"contexts"`
	// Wrapped counts the driver entry points handed out through it.
	Wrapped  int  `json:"wrapped"`
	Parked   bool `json:"parked"`
	Released bool `json:"released"`
	// Unfilled: mapped again, not yet copied in (unpark is refused).
	Unfilled bool `json:"unfilled"`
	// DeviceUsed is the device's used memory as the driver reports it.
	DeviceUsed int64 `json:"device_used"`
	// Driver: the driver's lock was announced (no CUDA call of the library
	// is safe until its restore and unlock); Detached: the owner let go
	// before CRIU. Kept are the paths of the kept copy it knows: for
	// people only (gpucr-stream opens what it recorded itself, kept.go).
	Driver   bool     `json:"driver"`
	Detached bool     `json:"detached"`
	Kept     []string `json:"kept"`
	// Staged counts the copy threads whose pinned buffers are staged
	// (Stage), not yet taken by a copy.
	Staged int `json:"staged"`
	// Collectives counts the NCCL collectives the program launched.
	Collectives int64 `json:"collectives"`
	// Cached is the device memory the program marked as caches it can
	// rebuild (gpucr_mark_cache), in CacheRanges ranges: not stored.
	Cached      int64 `json:"cached"`
	CacheRanges int   `json:"cache_ranges"`
}

// Conn is a connection to one process's library.
type Conn struct {
	PID  int
	conn *net.UnixConn
	rd   *bufio.Reader
	// broken: a command got no answer, so the next answer on this
	// connection may be an old one.
	broken bool
}

// Dial connects to the library of pid through its socket in dir,
// and checks that pid itself listens there.
func Dial(ctx context.Context, dir string, pid int) (*Conn, error) {
	path := socketOf(dir, pid)
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("process %d: %w (%v)", pid, ErrNotLoaded, err)
		}
		return nil, fmt.Errorf("process %d: connect to %s: %w", pid, path, err)
	}
	conn := c.(*net.UnixConn)
	if err := checkPeer(conn, pid, path); err != nil {
		conn.Close()
		return nil, err
	}
	return newConn(conn, pid), nil
}

// newConn is a connection on c to the library serving pid.
func newConn(c *net.UnixConn, pid int) *Conn {
	return &Conn{PID: pid, conn: c, rd: bufio.NewReaderSize(c, maxAnswer)}
}

// Close ends the connection; the library's state stays.
func (p *Conn) Close() error { return p.conn.Close() }

// Broken says that a command got no answer: the connection is out of step,
// good only to be closed.
func (p *Conn) Broken() bool { return p.broken }

// do sends one command (with fds) and returns the JSON of its answer.
func (p *Conn) do(ctx context.Context, cmd string, fds []*os.File) ([]byte, error) {
	stop := context.AfterFunc(ctx, func() { p.conn.SetDeadline(time.Now()) })
	defer stop()
	var oob []byte
	if len(fds) > 0 {
		ints := make([]int, len(fds))
		for i, f := range fds {
			ints[i] = int(f.Fd())
		}
		oob = syscall.UnixRights(ints...)
	}
	if p.broken {
		return nil, fmt.Errorf("process %d: %s: the connection is out of step after an earlier failure", p.PID, cmd)
	}
	if _, _, err := p.conn.WriteMsgUnix([]byte(cmd+"\n"), oob, nil); err != nil {
		p.broken = true
		return nil, fmt.Errorf("process %d: %s: %w", p.PID, cmd, ctxErr(ctx, err))
	}
	b, err := p.rd.ReadSlice('\n') // at most maxAnswer bytes
	if errors.Is(err, bufio.ErrBufferFull) {
		p.broken = true
		return nil, fmt.Errorf("process %d: %s: answer longer than %d bytes, starting %s: %w", p.PID, cmd, maxAnswer, redact.Text(string(b[:64])), ErrBadAnswer)
	}
	if err != nil {
		p.broken = true
		return nil, fmt.Errorf("process %d: %s: no answer: %w", p.PID, cmd, ctxErr(ctx, err))
	}
	line := string(b[:len(b)-1])
	if msg, ok := strings.CutPrefix(line, "err "); ok {
		return nil, fmt.Errorf("process %d: %s: %s", p.PID, cmd, redact.Text(msg))
	}
	js, ok := strings.CutPrefix(line, "ok ")
	if !ok {
		return nil, fmt.Errorf("process %d: %s: unexpected answer %q: %w", p.PID, cmd, line[:min(len(line), 64)], ErrBadAnswer)
	}
	return []byte(js), nil
}

func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return err
}

// Report asks for the library's bookkeeping.
func (p *Conn) Report(ctx context.Context) (Report, error) {
	r, err := ask[Report](ctx, p, "report", nil)
	if err != nil {
		return r, err
	}
	// Shown to people: the process may have put escape sequences there.
	r.Reason = redact.Text(r.Reason)
	for i, k := range r.Kept {
		r.Kept[i] = redact.Text(k)
	}
	return r, nil
}

// Park closes the gate (no new CUDA work starts), waits up to timeout for
// calls in flight to leave it, and synchronizes the program's contexts.
func (p *Conn) Park(ctx context.Context, timeout time.Duration) error {
	_, err := p.do(ctx, "park "+strconv.FormatInt(max(timeout.Milliseconds(), 1), 10), nil)
	return err
}

// CollectivesHold stops the process's next collective launch (an NCCL
// kernel) and returns how many it has launched: the first step of the
// collective barrier (preload/gate.c) that brings the ranks of a job to
// one collective boundary before they are parked. Unpark, CollectivesRelease
// and the end of this connection (while not parked) let them go.
func (p *Conn) CollectivesHold(ctx context.Context) (int64, error) {
	return p.collectives(ctx, "collhold")
}

// CollectivesUntil lets the process launch collectives until it has
// launched n, waiting up to timeout for that, and holds it there.
func (p *Conn) CollectivesUntil(ctx context.Context, n int64, timeout time.Duration) (int64, error) {
	return p.collectives(ctx, fmt.Sprintf("colluntil %d %d", n, max(timeout.Milliseconds(), 1)))
}

// CollectivesRelease lets held collective launches go.
func (p *Conn) CollectivesRelease(ctx context.Context) error {
	_, err := p.do(ctx, "collrelease", nil)
	return err
}

func (p *Conn) collectives(ctx context.Context, cmd string) (int64, error) {
	b, err := p.do(ctx, cmd, nil)
	if err != nil {
		return 0, err
	}
	var r struct {
		Collectives int64 `json:"collectives"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return 0, fmt.Errorf("process %d: %s: answer %q: %w", p.PID, cmd, b, err)
	}
	return r.Collectives, nil
}

// Shared is what the library says of the device memory its process shares
// with others through shareable handles (preload/wrappers.c).
type Shared struct {
	// Descriptors are the library's duplicates of the descriptors the
	// program exported or imported (numbers in the process's table),
	// there until the release: an import and its export are the same open
	// file (kcmp).
	Descriptors []SharedDescriptor `json:"descriptors"`
	// Imports are the handles imported from other processes, with the
	// export each came from as gpucr-stream matched it (Source).
	Imports []SharedImport `json:"imports"`
}

// SharedDescriptor is one exported or imported descriptor of handle
// record H.
type SharedDescriptor struct {
	H      int  `json:"h"`
	FD     int  `json:"fd"`
	Import bool `json:"import"`
}

// SharedImport is an imported handle record H, from handle record SrcH of
// process SrcPID (0: not matched); Present: mapped now.
type SharedImport struct {
	H       int  `json:"h"`
	SrcPID  int  `json:"src_pid"`
	SrcH    int  `json:"src_h"`
	Present bool `json:"present"`
}

// Pending says whether an import is not mapped again yet.
func (s Shared) Pending() bool {
	for _, im := range s.Imports {
		if !im.Present {
			return true
		}
	}
	return false
}

// Shared asks what the process shares.
func (p *Conn) Shared(ctx context.Context) (Shared, error) {
	s, err := ask[Shared](ctx, p, "shared", nil)
	if err != nil {
		return s, err
	}
	return s, nil
}

// Source records that imported handle record h came from handle record
// srcH of process pid (kept in the process: it survives CRIU).
func (p *Conn) Source(ctx context.Context, h, pid, srcH int) error {
	_, err := p.do(ctx, fmt.Sprintf("source %d %d %d", h, pid, srcH), nil)
	return err
}

// Export has the library export handle record h (mapped again after a
// remap) and returns the descriptor's number in the process, open until
// the next command on this connection: take it with pidfd_getfd first.
func (p *Conn) Export(ctx context.Context, h int) (int, error) {
	r, err := ask[struct {
		FD int `json:"fd"`
	}](ctx, p, "export "+strconv.Itoa(h), nil)
	if err != nil {
		return -1, err
	}
	return r.FD, nil
}

// Import has the library import f (an exporter's handle) as imported
// handle record h and map it where h was mapped.
func (p *Conn) Import(ctx context.Context, h int, f *os.File) error {
	_, err := p.do(ctx, "import "+strconv.Itoa(h), []*os.File{f})
	return err
}

// Unpark lets the program run again (refused while memory is released).
func (p *Conn) Unpark(ctx context.Context) error {
	_, err := p.do(ctx, "unpark", nil)
	return err
}

// Release unmaps and frees every device allocation, keeping what it takes
// to recreate them at the same addresses.
func (p *Conn) Release(ctx context.Context) error {
	_, err := p.do(ctx, "release", nil)
	return err
}

// Keep hands the library the directory of the copy kept of the device
// memory and read-only descriptors of its files (it must come before
// Release): should this connection end without Detach (gpucr-stream
// died), the library refills from them itself, and removes the files
// where it may (only those it holds, found in dir).
func (p *Conn) Keep(ctx context.Context, dir *os.File, files []*os.File) error {
	if len(files) == 0 || len(files) > 64 {
		return fmt.Errorf("process %d: keep: %d files, want 1..64", p.PID, len(files))
	}
	_, err := p.do(ctx, "keep", append([]*os.File{dir}, files...))
	return err
}

// Driver says the driver's lock comes next: from now on, should this
// connection end without Detach, the library makes no CUDA call and waits
// for Recover (`gpu resume --pid`).
func (p *Conn) Driver(ctx context.Context) error {
	_, err := p.do(ctx, "driver", nil)
	return err
}

// Detach lets go of the park before CRIU dumps the process: the library
// closes the kept copy's descriptors (it keeps their paths for Recover),
// and the end of this connection is no longer gpucr-stream's death.
func (p *Conn) Detach(ctx context.Context) error {
	_, err := p.do(ctx, "detach", nil)
	return err
}

// Recover brings a parked process back: it maps what was released again,
// refills it from files (none: the kept copy the library knows) with the
// checks of CopyIn, and unparks it. A process that is not parked is left
// alone. On failure it stays parked.
func (p *Conn) Recover(ctx context.Context, files []*os.File) error {
	if len(files) > 64 {
		return fmt.Errorf("process %d: recover: %d files, want at most 64", p.PID, len(files))
	}
	_, err := p.do(ctx, "recover", files)
	return err
}

// StatusFile is where the library of pid (its own pid) says what
// it did on its own after gpucr-stream went away (next to its socket in
// dir).
func StatusFile(dir string, pid int) string {
	return filepath.Join(dir, "preload-"+strconv.Itoa(pid)+".status")
}

// Remap recreates and maps what Release freed (contents undefined).
func (p *Conn) Remap(ctx context.Context) error {
	_, err := p.do(ctx, "remap", nil)
	return err
}

// Stage has the library allocate the pinned buffers and streams of
// workers copy threads now, while the program still runs, so that the copy
// out after Park starts at once. What no copy takes is freed at Unpark or
// when the connection ends. A library that stages nothing (no context yet,
// or GPUCR_PRELOAD_STAGE=0) answers ok too; its workers allocate their own.
func (p *Conn) Stage(ctx context.Context, workers int) error {
	_, err := p.do(ctx, "stage "+strconv.Itoa(workers), nil)
	return err
}

// ZeroScan is what a zero scan found of the process's own device memory
// (preload/written.c): of Allocated bytes, Zero were in all-zero blocks
// and Cached in blocks the program marked as caches, so a copy out moves
// and stores the other Stored bytes, in Pieces records (each with a
// header, padded to 4 KiB). ScanError, when not empty, says why the scan
// failed: then every block is stored.
type ZeroScan struct {
	Allocated int64   `json:"allocated"`
	Zero      int64   `json:"zero_bytes"`
	Cached    int64   `json:"cached_bytes"`
	Stored    int64   `json:"stored"`
	Pieces    int64   `json:"pieces"`
	Block     int64   `json:"block"`
	ScanS     float64 `json:"scan_s"`
	ScanError string  `json:"scan_error"`
}

// Scan has the parked process's library find its zero blocks on the
// device, for the copy out that follows: what that copy will hold.
func (p *Conn) Scan(ctx context.Context) (ZeroScan, error) {
	w, err := ask[ZeroScan](ctx, p, "scan", nil)
	if err != nil {
		return w, err
	}
	return w, nil
}

// CopyStats are what a copy moved and where its time went: the slowest
// worker's setup (its pinned buffers and streams, unless staged), copy and
// teardown; and, summed over the workers, the time they waited on the
// device and the time they spent writing (copy out) or reading (copy in)
// their files.
type CopyStats struct {
	Bytes int64
	// Workers copied; Staged of them found their buffers staged.
	Workers, Staged       int
	Setup, Work, Teardown time.Duration
	Wait, IO              time.Duration
	// Of the memory the copy covered (Allocated), what it left out: a copy
	// out's Zero and Cached blocks (its scan's, ScanError set if that
	// failed); a copy in's Zero is the bytes it set with memsets.
	Allocated, Zero, Cached int64
	ScanError               string
	// Earlier is what a copy out left holes for: stored in its files, not
	// copied, as an earlier checkpoint holds it (Skip).
	Earlier int64
}

// CopyOut writes every live mapping into the files (one copy thread each,
// the format of docs/PRODUCERS.md "VRAM files"); the library closes its
// copies of them when done.
func (p *Conn) CopyOut(ctx context.Context, files []*os.File) (CopyStats, error) {
	return p.copy(ctx, "copyout", files)
}

// Peek is CopyOut while the program runs (a migration's pre-copy): a
// hint of the memory, torn where the program writes meanwhile; memory
// unmapped meanwhile is left as zeros.
func (p *Conn) Peek(ctx context.Context, files []*os.File) (CopyStats, error) {
	return p.copy(ctx, "peek", files)
}

// CopyIn reads files in that format and writes their ranges back.
func (p *Conn) CopyIn(ctx context.Context, files []*os.File) (CopyStats, error) {
	return p.copy(ctx, "copyin", files)
}

func (p *Conn) copy(ctx context.Context, cmd string, files []*os.File) (CopyStats, error) {
	if len(files) == 0 || len(files) > 64 {
		return CopyStats{}, fmt.Errorf("process %d: %s: %d files, want 1..64", p.PID, cmd, len(files))
	}
	js, err := p.do(ctx, cmd, files)
	if err != nil {
		return CopyStats{}, err
	}
	var r struct {
		Bytes     int64   `json:"bytes"`
		Workers   int     `json:"workers"`
		Staged    int     `json:"staged"`
		SetupS    float64 `json:"setup_s"`
		WorkS     float64 `json:"work_s"`
		TeardownS float64 `json:"teardown_s"`
		WaitS     float64 `json:"wait_s"`
		IOS       float64 `json:"io_s"`
		Allocated int64   `json:"allocated"`
		Zero      int64   `json:"zero_bytes"`
		Cached    int64   `json:"cached_bytes"`
		Earlier   int64   `json:"earlier_bytes"`
		ScanError string  `json:"scan_error"`
	}
	if err := json.Unmarshal(js, &r); err != nil {
		return CopyStats{}, fmt.Errorf("process %d: %s: %w", p.PID, cmd, err)
	}
	return CopyStats{Bytes: r.Bytes, Workers: r.Workers, Staged: r.Staged, Setup: secs(r.SetupS), Work: secs(r.WorkS),
		Teardown: secs(r.TeardownS), Wait: secs(r.WaitS), IO: secs(r.IOS), Allocated: r.Allocated, Zero: r.Zero, Cached: r.Cached,
		ScanError: r.ScanError, Earlier: r.Earlier}, nil
}

// DevHash is what a `devhash` answered: the block hashes of the process's
// own device memory, computed on the device (preload/devhash.c).
type DevHash struct {
	Bytes    int64  `json:"bytes"`
	Blocks   int64  `json:"blocks"`
	Block    int64  `json:"block"`
	Mappings int    `json:"mappings"`
	Contexts int    `json:"contexts"`
	Digest   string `json:"digest"`
	// LoadS: loading the kernel and allocating its output; KernelS: the
	// kernels, every context's in turn; FetchS: the hashes to the host.
	LoadS   float64 `json:"load_s"`
	KernelS float64 `json:"kernel_s"`
	FetchS  float64 `json:"fetch_s"`
	// Compared: the previous call had the same block size and key;
	// ChangedBytes and UnchangedBytes are its mappings' blocks that are
	// different and the same (a mapping new since then is in neither).
	Compared       bool  `json:"compared"`
	ChangedBytes   int64 `json:"changed_bytes"`
	UnchangedBytes int64 `json:"unchanged_bytes"`
	// Checked: every block was also copied to the host and hashed there
	// (in CheckS); MismatchedBlocks are those whose hashes differ.
	Checked          bool    `json:"checked"`
	MismatchedBlocks int64   `json:"mismatched_blocks"`
	CheckS           float64 `json:"check_s"`
}

// DevHash hashes the parked process's device memory on the device, in
// blocks of block bytes under key; check hashes it on the host too.
func (p *Conn) DevHash(ctx context.Context, block int64, key uint64, check bool) (DevHash, error) {
	cmd := fmt.Sprintf("devhash %d %#x", block, key)
	if check {
		cmd += " check"
	}
	r, err := ask[DevHash](ctx, p, cmd, nil)
	if err != nil {
		return r, err
	}
	r.Digest = redact.Text(r.Digest) // printed by gpu hash
	return r, nil
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// FindLibrary finds the library: next to the running binary (where make
// build puts it), else in PREFIX/lib/gpucr-stream beside the binary's
// PREFIX/bin (where make install puts it, whatever PREFIX), else the
// default install dir.
func FindLibrary() (string, error) {
	var tried []string
	if exe, err := os.Executable(); err == nil {
		if exe, err = filepath.EvalSymlinks(exe); err == nil {
			bin := filepath.Dir(exe)
			tried = append(tried, filepath.Join(bin, Library), filepath.Join(bin, "..", "lib", "gpucr-stream", Library))
		}
	}
	if def := filepath.Join("/usr/local/lib/gpucr-stream", Library); !slices.Contains(tried, def) {
		tried = append(tried, def)
	}
	for _, p := range tried {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found (looked at %s; make build puts it next to the binary)", Library, strings.Join(tried, ", "))
}

// Env returns env with lib first in LD_PRELOAD, ahead of what was
// there; env itself is left alone.
func Env(env []string, lib string) []string {
	out := make([]string, 0, len(env)+1)
	pre := lib
	found := false
	for _, e := range env {
		if old, ok := strings.CutPrefix(e, "LD_PRELOAD="); ok && !found {
			found = true
			if old != "" {
				pre = lib + ":" + old
			}
			continue
		}
		out = append(out, e)
	}
	return append(out, "LD_PRELOAD="+pre)
}

// Exec replaces this process with args (a program, found on PATH
// unless it names a path, and its arguments) run with the library
// preloaded: `gpucr-stream run`. It returns only on failure.
func Exec(args []string) error {
	if len(args) == 0 {
		return errors.New("run: no program")
	}
	lib, err := FindLibrary()
	if err != nil {
		return err
	}
	prog := args[0]
	if !strings.Contains(prog, "/") {
		if prog, err = lookPath(prog); err != nil {
			return err
		}
	}
	if err := syscall.Exec(prog, args, Env(os.Environ(), lib)); err != nil {
		return fmt.Errorf("run %s: %w", prog, err)
	}
	return nil
}

// lookPath finds an executable name on PATH.
func lookPath(name string) (string, error) {
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("run: %s: not found on PATH", name)
}

// ask sends cmd and decodes its answer, a JSON object, into a T; an error
// names the command by its first word.
func ask[T any](ctx context.Context, p *Conn, cmd string, fds []*os.File) (T, error) {
	var r T
	js, err := p.do(ctx, cmd, fds)
	if err != nil {
		return r, err
	}
	if err := json.Unmarshal(js, &r); err != nil {
		verb, _, _ := strings.Cut(cmd, " ")
		return r, fmt.Errorf("process %d: %s: %w", p.PID, verb, err)
	}
	return r, nil
}
