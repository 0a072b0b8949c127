package checkpoint

// Migrate, the sender's state machine: dial the receiver, suspend the GPU
// state, dump with CRIU straight into the connection (and a local copy),
// commit once the receiver has verified the whole image, wait until the
// source is gone, confirm, and wait for the receiver's restore. Until the
// commit a failure leaves the process running here; after it, the local
// copy is what is not lost.
//
// The GPU fast path (gpuckpt/vramfiles.go) is taken as for a checkpoint when
// the receiver restores (it brings the VRAM files back after the driver's
// restore; one that serves an external criu restore would leave the
// processes parked): the VRAM files go first into the stream, the commit
// tells the receiver which processes took it, and a failure before the
// commit refills the source's device memory from the copy kept here.

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/gpuckpt"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/scratch"
	dirstore "github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/transport/tcp"
)

// MigrateOptions are a migration's.
type MigrateOptions struct {
	PID int
	// Dest is the receiver, tcp://HOST:PORT.
	Dest location.Location
	TCP  location.TCPConfig
	// Stream are the pipeline's options; Stream.Key encrypts the stream
	// (the receiver needs the key) and the local copy under one session.
	Stream       pipeline.Options
	CRIU         CRIU
	LeaveRunning bool
	// KeepDir is where the image is kept until the receiver confirms the
	// restore (empty: a tmpfs of huge pages of its own where it can, else
	// $TMPDIR; package scratch); NoKeep keeps no copy.
	KeepDir string
	NoKeep  bool
	CUDA    gpuckpt.CUDA
	// FastPath moves the device memory of CUDA processes that run with
	// libgpucr-preload through the stream (package gpuckpt).
	FastPath gpuckpt.FastPath
	Tool     string
	Hooks    Hooks
	// Precopy sends what the process holds while it runs (precopy.go).
	Precopy PrecopyOptions
}

// MigrateResult is a migration's outcome.
type MigrateResult struct {
	PID          int     `json:"pid"`
	RestoredPID  int     `json:"restored_pid,omitempty"`
	Destination  string  `json:"destination"`
	Session      string  `json:"session"`
	Streams      int     `json:"streams"`
	Files        int     `json:"files"`
	RawBytes     int64   `json:"raw_bytes"`
	StoredBytes  int64   `json:"stored_bytes"`
	StreamBytes  int64   `json:"stream_bytes"`
	WireBytes    int64   `json:"wire_bytes"`
	WireRatio    float64 `json:"wire_ratio"`
	DowntimeSecs float64 `json:"downtime_seconds"`
	// DowntimeTo says where the downtime ends: "restored" (the receiver
	// reported the restored PID) or "dumped" (the receiver does not restore).
	DowntimeTo  string  `json:"downtime_to"`
	Phases      []Phase `json:"phases"`
	TotalSecs   float64 `json:"total_seconds"`
	LeftRunning bool    `json:"left_running"`
	KeptImage   string  `json:"kept_image,omitempty"`
	// KeptInMemory: the local copy went on a tmpfs of its own (package
	// scratch), not into --keep-dir or $TMPDIR.
	KeptInMemory bool `json:"kept_in_memory,omitempty"`
	// CUDA processes suspended for the dump, and their GPUs.
	CUDAPIDs []int          `json:"cuda_pids,omitempty"`
	GPUs     []manifest.GPU `json:"gpus,omitempty"`
	// Precopy says what pre-copy did, or why it was off.
	Precopy *PrecopyResult `json:"precopy,omitempty"`
}

// migration is one Migrate in progress.
type migration struct {
	o      MigrateOptions
	criu   string
	tree   []int
	cc     *gpuckpt.Checkpoint
	out    *tcp.Output
	info   tcp.ReceiverInfo
	output streamer.Output // out, or out and the local copy
	// keep is the local copy, an archive in keepDir: a tmpfs of its own
	// unless the user named one (package scratch).
	keep    string
	keepDir *scratch.Dir
	man     *manifest.Manifest
	gpuErr  error // resuming the source's GPU state failed (LeaveRunning)
	res     MigrateResult

	start, dumpStart, dumped time.Time
}

