package main

// Wiring: the parsed flags turned into the options of the library calls,
// and their hooks into this process's progress bar and lines.

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/container"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/gpuckpt"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/s3"
	"github.com/gpucr/gpucr-stream/transport/tcp"
)

// openDriver is the CUDA driver the commands use, and findCUDAProcs how
// they find CUDA processes; tests replace them with fakes.
var (
	openDriver    = cudadriver.Open
	findCUDAProcs = cudadriver.FindCUDA
)

// locationConfig is how the commands open their locations.
func (c *config) locationConfig() location.Config {
	return location.Config{
		Stdin: c.stdin, Stdout: c.stdout, Shards: c.shards,
		Options: c.opts, BufferLimit: c.bufferLimit, SpillDir: c.spillDir, SegmentSize: c.segSize,
		S3:  c.s3Settings,
		TCP: func() (location.TCPConfig, error) { return c.tcpSettings() },
		Log: c.logLine,
	}
}

// parseLoc parses a DEST or SRC; flag names the flag for the message.
func parseLoc(flag, s string) (location.Location, error) {
	loc, err := location.Parse(s)
	if err != nil {
		return loc, usagef("%s: %v", flag, err)
	}
	return loc, nil
}

// refuseTerminal refuses a binary stream to standard output when that is a
// terminal, as compressors do: it would only garble the screen, and for
// checkpoint the process would be gone with nothing kept.
func (c *config) refuseTerminal(dest location.Location) error {
	if dest.Kind != location.Stdio || len(c.shards) > 0 {
		return nil
	}
	if f, ok := c.stdout.(*os.File); ok && isTerminal(f) {
		return usagef("refusing to write a binary stream to a terminal: redirect standard output (> FILE, | ssh HOST ...) or give --to DIR, s3://BUCKET/PREFIX/NAME or tcp://HOST:PORT")
	}
	return nil
}

// refuseNoCopy refuses a checkpoint whose only copy would go to standard
// output when that is a character device (a terminal, /dev/null): the
// process would be gone with the checkpoint kept nowhere. A pipe or a file
// holds a copy.
func (c *config) refuseNoCopy(dest location.Location) error {
	if err := c.refuseTerminal(dest); err != nil || dest.Kind != location.Stdio || len(c.shards) > 0 {
		return err
	}
	f, ok := c.stdout.(*os.File)
	if !ok {
		return nil
	}
	if st, err := f.Stat(); err != nil || st.Mode()&os.ModeCharDevice == 0 {
		return nil
	}
	name, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
	if err != nil {
		name = "a character device"
	}
	return usagef("refusing to checkpoint into %s (standard output): the checkpoint would be kept nowhere and the process would be gone; redirect standard output to a file or a pipe (> FILE, | ssh HOST ...) or give --to DIR, s3://BUCKET/PREFIX/NAME or tcp://HOST:PORT", name)
}

// s3Settings turns the --s3-* flags into the store's configuration; the
// bucket and prefix come from the location. Credentials are not flags:
// they come from the environment or the shared credentials file (s3.New),
// so that they never show in a process listing.
func (c *config) s3Settings() (s3.Config, error) {
	style, err := s3.ParsePathStyle(c.s3PathStyle)
	if err != nil {
		return s3.Config{}, usagef("--s3-path-style: %v", err)
	}
	part, err := parseSize(c.s3PartSize)
	if err != nil || part < 5<<20 || part > 5<<30 {
		return s3.Config{}, usagef("--s3-part-size %q: want a size from 5MiB to 5GiB", c.s3PartSize)
	}
	if c.s3Parallel < 1 || c.s3Parallel > 256 {
		return s3.Config{}, usagef("--s3-parallel %d: want 1..256", c.s3Parallel)
	}
	sse, err := s3.LoadSSE(c.s3SSE, c.s3SSEKey)
	if err != nil {
		return s3.Config{}, usagef("--s3-sse, --s3-sse-key-file: %v", err)
	}
	return s3.Config{Endpoint: c.s3Endpoint, Region: c.s3Region, PathStyle: style, PartSize: part, Parallel: c.s3Parallel, SSE: sse,
		CreateBucket: c.createBucket}, nil
}

// loadKey reads --key-file, else $GPUCR_KEY, into the pipeline's options:
// location and checkpoint encrypt what they write with it and require it
// of what they read. Only the commands that take --key-file load it.
func (c *config) loadKey() error {
	key, err := crypt.LoadKey(c.keyFile)
	if err != nil {
		return usagef("%v", err)
	}
	c.opts.Key = key
	return nil
}

