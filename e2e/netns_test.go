package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/scratch"
)

// migrateEnv is a sender namespace (A) and a receiver namespace (B), a
// shared token and the binaries.
type migrateEnv struct {
	t     *testing.T
	ctx   context.Context
	dir   string
	net   *NetPair
	token string
	bin   string
	// recvBin, when set, is the receiver's binary (another build, for a
	// benchmark's before and after).
	recvBin string
	criu    string
	port    int
	// migrateStderr, when set, gets a copy of migrate's stderr.
	migrateStderr io.Writer
}

func newMigrateEnv(t *testing.T) *migrateEnv {
	t.Helper()
	e := &migrateEnv{t: t, criu: CRIU(t), ctx: testCtx(t), dir: ShortTempDir(t), port: 7000}
	e.net = NewNetPair(t)
	e.bin = BuildBinary(t, "./cmd/gpucr-stream")
	e.token = e.newToken("token")
	return e
}

func (e *migrateEnv) newToken(name string) string {
	e.t.Helper()
	return writeToken(e.t, e.bin, filepath.Join(e.dir, name))
}

// writeToken writes a new `gpucr-stream token` (bin) into path, 0600.
func writeToken(t testing.TB, bin, path string) string {
	t.Helper()
	out, err := exec.Command(bin, "token").Output()
	if err != nil || len(bytes.TrimSpace(out)) != 64 {
		t.Fatalf("gpucr-stream token: %q %v", out, err)
	}
	if err := os.WriteFile(path, out, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func (e *migrateEnv) addr() string { return fmt.Sprintf("%s:%d", e.net.AddrB, e.port) }

// startTarget starts the target inside A.
func (e *migrateEnv) startTarget(name string, mb int, extra ...string) (*Target, Proof) {
	e.t.Helper()
	var tg *Target
	var before Proof
	InNetns(e.t, e.net.A, func() { tg, before = startedTarget(e.ctx, e.t, filepath.Join(e.dir, name), mb, extra...) })
	return tg, before
}

// startReceiver runs `receive` inside B and waits until it listens.
func (e *migrateEnv) startReceiver(stdout io.Writer, args ...string) *proc {
	e.t.Helper()
	var p *proc
	args = append([]string{"receive", "--listen", e.addr(), "--token-file", e.token, "--net-timeout", "3s"}, args...)
	InNetns(e.t, e.net.B, func() { p = startGCS(e.ctx, e.t, gcsOpts{stdout: stdout, bin: e.recvBin}, args...) })
	if !p.waitLine(e.ctx, "socket-init") {
		e.t.Fatalf("receiver ended before listening: %v", p.wait(e.ctx))
	}
	return p
}

// migrate runs `migrate` of tg inside A. While it runs, the harness reaps
// the dumped target (it is the target's parent and subreaper), as an init
// would: the restore needs its PIDs free.
func (e *migrateEnv) migrate(tg *Target, stdout io.Writer, args ...string) *proc {
	e.t.Helper()
	var p *proc
	args = append([]string{"migrate", "--pid", strconv.Itoa(tg.PID()), "--to", "tcp://" + e.addr(), "--token-file", e.token,
		"--criu", e.criu, "--net-timeout", "3s"}, args...)
	InNetns(e.t, e.net.A, func() { p = startGCS(e.ctx, e.t, gcsOpts{stdout: stdout, stderr: e.migrateStderr}, args...) })
	rctx, stop := context.WithCancel(e.ctx)
	go func() {
		<-p.done
		stop()
	}()
	go tg.WaitGone(rctx)
	return p
}

// migrated migrates tg to a receiver that restores it, both with --json
// (recvArgs and args add to their flags), waits for both, and decodes the
// results into res (migrate's) and rres (receive's; nil: not decoded).
func (e *migrateEnv) migrated(tg *Target, recvArgs, args []string, res, rres any) {
	e.t.Helper()
	var rout, mout bytes.Buffer
	recv := e.startReceiver(&rout, append([]string{"--restore", "--criu", e.criu, "--json"}, recvArgs...)...)
	m := e.migrate(tg, &mout, append([]string{"--json"}, args...)...)
	if err := m.wait(e.ctx); err != nil {
		e.t.Fatalf("migrate: %v; receiver: %v", err, recv.wait(e.ctx))
	}
	if err := recv.wait(e.ctx); err != nil {
		e.t.Fatalf("receive: %v", err)
	}
	if err := json.Unmarshal(mout.Bytes(), res); err != nil {
		e.t.Fatalf("migrate --json: %v: %s", err, mout.String())
	}
	if rres == nil {
		return
	}
	if err := json.Unmarshal(rout.Bytes(), rres); err != nil {
		e.t.Fatalf("receive --json: %v: %s", err, rout.String())
	}
}

type migrateJSON struct {
	PID          int     `json:"pid"`
	RestoredPID  int     `json:"restored_pid"`
	Streams      int     `json:"streams"`
	RawBytes     int64   `json:"raw_bytes"`
	WireBytes    int64   `json:"wire_bytes"`
	DowntimeSecs float64 `json:"downtime_seconds"`
	DowntimeTo   string  `json:"downtime_to"`
	KeptImage    string  `json:"kept_image"`
	KeptInMemory bool    `json:"kept_in_memory"`
	Phases       []struct {
		Name string  `json:"name"`
		Secs float64 `json:"seconds"`
	} `json:"phases"`
}

func emptyDir(t *testing.T, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if len(names) > 0 {
		t.Errorf("%s is not empty: %v", dir, names)
	}
}

// onlyKeptCRIULogs checks that a failed run left nothing in dir but the
// CRIU work dirs its error names as kept for their logs (issue 11: the log
// that says why stays), and that those hold no image data.
// noImageData checks the entries of dir named prefix* for files other than
// CRIU's logs and sockets, and removes them.
func noImageData(t *testing.T, dir, prefix string) {
	t.Helper()
	ents, _ := filepath.Glob(filepath.Join(dir, prefix+"*"))
	for _, p := range ents {
		filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() && !strings.HasSuffix(q, ".log") && d.Type()&fs.ModeSocket == 0 {
				t.Errorf("%s left behind by a killed receiver", q)
			}
			return err
		})
		os.RemoveAll(p)
	}
}