// Migrate moves the tree of o.PID to the receiver at o.Dest.
func Migrate(ctx context.Context, o MigrateOptions) (*MigrateResult, error) {
	if o.PID <= 0 || !proc.Exists(o.PID) {
		return nil, fmt.Errorf("migrate: no process %d: %w", o.PID, errdefs.ErrNotFound)
	}
	m, err := startMigration(ctx, o)
	if err != nil {
		return nil, err
	}
	defer m.out.Close()
	if err := m.openKeep(ctx); err != nil {
		return nil, err
	}
	if err := m.precopy(ctx); err != nil {
		return nil, err
	}
	if err := m.dump(ctx); err != nil {
		return nil, err
	}
	if err := m.handOver(ctx); err != nil {
		return nil, err
	}
	return m.finish()
}

// startMigration finds what to move and dials the receiver; nothing has
// touched the process yet.
func startMigration(ctx context.Context, o MigrateOptions) (*migration, error) {
	criu, err := criusock.FindCRIU(o.CRIU.Path)
	if err != nil {
		return nil, err
	}
	tree, err := proc.Tree(o.PID)
	if err != nil {
		return nil, err
	}
	// The CUDA processes of the tree: their GPU state is moved into host
	// memory (lock, checkpoint) before CRIU dumps them, as for checkpoint.
	// Whether the receiver restores (and so whether the fast path can be
	// taken) is known once connected: checked again then.
	cc, err := gpuckpt.Find(o.CUDA, o.PID)
	if err != nil {
		return nil, fmt.Errorf("migrate %d: %w (the process was not touched)", o.PID, err)
	}
	if err := cc.CheckDumpable(ctx, tree, o.CRIU.Args, o.FastPath); err != nil {
		return nil, fmt.Errorf("migrate %d: %w (the process was not touched)", o.PID, err)
	}
	if o.CRIU.Args, err = dumpNetworkLock(ctx, criu, o.CRIU.Args, tree); err != nil {
		return nil, fmt.Errorf("migrate %d: %w (the process was not touched)", o.PID, err)
	}
	o.CRIU.Args = dumpGhostLimit(o.CRIU.Args, tree, o.Hooks.log)
	if !o.Precopy.Off {
		// A chunk's hash is its content id, which pre-copy references.
		o.Stream.ChunkHashes = true
	}
	format, err := o.Stream.NewFormat()
	if err != nil {
		return nil, fmt.Errorf("migrate %d: %w (the process was not touched)", o.PID, err)
	}
	start := time.Now()
	out, err := tcp.Dial(ctx, o.Dest.Path, tcp.SendOptions{Auth: o.TCP.Auth, Timeout: o.TCP.Timeout, Streams: o.TCP.Streams, Format: format})
	if err != nil {
		return nil, fmt.Errorf("migrate %d: %w (the process was not touched)", o.PID, err)
	}
	if !out.Receiver().Restores {
		// No fast path to a receiver that does not restore: the tree must
		// pass as on the driver's path.
		if err := cc.CheckDumpable(ctx, tree, o.CRIU.Args, fastIf(o.FastPath, false)); err != nil {
			out.Cancel("sender refused the tree")
			return nil, fmt.Errorf("migrate %d: %w (the receiver does not restore, so the fast path is not taken; the process was not touched)", o.PID, err)
		}
	}
	m := &migration{o: o, criu: criu, tree: tree, cc: cc, out: out, info: out.Receiver(), output: out, start: start}
	m.res = MigrateResult{PID: o.PID, Destination: o.Dest.String(), Session: out.Session(), Streams: o.TCP.Streams, LeftRunning: o.LeaveRunning}
	return m, nil
}