// tcpSettings are the tcp:// flags: auth, timeout and streams.
func (c *config) tcpSettings() (location.TCPConfig, error) {
	var t location.TCPConfig
	var err error
	if t.Auth, err = c.tcpAuth(); err != nil {
		return t, err
	}
	if t.Timeout, err = c.tcpTimeout(); err != nil {
		return t, err
	}
	if c.streams < 0 || c.streams > tcp.MaxStreams {
		return t, usagef("--streams %d: want 1..%d, or 0 for the default", c.streams, tcp.MaxStreams)
	}
	t.Streams = c.streams
	if t.Streams == 0 {
		t.Streams = tcp.DefaultStreams()
	}
	return t, nil
}

func (c *config) tcpAuth() (tcp.Auth, error) {
	a, err := tcp.LoadAuth(c.tokenFile, c.tlsCert, c.tlsKey, c.tlsCA)
	if err != nil {
		return a, usagef("%v", err)
	}
	return a, nil
}

func (c *config) tcpTimeout() (time.Duration, error) {
	d, err := time.ParseDuration(c.netTimeout)
	if err != nil || d < time.Second {
		return 0, usagef("--net-timeout %q: want a duration of at least 1s, such as 20s", c.netTimeout)
	}
	return d, nil
}

// logLine writes one diagnostic line to stderr.
func (c *config) logLine(msg string) {
	fmt.Fprintf(c.stderr, "gpucr-stream: %s\n", msg)
}

// progressLine writes one line to --progress-fd.
func (c *config) progressLine(s string) {
	fmt.Fprintln(c.progress, s)
}

// hooks draw the progress bar, write progress lines and log.
func (c *config) hooks() checkpoint.Hooks {
	return checkpoint.Hooks{
		Progress: func(p checkpoint.Progress) func() { return startProgress(c, p).finish },
		Line:     c.progressLine,
		Stats:    c.statsLine,
		Log:      c.logLine,
	}
}

func (c *config) criuOptions() checkpoint.CRIU {
	return checkpoint.CRIU{Path: c.criu, WorkDir: c.workDir, Args: strings.Fields(c.criuOpts), Carry: c.carryList()}
}

// carryList is --carry, checked in finish.
func (c *config) carryList() []string {
	if c.carry == "" {
		return nil
	}
	return strings.Split(c.carry, ",")
}

// containerOptions are --runtime, --runtime-root and --bundle.
func (c *config) containerOptions() container.Options {
	return container.Options{Runtime: c.runtime, Root: c.runtimeRoot, Bundle: c.bundle}
}

// checkpointTarget is the tree a checkpoint or migration dumps: --pid, or
// the init of --container, whose runtime then runs CRIU.
func (c *config) checkpointTarget(ctx context.Context, cmd string, criu *checkpoint.CRIU) (int, error) {
	switch {
	case c.container != "" && c.pid > 0:
		return 0, usagef("%s takes --pid or --container, not both", cmd)
	case c.container == "" && c.pid <= 0:
		return 0, usagef("%s needs --pid PID or --container ID", cmd)
	case c.container == "":
		return c.pid, nil
	}
	pid, l, err := container.ForCheckpoint(ctx, c.containerOptions(), c.container)
	criu.Launcher = l
	return pid, err
}

// restoreAs makes a restore (restore, receive --restore) restore as
// --container through its runtime, where it is given.
func (c *config) restoreAs(ctx context.Context, criu *checkpoint.CRIU) error {
	if c.container == "" {
		return nil
	}
	l, err := container.ForRestore(ctx, c.containerOptions(), c.container)
	criu.Launcher = l
	return err
}

// cudaOptions are --cuda, and --lock-timeout where the command suspends.
func (c *config) cudaOptions(suspends bool) (gpuckpt.CUDA, error) {
	mode, err := parseCUDAMode(c.cuda)
	if err != nil {
		return gpuckpt.CUDA{}, err
	}
	cuda := gpuckpt.CUDA{Mode: mode, OpenDriver: openDriver, FindProcs: findCUDAProcs}
	if suspends {
		cuda.LockTimeout, err = c.lockTimeoutDur()
	} else {
		cuda.Stage, err = c.stage()
	}
	return cuda, err
}

