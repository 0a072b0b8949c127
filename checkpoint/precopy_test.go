package checkpoint

import (
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/transport/tcp"
)

// TestPrecopyOff: pre-copy runs only where its rounds can be taken and
// their chunks referenced; otherwise the result says why not.
func TestPrecopyOff(t *testing.T) {
	hashes := pipeline.Format{ChunkHashes: true}
	cache := tcp.ReceiverInfo{ChunkCache: true, Restores: true}
	for _, tc := range []struct {
		name string
		o    PrecopyOptions
		f    pipeline.Format
		info tcp.ReceiverInfo
		cuda []int
		want string // "" or part of the reason
	}{
		{"plain process", PrecopyOptions{}, hashes, cache, nil, ""},
		{"one CUDA process", PrecopyOptions{}, hashes, cache, []int{7}, ""},
		{"off", PrecopyOptions{Off: true}, hashes, cache, nil, "--precopy off"},
		{"no chunk cache", PrecopyOptions{}, hashes, tcp.ReceiverInfo{Restores: true}, nil, "no chunk cache"},
		{"encrypted", PrecopyOptions{}, pipeline.Format{ChunkHashes: true, Seal: &crypt.Session{}}, cache, nil, "encrypted"},
		{"no chunk hashes", PrecopyOptions{}, pipeline.Format{}, cache, nil, "no chunk hashes"},
		{"CUDA, receiver does not restore", PrecopyOptions{}, hashes, tcp.ReceiverInfo{ChunkCache: true}, []int{7}, "does not restore"},
		{"NCCL pair", PrecopyOptions{}, hashes, cache, []int{7, 8}, "several CUDA processes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := precopyOff(tc.o, tc.f, tc.info, tc.cuda)
			if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
				t.Fatalf("precopyOff = %q, want %q", got, tc.want)
			}
		})
	}
}