// openKeep starts the local copy: unless the process is left running, a
// copy of the image stays here until the receiver confirms the restore,
// so that whatever happens there after the source is killed, the process
// is not lost.
func (m *migration) openKeep(ctx context.Context) error {
	if m.o.LeaveRunning || m.o.NoKeep {
		return nil
	}
	dir, err := scratch.New(scratch.DefaultRoot, m.o.KeepDir, "gpucr-migrate-keep-", m.keepEstimate(ctx))
	if err != nil {
		m.out.Cancel("sender could not create its local copy")
		return fmt.Errorf("migrate %d: local copy of the image: %w (the process was not touched)", m.o.PID, err)
	}
	m.keepDir = dir
	m.res.KeptInMemory = dir.Mounted
	if dir.Why != "" {
		m.o.Hooks.log(fmt.Sprintf("migrate: the local copy goes into %s, not a tmpfs of huge pages of its own: %s", dir.Path, dir.Why))
	}
	// An archive, written on several lanes at once: a single file took
	// about 3 GB/s of writes, and it paced the final dump of a pre-copy
	// (13 GB kept while 2 GB went over the link). It shares the stream's
	// session: a tee writes the same sealed frames to both. Its commits do
	// not sync: it outlives a failed restore elsewhere, not the host.
	m.keep = filepath.Join(dir.Path, fmt.Sprintf("gpucr-migrate-%d-%s", m.o.PID, m.out.Session()))
	keepOut, err := streamer.NewArchiveOutputAs(ctx, dirstore.NewVolatile(m.keep), 0, m.out.Format())
	if err != nil {
		m.out.Cancel("sender could not create its local copy")
		m.dropKeep()
		return fmt.Errorf("migrate %d: local copy of the image: %w (the process was not touched)", m.o.PID, err)
	}
	m.output = streamer.TeeOutput{Primary: m.out, Copy: keepOut}
	return nil
}

// keepEstimate is the memory the local copy may need beside what is there
// now: the tree's host memory and twice its device memory (the copy holds
// it, and on the fast path the kept copy of it sits in memory until the
// commit too). Unknown device memory counts as none.
func (m *migration) keepEstimate(ctx context.Context) int64 {
	n := proc.DumpEstimate(m.tree)
	for _, g := range m.cc.GPUs(ctx) {
		n += 2 * g.Bytes
	}
	return n
}

// dropKeep removes the local copy, and its directory.
func (m *migration) dropKeep() {
	if m.keepDir != nil {
		m.keep = ""
		dir := m.keepDir
		m.keepDir = nil
		if err := dir.Remove(); err != nil {
			m.o.Hooks.log(fmt.Sprintf("migrate: %v", err))
		}
	}
}

