package location

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// Under umask 022 a redirected stdout file is 0644: it becomes 0600 before
// anything is written to it. A pipe is left alone.
func TestPrivateOutput(t *testing.T) {
	old := syscall.Umask(0o022)
	defer syscall.Umask(old)
	f, err := os.Create(filepath.Join(t.TempDir(), "ckpt.stream"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if st, _ := f.Stat(); st.Mode().Perm() != 0o644 {
		t.Fatalf("created with mode %v", st.Mode().Perm())
	}
	if err := PrivateOutput(f); err != nil {
		t.Fatal(err)
	}
	if st, _ := f.Stat(); st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v after PrivateOutput, want 0600", st.Mode().Perm())
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if err := PrivateOutput(w); err != nil {
		t.Fatalf("pipe: %v", err)
	}
}