func onlyKeptCRIULogs(t *testing.T, dir, errText string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		if !strings.Contains(errText, "criu's log is kept in "+p) {
			t.Errorf("%s left behind, and the error does not name it as a kept CRIU log: %s", p, errText)
			continue
		}
		logs := 0
		filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			if strings.HasSuffix(q, ".log") {
				logs++
			}
			if info, err := d.Info(); err == nil && info.Mode().IsRegular() && strings.HasSuffix(q, ".img") && info.Size() > 1<<20 {
				t.Errorf("kept CRIU log dir holds image data: %s (%d bytes)", q, info.Size())
			}
			return nil
		})
		if logs == 0 {
			t.Errorf("kept CRIU log dir %s holds no log", p)
		}
	}
}

// TestMigrateNetns moves the target from namespace A to namespace B over
// two TLS streams with real CRIU on both sides; it carries on intact in B.
func TestMigrateNetns(t *testing.T) {
	// The sender keeps its copy where it does by default: on a tmpfs of
	// its own (as root), mounted under root's /run/gpucr-stream.
	e := newMigrateEnv(t)
	tg, before := e.startTarget("target", 96)
	var res migrateJSON
	var rres struct {
		PID        int     `json:"pid"`
		Streams    int     `json:"streams"`
		CRIUWaited float64 `json:"criu_waited_seconds"`
	}
	e.migrated(tg, nil, []string{"--streams", "2"}, &res, &rres)
	if res.RestoredPID != tg.PID() || rres.PID != tg.PID() || res.DowntimeTo != "restored" || rres.Streams != 2 {
		t.Fatalf("migrate says %+v, receive says %+v, target pid %d", res, rres, tg.PID())
	}
	// The receiver's criu started beside the transfer: its first request
	// was there, waiting, before the sender committed.
	if rres.CRIUWaited <= 0 {
		t.Errorf("the receiver's criu asked for its first file only after the commit: receive says %+v", rres)
	}
	if res.WireBytes <= 0 || res.RawBytes < 64<<20 || res.DowntimeSecs <= 0 {
		t.Errorf("implausible numbers: %+v", res)
	}
	if in, err := NetnsOf(tg.PID(), e.net.B); err != nil || !in {
		t.Errorf("restored target is not in namespace %s: %v", e.net.B, err)
	}
	if !res.KeptInMemory && os.Geteuid() == 0 {
		t.Errorf("the sender's copy was not on a tmpfs of its own: %+v", res)
	}
	// Confirmed: the sender's copy is gone, and its tmpfs.
	if left, _ := filepath.Glob(filepath.Join(scratch.DefaultRoot, "gpucr-migrate-keep-*")); len(left) != 0 {
		t.Errorf("the sender's copy left after the migration: %v", left)
	}
	if mi, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(mi), "gpucr-migrate-keep-") {
		t.Errorf("a mount left after the migration:\n%s", mi)
	}
	provenRestore(e.ctx, t, tg, before)
	t.Logf("downtime %.2fs, %d MiB raw, %d MiB on the wire; phases %+v", res.DowntimeSecs, res.RawBytes>>20, res.WireBytes>>20, res.Phases)
}

