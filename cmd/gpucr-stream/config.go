package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/pipeline"
)

type config struct {
	stdin          io.Reader
	stdout, stderr io.Writer

	help         bool
	showVersion  bool
	imagesDir    string
	progressFD   int
	shardFDs     string
	extFileFDs   string
	connectWait  string
	createBucket bool
	tcpRemap     string
	serveEarly   bool
	to           string
	from         string
	codecSpec    string
	workers      int
	chunkSize    string
	memoryLimit  string
	spillDir     string
	segmentSize  string
	jsonOut      bool
	noProgress   bool
	keyFile      string
	chunkHashes  bool
	dedup        bool
	pagesLast    bool

	// checkpoint and restore
	pid          int
	criu         string
	leaveRunning bool
	precopy      string
	precopyMax   int
	precopyPct   int
	workDir      string
	carry        string

	// containers (wire.go)
	container   string
	runtime     string
	runtimeRoot string
	bundle      string

	// GPU checkpoint and VRAM producers (gpu.go, vram.go)
	cuda        string
	gpuMap      string
	lockTimeout string
	producers   int
	criuOpts    string
	fastPath    string
	stageMemory string
	vramFiles   int
	vramKeepDir string

	// S3 and archive management (s3.go, ls.go)
	s3Endpoint  string
	s3Region    string
	s3PathStyle string
	s3PartSize  string
	s3Parallel  int
	s3SSE       string
	s3SSEKey    string
	olderThan   string
	repackBelow string
	dryRun      bool
	repairIndex bool
	readData    bool
	hostCheck   bool

	// live migration over TCP (migrate.go, sinks/tcp*.go)
	streams    int
	tokenFile  string
	tlsCert    string
	tlsKey     string
	tlsCA      string
	listen     string
	restoreArg bool
	lazyPages  bool
	netTimeout string
	keepDir    string

	// parsed by finish
	opts pipeline.Options
	// bufferLimit is what a stream source buffers in memory before spilling;
	// 0: --memory-limit auto, sized when a stream source is opened.
	bufferLimit int64
	shards      []int
	extFiles    []extFile
	segSize     int64
	progress    io.Writer
	// connectTimeout is --connect-timeout for package criusock (< 0: no limit).
	connectTimeout time.Duration
	// takes are the flags of the command being run (nil: all), onCmdLine
	// those given on its command line; badFlag reads them.
	takes, onCmdLine map[string]bool
	// dropInProgress is set for capture, serve and extract, whose
	// progress channel carries criu-image-streamer's lines.
	dropInProgress bool
}

type extFile struct {
	name string
	fd   int
}

func newConfig(stdin io.Reader, stdout, stderr io.Writer) *config {
	return &config{stdin: stdin, stdout: stdout, stderr: stderr}
}

