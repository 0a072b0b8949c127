// Command s3bench is the helper of scripts/bench-s3.sh. It is what the
// benchmark compares gpucr-stream against, and what stands in for CRIU
// where a measurement needs no real process:
//
//	s3bench mb BUCKET                      make a bucket
//	s3bench put -bucket B -key K FILE...   one plain minio-go PutObject of the
//	                                       files' bytes, concatenated (the
//	                                       baseline); prints JSON
//	s3bench push -images-dir A DIR         push an images dir into a capture
//	                                       listening in A, as criu dump does
//	s3bench synth -dir D -size 4GiB -from IMGDIR
//	                                       a synthetic images dir: the small
//	                                       images of IMGDIR and one pages file
//	                                       of the given size (mixed content)
//	s3bench read -images-dir B -files F -- CMD...
//	                                       start CMD (a serve), then read the
//	                                       image as criu restore does:
//	                                       inventory.img first, then every
//	                                       file, the pages last; prints the
//	                                       time to the first byte of pages
//
// S3 credentials and endpoint: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
// AWS_ENDPOINT_URL.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/gpucr/gpucr-stream/criusock"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: s3bench mb|put|push|synth|read ...")
		os.Exit(2)
	}
	var err error
	switch cmd, args := os.Args[1], os.Args[2:]; cmd {
	case "mb":
		err = makeBucket(args)
	case "put":
		err = put(args)
	case "push":
		err = push(args)
	case "synth":
		err = synth(args)
	case "read":
		err = read(args)
	default:
		err = fmt.Errorf("unknown command %q", cmd)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "s3bench:", err)
		os.Exit(1)
	}
}

func client() (*minio.Client, error) {
	u, err := url.Parse(os.Getenv("AWS_ENDPOINT_URL"))
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("AWS_ENDPOINT_URL %q: want http(s)://host:port", os.Getenv("AWS_ENDPOINT_URL"))
	}
	return minio.New(u.Host, &minio.Options{
		Creds:  credentials.NewStaticV4(os.Getenv("AWS_ACCESS_KEY_ID"), os.Getenv("AWS_SECRET_ACCESS_KEY"), ""),
		Secure: u.Scheme == "https",
	})
}

func makeBucket(args []string) error {
	if len(args) != 1 {
		return errors.New("mb BUCKET")
	}
	c, err := client()
	if err != nil {
		return err
	}
	return c.MakeBucket(context.Background(), args[0], minio.MakeBucketOptions{})
}

func put(args []string) error {
	fs := flag.NewFlagSet("put", flag.ExitOnError)
	bucket := fs.String("bucket", "", "bucket")
	key := fs.String("key", "", "object key")
	partSize := fs.Uint64("part-size", 16<<20, "multipart part size (minio-go's own default for a known size of a few GiB is 64 MiB)")
	threads := fs.Uint("threads", 4, "parts in flight")
	fs.Parse(args)
	if *bucket == "" || *key == "" || fs.NArg() == 0 {
		return errors.New("usage: put -bucket B -key K FILE [FILE]")
	}
	c, err := client()
	if err != nil {
		return err
	}
	var rs []io.Reader
	var size int64
	for _, f := range fs.Args() {
		fh, err := os.Open(f)
		if err != nil {
			return err
		}
		defer fh.Close()
		st, err := fh.Stat()
		if err != nil {
			return err
		}
		size += st.Size()
		rs = append(rs, fh)
	}
	start := time.Now()
	info, err := c.PutObject(context.Background(), *bucket, *key, io.MultiReader(rs...), size,
		minio.PutObjectOptions{PartSize: *partSize, NumThreads: *threads})
	if err != nil {
		return err
	}
	secs := time.Since(start).Seconds()
	return json.NewEncoder(os.Stdout).Encode(map[string]any{"bytes": info.Size, "seconds": secs, "mib_per_s": float64(info.Size) / secs / (1 << 20)})
}

