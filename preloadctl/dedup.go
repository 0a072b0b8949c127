package preloadctl

// The library's side of a --dedup checkpoint's copy out (preload/dedup.c):
// its device hashes, the blocks to leave out, and its record of the
// checkpoints it went into.

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
)

// HashStats is what `hashes` answered: the mappings and blocks it hashed
// on the device, and how many blocks it offered to be left out.
type HashStats struct {
	Mappings int     `json:"mappings"`
	Bytes    int64   `json:"bytes"`
	Blocks   int64   `json:"blocks"`
	Block    int64   `json:"block"`
	Offered  int64   `json:"offered"`
	KernelS  float64 `json:"kernel_s"`
	HashesS  float64 `json:"hashes_s"`
}

// Hashes has the parked process's library hash every block of its memory
// as its last Scan cut them, on the device under key, and write the
// hashes into f (preload/dedup.c; vram reads them).
func (p *Conn) Hashes(ctx context.Context, key uint64, f *os.File) (HashStats, error) {
	r, err := ask[HashStats](ctx, p, fmt.Sprintf("hashes %#x", key), []*os.File{f})
	if err != nil {
		return r, err
	}
	return r, nil
}

// Skip hands the parked process's library the blocks its next copy out
// leaves holes for (f, preload/dedup.c's skip file): it answers their
// bytes.
func (p *Conn) Skip(ctx context.Context, f *os.File) (int64, error) {
	r, err := ask[struct {
		Skipped int64 `json:"skipped"`
	}](ctx, p, "skip", []*os.File{f})
	if err != nil {
		return 0, err
	}
	return r.Skipped, nil
}

// MaxBaseName is the longest checkpoint name Based records.
const MaxBaseName = 255

// Based records in the process that it went into the checkpoint name of
// the location loc (a 64-bit name of it): CRIU carries that into the
// checkpoint, so that the process, and a restore of it, can say where
// its memory is (Bases).
func (p *Conn) Based(ctx context.Context, loc uint64, name string) error {
	if name == "" || len(name) > MaxBaseName {
		return fmt.Errorf("process %d: based: a name of 1 to %d bytes, not %d", p.PID, MaxBaseName, len(name))
	}
	_, err := p.do(ctx, fmt.Sprintf("based %x %s", loc, hex.EncodeToString([]byte(name))), nil)
	return err
}

// Bases are the names Based recorded for loc, the latest first (at most
// four): hints only, which the caller checks.
func (p *Conn) Bases(ctx context.Context, loc uint64) ([]string, error) {
	r, err := ask[struct {
		Names []string `json:"names"`
	}](ctx, p, fmt.Sprintf("bases %x", loc), nil)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, h := range r.Names {
		if b, err := hex.DecodeString(h); err == nil && len(b) > 0 && len(b) <= MaxBaseName {
			out = append(out, string(b))
		}
	}
	return out, nil
}
