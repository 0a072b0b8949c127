package main

// Flag groups that several commands share, each a struct with one
// register: images (capture, serve, extract beside CRIU) and the
// locations' (pipeline, key, S3, tcp://). A command offers part of a group
// by narrowing the flags it registers it with to the names it takes:
// these lists.

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store/s3"
	"github.com/gpucr/gpucr-stream/transport/tcp"
)

var (
	// writing a checkpoint (encodeNames), a migration's stream (no
	// archive: streamNames), reading one (decodeNames), and copying or
	// checking without a stream (bufferNames)
	encodeNames = []string{"codec", "chunk-size", "segment-size", "workers", "memory-limit", "chunk-hashes", "dedup"}
	streamNames = []string{"codec", "chunk-size", "workers", "memory-limit", "chunk-hashes"}
	decodeNames = []string{"workers", "memory-limit", "spill-dir"}
	bufferNames = []string{"workers", "memory-limit"}
	keyNames    = []string{"key-file"}
	imagesNames = []string{"images-dir", "shard-fds", "ext-file-fds"}
	// what connecting to S3 takes (listing, deleting, reading manifests),
	// reading checkpoints, and writing them
	s3ConnNames  = []string{"s3-endpoint", "s3-region", "s3-path-style", "s3-sse-key-file"}
	s3ReadNames  = slices.Concat(s3ConnNames, []string{"s3-parallel"})
	s3WriteNames = slices.Concat(s3ReadNames, []string{"s3-part-size", "s3-sse"})
	// a tcp:// receiver (the sender chooses the streams), a sender
	tcpListenNames = []string{"token-file", "tls-cert", "tls-key", "tls-ca", "net-timeout"}
	tcpSendNames   = slices.Concat(tcpListenNames, []string{"streams"})
)

// imagesFlags are criu-image-streamer's: the images dir, shards and
// external files.
type imagesFlags struct {
	dir, shardFDs, extFileFDs string
	shards                    []int
	extFiles                  []checkpoint.ExtFile
}

func (o *imagesFlags) register(f *flags) {
	f.str(&o.dir, "images-dir")
	f.str(&o.shardFDs, "shard-fds")
	f.str(&o.extFileFDs, "ext-file-fds")
	f.check(o.parse)
}

func (o *imagesFlags) parse() error {
	if o.shardFDs != "" {
		for _, s := range strings.Split(o.shardFDs, ",") {
			fd, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil || fd < 0 {
				return usagef("--shard-fds: %q is not a descriptor number", s)
			}
			o.shards = append(o.shards, fd)
		}
	}
	if o.extFileFDs != "" {
		for _, item := range strings.Split(o.extFileFDs, ",") {
			name, fdStr, ok := strings.Cut(item, ":")
			fd, err := strconv.Atoi(fdStr)
			if !ok || name == "" || strings.ContainsAny(name, "/\x00") || err != nil || fd < 0 {
				return usagef("--ext-file-fds: %q is not NAME:FD", item)
			}
			o.extFiles = append(o.extFiles, checkpoint.ExtFile{Name: name, FD: fd})
		}
	}
	return nil
}

// needImagesDir makes sure dir, given, is a directory: created if
// missing, as criu-image-streamer does; private, since CRIU's images hold
// process memory.
func needImagesDir(dir, cmd string) error {
	if dir == "" {
		return usagef("%s needs --images-dir DIR (the directory given to criu with -D)", cmd)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return usagef("--images-dir %s: %v", dir, err)
	}
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return usagef("--images-dir %s: not a directory", dir)
	}
	return nil
}

// locationFlags are how a command opens its locations: the pipeline's
// settings, the key, S3 and tcp://. Register them with flags narrowed to
// what the command offers; the rest keep their defaults.
type locationFlags struct {
	pipe pipelineFlags
	key  keyFlags
	s3   s3Flags
	tcp  tcpFlags
}

func (o *locationFlags) register(f *flags) {
	o.pipe.register(f)
	o.key.register(f)
	o.s3.register(f)
	o.tcp.register(f)
}

