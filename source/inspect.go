package source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"sync"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
)

// What ScanStream indexes at most: about pipeline.DefaultMemoryLimit.
const (
	maxScanChunks = pipeline.DefaultMemoryLimit / 256
	maxScanNames  = pipeline.DefaultMemoryLimit / 4
)

// ScanStream describes a stream from its frame headers alone, without
// decoding payloads: what inspect shows for stdin or a stream file. A
// finished single-shard stream carries its manifest in the END frame; that
// one is returned when present, since it also has the metadata.
func ScanStream(r io.Reader, name string) (*manifest.Manifest, error) {
	rd, err := manifest.NewReader(r, name)
	if err != nil {
		return nil, err
	}
	h := rd.Header()
	m := &manifest.Manifest{Encryption: h.Encryption, NoChunkHashes: h.NoChunkHashes}
	m.Format = m.FormatVersion()
	files := map[uint32]*manifest.File{}
	// by name, the file whose FILE-END came last; a pointer, since late
	// data (format 5) may add chunks after it
	byName := map[string]*manifest.File{}
	var chunks, names int
	for {
		fr, err := rd.Next(nil)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		switch fr.Type {
		case manifest.FrameFile:
			if names += len(fr.Payload); names > maxScanNames {
				return nil, fmt.Errorf("%s: over %d bytes of file names: %w", name, maxScanNames, ErrMemoryLimit)
			}
			if !manifest.ValidName(string(fr.Payload)) {
				return nil, rd.FrameErrorf(fr, "FILE frame with unsafe name %s", manifest.PrintableName(string(fr.Payload)))
			}
			files[fr.FileID] = &manifest.File{Name: string(fr.Payload), External: fr.Flags&manifest.FileFlagExternal != 0,
				Carried: fr.Flags&manifest.FileFlagCarried != 0, Chunks: []manifest.Chunk{}}
		case manifest.FrameData:
			// The index of a stream that never ends must not grow without
			// bound: a chunk record per 64-byte frame.
			if chunks++; chunks > maxScanChunks {
				return nil, fmt.Errorf("%s: over %d chunks: %w", name, maxScanChunks, ErrMemoryLimit)
			}
			f := files[fr.FileID]
			f.Chunks = append(f.Chunks, manifest.Chunk{Offset: int64(fr.Offset), RawLen: fr.RawLen, Stored: fr.StoredLen, Codec: fr.Codec, Checksum: fr.Checksum, Hash: fr.Hash, Pos: fr.Pos})
		case manifest.FrameFileEnd:
			f := files[fr.FileID]
			f.Size, f.Digest = int64(fr.Offset), fr.Hash
			byName[f.Name] = f
		case manifest.FrameEnd:
			if len(fr.Payload) > 0 {
				if full, err := manifest.Parse(fr.Payload); err == nil {
					return full, nil
				}
			}
		}
	}
	for _, f := range byName {
		for _, c := range f.Chunks {
			m.Stats.Add(codec.ID(c.Codec).String(), int64(c.RawLen), int64(c.Stored))
		}
		m.Files = append(m.Files, *f)
	}
	sort.Slice(m.Files, func(i, j int) bool { return m.Files[i].Name < m.Files[j].Name })
	return m, nil
}

// VerifyReport sums a verification.
type VerifyReport struct {
	Files  int   `json:"files"`
	Chunks int   `json:"chunks"`
	Bytes  int64 `json:"bytes"`
}