// stage parses --stage-memory.
func (c *config) stage() (gpuckpt.StageMemory, error) {
	switch c.stageMemory {
	case "auto":
		return 0, nil
	case "none":
		return -1, nil
	}
	n, err := parseSize(c.stageMemory)
	if err != nil || n <= 0 {
		return 0, usagef("--stage-memory %q: want a size such as 16GiB, auto or none", c.stageMemory)
	}
	return gpuckpt.StageMemory(n), nil
}

// fastPathOptions are --fast-path, --vram-files and --vram-keep-dir.
func (c *config) fastPathOptions() (gpuckpt.FastPath, error) {
	mode := gpuckpt.FastPathMode(c.fastPath)
	if mode != gpuckpt.FastPathAuto && mode != gpuckpt.FastPathOff {
		return gpuckpt.FastPath{}, usagef("--fast-path %q: want auto or off", c.fastPath)
	}
	if c.vramFiles < 1 || c.vramFiles > 64 {
		return gpuckpt.FastPath{}, usagef("--vram-files %d: want 1..64", c.vramFiles)
	}
	return gpuckpt.FastPath{Mode: mode, Files: c.vramFiles, KeepDir: c.vramKeepDir}, nil
}

// lockTimeoutDur parses --lock-timeout.
func (c *config) lockTimeoutDur() (time.Duration, error) {
	d, err := time.ParseDuration(c.lockTimeout)
	if err != nil || d < 0 {
		return 0, usagef("--lock-timeout %q: want a duration such as 10s", c.lockTimeout)
	}
	return d, nil
}

func parseCUDAMode(s string) (gpuckpt.CUDAMode, error) {
	switch m := gpuckpt.CUDAMode(s); m {
	case gpuckpt.CUDAAuto, gpuckpt.CUDAOn, gpuckpt.CUDAOff:
		return m, nil
	}
	return "", usagef("--cuda %q: want auto, on or off", s)
}

// parseGPUMap reads --gpu-map: OLD_UUID=NEW_UUID[,...], or all=NEW_UUID
// for a checkpoint's one GPU, whichever it is.
func parseGPUMap(spec string) (gpuckpt.GPUMap, error) {
	if spec == "" {
		return gpuckpt.GPUMap{}, nil
	}
	if old, nw, ok := strings.Cut(spec, "="); ok && old == "all" {
		u, err := cudadriver.ParseUUID(nw)
		if err != nil {
			return gpuckpt.GPUMap{}, usagef("--gpu-map: %v", err)
		}
		return gpuckpt.GPUMap{All: true, AllTo: u}, nil
	}
	pairs, err := cudadriver.ParseGPUMap(spec)
	if err != nil {
		return gpuckpt.GPUMap{}, usagef("--gpu-map: %v", err)
	}
	return gpuckpt.GPUMap{Pairs: pairs}, nil
}

// extFileList is --ext-file-fds.
func (c *config) extFileList() []checkpoint.ExtFile {
	var out []checkpoint.ExtFile
	for _, e := range c.extFiles {
		out = append(out, checkpoint.ExtFile{Name: e.name, FD: e.fd})
	}
	return out
}

func srcArg(cfg *config, cmd string, args []string) (string, error) {
	switch len(args) {
	case 0:
		// Stdin by default, but not a terminal: nobody types a stream.
		if f, ok := cfg.stdin.(*os.File); ok && cfg.from == "-" && isTerminal(f) {
			return "", usagef("%s needs SRC (a checkpoint directory, s3://..., a stream file, or - with a stream on standard input)", cmd)
		}
		return cfg.from, nil
	case 1:
		if cfg.onCmdLine["from"] {
			return "", usagef("%s: give SRC once: --from %s or the argument %s, not both", cmd, cfg.from, args[0])
		}
		return args[0], nil
	}
	return "", usagef("%s takes one SRC argument, got %d", cmd, len(args))
}

// storeAt opens the store of the one LOCATION argument of ls, rm and gc.
func storeAt(ctx context.Context, cfg *config, cmd string, args []string) (store.Store, location.Location, func(), error) {
	if len(args) != 1 {
		return nil, location.Location{}, nil, usagef("%s takes one LOCATION argument, got %d", cmd, len(args))
	}
	loc, err := location.Parse(args[0])
	if err != nil {
		return nil, loc, nil, usagef("%s: %v", cmd, err)
	}
	st, closeStore, err := location.OpenStore(ctx, loc, cfg.locationConfig())
	if err != nil {
		return nil, loc, nil, fmt.Errorf("%s: %w", cmd, err)
	}
	return st, loc, closeStore, nil
}
