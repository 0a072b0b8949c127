package main

// flagTable is every flag, as `gpucr-stream --help` lists it: where a
// description starts with the commands it concerns, a command's own help
// leaves them out (commandPrefix), and a command may describe the flag in
// its own terms instead (flags.describe).
var flagTable = []flagDef{
	{"help", boolFlag, "", "show this help"},
	{"version", boolFlag, "", "print the version and exit"},

	// how a command reports (cli.go)
	{"json", boolFlag, "", "machine-readable output and results"},
	{"no-progress", boolFlag, "", "never draw progress bars"},
	{"progress-fd", numFlag, "2", "descriptor for progress lines (socket-init, checkpoint-start, statistics JSON)"},

	// capture, serve and extract beside CRIU (imagesFlags, cmd_capture.go)
	{"images-dir", strFlag, "", "CRIU's images directory (criu -D DIR): where capture and serve listen for criu and extract writes the image files"},
	{"shard-fds", strFlag, "", "comma-separated descriptors to spread the stream over (capture) or gather it from (serve, extract)"},
	{"ext-file-fds", strFlag, "", "extra files as NAME:FD,... to carry in the stream (capture) or write out (serve, extract)"},
	{"tcp-listen-remap", strFlag, "", "serve: move TCP listening ports of the image, OLD:NEW,... (as criu-image-streamer does)"},
	{"early", boolFlag, "", "serve: listen at once and let criu restore while the stream is still read (socket-init first, the statistics line last: not criu-image-streamer's order)"},
	{"connect-timeout", strFlag, "2m", "capture/serve: how long to wait for criu to connect to the socket after socket-init (0: forever)"},
	{"producers", numFlag, "0", "checkpoint/restore/capture/serve: VRAM producers the image waits for before it is complete (see vram push/pull)"},

	// locations (locationFlags)
	{"to", strFlag, "-", "where the checkpoint goes: - (stdout), a path or file:///path (archive directory), s3://BUCKET/PREFIX/NAME, or tcp://HOST:PORT (a receiver: gpucr-stream receive, or serve/restore/extract --from tcp://)"},
	{"from", strFlag, "-", "where the checkpoint comes from: - (stdin), an archive directory, s3://BUCKET/PREFIX/NAME, a stream file, or tcp://HOST:PORT (listen there for one sender: capture or checkpoint --to tcp://)"},
	{"codec", strFlag, "lz4", "chunk codec: auto, none, lz4, zstd[:LEVEL], shuffle"},
	{"workers", numFlag, "0", "encoder/decoder goroutines (0: one per core)"},
	{"chunk-size", strFlag, "4MiB", "largest chunk of a file"},
	{"memory-limit", strFlag, "auto", "memory for chunks in flight (auto: 1GiB) and, reading a stream (serve, restore, receive), for the images held before spilling to --spill-dir (auto: half the available memory, at least 1GiB)"},
	{"spill-dir", strFlag, "", "reading a stream: where the images held beyond --memory-limit go (default: $TMPDIR)"},
	{"segment-size", strFlag, "256MiB", "size of archive segment objects"},
	{"chunk-hashes", boolFlag, "", "hash every chunk with BLAKE3 beside its CRC-32C, for verify to check too (format 1; costs about 0.2 CPU-s/GiB); encrypted checkpoints always have them"},
	{"pages-last", boolFlag, "", "stream destinations: send CRIU's page images after every other file (held back meanwhile: in memory up to half the memory available, beyond in $TMPDIR), so that a restore from the stream (serve --early, restore --from) starts CRIU before they arrive; the capture ends later, by the time to send them"},
	{"dedup", boolFlag, "", "archive destinations: store each chunk once in the chunk store of the location that holds the checkpoint (its parent directory or S3 prefix), shared by every checkpoint there (format 4; with --key-file, shared only among checkpoints of that key)"},
	{"key-file", strFlag, "", "encryption key file (mode 0600; make one with: gpucr-stream keygen > FILE), else $GPUCR_KEY (64 hex digits or base64): captures encrypt with it, readers require it"},

	// S3 (s3Flags)
	{"s3-endpoint", strFlag, "", "S3 endpoint, http(s)://host[:port] (default: $AWS_ENDPOINT_URL, else AWS S3); credentials from $AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY or ~/.aws/credentials"},
	{"s3-region", strFlag, "", "S3 region (default: $AWS_REGION, else asked from the server)"},
	{"s3-path-style", strFlag, "auto", "S3 bucket addressing: auto, path or virtual"},
	{"s3-part-size", strFlag, "16MiB", "S3 multipart part size, 5MiB..5GiB"},
	{"s3-parallel", numFlag, "4", "S3 parts uploading at once, over all objects; each holds --s3-part-size of memory (ranged reads on restore: twice as many per file)"},
	{"s3-sse", strFlag, "", "S3 server-side encryption of the objects written: none, s3 (SSE-S3), kms[:KEY-ID] (SSE-KMS), c (SSE-C, key from --s3-sse-key-file; https only)"},
	{"s3-sse-key-file", strFlag, "", "S3 SSE-C key file (32 bytes, hex or base64, mode 0600), needed to write and to read SSE-C objects"},
	{"create-bucket", boolFlag, "", "capture/checkpoint/cp to s3://: create the bucket if it does not exist (in --s3-region)"},

	// tcp:// (tcpFlags)
	{"streams", numFlag, "0", "tcp://: parallel connections carrying the stream's shards, each written and encrypted on its own goroutine (1..64; 0: half the cores, 4 to 8)"},
	{"token-file", strFlag, "", "tcp://: file holding the shared secret both sides prove (make one with: gpucr-stream token > FILE)"},
	{"tls-cert", strFlag, "", "tcp://: this side's certificate (PEM), instead of or besides --token-file"},
	{"tls-key", strFlag, "", "tcp://: the key of --tls-cert (PEM)"},
	{"tls-ca", strFlag, "", "tcp://: CA certificate (PEM) that must have signed the peer's certificate"},
	{"net-timeout", strFlag, "20s", "tcp://: how long a dead link or a silent peer is tolerated"},

	// CRIU (criuFlags) and containers (containerFlags)
	{"pid", numFlag, "0", "checkpoint, migrate, gpu: the process (the root of its tree)"},
	{"leave-running", boolFlag, "", "checkpoint, migrate: keep the process running afterwards"},
	{"criu", strFlag, "", "checkpoint/restore: the criu binary (default: criu on PATH, then /opt/gpucr-criu/bin/criu)"},
	{"work-dir", strFlag, "", "checkpoint/restore: directory for CRIU's images dir, sockets and logs (default: a new temporary dir)"},
	{"criu-opts", strFlag, "", "checkpoint/restore: extra criu arguments, space-separated (e.g. --tcp-established)"},
	{"carry", strFlag, "", "files of CRIU's images dir to carry in the checkpoint and write back there on restore, comma-separated (a name in the images dir or an absolute path; runc's descriptors.json always goes); restore, serve --early: carried files to wait for in a stream"},
	{"container", strFlag, "", "checkpoint, migrate: the container to checkpoint (its runtime's ID or name); restore, receive --restore: the container to restore as, managed by its runtime afterwards"},
	{"runtime", strFlag, "runc", "with --container: the container runtime, runc or podman (run with gpucr-stream as its criu)"},
	{"runtime-root", strFlag, "", "with --container and --runtime runc: runc's state directory (runc --root; default runc's)"},
	{"bundle", strFlag, "", "restore --container with --runtime runc: the OCI bundle (default: the one the container was checkpointed from)"},

	// CUDA processes (cudaFlags, fastPathFlags)
	{"cuda", strFlag, "auto", "checkpoint/restore: CUDA processes of the tree: auto (suspend/resume those found), on (require them), off (plain CRIU)"},
	{"gpu-map", strFlag, "", "restore: move GPU state from OLD to NEW GPU: OLD_UUID=NEW_UUID[,...] (OLD may be 'all' for one GPU)"},
	{"lock-timeout", strFlag, "10s", "checkpoint: how long the CUDA lock may wait for GPU work in flight (0: the driver's default)"},
	{"stage-memory", strFlag, "auto", "restore, gpu resume --from: memory to read the fast path's VRAM files into while criu (or the driver) restores, so that the copy in reads memory: a size, auto (half the available memory, less the images criu restores) or none (read them from the checkpoint during the copy in)"},
	{"fast-path", strFlag, "auto", "checkpoint, migrate, gpu suspend --to: CUDA processes started with gpucr-stream run move their device memory through the pipeline themselves: auto (when every CUDA process of the tree can), off (the driver's checkpoint only)"},
	{"vram-files", numFlag, "16", "checkpoint, migrate, gpu suspend --to: fast path: files (and copy threads) per CUDA process, 1..64"},
	{"vram-keep-dir", strFlag, "", "checkpoint, migrate, gpu suspend --to: fast path: where the copy of device memory kept until the commit goes (for an undo; default: a tmpfs of huge pages mounted for it under /run/gpucr-stream where it can, else $TMPDIR)"},
	{"host-check", boolFlag, "", "gpu hash: also hash every block on the host, in the library, and count the blocks whose device hashes differ"},

	// live migration (cmd_migrate.go, cmd_receive.go)
	{"listen", strFlag, "", "receive: HOST:PORT to accept one checkpoint on"},
	{"restore", boolFlag, "", "receive: restore the checkpoint with criu and print the restored PID"},
	{"lazy-pages", boolFlag, "", "receive --restore: once the whole image is in, restore with criu's lazy pages: the process runs before its memory is copied back, which criu lazy-pages hands in on first touch and in the background (not for CUDA processes; needs userfaultfd)"},
	{"keep-dir", strFlag, "", "migrate: where the image is kept until the receiver confirms the restore (default: a tmpfs of huge pages mounted for it under /run/gpucr-stream where it can, else $TMPDIR; none: keep no copy)"},
	{"precopy", strFlag, "off", "migrate: off (stop-and-copy) or on (send what the process holds while it runs, in rounds, then only the chunks that changed; it pays only on a link slower than CRIU's dump: docs/MIGRATION.md)"},
	{"precopy-rounds", numFlag, "5", "migrate: at most this many pre-copy rounds"},
	{"precopy-shrink", numFlag, "25", "migrate: another pre-copy round follows one that sent at least this percentage less than the one before"},

	// locations' contents (ls, rm, gc, check)
	{"older-than", strFlag, "1h", "gc: remove what dead captures left, and unreferenced packs, once this old by the store's clock (e.g. 30m, 2h, 7d; 0s: at once); a running capture (its lock refreshed within 6h) is never touched"},
	{"repack-below", strFlag, "50%", "gc: repack a pack of the chunk store whose live chunks fill less than this share of it (0%: never)"},
	{"dry-run", boolFlag, "", "rm, gc: print what would be removed, remove nothing"},
	{"repair-index", boolFlag, "", "check: where the chunk store's index is damaged or incomplete, rebuild it from the packs (writes one index object, then deletes the others)"},
	{"read-data", boolFlag, "", "check: also decode every checkpoint whole and check every checksum and hash, as verify does"},
}