// dump suspends the GPU state and dumps with CRIU into the connection, up
// to the commit: the receiver holds the whole image, verified. A failure
// before that leaves the process running here.
func (m *migration) dump(ctx context.Context) error {
	c, err := streamer.NewCapture(ctx, m.output, m.o.Stream)
	if err != nil {
		m.out.Cancel("sender failed to start")
		m.dropKeep()
		return err
	}
	m.out.OnFailure(func(err error) { c.Abort(err) })
	version := criusock.StartVersionQuery(ctx, m.criu)
	defer version.Wait()
	meta := manifest.Manifest{Tool: m.o.Tool, Process: processOf(m.o.PID)} // CRIUVersion: dump's
	phases := m.cc.QueryGPUs(ctx, &meta)
	tree, _ := proc.Tree(m.o.PID)
	done := m.o.Hooks.progress(Progress{What: "migrate", Counters: &c.Counters, Total: dumpEstimate(tree, meta.GPUs)})
	defer done()
	// The downtime starts where CUDA work stops: the fast path's park, or
	// the GPU lock.
	m.dumpStart = time.Now()
	wireBefore := m.out.WireBytes()
	ps, err := m.cc.FastSuspend(ctx, m.o.FastPath, m.info.Restores, c, &meta, m.o.Hooks.log)
	phases = append(phases, ps...)
	if err == nil {
		ps, err = m.cc.Suspend(ctx, m.o.CUDA.LockTimeout)
		phases = append(phases, ps...)
	}
	var rep criusock.DumpReport
	if err != nil {
		// A failed fastSuspend or suspend has undone its steps (the
		// device memory is back), and CRIU does not run.
		location.AbortCapture(ctx, c, err)
	} else {
		m.man, rep, err = dump(ctx, c, meta, criusock.DumpOptions{
			CRIU: m.criu, PID: m.o.PID, WorkDir: m.o.CRIU.WorkDir, LeaveRunning: m.o.LeaveRunning, ExtraArgs: m.o.CRIU.Args,
			Hooks: criusock.Hooks{Log: m.o.Hooks.Log}, Carry: m.o.CRIU.Carry, Launcher: m.o.CRIU.Launcher, Version: version,
		}, m.cc)
		if err != nil {
			err = m.cc.Undo(err)
		}
	}
	m.dumped = time.Now()
	done()
	if err != nil {
		m.out.Cancel("the checkpoint failed on the sender; the process keeps running there")
		m.dropKeep()
		return fmt.Errorf("migrate %d: %w; the process was not migrated and keeps running here", m.o.PID, err)
	}
	m.recordDump(phases, rep)
	if p := m.res.Precopy; p != nil && p.Method != "off" {
		p.FinalWireBytes, p.FinalRefBytes = m.out.WireBytes()-wireBefore, m.out.RefBytes()
	}
	return nil
}

// recordDump notes a committed dump in the result; with LeaveRunning the
// source runs on at once, GPU included (the fast path refills its device
// memory from the kept copy), while the receiver restores its copy;
// otherwise CRIU has killed it and the fast path's kept copy goes.
func (m *migration) recordDump(phases []Phase, rep criusock.DumpReport) {
	phases = append(phases, m.cc.FastStorePhases()...)
	m.res.Phases = append(phases,
		Phase{Name: "criu dump + transfer", Secs: (rep.CRIU - rep.Commit).Seconds()},
		Phase{Name: "receiver verifies (commit)", Secs: rep.Commit.Seconds()})
	if m.o.LeaveRunning {
		ps, err := m.cc.Resume()
		m.res.Phases = append(m.res.Phases, ps...)
		if err != nil {
			m.gpuErr = fmt.Errorf("resuming the GPU state of the source failed: %w (retry with `gpucr-stream gpu resume --pid %d`)", err, m.o.PID)
		}
	} else {
		m.cc.FastCommit()
	}
	m.res.KeptImage = m.keep
	m.res.Files, m.res.RawBytes, m.res.StoredBytes = len(m.man.Files), m.man.Stats.RawBytes, m.man.Stats.StoredBytes
	m.res.CUDAPIDs, m.res.GPUs = m.cc.PIDs(), m.man.GPUs
	for _, n := range m.out.Sizes() {
		m.res.StreamBytes += n
	}
}

