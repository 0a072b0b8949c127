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

// TestRestoreNftablesClosedEarly: real CRIU in stream mode reads a
// network namespace's nftables-N.img as size 0 and closes its pipe. With
// more rules than a pipe holds (1 MiB) the serve's write meets the closed
// pipe every time; that is CRIU's decision, so the restore goes on (it
// once failed with "serve nftables-9.img: ... broken pipe"), and the file
// is named with the bytes not taken.
func TestRestoreNftablesClosedEarly(t *testing.T) {
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
	if !strings.Contains(r.stderr, "nftables-") || !strings.Contains(r.stderr, "closed by its reader with") {
		t.Errorf("restore does not name the nftables image CRIU closed early:\n%s", r.stderr)
	}
	if !pidRunning(restored) {
		t.Errorf("the restored process %d is not running", restored)
	}
}
