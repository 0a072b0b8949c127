package checkpoint

import (
	"os"
	"testing"
)

func TestProcessOf(t *testing.T) {
	p := processOf(os.Getpid())
	if p.PID != os.Getpid() || len(p.Cmdline) == 0 || p.Cmdline[0] != os.Args[0] {
		t.Errorf("processOf(self) = %+v, want pid %d and cmdline starting %q", p, os.Getpid(), os.Args[0])
	}
}
