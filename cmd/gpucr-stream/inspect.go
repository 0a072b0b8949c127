package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/redact"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/streamer"
)

func srcArg(cfg *config, cmd string, args []string) (string, error) {
	switch len(args) {
	case 0:
		return cfg.from, nil
	case 1:
		return args[0], nil
	}
	return "", usagef("%s takes one SRC argument, got %d", cmd, len(args))
}

// readManifest loads a checkpoint's description without decoding data.
func readManifest(ctx context.Context, cfg *config, from string) (*manifest.Manifest, error) {
	loc, err := location.Parse(from)
	if err != nil {
		return nil, usagef("%v", err)
	}
	switch loc.Kind {
	case location.Stdio:
		return streamer.ScanStream(cfg.stdin, "stdin")
	case location.StreamFile:
		f, err := os.Open(loc.Path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		return streamer.ScanStream(f, loc.Path)
	case location.Archive:
		return streamer.ReadManifest(ctx, dir.New(loc.Path))
	case location.S3:
		return readS3Manifest(ctx, cfg, loc)
	}
	return nil, usagef("%s: not supported yet", loc)
}

type inspectFile struct {
	Name        string         `json:"name"`
	Size        int64          `json:"size"`
	StoredBytes int64          `json:"stored_bytes"`
	Ratio       float64        `json:"ratio"`
	Chunks      int            `json:"chunks"`
	Codecs      map[string]int `json:"codecs"`
	External    bool           `json:"external,omitempty"`
	Digest      string         `json:"digest"`
}

type inspectResult struct {
	Source    string            `json:"source"`
	ID        string            `json:"id,omitempty"`
	Created   time.Time         `json:"created,omitzero"`
	Host      string            `json:"host,omitempty"`
	Tool      string            `json:"tool,omitempty"`
	CRIU      string            `json:"criu_version,omitempty"`
	Codec     string            `json:"codec,omitempty"`
	ChunkSize int               `json:"chunk_size,omitempty"`
	Stats     manifest.Stats    `json:"stats"`
	Ratio     float64           `json:"ratio"`
	Segments  int               `json:"segments"`
	GPUs      []manifest.GPU    `json:"gpus,omitempty"`
	Labels    map[string]string `json:"labels,omitempty"`
	Files     []inspectFile     `json:"files"`
}

func runInspect(ctx context.Context, cfg *config, args []string) error {
	from, err := srcArg(cfg, "inspect", args)
	if err != nil {
		return err
	}
	m, err := readManifest(ctx, cfg, from)
	if err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	res := inspectResult{Source: redact.URL(from), ID: m.ID, Created: m.Created, Host: m.Host, Tool: m.Tool, CRIU: m.CRIUVersion,
		Codec: m.Codec, ChunkSize: m.ChunkSize, Stats: m.Stats, Ratio: m.Stats.Ratio(), Segments: len(m.Segments), GPUs: m.GPUs, Labels: m.Labels}
	for _, f := range m.Files {
		fi := inspectFile{Name: f.Name, Size: f.Size, Chunks: len(f.Chunks), Codecs: map[string]int{}, External: f.External, Digest: f.Digest.String()}
		for _, c := range f.Chunks {
			fi.StoredBytes += int64(c.Stored)
			fi.Codecs[codec.ID(c.Codec).String()]++
		}
		fi.Ratio = 1
		if fi.StoredBytes > 0 {
			fi.Ratio = float64(f.Size) / float64(fi.StoredBytes)
		}
		res.Files = append(res.Files, fi)
	}
	if cfg.jsonOut {
		enc := json.NewEncoder(cfg.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	printInspect(cfg.stdout, res)
	return nil
}

func printInspect(w io.Writer, r inspectResult) {
	fmt.Fprintf(w, "checkpoint  %s\n", r.Source)
	if !r.Created.IsZero() {
		fmt.Fprintf(w, "created     %s on %s by %s\n", r.Created.Format(time.RFC3339), manifest.PrintableName(r.Host), manifest.PrintableName(r.Tool))
	}
	fmt.Fprintf(w, "files       %d, %s raw, %s stored (%.2fx), codec %s, %d segment(s)\n",
		len(r.Files), humanBytes(r.Stats.RawBytes), humanBytes(r.Stats.StoredBytes), r.Ratio, r.Codec, r.Segments)
	var names []string
	for n := range r.Stats.ByCodec {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		s := r.Stats.ByCodec[n]
		fmt.Fprintf(w, "  %-14s %6d chunks  %10s -> %10s\n", n, s.Chunks, humanBytes(s.RawBytes), humanBytes(s.StoredBytes))
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "SIZE\tSTORED\tRATIO\tCHUNKS\tCODECS\t\tNAME")
	for _, f := range r.Files {
		var cs []string
		for n, k := range f.Codecs {
			cs = append(cs, fmt.Sprintf("%s:%d", n, k))
		}
		sort.Strings(cs)
		fmt.Fprintf(tw, "%d\t%d\t%.2f\t%d\t%s\t\t%s\n", f.Size, f.StoredBytes, f.Ratio, f.Chunks, strings.Join(cs, ","), manifest.PrintableName(f.Name))
	}
	tw.Flush()
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

func runVerify(ctx context.Context, cfg *config, args []string) error {
	from, err := srcArg(cfg, "verify", args)
	if err != nil {
		return err
	}
	start := time.Now()
	src, err := openSource(ctx, cfg, from, streamer.StreamOptions{Discard: true})
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	defer src.Close()
	var rep streamer.VerifyReport
	if a, ok := src.(*streamer.ArchiveSource); ok {
		rep, err = streamer.VerifyArchive(ctx, a)
	} else {
		stream := streamOf(src)
		if err = stream.Wait(ctx); err == nil {
			var files []manifest.File
			files, err = stream.Files(ctx)
			rep.Files = len(files)
			rep.Bytes = stream.Counters.RawBytes.Load()
		}
	}
	if err != nil {
		return fmt.Errorf("verify %s: %w", redact.URL(from), err)
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(struct {
			OK bool `json:"ok"`
			streamer.VerifyReport
			DurationMS int64 `json:"duration_ms"`
		}{true, rep, time.Since(start).Milliseconds()})
	}
	fmt.Fprintf(cfg.stdout, "ok: %d files, %s checked in %s\n", rep.Files, humanBytes(rep.Bytes), time.Since(start).Round(time.Millisecond))
	return nil
}