// envName is the environment variable that sets a flag's default.
func envName(flagName string) string {
	return "GPUCR_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

func (c *config) flagSet() *flag.FlagSet {
	fs := flag.NewFlagSet("gpucr-stream", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	str := func(p *string, name, def, usage string) {
		if v, ok := os.LookupEnv(envName(name)); ok {
			def = v
		}
		fs.StringVar(p, name, def, usage)
	}
	num := func(p *int, name string, def int, usage string) {
		if v, ok := os.LookupEnv(envName(name)); ok {
			if n, err := strconv.Atoi(v); err == nil {
				def = n
			}
		}
		fs.IntVar(p, name, def, usage)
	}
	boolean := func(p *bool, name string, usage string) {
		def := false
		if v, ok := os.LookupEnv(envName(name)); ok {
			def, _ = strconv.ParseBool(v)
		}
		fs.BoolVar(p, name, def, usage)
	}
	fs.BoolVar(&c.help, "help", false, "show this help")
	str(&c.imagesDir, "images-dir", "", "CRIU images directory (-D) holding the streamer sockets")
	num(&c.progressFD, "progress-fd", 2, "descriptor for progress lines (socket-init, checkpoint-start, statistics JSON)")
	str(&c.shardFDs, "shard-fds", "", "comma-separated descriptors to spread the stream over (capture) or gather it from (serve, extract)")
	str(&c.extFileFDs, "ext-file-fds", "", "extra files as NAME:FD,... to carry in the stream (capture) or write out (serve, extract)")
	str(&c.tcpRemap, "tcp-listen-remap", "", "serve: move TCP listening ports of the image, OLD:NEW,... (as criu-image-streamer does)")
	boolean(&c.serveEarly, "early", "serve: listen at once and let criu restore while the stream is still read (socket-init first, the statistics line last: not criu-image-streamer's order)")
	str(&c.connectWait, "connect-timeout", "2m", "capture/serve: how long to wait for criu to connect to the socket after socket-init (0: forever)")
	str(&c.to, "to", "-", "where the checkpoint goes: - (stdout), a path or file:///path (archive directory), s3://BUCKET/PREFIX/NAME")
	str(&c.from, "from", "-", "where the checkpoint comes from: - (stdin), an archive directory, s3://BUCKET/PREFIX/NAME, or a stream file")
	str(&c.codecSpec, "codec", "lz4", "chunk codec: auto, none, lz4, zstd[:LEVEL], shuffle")
	num(&c.workers, "workers", 0, "encoder/decoder goroutines (0: one per core)")
	str(&c.chunkSize, "chunk-size", "4MiB", "largest chunk of a file")
	str(&c.memoryLimit, "memory-limit", "auto", "memory for chunks in flight (auto: 1GiB) and, on serve or receive from a stream, for held images before spilling (auto: half the available memory, at least 1GiB)")
	str(&c.spillDir, "spill-dir", "", "where serve spills held images beyond --memory-limit (default: $TMPDIR)")
	str(&c.segmentSize, "segment-size", "256MiB", "size of archive segment objects")
	boolean(&c.chunkHashes, "chunk-hashes", "hash every chunk with BLAKE3 beside its CRC-32C, for verify to check too (format 1; costs about 0.2 CPU-s/GiB); encrypted checkpoints always have them")
	boolean(&c.pagesLast, "pages-last", "stream destinations: send CRIU's page images after every other file (held back meanwhile: in memory up to half the memory available, beyond in $TMPDIR), so that a restore from the stream (serve --early, restore --from) starts CRIU before they arrive; the capture ends later, by the time to send them")
	boolean(&c.dedup, "dedup", "archive destinations: store each chunk once in the chunk store of the location that holds the checkpoint (its parent directory or S3 prefix), shared by every checkpoint there (format 4; with --key-file, shared only among checkpoints of that key)")
	boolean(&c.jsonOut, "json", "machine-readable output and results")
	boolean(&c.noProgress, "no-progress", "never draw progress bars")
	str(&c.keyFile, "key-file", "", "encryption key file (mode 0600; make one with: gpucr-stream keygen > FILE), else $GPUCR_KEY (64 hex digits or base64): captures encrypt with it, readers require it")
	num(&c.pid, "pid", 0, "checkpoint: the process (tree root) to checkpoint")
	str(&c.criu, "criu", "", "checkpoint/restore: the criu binary (default: criu on PATH, then /opt/gpucr-criu/bin/criu)")
	boolean(&c.leaveRunning, "leave-running", "checkpoint: keep the process running afterwards")
	str(&c.workDir, "work-dir", "", "checkpoint/restore: directory for CRIU's images dir, sockets and logs (default: a new temporary dir)")
	// GPU checkpoint and VRAM producers (gpu.go, vram.go)
	str(&c.cuda, "cuda", "auto", "checkpoint/restore: CUDA processes of the tree: auto (suspend/resume those found), on (require them), off (plain CRIU)")
	str(&c.gpuMap, "gpu-map", "", "restore: move GPU state from OLD to NEW GPU: OLD_UUID=NEW_UUID[,...] (OLD may be 'all' for one GPU)")
	str(&c.lockTimeout, "lock-timeout", "10s", "checkpoint: how long the CUDA lock may wait for GPU work in flight (0: the driver's default)")
	num(&c.producers, "producers", 0, "checkpoint/restore/capture/serve: VRAM producers the image waits for before it is complete (see vram push/pull)")
	str(&c.stageMemory, "stage-memory", "auto", "restore, gpu resume --from: memory to read the fast path's VRAM files into while criu (or the driver) restores, so that the copy in reads memory: a size, auto (half the available memory, less the images criu restores) or none (read them from the checkpoint during the copy in)")
	str(&c.fastPath, "fast-path", "auto", "checkpoint, migrate, gpu suspend --to: CUDA processes started with gpucr-stream run move their device memory through the pipeline themselves: auto (when every CUDA process of the tree can), off (the driver's checkpoint only)")
	num(&c.vramFiles, "vram-files", 16, "checkpoint, migrate, gpu suspend --to: fast path: files (and copy threads) per CUDA process, 1..64")
	str(&c.vramKeepDir, "vram-keep-dir", "", "checkpoint, migrate, gpu suspend --to: fast path: where the copy of device memory kept until the commit goes (for an undo; default: a tmpfs of huge pages mounted for it under /run/gpucr-stream where it can, else $TMPDIR)")
	boolean(&c.hostCheck, "host-check", "gpu hash: also hash every block on the host, in the library, and count the blocks whose device hashes differ")
	str(&c.criuOpts, "criu-opts", "", "checkpoint/restore: extra criu arguments, space-separated (e.g. --tcp-established)")
	str(&c.carry, "carry", "", "files of CRIU's images dir to carry in the checkpoint and write back there on restore, comma-separated (a name in the images dir or an absolute path; runc's descriptors.json always goes); restore, serve --early: carried files to wait for in a stream")
	str(&c.container, "container", "", "checkpoint, migrate: the container to checkpoint (its runtime's ID or name); restore, receive --restore: the container to restore as, managed by its runtime afterwards")
	str(&c.runtime, "runtime", "runc", "with --container: the container runtime, runc or podman (run with gpucr-stream as its criu)")
	str(&c.runtimeRoot, "runtime-root", "", "with --container and --runtime runc: runc's state directory (runc --root; default runc's)")
	str(&c.bundle, "bundle", "", "restore --container with --runtime runc: the OCI bundle (default: the one the container was checkpointed from)")
	// S3 and archive management (s3.go, ls.go)
	str(&c.s3Endpoint, "s3-endpoint", "", "S3 endpoint, http(s)://host[:port] (default: $AWS_ENDPOINT_URL, else AWS S3); credentials from $AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY or ~/.aws/credentials")
	str(&c.s3Region, "s3-region", "", "S3 region (default: $AWS_REGION, else asked from the server)")
	str(&c.s3PathStyle, "s3-path-style", "auto", "S3 bucket addressing: auto, path or virtual")
	str(&c.s3PartSize, "s3-part-size", "16MiB", "S3 multipart part size, 5MiB..5GiB")
	num(&c.s3Parallel, "s3-parallel", 4, "S3 parts uploading at once, over all objects; each holds --s3-part-size of memory (ranged reads on restore: twice as many per file)")
	str(&c.s3SSE, "s3-sse", "", "S3 server-side encryption of the objects written: none, s3 (SSE-S3), kms[:KEY-ID] (SSE-KMS), c (SSE-C, key from --s3-sse-key-file; https only)")
	str(&c.s3SSEKey, "s3-sse-key-file", "", "S3 SSE-C key file (32 bytes, hex or base64, mode 0600), needed to write and to read SSE-C objects")
	str(&c.olderThan, "older-than", "1h", "gc: remove what dead captures left, and unreferenced packs, once this old by the store's clock (e.g. 30m, 2h, 7d; 0s: at once); a running capture (its lock refreshed within 6h) is never touched")
	str(&c.repackBelow, "repack-below", "50%", "gc: repack a pack of the chunk store whose live chunks fill less than this share of it (0%: never)")
	boolean(&c.createBucket, "create-bucket", "capture/checkpoint/cp to s3://: create the bucket if it does not exist (in --s3-region)")
	boolean(&c.dryRun, "dry-run", "rm, gc: print what would be removed, remove nothing")
	boolean(&c.repairIndex, "repair-index", "check: where the chunk store's index is damaged or incomplete, rebuild it from the packs (writes one index object, then deletes the others)")
	boolean(&c.readData, "read-data", "check: also decode every checkpoint whole and check every checksum and hash, as verify does")
	// live migration over TCP (migrate.go, sinks/tcp*.go)
	num(&c.streams, "streams", 0, "tcp://: parallel connections carrying the stream's shards, each written and encrypted on its own goroutine (1..64; 0: half the cores, 4 to 8)")
	str(&c.tokenFile, "token-file", "", "tcp://: file holding the shared secret both sides prove (make one with: gpucr-stream token > FILE)")
	str(&c.tlsCert, "tls-cert", "", "tcp://: this side's certificate (PEM), instead of or besides --token-file")
	str(&c.tlsKey, "tls-key", "", "tcp://: the key of --tls-cert (PEM)")
	str(&c.tlsCA, "tls-ca", "", "tcp://: CA certificate (PEM) that must have signed the peer's certificate")
	str(&c.listen, "listen", "", "receive: HOST:PORT to accept one checkpoint on")
	boolean(&c.restoreArg, "restore", "receive: restore the checkpoint with criu and print the restored PID")
	boolean(&c.lazyPages, "lazy-pages", "receive --restore: once the whole image is in, restore with criu's lazy pages: the process runs before its memory is copied back, which criu lazy-pages hands in on first touch and in the background (not for CUDA processes; needs userfaultfd)")
	str(&c.netTimeout, "net-timeout", "20s", "tcp://: how long a dead link or a silent peer is tolerated")
	str(&c.keepDir, "keep-dir", "", "migrate: where the image is kept until the receiver confirms the restore (default: a tmpfs of huge pages mounted for it under /run/gpucr-stream where it can, else $TMPDIR; none: keep no copy)")
	str(&c.precopy, "precopy", "off", "migrate: off (stop-and-copy) or on (send what the process holds while it runs, in rounds, then only the chunks that changed; it pays only on a link slower than CRIU's dump: docs/MIGRATION.md)")
	num(&c.precopyMax, "precopy-rounds", 5, "migrate: at most this many pre-copy rounds")
	num(&c.precopyPct, "precopy-shrink", 25, "migrate: another pre-copy round follows one that sent at least this percentage less than the one before")
	fs.BoolVar(&c.showVersion, "version", false, "print the version and exit")
	// criu-image-streamer's short options share the long ones' values.
	for short, long := range shortFlags {
		fs.Var(fs.Lookup(long).Value, short, "short for --"+long)
	}
	return fs
}

// shortFlags are criu-image-streamer's short options, by the long flag
// each stands for.
var shortFlags = map[string]string{"D": "images-dir", "s": "shard-fds", "e": "ext-file-fds", "p": "progress-fd", "V": "version", "h": "help"}

// longName is the flag a name given on the command line stands for.
func longName(name string) string {
	if long, ok := shortFlags[name]; ok {
		return long
	}
	return name
}

// badFlag reports a bad value of flag name, naming where it came from: the
// command line, or its environment variable. A bad variable is ignored by
// commands that do not take the flag ($GPUCR_CODEC must not break inspect).
func (c *config) badFlag(name, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	if c.onCmdLine[name] {
		return usagef("--%s %s", name, msg)
	}
	if c.takes != nil && !c.takes[name] {
		return nil
	}
	return usagef("$%s (--%s) %s", envName(name), name, msg)
}

func (c *config) finish() error {
	spec, err := codec.ParseSpec(c.codecSpec)
	if err != nil {
		if err := c.badFlag("codec", "%q: %v", c.codecSpec, err); err != nil {
			return err
		}
	}
	chunk, err := parseSize(c.chunkSize)
	if err != nil || chunk < 4096 || chunk > codec.MaxChunk {
		if err := c.badFlag("chunk-size", "%q: want a size from 4KiB to %dMiB", c.chunkSize, codec.MaxChunk>>20); err != nil {
			return err
		}
		chunk = pipeline.DefaultChunkSize
	}
	mem := int64(1 << 30)
	if c.memoryLimit != "auto" {
		if m, err := parseSize(c.memoryLimit); err != nil || m <= 0 {
			if err := c.badFlag("memory-limit", "%q: want a size such as 512MiB, or auto", c.memoryLimit); err != nil {
				return err
			}
		} else {
			mem, c.bufferLimit = m, m
		}
	}
	if c.segSize, err = parseSize(c.segmentSize); err != nil || c.segSize < 1<<20 {
		if err := c.badFlag("segment-size", "%q: want a size of at least 1MiB", c.segmentSize); err != nil {
			return err
		}
	}
	if c.workers < 0 {
		if err := c.badFlag("workers", "%d: must not be negative", c.workers); err != nil {
			return err
		}
		c.workers = 0
	}
	if c.connectTimeout, err = time.ParseDuration(c.connectWait); err != nil || c.connectTimeout < 0 {
		if err := c.badFlag("connect-timeout", "%q: want a duration such as 30s or 5m (0: wait forever)", c.connectWait); err != nil {
			return err
		}
	}
	if c.connectTimeout == 0 {
		c.connectTimeout = -1
	}
	c.opts = pipeline.Options{ChunkSize: int(chunk), Workers: c.workers, MemoryLimit: mem, Codec: spec, ChunkHashes: c.chunkHashes, Dedup: c.dedup, LateData: c.pagesLast}
	if c.shardFDs != "" {
		for _, f := range strings.Split(c.shardFDs, ",") {
			fd, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || fd < 0 {
				return usagef("--shard-fds: %q is not a descriptor number", f)
			}
			c.shards = append(c.shards, fd)
		}
	}
	if c.extFileFDs != "" {
		for _, item := range strings.Split(c.extFileFDs, ",") {
			name, fdStr, ok := strings.Cut(item, ":")
			fd, err := strconv.Atoi(fdStr)
			if !ok || name == "" || strings.ContainsAny(name, "/\x00") || err != nil || fd < 0 {
				return usagef("--ext-file-fds: %q is not NAME:FD", item)
			}
			c.extFiles = append(c.extFiles, extFile{name, fd})
		}
	}
	if err := criusock.CheckCarry(c.carryList()); err != nil {
		return err
	}
	switch c.progressFD {
	case 1:
		c.progress = c.stdout
	case 2:
		c.progress = c.stderr
	default:
		if c.progressFD < 0 {
			return usagef("--progress-fd must not be negative")
		}
		c.progress = os.NewFile(uintptr(c.progressFD), fmt.Sprintf("progress fd %d", c.progressFD))
	}
	return nil
}

func (c *config) needImagesDir(cmd string) error {
	if c.imagesDir == "" {
		return usagef("%s needs --images-dir DIR (the directory given to criu with -D)", cmd)
	}
	// Created if missing, as criu-image-streamer does; private, since CRIU's
	// images hold process memory.
	if err := os.MkdirAll(c.imagesDir, 0o700); err != nil {
		return usagef("--images-dir %s: %v", c.imagesDir, err)
	}
	if st, err := os.Stat(c.imagesDir); err != nil || !st.IsDir() {
		return usagef("--images-dir %s: not a directory", c.imagesDir)
	}
	return nil
}

// parseSize reads "4MiB", "256M", "1G", "65536".
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	units := []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}, {"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40}, {"B", 1}}
	mult := int64(1)
	for _, u := range units {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("bad size %q", s)
	}
	return n * mult, nil
}