// options are the pipeline's, with the key.
func (o *locationFlags) options() pipeline.Options {
	opts := o.pipe.opts
	opts.Key = o.key.key
	return opts
}

// config is how the command opens its locations; shards stand for "-"
// where given.
func (o *locationFlags) config(c *cli, shards []int) location.Config {
	return location.Config{
		Stdin: c.stdin, Stdout: c.stdout, Shards: shards,
		Options: o.options(), BufferLimit: o.pipe.bufferLimit, SpillDir: o.pipe.spillDir, SegmentSize: o.pipe.segSize,
		S3:  o.s3.config,
		TCP: o.tcp.settings,
		Log: c.logLine,
	}
}

// pipelineFlags set the chunks' codec and size, the workers and memory,
// and the archive's segments.
type pipelineFlags struct {
	codec, chunkSize, memoryLimit, spillDir, segmentSize string
	workers                                              int
	chunkHashes, dedup, pagesLast                        bool

	opts pipeline.Options
	// bufferLimit is what a stream source buffers in memory before
	// spilling; 0: --memory-limit auto, sized when a stream source is opened.
	bufferLimit int64
	segSize     int64
	f           *flags
}

func (o *pipelineFlags) register(f *flags) {
	f.str(&o.codec, "codec")
	f.num(&o.workers, "workers")
	f.str(&o.chunkSize, "chunk-size")
	f.str(&o.memoryLimit, "memory-limit")
	f.str(&o.spillDir, "spill-dir")
	f.str(&o.segmentSize, "segment-size")
	f.boolean(&o.chunkHashes, "chunk-hashes")
	f.boolean(&o.dedup, "dedup")
	f.boolean(&o.pagesLast, "pages-last")
	// What --memory-limit bounds: a writer holds nothing, a reader a
	// stream's images (extract and verify say how they differ).
	if f.bound("spill-dir") {
		f.describe("memory-limit", "memory for chunks in flight (auto: 1GiB) and, reading a stream, for the images held before spilling to --spill-dir (auto: half the available memory, at least 1GiB)")
	} else {
		f.describe("memory-limit", "memory for chunks in flight (auto: 1GiB)")
	}
	o.f = f
	f.check(o.parse)
}

func (o *pipelineFlags) parse() error {
	spec, err := codec.ParseSpec(o.codec)
	if err != nil {
		return o.f.bad("codec", "%q: %v", o.codec, err)
	}
	chunk, err := parseSize(o.chunkSize)
	if err != nil || chunk < 4096 || chunk > codec.MaxChunk {
		return o.f.bad("chunk-size", "%q: want a size from 4KiB to %dMiB", o.chunkSize, codec.MaxChunk>>20)
	}
	mem := int64(1 << 30)
	if o.memoryLimit != "auto" {
		m, err := parseSize(o.memoryLimit)
		if err != nil || m <= 0 {
			return o.f.bad("memory-limit", "%q: want a size such as 512MiB, or auto", o.memoryLimit)
		}
		mem, o.bufferLimit = m, m
	}
	if o.segSize, err = parseSize(o.segmentSize); err != nil || o.segSize < 1<<20 {
		return o.f.bad("segment-size", "%q: want a size of at least 1MiB", o.segmentSize)
	}
	if o.workers < 0 {
		return o.f.bad("workers", "%d: must not be negative", o.workers)
	}
	o.opts = pipeline.Options{ChunkSize: int(chunk), Workers: o.workers, MemoryLimit: mem, Codec: spec,
		ChunkHashes: o.chunkHashes, Dedup: o.dedup, LateData: o.pagesLast}
	return nil
}

// keyFlags are --key-file, else $GPUCR_KEY: location and checkpoint
// encrypt what they write with the key and require it of what they read.
// Only the commands that offer --key-file load it.
type keyFlags struct {
	file string
	key  *crypt.Key
}

