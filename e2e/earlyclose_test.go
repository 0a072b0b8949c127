package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestRestoreNftablesLargerThanAPipe: real CRIU in stream mode read a network
// namespace's nftables-N.img as size 0 (it sizes it with fstat) and
// closed its pipe: the serve once failed on that ("serve nftables-9.img:
// ... broken pipe"), then let it be and lost the rules. Now the image is
// handed to CRIU as a file (criusock/asfile.go), and a table of more rules
// than a pipe holds (1 MiB) comes back whole.
func TestRestoreNftablesLargerThanAPipe(t *testing.T) {
	CRIU(t)
	for _, tool := range []string{"unshare", "nft", "iptables-restore"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing(t, "%s (CRIU dumps a network namespace's rules with nft and iptables-restore)", tool)
		}
	}
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	rules := filepath.Join(dir, "rules.nft")
	var b strings.Builder
	b.WriteString("table inet big {\n chain input {\n  type filter hook input priority 0;\n")
	for i := 1; i <= 15000; i++ {
		fmt.Fprintf(&b, "  tcp dport %d counter accept comment \"rule %d of a table larger than a pipe\"\n", i, i)
	}
	b.WriteString(" }\n}\n")
	if err := os.WriteFile(rules, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	// unshare execs sh, which execs sleep: one pid.
	pid, gone := startScript(ctx, t, dir, []string{"unshare", "-n"}, "nft -f "+rules+" && touch \"$1\" && exec sleep 600")
	archive := filepath.Join(dir, "ck")
	gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(pid), "--to", archive).ok(t, "checkpoint")
	<-gone
	insp := gcsRun(ctx, t, "inspect", archive).ok(t, "inspect")
	if !strings.Contains(insp.stdout, "nftables-") {
		t.Fatalf("the checkpoint holds no nftables image:\n%s", insp.stdout)
	}
	r := restoreInPlace(ctx, t, archive, pid)
	restored := pid
	if !strings.Contains(r.stderr, "nftables-") || !strings.Contains(r.stderr, "served as a file") {
		t.Errorf("restore does not say it handed CRIU the nftables image as a file:\n%s", r.stderr)
	}
	if !pidRunning(restored) {
		t.Errorf("the restored process %d is not running", restored)
	}
	out, err := inNetnsOutput(t, fmt.Sprintf("/proc/%d/ns/net", restored), "nft", "list", "table", "inet", "big")
	if n := strings.Count(out, "counter packets"); err != nil || n != 15000 {
		t.Errorf("the restored table holds %d rules (%v), want 15000", n, err)
	}
}