// handOver lets the receiver start the process once the source is gone,
// and waits for its restore where it restores.
func (m *migration) handOver(ctx context.Context) error {
	if !m.o.LeaveRunning {
		m.waitSourceGone(ctx)
	}
	if err := m.out.Confirm(ctx, tcp.CommitInfo{LeftRunning: m.o.LeaveRunning, GPUs: m.man.GPUs, CUDA: m.man.CUDA}); err != nil {
		return m.lost(err)
	}
	if !m.info.Restores {
		// The receiver serves an external criu restore and cannot confirm
		// it; the copy stays (remove it once the process runs there).
		m.res.DowntimeSecs, m.res.DowntimeTo = m.dumped.Sub(m.dumpStart).Seconds(), "dumped"
		return nil
	}
	committed := time.Now()
	r, err := m.out.WaitReport(ctx)
	if err != nil {
		return m.lost(fmt.Errorf("%w (the receiver may have restored it: check there before using the copy)", err))
	}
	if r.Error != "" {
		return m.lost(fmt.Errorf("restore on the receiver failed: %s", r.Error))
	}
	m.res.RestoredPID = r.PID
	// What the receiver says the process ran for lies within its restore
	// (a report of more is the receiver's error, not a negative downtime).
	running := min(max(time.Duration(r.RunningSecs*float64(time.Second)), 0), time.Since(committed))
	m.res.DowntimeSecs, m.res.DowntimeTo = (time.Since(m.dumpStart) - running).Seconds(), "restored"
	m.res.Phases = append(m.res.Phases, Phase{Name: "restore on the receiver", Secs: (time.Since(committed) - running).Seconds()})
	if running > 0 {
		// Lazy pages: the process ran there before its last page was in.
		m.res.DowntimeTo = "running (lazy pages)"
		m.res.Phases = append(m.res.Phases, Phase{Name: "receiver: pages handed in while the process ran", Secs: running.Seconds()})
	}
	m.dropKeep()
	m.res.KeptImage = ""
	return nil
}

// waitSourceGone waits until CRIU's kill took: only then may the receiver
// start the process, and where it restores into this PID space (one host,
// network namespaces) its PIDs must also be free, i.e. reaped.
func (m *migration) waitSourceGone(ctx context.Context) {
	gone := time.Now()
	reaped := m.out.Acked().PIDSpace != "" && m.out.Acked().PIDSpace == proc.Space()
	if err := proc.WaitGone(ctx, m.tree, reaped, m.o.TCP.Timeout); err != nil {
		m.o.Hooks.log(fmt.Sprintf("migrate: %v; telling the receiver to restore anyway", err))
	}
	m.res.Phases = append(m.res.Phases, Phase{Name: "source process gone", Secs: time.Since(gone).Seconds()})
}

// lost explains a failure after the commit: where the process is now.
func (m *migration) lost(err error) error {
	m.res.WireBytes = m.out.WireBytes()
	pid := m.o.PID
	switch {
	case m.o.LeaveRunning && m.gpuErr != nil:
		return fmt.Errorf("migrate %d: %w; the source process is still here (--leave-running), but %w", pid, err, m.gpuErr)
	case m.o.LeaveRunning:
		return fmt.Errorf("migrate %d: %w; the source process is still running here (--leave-running)", pid, err)
	case m.res.KeptImage != "" && m.keepDir != nil && m.keepDir.Mounted:
		return fmt.Errorf("migrate %d: %w; the source process is gone, its image is kept at %s: restore it with `gpucr-stream restore --from %s` (it is in memory, on a tmpfs mounted at %s: restore it or copy it to disk before the host restarts; `umount %s` once done)",
			pid, err, m.res.KeptImage, m.res.KeptImage, m.keepDir.Path, m.keepDir.Path)
	case m.res.KeptImage != "":
		return fmt.Errorf("migrate %d: %w; the source process is gone, its image is kept at %s: restore it with `gpucr-stream restore --from %s`", pid, err, m.res.KeptImage, m.res.KeptImage)
	}
	return fmt.Errorf("migrate %d: %w; the source process is gone and no copy was kept (--keep-dir none)", pid, err)
}

func (m *migration) finish() (*MigrateResult, error) {
	m.res.WireBytes = m.out.WireBytes()
	if m.res.WireBytes > 0 {
		m.res.WireRatio = float64(m.res.RawBytes) / float64(m.res.WireBytes)
	}
	m.res.TotalSecs = time.Since(m.start).Seconds()
	if m.gpuErr != nil {
		return nil, fmt.Errorf("migrate %d: the copy reached %s, but %w", m.o.PID, m.res.Destination, m.gpuErr)
	}
	return &m.res, nil
}