// TestMigrateSSHPipe runs the form users type over a real sshd in B:
// gpucr-stream capture | ssh B gpucr-stream serve.
func TestMigrateSSHPipe(t *testing.T) {
	CRIU(t)
	sshd := NeedTool(t, "sshd")
	ssh := NeedTool(t, "ssh")
	keygen := NeedTool(t, "ssh-keygen")
	e := newMigrateEnv(t)
	tg, before := e.startTarget("target", 96)

	sd := mkdir(t, filepath.Join(e.dir, "ssh"))
	for _, k := range []string{"host", "user"} {
		if out, err := exec.Command(keygen, "-q", "-t", "ed25519", "-N", "", "-C", "gcs-e2e-"+k, "-f", filepath.Join(sd, k)).CombinedOutput(); err != nil {
			t.Fatalf("ssh-keygen: %v: %s", err, out)
		}
	}
	pub := func(k string) string {
		b, err := os.ReadFile(filepath.Join(sd, k+".pub"))
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	write := func(name, s string) string {
		p := filepath.Join(sd, name)
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("authorized_keys", pub("user")+"\n")
	knownHosts := write("known_hosts", e.net.AddrB+" "+pub("host")+"\n")
	config := write("sshd_config", fmt.Sprintf(`ListenAddress %s:22
HostKey %s/host
PidFile %s/sshd.pid
AuthorizedKeysFile %s/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
LogLevel VERBOSE
`, e.net.AddrB, sd, sd, sd))
	// sshd wants its privilege separation directory, as the Debian service
	// makes it.
	if err := os.MkdirAll("/run/sshd", 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(sshd, "-t", "-f", config).CombinedOutput(); err != nil {
		t.Fatalf("sshd -t: %v: %s", err, out)
	}
	var sshdLog bytes.Buffer
	var sshdCmd *exec.Cmd
	InNetns(t, e.net.B, func() {
		sshdCmd = exec.Command(sshd, "-D", "-e", "-f", config)
		sshdCmd.Stdout, sshdCmd.Stderr = &sshdLog, &sshdLog
		if err := sshdCmd.Start(); err != nil {
			t.Fatalf("start sshd: %v", err)
		}
	})
	sshdDone := make(chan struct{})
	go func() { sshdCmd.Wait(); close(sshdDone) }()
	t.Cleanup(func() {
		sshdCmd.Process.Kill()
		<-sshdDone
		if t.Failed() {
			t.Logf("sshd log:\n%s", sshdLog.String())
		}
	})
	// Wait until sshd accepts connections in B.
	deadline := time.Now().Add(20 * time.Second)
	for {
		var err error
		InNetns(t, e.net.A, func() {
			var c net.Conn
			if c, err = net.DialTimeout("tcp", e.net.AddrB+":22", time.Second); err == nil {
				c.Close()
			}
		})
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sshd does not accept connections: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}

	a := mkdir(t, filepath.Join(e.dir, "a"))
	b := mkdir(t, filepath.Join(e.dir, "b"))
	sshCmd := fmt.Sprintf("%s -F /dev/null -i %s/user -o BatchMode=yes -o IdentitiesOnly=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile=%s root@%s",
		ssh, sd, knownHosts, e.net.AddrB)
	pipeline := fmt.Sprintf("%s --images-dir %s capture | %s %s --images-dir %s serve", e.bin, a, sshCmd, e.bin, b)
	var stderr bytes.Buffer
	var sh *exec.Cmd
	InNetns(t, e.net.A, func() {
		sh = exec.CommandContext(e.ctx, "bash", "-o", "pipefail", "-c", pipeline)
		sh.Stderr = &stderr
		if err := sh.Start(); err != nil {
			t.Fatal(err)
		}
	})
	shDone := make(chan error, 1)
	go func() { shDone <- sh.Wait() }()
	defer sh.Process.Kill()
	waitForFile(e.ctx, t, filepath.Join(a, "streamer-capture.sock"))
	var err error
	InNetns(t, e.net.A, func() {
		err = RunCRIU(e.ctx, t, "dump", "--stream", "-D", a, "-t", strconv.Itoa(tg.PID()), "-o", "dump.log", "-v4")
	})
	if err != nil {
		sh.Process.Kill()
		<-shDone
		t.Fatalf("criu dump: %v; pipeline: %s", err, stderr.String())
	}
	if err := tg.WaitGone(e.ctx); err != nil {
		t.Fatal(err)
	}
	waitForFile(e.ctx, t, filepath.Join(b, "streamer-serve.sock"))
	InNetns(t, e.net.B, func() {
		err = RunCRIU(e.ctx, t, "restore", "--stream", "-D", b, "--restore-detached", "-o", "restore.log", "-v4")
	})
	if err != nil {
		t.Fatalf("criu restore: %v", err)
	}
	select {
	case err := <-shDone:
		if err != nil {
			t.Fatalf("pipeline: %v: %s", err, stderr.String())
		}
	case <-e.ctx.Done():
		t.Fatalf("pipeline did not end: %s", stderr.String())
	}
	if !strings.Contains(sshdLog.String(), "Accepted publickey for root") {
		t.Errorf("sshd did not log a key login:\n%s", sshdLog.String())
	}
	if in, err := NetnsOf(tg.PID(), e.net.B); err != nil || !in {
		t.Errorf("restored target is not in namespace %s: %v", e.net.B, err)
	}
	provenRestore(e.ctx, t, tg, before)
}

// TestMigrateLinkCut breaks a migration in the middle, by taking the link
// down and by killing the receiver: the dump fails, CRIU resumes the
// target, which runs on intact; the receiver restores nothing and leaves
// no files behind.
func TestMigrateLinkCut(t *testing.T) {
	// With pre-copy (the default) the cut lands in its first round, while
	// the process runs; with --precopy off, in the stop-and-copy dump.
	for _, c := range []struct{ how, precopy string }{{"veth-down", "on"}, {"receiver-killed", "on"}, {"veth-down", "off"}, {"receiver-killed", "off"}} {
		how := c.how
		t.Run(how+"/precopy-"+c.precopy, func(t *testing.T) {
			e := newMigrateEnv(t)
			// Slow the link so that the cut lands in the transfer.
			e.net.Shape(t, "200mbit")
			tmp := mkdir(t, filepath.Join(e.dir, "tmp"))
			keep := mkdir(t, filepath.Join(e.dir, "keep"))
			tg, before := e.startTarget("target", 128)
			t.Setenv("TMPDIR", tmp) // the receiver's temporary files
			var rout bytes.Buffer
			recv := e.startReceiver(&rout, "--restore", "--criu", e.criu)
			rx0 := e.net.RxBytes(t)
			m := e.migrate(tg, io.Discard, "--streams", "2", "--codec", "none", "--keep-dir", keep, "--precopy", c.precopy)
			for e.net.RxBytes(t)-rx0 < 24<<20 {
				select {
				case <-m.done:
					t.Fatalf("migration ended before the cut: %v", m.wait(e.ctx))
				case <-time.After(10 * time.Millisecond):
				}
			}
			cut := time.Now()
			if how == "veth-down" {
				e.net.Cut(t)
			} else {
				recv.cmd.Process.Kill()
			}
			err := m.wait(e.ctx)
			if err == nil {
				t.Fatal("migrate succeeded over a cut link")
			}
			t.Logf("migrate failed %v after the cut: %v", time.Since(cut).Round(time.Millisecond), err)
			migErr := err.Error()
			if !strings.Contains(err.Error(), "not migrated and keeps running here") {
				t.Errorf("migrate does not say the process was resumed: %v", err)
			}
			if inRound := strings.Contains(err.Error(), "pre-copy round 1"); inRound != (c.precopy == "on") {
				t.Errorf("with --precopy %s, the failure is not where the cut was: %v", c.precopy, err)
			}
			rerr := recv.wait(e.ctx)
			if how == "veth-down" {
				if rerr == nil || !strings.Contains(rerr.Error(), "nothing is restored") {
					t.Errorf("receiver: %v", rerr)
				}
				if strings.TrimSpace(rout.String()) != "" {
					t.Errorf("receiver printed %q", rout.String())
				}
			}
			// The source runs on, intact, still in A.
			after, err := tg.Prove(e.ctx)
			if err != nil {
				t.Fatalf("target after the failed migration: %v", err)
			}
			if err := after.Check(before); err != nil {
				t.Fatalf("target after the failed migration: %v", err)
			}
			if in, err := NetnsOf(tg.PID(), e.net.A); err != nil || !in {
				t.Errorf("target left namespace %s: %v", e.net.A, err)
			}
			if how == "receiver-killed" {
				// Its criu started beside the transfer, in a work dir a
				// killed receiver cannot remove: it must hold no image byte.
				noImageData(t, tmp, "gcs-")
			}
			onlyKeptCRIULogs(t, tmp, migErr)
			emptyDir(t, keep)
		})
	}
}

// TestMigrateRefusals: a sender with the wrong token is refused (and the
// target left alone), garbage on the port is refused, and the same receiver
// then takes the real migration.
func TestMigrateRefusals(t *testing.T) {
	e := newMigrateEnv(t)
	tg, before := e.startTarget("target", 64)
	var rout bytes.Buffer
	recv := e.startReceiver(&rout, "--restore", "--criu", e.criu)

	bad := e.newToken("bad-token")
	var wrong *proc
	InNetns(t, e.net.A, func() {
		wrong = startGCS(e.ctx, t, gcsOpts{}, "migrate", "--pid", strconv.Itoa(tg.PID()), "--to", "tcp://"+e.addr(),
			"--token-file", bad, "--criu", e.criu, "--net-timeout", "3s")
	})
	err := wrong.wait(e.ctx)
	if err == nil || !strings.Contains(err.Error(), "token does not match") || !strings.Contains(err.Error(), "not touched") {
		t.Fatalf("migrate with the wrong token: %v", err)
	}
	p, err := tg.Prove(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Check(before); err != nil {
		t.Fatalf("target after a refused migration: %v", err)
	}

	junk := make([]byte, 64<<10)
	rand.Read(junk)
	for _, b := range [][]byte{junk, []byte("GET / HTTP/1.0\r\n\r\n"), []byte("SSH-2.0-OpenSSH_9.2\r\n")} {
		InNetns(t, e.net.A, func() {
			c, err := net.DialTimeout("tcp", e.addr(), 5*time.Second)
			if err != nil {
				t.Fatalf("connect to the receiver: %v", err)
			}
			defer c.Close()
			c.Write(b)
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			// It hangs up (EOF, or a reset when it left bytes unread).
			if _, err := io.Copy(io.Discard, c); err != nil {
				if ne, ok := err.(net.Error); ok && ne.Timeout() {
					t.Errorf("receiver did not hang up on garbage: %v", err)
				}
			}
		})
	}

	var mout bytes.Buffer
	m := e.migrate(tg, &mout, "--json")
	if err := m.wait(e.ctx); err != nil {
		t.Fatalf("real migration after the refusals: %v; receiver: %v", err, recv.wait(e.ctx))
	}
	if err := recv.wait(e.ctx); err != nil {
		t.Fatalf("receive: %v", err)
	}
	provenRestore(e.ctx, t, tg, p)
	log := recv.stderr.String()
	if n := strings.Count(log, "refused"); n < 4 || !strings.Contains(log, "authentication failed") || !strings.Contains(log, "TLS handshake failed") {
		t.Errorf("receiver log does not show the refusals:\n%s", log)
	}
}

// TestMigrateRestoreFails: the transfer completes but the restore on the
// receiver fails. Moved, the source is gone and the sender keeps the image,
// from which the process is restored here; with --leave-running the source
// simply runs on.
func TestMigrateRestoreFails(t *testing.T) {
	// The image kept: in the directory given, and by default on a tmpfs of
	// its own (as root), which stays mounted with the image until the user
	// is done with it.
	for _, given := range []bool{true, false} {
		t.Run(map[bool]string{true: "image-kept", false: "image-kept-default"}[given], func(t *testing.T) { migrateImageKept(t, given, false) })
	}
	// Encrypted, the kept image (an archive sharing the stream's session)
	// is restored with the key.
	t.Run("image-kept-encrypted", func(t *testing.T) { migrateImageKept(t, true, true) })
	// A receiver whose criu fails before the commit (it starts beside the
	// transfer) refuses the sender: the source runs on.
	t.Run("criu-fails-early", func(t *testing.T) {
		e := newMigrateEnv(t)
		tg, before := e.startTarget("target", 64)
		falseBin, err := exec.LookPath("false")
		if err != nil {
			t.Fatal(err)
		}
		recv := e.startReceiver(nil, "--restore", "--criu", falseBin)
		err = e.migrate(tg, io.Discard, "--keep-dir", mkdir(t, filepath.Join(e.dir, "keep"))).wait(e.ctx)
		if err == nil || !strings.Contains(err.Error(), "keeps running here") || !strings.Contains(err.Error(), "criu failed before the transfer ended") {
			t.Fatalf("migrate to a receiver whose criu fails: %v", err)
		}
		if rerr := recv.wait(e.ctx); rerr == nil {
			t.Fatal("receiver succeeded with a failing criu")
		}
		after, err := tg.Prove(e.ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := after.Check(before); err != nil {
			t.Fatalf("source after a refused migration: %v", err)
		}
	})
	t.Run("leave-running", func(t *testing.T) {
		e := newMigrateEnv(t)
		tg, before := e.startTarget("target", 64)
		// One PID space: the receiver cannot restore while the source runs.
		recv := e.startReceiver(nil, "--restore", "--criu", e.criu)
		m := e.migrate(tg, io.Discard, "--leave-running")
		err := m.wait(e.ctx)
		if err == nil || !strings.Contains(err.Error(), "still running here") {
			t.Fatalf("migrate --leave-running to a failing restore: %v", err)
		}
		if rerr := recv.wait(e.ctx); rerr == nil {
			t.Fatal("receiver restored a process whose PIDs are taken")
		}
		after, err := tg.Prove(e.ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := after.Check(before); err != nil {
			t.Fatalf("source after migrate --leave-running: %v", err)
		}
	})
}

// criuFailingLate writes into dir a criu that fails once it has read the
// image's inventory (in its pre-restore action script), so after a
// migration's commit: the receiver's criu starts before it, and one that
// fails at once refuses the transfer instead (criu-fails-early).
func criuFailingLate(t testing.TB, dir, criu string) string {
	t.Helper()
	failing, action := filepath.Join(dir, "criu-fails-pre-restore"), filepath.Join(dir, "fail-pre-restore")
	if err := os.WriteFile(action, []byte("#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" != pre-restore ]\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(failing, []byte("#!/bin/sh\nexec "+criu+" \"$@\" --action-script "+action+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return failing
}

// restoreKept restores tg in A from the image a failed migration (its
// error migrateErr) kept in keep, once the target is gone, and proves it
// against before; it returns the kept image's path.
func (e *migrateEnv) restoreKept(tg *Target, before Proof, migrateErr error, keep string, extra ...string) string {
	t := e.t
	t.Helper()
	kept := regexp.MustCompile(`kept at (\S+):`).FindStringSubmatch(migrateErr.Error())
	if kept == nil || !strings.HasPrefix(kept[1], keep+"/") {
		t.Fatalf("migrate does not name the kept image in %s: %v", keep, migrateErr)
	}
	if err := tg.WaitGone(e.ctx); err != nil {
		t.Fatal(err)
	}
	var out []byte
	var err error
	InNetns(t, e.net.A, func() {
		cmd := exec.CommandContext(e.ctx, e.bin, append([]string{"restore", "--from", kept[1], "--criu", e.criu}, extra...)...)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if out, err = cmd.Output(); err != nil {
			err = fmt.Errorf("%w: %s", err, stderr.String())
		}
	})
	if err != nil {
		t.Fatalf("restore from the kept image: %v", err)
	}
	if pid, _ := strconv.Atoi(strings.TrimSpace(string(out))); pid != tg.PID() {
		t.Fatalf("restore from the kept image printed %q", out)
	}
	provenRestore(e.ctx, t, tg, before)
	return kept[1]
}

// migrateImageKept migrates to a receiver whose restore fails: the source
// is gone, the image kept (in --keep-dir when given, else on a tmpfs of
// its own), and a restore from it brings the process back (encrypted:
// with the key).
func migrateImageKept(t *testing.T, given, encrypted bool) {
	e := newMigrateEnv(t)
	tg, before := e.startTarget("target", 64)
	keep := mkdir(t, filepath.Join(e.dir, "keep"))
	keepArgs := []string{"--keep-dir", keep}
	if !given {
		keep, keepArgs = scratch.DefaultRoot, nil
	}
	var keyArgs []string
	if encrypted {
		keyFile := filepath.Join(e.dir, "key")
		writeKey(e.ctx, t, keyFile)
		keyArgs = []string{"--key-file", keyFile}
	}
	failing := criuFailingLate(t, e.dir, e.criu)
	recv := e.startReceiver(nil, append([]string{"--restore", "--criu", failing}, keyArgs...)...)
	m := e.migrate(tg, io.Discard, append(keepArgs, keyArgs...)...)
	err := m.wait(e.ctx)
	if err == nil || !strings.Contains(err.Error(), "restore on the receiver failed") {
		t.Fatalf("migrate to a failing restore: %v", err)
	}
	if rerr := recv.wait(e.ctx); rerr == nil {
		t.Fatal("receiver succeeded with a failing criu")
	}
	kept := e.restoreKept(tg, before, err, keep, keyArgs...)
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	dir := filepath.Dir(kept)
	if mounted := strings.Contains(string(mi), " "+dir+" "); mounted != !given {
		t.Fatalf("kept image's directory %s mounted: %v, want %v", dir, mounted, !given)
	}
	if !given {
		if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil {
			t.Fatal(err)
		}
		os.RemoveAll(dir)
	}
}

// TestCaptureToTCP: the criu-image-streamer form over the network. The
// test runs `criu dump --stream` against `capture --to tcp://B --streams 3`
// in A, and `criu restore --stream` against `receive --images-dir` (no
// --restore) in B.
func TestCaptureToTCP(t *testing.T) {
	e := newMigrateEnv(t)
	tg, before := e.startTarget("target", 96)
	a := mkdir(t, filepath.Join(e.dir, "a"))
	b := mkdir(t, filepath.Join(e.dir, "b"))
	recv := e.startReceiver(nil, "--images-dir", b)
	var capture *proc
	InNetns(t, e.net.A, func() {
		capture = startGCS(e.ctx, t, gcsOpts{}, "--images-dir", a, "capture", "--to", "tcp://"+e.addr(), "--streams", "3",
			"--token-file", e.token, "--net-timeout", "3s")
	})
	InNetns(t, e.net.A, func() { dumpThrough(e.ctx, t, tg, a, capture) })
	var criuErr error
	InNetns(t, e.net.B, func() {
		criuErr = RunCRIU(e.ctx, t, "restore", "--stream", "-D", b, "--restore-detached", "-o", "restore.log", "-v4")
	})
	if err := recv.wait(e.ctx); criuErr != nil || err != nil {
		t.Fatalf("restore: criu: %v; receive: %v", criuErr, err)
	}
	if !strings.Contains(recv.stderr.String(), "3 stream(s)") {
		t.Errorf("receiver did not get 3 streams:\n%s", recv.stderr.String())
	}
	if in, err := NetnsOf(tg.PID(), e.net.B); err != nil || !in {
		t.Errorf("restored target is not in namespace %s: %v", e.net.B, err)
	}
	provenRestore(e.ctx, t, tg, before)
}
