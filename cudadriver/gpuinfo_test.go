package cudadriver

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeSMI points SMI at a script that prints out, for the length of the test.
func fakeSMI(t *testing.T, out string) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "nvidia-smi")
	if err := os.WriteFile(p, []byte("#!/bin/sh\ncat <<'EOF'\n"+out+"EOF\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	old := SMI
	SMI = p
	t.Cleanup(func() { SMI = old })
}

func TestHostGPUs(t *testing.T) {
	const g0, g1 = "GPU-6227a755-bc41-ed8c-faca-dc4721a7e5ae", "GPU-d9cee57e-2a39-21a8-d081-3d2d0618745c"
	for _, tc := range []struct {
		name, out string
		want      []int64 // free MiB per GPU
		wantErr   string
	}{
		{"two", g0 + ", NVIDIA H100 80GB HBM3, 81079\n" + g1 + ", NVIDIA H100 80GB HBM3, 511\n", []int64{81079, 511}, ""},
		{"bad uuid", "GPU-zz, H100, 5\n", nil, "hex digit"},
		{"bad free", g0 + ", H100, [N/A]\n", nil, "is not a number"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fakeSMI(t, tc.out)
			gpus, err := HostGPUs(context.Background())
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("HostGPUs err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || len(gpus) != len(tc.want) {
				t.Fatalf("HostGPUs = %v, %v", gpus, err)
			}
			for i, g := range gpus {
				if g.Free != tc.want[i]<<20 || g.Name != "NVIDIA H100 80GB HBM3" {
					t.Errorf("GPU %d: %+v, want %d MiB free", i, g, tc.want[i])
				}
			}
			if gpus[0].UUID.String() != g0 {
				t.Errorf("UUID %s, want %s", gpus[0].UUID, g0)
			}
		})
	}
}
