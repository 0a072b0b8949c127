package e2e

// The torture test's runs, its images, and what it checks once the storm
// is over (torture_test.go).

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gpucr/gpucr-stream/catalog"
)

// tproc is a gpucr-stream run of the torture test.
type tproc struct {
	cmd            *exec.Cmd
	stdout, stderr bytes.Buffer
	start          time.Time
	listening      chan struct{} // closed at its "socket-init" progress line
	exited         chan struct{}
	timer          *time.Timer
}

// trun is a finished run: code -1 is a run killed.
type trun struct {
	code           int
	stdout, stderr string
	start, end     time.Time
}

func (r trun) String() string {
	d := r.end.Sub(r.start).Round(time.Millisecond)
	switch r.code {
	case -1:
		return fmt.Sprintf("killed after %v", d)
	case 0:
		return fmt.Sprintf("exit 0 in %v", d)
	}
	return fmt.Sprintf("exit %d in %v: %s", r.code, d, lastLine(strings.TrimSpace(r.stderr)))
}

// launch starts gpucr-stream with args, its progress lines on fd 3.
func (tt *torture) launch(args ...string) (*tproc, error) {
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	p := &tproc{start: time.Now(), listening: make(chan struct{}), exited: make(chan struct{})}
	p.cmd = exec.CommandContext(tt.ctx, tt.bin, append([]string{"--progress-fd", "3"}, args...)...)
	p.cmd.Stdout, p.cmd.Stderr = &p.stdout, &p.stderr
	p.cmd.ExtraFiles = []*os.File{pw}
	err = p.cmd.Start()
	pw.Close()
	if err != nil {
		pr.Close()
		return nil, err
	}
	go func() { // waited for through exited
		sc := bufio.NewScanner(pr)
		sc.Buffer(nil, 1<<20)
		seen := false
		for sc.Scan() {
			if !seen && sc.Text() == "socket-init" {
				seen = true
				close(p.listening)
			}
		}
		_, _ = io.Copy(io.Discard, pr)
		pr.Close()
		_ = p.cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// killAfter SIGKILLs p after d, unless it ended before; 0: never.
func (p *tproc) killAfter(d time.Duration) {
	if d > 0 {
		p.timer = time.AfterFunc(d, func() { _ = p.cmd.Process.Signal(syscall.SIGKILL) })
	}
}

// result waits for p to end; the PID of a run killed is kept, for settle.
func (tt *torture) result(p *tproc) trun {
	<-p.exited
	if p.timer != nil {
		p.timer.Stop()
	}
	r := trun{code: p.cmd.ProcessState.ExitCode(), start: p.start, end: time.Now(), stdout: p.stdout.String(), stderr: p.stderr.String()}
	if r.code == -1 {
		tt.mu.Lock()
		tt.killed = append(tt.killed, p.cmd.Process.Pid)
		tt.mu.Unlock()
	}
	return r
}

// run runs gpucr-stream with args to its end, SIGKILLed after killAfter
// (0: never).
func (tt *torture) run(killAfter time.Duration, args ...string) trun {
	p, err := tt.launch(args...)
	if err != nil {
		now := time.Now()
		return trun{code: -2, stderr: err.Error(), start: now, end: now}
	}
	p.killAfter(killAfter)
	return tt.result(p)
}

// tortureBases are the sizes of the pages of three processes: each
// capture sends a copy of one with a share of its 256 KiB blocks
// rewritten, so that --dedup captures share chunks (and gc must keep
// packs that others still use). The last block starts out zero.
var tortureBases = []int{2 << 20, 3 << 20, 4 << 20}

const tortureBlock = 256 << 10

// imageSpec says what one capture sent.
type imageSpec struct {
	base   int    // of tortureBases
	seed   uint64 // of the blocks rewritten
	change int    // percent of the blocks rewritten
	tag    string // the capture's name, in its small images
}

func (s imageSpec) files() map[string][]byte {
	pages := make([]byte, tortureBases[s.base])
	fill(rand.New(rand.NewPCG(37, uint64(s.base))), pages[:len(pages)-tortureBlock])
	r := rand.New(rand.NewPCG(s.seed, 37))
	for off := 0; off < len(pages); off += tortureBlock {
		if r.IntN(100) < s.change {
			fill(r, pages[off:off+tortureBlock])
		}
	}
	return map[string][]byte{
		"pages-1.img":   pages,
		"pagemap-1.img": []byte(strings.Repeat("pagemap of "+s.tag+"\n", 50)),
		"core-1.img":    []byte(strings.Repeat("core of "+s.tag+"\n", 333)),
		"inventory.img": []byte("inventory of " + s.tag),
	}
}

func fill(r *rand.Rand, b []byte) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
}

// settle checks, once the storm is over, what it left: after a last gc of
// each location, check finds it clean and ls lists what it should; every
// checkpoint committed and not removed verifies and extracts byte-exact.
func (tt *torture) settle() {
	tt.waitKilledGone()
	for _, loc := range []string{tt.env.main, tt.env.second} {
		if !slices.ContainsFunc(tt.ckpts, func(c *tckpt) bool { return c.loc == loc }) {
			continue // no cp went there
		}
		r := tt.run(0, "gc", "--older-than", "0s", loc)
		tt.logf("last gc %s: %s", loc, r)
		if gcFoundEmpty(r, loc) && !slices.ContainsFunc(tt.ckpts, func(c *tckpt) bool { return c.loc == loc && c.state == stCommitted }) {
			tt.t.Logf("%s: rm removed every checkpoint there", loc)
			continue
		}
		if r.code != 0 {
			tt.t.Errorf("last gc --older-than 0s %s: %s\n%s", loc, r, r.stderr)
			continue
		}
		r = tt.run(0, "check", "--json", loc)
		var rep catalog.CheckReport
		if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || r.code != 0 || !rep.OK {
			tt.t.Errorf("check %s after the last gc: %s (%v)\n%s", loc, r, err, r.stdout)
			continue
		}
		tt.t.Logf("check %s: clean: %d checkpoints (%d --dedup), %d packs, %d index objects, %d chunks not indexed",
			loc, rep.Checkpoints, rep.Dedup, rep.Packs, rep.IndexObjects, rep.Unindexed)
		tt.listed(loc)
	}
	tt.verifyAll()
}

// waitKilledGone waits until no process has the PID of a run killed: a
// lock names its holder's PID, and one taken again by another process
// would keep the killed run's lock counting (store.HolderGone).
func (tt *torture) waitKilledGone() {
	deadline := time.Now().Add(2 * time.Minute)
	for _, pid := range tt.killed {
		if pidExists(pid) {
			tt.logf("the PID %d of a run killed is another process's now; waiting for it to end", pid)
		}
		for pidExists(pid) {
			if time.Now().After(deadline) {
				tt.t.Fatalf("PID %d, of a run killed, has been another process's for 2 minutes: the run's lock counts as held", pid)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// listed checks that ls lists in loc every checkpoint committed and none
// removed, and nothing the test did not write.
func (tt *torture) listed(loc string) {
	r := tt.run(0, "ls", "--json", loc)
	var es []catalog.Entry
	if err := json.Unmarshal([]byte(r.stdout), &es); err != nil || r.code != 0 {
		tt.t.Errorf("ls --json %s: %s (%v)", loc, r, err)
		return
	}
	seen := map[string]catalog.Entry{}
	for _, e := range es {
		seen[e.Name] = e
	}
	for _, c := range tt.ckpts {
		if c.loc != loc {
			continue
		}
		e, ok := seen[c.name]
		delete(seen, c.name)
		switch {
		case c.state == stCommitted && !ok:
			tt.t.Errorf("ls %s does not list %s, whose writer exited 0", loc, c.name)
		case c.state == stRemoved && ok:
			tt.t.Errorf("ls %s lists %s, which rm removed (exit 0)", loc, c.name)
		case ok && e.Error != "":
			tt.t.Errorf("ls %s: %s: %s", loc, c.name, e.Error)
		}
	}
	for n := range seen {
		tt.t.Errorf("ls %s lists %s, which no capture or cp wrote", loc, n)
	}
}

// verifyAll verifies and extracts every checkpoint committed and not
// removed, two at a time.
func (tt *torture) verifyAll() {
	todo := make(chan *tckpt)
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for c := range todo {
				if err := tt.verifyOne(c); err != nil {
					tt.t.Errorf("%s, committed (its writer exited 0): %v", c.url(), err)
					continue
				}
				tt.mu.Lock()
				tt.count.verified++
				tt.mu.Unlock()
			}
		})
	}
	for _, c := range tt.ckpts {
		if c.state == stCommitted {
			todo <- c
		}
	}
	close(todo)
	wg.Wait()
}

// verifyOne runs verify on c, then extract, and compares what extract
// wrote with what the synthetic CRIU sent.
func (tt *torture) verifyOne(c *tckpt) error {
	if r := tt.run(0, "verify", c.url()); r.code != 0 {
		return fmt.Errorf("verify: %s", r)
	}
	out, err := os.MkdirTemp(tt.tmp, "x")
	if err != nil {
		return err
	}
	defer os.RemoveAll(out)
	if r := tt.run(0, "--images-dir", out, "extract", "--from", c.url()); r.code != 0 {
		return fmt.Errorf("extract: %s", r)
	}
	want := c.spec.files()
	ents, err := os.ReadDir(out)
	if err != nil {
		return err
	}
	var got []string
	for _, e := range ents {
		got = append(got, e.Name())
	}
	if names := slices.Sorted(maps.Keys(want)); !slices.Equal(got, names) {
		return fmt.Errorf("extract wrote %v, the client sent %v", got, names)
	}
	for n, b := range want {
		g, err := os.ReadFile(filepath.Join(out, n))
		if err != nil {
			return err
		}
		if !bytes.Equal(g, b) {
			i := 0
			for i < min(len(g), len(b)) && g[i] == b[i] {
				i++
			}
			return fmt.Errorf("extract: %s: %d bytes, the client sent %d; first difference at %d", n, len(g), len(b), i)
		}
	}
	return nil
}
