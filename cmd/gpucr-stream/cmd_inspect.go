package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/gpuckpt"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/redact"
	"github.com/gpucr/gpucr-stream/source"
)

var inspectCommand = command{"inspect", "list the files, sizes, codecs and ratios of a checkpoint: inspect SRC", "[SRC]",
	func() options { return &inspectOptions{} }}

type inspectOptions struct {
	loc locationFlags
	src fromFlag
}

func (o *inspectOptions) register(f *flags) {
	f.show("json")
	o.loc.register(f.narrow(keyNames, s3ConnNames))
	o.src.register(f)
	f.describe("from", "the checkpoint (or give it as SRC): - (stdin), an archive directory, s3://BUCKET/PREFIX/NAME, or a stream file")
	f.describe("key-file", "encryption key file (mode 0600), else $GPUCR_KEY: with it an encrypted archive's manifest is authenticated; without it its metadata is shown, not trusted")
}

type inspectResult struct {
	Source string `json:"source"`
	Format int    `json:"format"`
	// ChunkHashes: every chunk carries a BLAKE3 hash beside its CRC-32C
	// (formats 1 and 2; format 3 has none).
	ChunkHashes bool              `json:"chunk_hashes"`
	ID          string            `json:"id,omitempty"`
	Created     time.Time         `json:"created,omitzero"`
	Host        string            `json:"host,omitempty"`
	Tool        string            `json:"tool,omitempty"`
	CRIU        string            `json:"criu_version,omitempty"`
	Codec       string            `json:"codec,omitempty"`
	ChunkSize   int               `json:"chunk_size,omitempty"`
	Stats       manifest.Stats    `json:"stats"`
	Ratio       float64           `json:"ratio"`
	Segments    int               `json:"segments"`
	GPUs        []manifest.GPU    `json:"gpus,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
	Process     *manifest.Process `json:"process,omitempty"`
	// Encryption: the key id and whether the metadata shown was
	// authenticated (it is readable without the key, not trusted).
	Encryption *inspectEncryption `json:"encryption,omitempty"`
	Files      []source.FileStats `json:"files"`
	// VRAM: the fast path's VRAM files, from their headers; VRAMNote says
	// why they are not shown.
	VRAM     []gpuckpt.VRAMFile `json:"vram,omitempty"`
	VRAMNote string             `json:"vram_note,omitempty"`
}

type inspectEncryption struct {
	Cipher string `json:"cipher"`
	KeyID  string `json:"key_id"`
	// Authenticated: the manifest's MAC was checked with the key (an
	// archive's; a stream's metadata is checked whole by verify).
	Authenticated bool `json:"authenticated"`
	keyGiven      bool
}

func (o *inspectOptions) run(ctx context.Context, c *cli, args []string) error {
	from, err := o.src.src(c, "inspect", args)
	if err != nil {
		return err
	}
	loc, err := parseLoc("inspect", from)
	if err != nil {
		return err
	}
	m, authenticated, err := location.ReadManifest(ctx, loc, o.loc.config(c, nil))
	if err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	res := inspectResult{Source: redact.URL(from), Format: m.FormatVersion(), ChunkHashes: !m.NoChunkHashes, ID: m.ID, Created: m.Created, Host: m.Host, Tool: m.Tool, CRIU: m.CRIUVersion,
		Codec: m.Codec, ChunkSize: m.ChunkSize, Stats: m.Stats, Ratio: m.Stats.Ratio(), Segments: len(m.Segments), GPUs: m.GPUs, Labels: m.Labels, Process: m.Process,
		Files: source.DescribeFiles(m)}
	if e := m.Encryption; e != nil {
		res.Encryption = &inspectEncryption{Cipher: crypt.CipherName, KeyID: e.KeyID.String(), Authenticated: authenticated,
			keyGiven: o.loc.key.key != nil}
	}
	res.VRAM, res.VRAMNote = inspectVRAM(ctx, o.loc.config(c, nil), loc, m)
	if c.json {
		enc := json.NewEncoder(c.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	printInspect(c.stdout, res)
	return nil
}

// inspectVRAM reads the headers of the checkpoint's VRAM files, if it has
// any: what they hold, or why that is not shown.
func inspectVRAM(ctx context.Context, open location.Config, loc location.Location, m *manifest.Manifest) ([]gpuckpt.VRAMFile, string) {
	if !slices.ContainsFunc(m.CUDA, func(p manifest.CUDAProcess) bool { return p.Path == manifest.CUDAPathPreload }) {
		return nil, ""
	}
	src, err := location.OpenSource(ctx, loc, open, source.StreamSourceOptions{Discard: true})
	if err != nil {
		return nil, err.Error()
	}
	defer src.Close()
	vs, err := gpuckpt.InspectVRAM(ctx, src)
	if err != nil {
		return vs, err.Error()
	}
	return vs, ""
}

func printInspect(w io.Writer, r inspectResult) {
	fmt.Fprintf(w, "checkpoint  %s\n", r.Source)
	if r.ID != "" {
		fmt.Fprintf(w, "id          %s\n", manifest.PrintableName(r.ID))
	}
	if !r.Created.IsZero() {
		fmt.Fprintf(w, "created     %s on %s by %s\n", formatTime(r.Created), manifest.PrintableName(r.Host), manifest.PrintableName(r.Tool))
	}
	if r.Process != nil {
		fmt.Fprintf(w, "process     %d: %s\n", r.Process.PID, commandLine(r.Process.Cmdline, 0))
	}
	checks := "CRC-32C per chunk, no chunk hashes"
	if r.ChunkHashes {
		checks = "CRC-32C and BLAKE3 hash per chunk"
	}
	fmt.Fprintf(w, "format      %d (%s)\n", r.Format, checks)
	if e := r.Encryption; e != nil {
		how := "metadata not authenticated: no key given"
		switch {
		case e.Authenticated:
			how = "manifest authenticated"
		case e.keyGiven:
			how = "metadata not authenticated: a stream's is, by verify"
		}
		fmt.Fprintf(w, "encrypted   %s, key %s (%s)\n", e.Cipher, e.KeyID, how)
	}
	fmt.Fprintf(w, "files       %d, %s raw, %s stored (%.2fx), codec %s, %d segment(s)\n",
		len(r.Files), humanBytes(r.Stats.RawBytes), humanBytes(r.Stats.StoredBytes), r.Ratio, r.Codec, r.Segments)
	if r.Format >= manifest.VersionSharedChunks {
		fmt.Fprintf(w, "dedup       chunks in the location's chunk store, %d pack(s); %s new (%d of %d chunks), the rest shared\n",
			r.Segments, humanBytes(r.Stats.NewStoredBytes), r.Stats.NewChunks, r.Stats.Chunks)
	}
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
	printVRAM(w, r)
}

// printVRAM shows what the VRAM files hold of the device memory:
// allocated, written (not zero), cached (marked by the program, not kept)
// and stored.
func printVRAM(w io.Writer, r inspectResult) {
	if r.VRAMNote != "" {
		fmt.Fprintf(w, "\nVRAM files: not read: %s\n", r.VRAMNote)
	}
	if len(r.VRAM) == 0 {
		return
	}
	fmt.Fprintln(w, "\nVRAM files (device memory: allocated, written, of it cached and not kept, stored)")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "ALLOCATED\tWRITTEN\tCACHED\tSTORED\tPIECES\t\tNAME")
	var sum gpuckpt.VRAMFile
	for _, v := range r.VRAM {
		fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%d\t\t%s\n", v.Allocated, v.Written, v.Cached, v.Stored, v.Pieces, manifest.PrintableName(v.Name))
		sum.Allocated, sum.Written, sum.Cached, sum.Stored, sum.Pieces = sum.Allocated+v.Allocated, sum.Written+v.Written, sum.Cached+v.Cached, sum.Stored+v.Stored, sum.Pieces+v.Pieces
	}
	fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t\t(all)\n", humanBytes(sum.Allocated), humanBytes(sum.Written), humanBytes(sum.Cached), humanBytes(sum.Stored), sum.Pieces)
	tw.Flush()
}