func push(args []string) error {
	fs := flag.NewFlagSet("push", flag.ExitOnError)
	imagesDir := fs.String("images-dir", "", "where the capture listens")
	fs.Parse(args)
	if *imagesDir == "" || fs.NArg() != 1 {
		return errors.New("push -images-dir A DIR")
	}
	ctx := context.Background()
	sock := filepath.Join(*imagesDir, criusock.CaptureSocket)
	for i := 0; ; i++ {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if i > 3000 {
			return fmt.Errorf("no capture socket at %s", sock)
		}
		time.Sleep(10 * time.Millisecond)
	}
	c, err := criusock.Dial(ctx, *imagesDir)
	if err != nil {
		return err
	}
	start := time.Now()
	n, err := c.PushDir(ctx, fs.Arg(0))
	if err != nil {
		return err
	}
	c.Close()
	return json.NewEncoder(os.Stdout).Encode(map[string]any{"files": n, "seconds": time.Since(start).Seconds()})
}

// synth writes a pages file of mixed content: runs of random bytes (not
// compressible), zeros, and repetitive text, about a third each.
func synth(args []string) error {
	fs := flag.NewFlagSet("synth", flag.ExitOnError)
	dir := fs.String("dir", "", "output images dir")
	sizeStr := fs.String("size", "1GiB", "size of the pages file")
	from := fs.String("from", "", "an images dir (criu dump -D) whose small files to copy")
	fs.Parse(args)
	size, err := parseSize(*sizeStr)
	if err != nil || *dir == "" || *from == "" {
		return errors.New("synth -dir D -size N -from IMGDIR")
	}
	if err := os.MkdirAll(*dir, 0o755); err != nil {
		return err
	}
	ents, err := os.ReadDir(*from)
	if err != nil {
		return err
	}
	for _, e := range ents {
		n := e.Name()
		if !strings.HasSuffix(n, ".img") || strings.HasPrefix(n, "pages-") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(*from, n))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(*dir, n), b, 0o644); err != nil {
			return err
		}
	}
	f, err := os.Create(filepath.Join(*dir, "pages-1.img"))
	if err != nil {
		return err
	}
	defer f.Close()
	r := rand.New(rand.NewPCG(1, 2))
	text := []byte(strings.Repeat("checkpoint restore tensor page stream 0123456789 ", 1<<10))
	buf := make([]byte, 4<<20)
	for off := int64(0); off < size; {
		n := min(int64(len(buf)), size-off)
		b := buf[:n]
		switch (off >> 22) % 3 {
		case 0:
			for i := 0; i+8 <= len(b); i += 8 {
				binary.LittleEndian.PutUint64(b[i:], r.Uint64())
			}
		case 1:
			clear(b)
		case 2:
			for i := 0; i < len(b); i += copy(b[i:], text) {
			}
		}
		if _, err := f.Write(b); err != nil {
			return err
		}
		off += n
	}
	return f.Close()
}

