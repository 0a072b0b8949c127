package cudadriver

import (
	"errors"
	"strings"
	"testing"
)

func TestOpenDefaultWithoutDriver(t *testing.T) {
	// On CI hosts without a GPU, Open must fail plainly (and never panic);
	// on a GPU host it must succeed.
	d, err := Open()
	if err != nil {
		if !errors.Is(err, ErrNoDriver) && !errors.Is(err, ErrUnsupported) {
			t.Fatalf("Open() = %v: want ErrNoDriver or ErrUnsupported", err)
		}
		t.Logf("no driver here: %v", err)
		return
	}
	v, _ := d.Version()
	t.Logf("driver CUDA %s", VersionString(v))
}

func TestNames(t *testing.T) {
	for s, want := range map[State]string{StateRunning: "running", StateLocked: "locked", StateCheckpointed: "checkpointed", StateFailed: "failed", 7: "state(7)"} {
		if s.String() != want {
			t.Errorf("State(%d) = %q, want %q", int(s), s, want)
		}
	}
	for r, want := range map[Result]string{Success: "CUDA_SUCCESS", ErrorTimeout: "CUDA_ERROR_TIMEOUT", ErrorNotSupported: "CUDA_ERROR_NOT_SUPPORTED", ErrorIllegalState: "CUDA_ERROR_ILLEGAL_STATE", 12345: "CUresult(12345)"} {
		if r.String() != want {
			t.Errorf("Result(%d) = %q, want %q", int(r), r, want)
		}
	}
	e := &Error{Op: "lock", PID: 42, Code: ErrorTimeout}
	if !strings.Contains(e.Error(), "cuda lock of pid 42: CUDA_ERROR_TIMEOUT") || !strings.Contains(e.Error(), "--lock-timeout") {
		t.Errorf("lock timeout error %q", e)
	}
}

func TestUUID(t *testing.T) {
	const s = "GPU-b9866d0b-7eb7-389c-2420-04c59d30be30"
	u, err := ParseUUID(s)
	if err != nil {
		t.Fatal(err)
	}
	if u.String() != s {
		t.Fatalf("round trip %q -> %q", s, u)
	}
	if u2, err := ParseUUID("B9866D0B7EB7389C242004C59D30BE30"); err != nil || u2 != u {
		t.Fatalf("bare hex: %v %v", u2, err)
	}
	for _, bad := range []string{"", "GPU-", "GPU-b9866d0b", "GPU-b9866d0b-7eb7-389c-2420-04c59d30be3g", "GPU-b9866d0b-7eb7-389c-2420-04c59d30be3000"} {
		if _, err := ParseUUID(bad); err == nil {
			t.Errorf("ParseUUID(%q) accepted", bad)
		}
	}
	pairs, err := ParseGPUMap(s + "=GPU-00000000-0000-0000-0000-000000000001," + s + "=" + s)
	if err != nil || len(pairs) != 2 || pairs[0].Old != u || pairs[0].New[15] != 1 || pairs[1].New != u {
		t.Fatalf("ParseGPUMap: %v %v", pairs, err)
	}
	if back, err := ParseGPUMap(FormatGPUMap(pairs)); err != nil || len(back) != 2 || back[0] != pairs[0] || back[1] != pairs[1] {
		t.Fatalf("ParseGPUMap(FormatGPUMap(%v)) = %v %v", pairs, back, err)
	}
	if _, err := ParseGPUMap(s); err == nil {
		t.Error("ParseGPUMap without '=' accepted")
	}
}