// VerifyArchive decodes every chunk of every file and checks its CRC-32C,
// its BLAKE3 content hash (where chunks have one), and every file digest;
// in a plain archive it first checks every other byte of the segments
// (CheckSegments), so that no byte of them goes unchecked. Open the source
// with VerifyHashes set.
func VerifyArchive(ctx context.Context, a *ArchiveSource) (VerifyReport, error) {
	var rep VerifyReport
	if !a.opts.VerifyHashes {
		return rep, fmt.Errorf("verify: archive source opened without VerifyHashes")
	}
	if a.man.SharedChunks {
		return verifyShared(ctx, a)
	}
	if err := CheckSegments(ctx, a); err != nil {
		return rep, err
	}
	for _, f := range a.man.Files {
		digested := make([]byte, 0, 32*len(f.Chunks))
		for _, c := range f.Chunks {
			digested = a.sums.Chunk(digested, c.Checksum, c.RawLen, c.Hash)
		}
		if a.sums.Digest(digested, f.Size) != f.Digest {
			return rep, fmt.Errorf("%s: file %s: digest does not match its chunks: %w", a.store, manifest.PrintableName(f.Name), errdefs.ErrCorrupt)
		}
		n, err := a.Copy(ctx, f.Name, io.Discard)
		if err != nil {
			return rep, err
		}
		rep.Files++
		rep.Chunks += len(f.Chunks)
		rep.Bytes += n
	}
	return rep, nil
}

// verifyShared verifies a format 4 checkpoint: every file's digest, and
// every chunk it references once, however many files or offsets share it,
// several at once.
func verifyShared(ctx context.Context, a *ArchiveSource) (VerifyReport, error) {
	var rep VerifyReport
	type job struct {
		f *manifest.File
		i int
	}
	jobs := make(chan job)
	errs := make(chan error, 1)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	for range max(1, a.parallel) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				v, err := a.fetch(ctx, j.f, j.i)
				if err != nil {
					select {
					case errs <- err:
					default:
					}
					cancel()
					continue
				}
				a.drop(v)
			}
		}()
	}
	seen := map[manifest.Hash]bool{}
	var failed error
feed:
	for fi := range a.man.Files {
		f := &a.man.Files[fi]
		digested := make([]byte, 0, 32*len(f.Chunks))
		for _, c := range f.Chunks {
			digested = a.sums.Chunk(digested, c.Checksum, c.RawLen, c.Hash)
		}
		if a.sums.Digest(digested, f.Size) != f.Digest {
			failed = fmt.Errorf("%s: file %s: digest does not match its chunks: %w", a.store, manifest.PrintableName(f.Name), errdefs.ErrCorrupt)
			break
		}
		for i, c := range f.Chunks {
			if codec.ID(c.Codec) != codec.Zero {
				if seen[c.Hash] {
					continue
				}
				seen[c.Hash] = true
			}
			select {
			case jobs <- job{f, i}:
			case <-ctx.Done():
				break feed
			}
			rep.Chunks++
		}
		rep.Files++
		rep.Bytes += f.Size
	}
	close(jobs)
	wg.Wait()
	select {
	case err := <-errs:
		return rep, err
	default:
	}
	if failed == nil {
		failed = ctx.Err()
	}
	return rep, failed
}

// FileStats is one file of a checkpoint as inspect shows it: its stored
// bytes and the codecs of its chunks, from the manifest alone.
type FileStats struct {
	Name        string         `json:"name"`
	Size        int64          `json:"size"`
	StoredBytes int64          `json:"stored_bytes"`
	Ratio       float64        `json:"ratio"`
	Chunks      int            `json:"chunks"`
	Codecs      map[string]int `json:"codecs"`
	External    bool           `json:"external,omitempty"`
	Carried     bool           `json:"carried,omitempty"`
	Digest      string         `json:"digest"`
}

// DescribeFiles returns the FileStats of m's files, in m's order.
func DescribeFiles(m *manifest.Manifest) []FileStats {
	var out []FileStats
	for _, f := range m.Files {
		fi := FileStats{Name: f.Name, Size: f.Size, Chunks: len(f.Chunks), Codecs: map[string]int{}, External: f.External, Carried: f.Carried, Digest: f.Digest.String()}
		for _, c := range f.Chunks {
			fi.StoredBytes += int64(c.Stored)
			fi.Codecs[codec.ID(c.Codec).String()]++
		}
		fi.Ratio = 1
		if fi.StoredBytes > 0 {
			fi.Ratio = float64(f.Size) / float64(fi.StoredBytes)
		}
		out = append(out, fi)
	}
	return out
}