func parseSize(s string) (int64, error) {
	mult := int64(1)
	for _, u := range []struct {
		s string
		m int64
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"G", 1 << 30}, {"M", 1 << 20}} {
		if strings.HasSuffix(s, u.s) {
			s, mult = strings.TrimSuffix(s, u.s), u.m
			break
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n * mult, err
}

// read starts the serve command, then reads every image as criu restore
// would, and reports the time to the first byte of the pages.
func read(args []string) error {
	fs := flag.NewFlagSet("read", flag.ExitOnError)
	imagesDir := fs.String("images-dir", "", "the serve's images dir")
	list := fs.String("files", "", "an images dir whose .img files to request, or a file of names, one a line")
	fs.Parse(args)
	if *imagesDir == "" || fs.NArg() == 0 {
		return errors.New("usage: read -images-dir B -files IMGDIR -- SERVE-COMMAND [ARG]")
	}
	names, err := requestOrder(*list)
	if err != nil {
		return err
	}
	start := time.Now()
	cmd := exec.Command(fs.Arg(0), fs.Args()[1:]...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	conn, err := dialServe(filepath.Join(*imagesDir, criusock.ServeSocket), start)
	if err != nil {
		cmd.Process.Kill()
		return err
	}
	listening := time.Since(start)
	t, err := pullAll(conn, names, start)
	conn.Close()
	if err != nil {
		cmd.Process.Kill()
		return err
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{
		"files": len(names), "bytes": t.total, "seconds": time.Since(start).Seconds(),
		"listening_s": listening.Seconds(), "first_page_byte_s": t.firstPage.Seconds(),
		"first_page_byte_after_request_s": (t.firstPage - t.pagesRequested).Seconds(),
	})
}

// requestOrder lists the files to request in CRIU's restore order:
// inventory.img first, pages last (CRIU reads them while restoring memory).
func requestOrder(list string) ([]string, error) {
	var names []string
	if st, err := os.Stat(list); err == nil && st.Mode().IsRegular() {
		b, err := os.ReadFile(list)
		if err != nil {
			return nil, err
		}
		for _, n := range strings.Fields(string(b)) {
			if n != "inventory.img" {
				names = append(names, n)
			}
		}
	} else {
		ents, err := os.ReadDir(list)
		if err != nil {
			return nil, err
		}
		for _, e := range ents {
			if n := e.Name(); strings.HasSuffix(n, ".img") && n != "inventory.img" {
				names = append(names, n)
			}
		}
	}
	sort.Slice(names, func(i, j int) bool {
		pi, pj := strings.HasPrefix(names[i], "pages-"), strings.HasPrefix(names[j], "pages-")
		if pi != pj {
			return pj
		}
		return names[i] < names[j]
	})
	return append([]string{"inventory.img"}, names...), nil
}

// dialServe waits for the serve socket and connects. The socket file
// appears at bind, a moment before listen: a dial in between is refused.
func dialServe(sock string, start time.Time) (*net.UnixConn, error) {
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Since(start) > time.Minute {
			return nil, fmt.Errorf("no serve socket at %s", sock)
		}
		time.Sleep(time.Millisecond)
	}
	for {
		raw, err := net.Dial("unix", sock)
		if err == nil {
			return raw.(*net.UnixConn), nil
		}
		if !errors.Is(err, syscall.ECONNREFUSED) || time.Since(start) > time.Minute {
			return nil, err
		}
		time.Sleep(time.Millisecond)
	}
}

type pullTimes struct {
	total                     int64
	firstPage, pagesRequested time.Duration
}

// pullAll requests every file as CRIU would and reads it to the end.
func pullAll(conn *net.UnixConn, names []string, start time.Time) (pullTimes, error) {
	var t pullTimes
	buf := make([]byte, 1<<20)
	for _, n := range names {
		req, err := criusock.EncodeRequest(n)
		if err != nil {
			return t, err
		}
		pages := strings.HasPrefix(n, "pages-")
		if pages && t.pagesRequested == 0 {
			t.pagesRequested = time.Since(start)
		}
		if _, err := conn.Write(req); err != nil {
			return t, err
		}
		ok, err := criusock.ReadReply(conn)
		if err != nil {
			return t, fmt.Errorf("%s: %w", n, err)
		}
		if !ok {
			return t, fmt.Errorf("%s: serve says it does not exist", n)
		}
		pr, pw, err := os.Pipe()
		if err != nil {
			return t, err
		}
		if err := criusock.SendPipe(conn, pw); err != nil {
			return t, err
		}
		pw.Close()
		for {
			k, err := pr.Read(buf)
			if k > 0 && pages && t.firstPage == 0 {
				t.firstPage = time.Since(start)
			}
			t.total += int64(k)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				pr.Close()
				return t, fmt.Errorf("%s: %w", n, err)
			}
		}
		pr.Close()
	}
	return t, nil
}