func (o *keyFlags) register(f *flags) {
	f.str(&o.file, "key-file")
	if f.bound("key-file") {
		f.check(o.load)
	}
}

func (o *keyFlags) load() error {
	key, err := crypt.LoadKey(o.file)
	if err != nil {
		return usagef("%v", err)
	}
	o.key = key
	return nil
}

// s3Flags are the S3 store's settings; the bucket and prefix come from the
// location. Credentials are not flags: they come from the environment or
// the shared credentials file (s3.New), so that they never show in a
// process listing.
type s3Flags struct {
	endpoint, region, pathStyle, partSize, sse, sseKeyFile string
	parallel                                               int
	createBucket                                           bool
}

func (o *s3Flags) register(f *flags) {
	f.str(&o.endpoint, "s3-endpoint")
	f.str(&o.region, "s3-region")
	f.str(&o.pathStyle, "s3-path-style")
	f.str(&o.partSize, "s3-part-size")
	f.num(&o.parallel, "s3-parallel")
	f.str(&o.sse, "s3-sse")
	f.str(&o.sseKeyFile, "s3-sse-key-file")
	f.boolean(&o.createBucket, "create-bucket")
}

// config checks the settings, when an s3:// location is opened.
func (o *s3Flags) config() (s3.Config, error) {
	style, err := s3.ParsePathStyle(o.pathStyle)
	if err != nil {
		return s3.Config{}, usagef("--s3-path-style: %v", err)
	}
	part, err := parseSize(o.partSize)
	if err != nil || part < 5<<20 || part > 5<<30 {
		return s3.Config{}, usagef("--s3-part-size %q: want a size from 5MiB to 5GiB", o.partSize)
	}
	if o.parallel < 1 || o.parallel > 256 {
		return s3.Config{}, usagef("--s3-parallel %d: want 1..256", o.parallel)
	}
	sse, err := s3.LoadSSE(o.sse, o.sseKeyFile)
	if err != nil {
		return s3.Config{}, usagef("--s3-sse, --s3-sse-key-file: %v", err)
	}
	return s3.Config{Endpoint: o.endpoint, Region: o.region, PathStyle: style, PartSize: part, Parallel: o.parallel, SSE: sse,
		CreateBucket: o.createBucket}, nil
}

// tcpFlags are tcp://'s: authentication, timeout and streams.
type tcpFlags struct {
	streams                                  int
	tokenFile, tlsCert, tlsKey, tlsCA, netTO string
}

func (o *tcpFlags) register(f *flags) {
	f.num(&o.streams, "streams")
	f.str(&o.tokenFile, "token-file")
	f.str(&o.tlsCert, "tls-cert")
	f.str(&o.tlsKey, "tls-key")
	f.str(&o.tlsCA, "tls-ca")
	f.str(&o.netTO, "net-timeout")
}

// settings checks the flags, when a tcp:// location is opened.
func (o *tcpFlags) settings() (location.TCPConfig, error) {
	var t location.TCPConfig
	var err error
	if t.Auth, err = o.auth(); err != nil {
		return t, err
	}
	if t.Timeout, err = o.timeout(); err != nil {
		return t, err
	}
	if o.streams < 0 || o.streams > tcp.MaxStreams {
		return t, usagef("--streams %d: want 1..%d, or 0 for the default", o.streams, tcp.MaxStreams)
	}
	t.Streams = o.streams
	if t.Streams == 0 {
		t.Streams = tcp.DefaultStreams()
	}
	return t, nil
}

func (o *tcpFlags) auth() (tcp.Auth, error) {
	a, err := tcp.LoadAuth(o.tokenFile, o.tlsCert, o.tlsKey, o.tlsCA)
	if err != nil {
		return a, usagef("%v", err)
	}
	return a, nil
}

func (o *tcpFlags) timeout() (time.Duration, error) {
	d, err := time.ParseDuration(o.netTO)
	if err != nil || d < time.Second {
		return 0, usagef("--net-timeout %q: want a duration of at least 1s, such as 20s", o.netTO)
	}
	return d, nil
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
