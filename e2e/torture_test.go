package e2e

// The torture test (issue 37, item 6). Against a directory and against a
// real MinIO, at once: captures, plain and --dedup, fed by the project's
// own CRIU socket client (the images are the test's, so no CRIU runs),
// some SIGKILLed at a random moment; gc with a random --older-than (0s
// included), some SIGKILLed too; rm; and cp, to a new name in the same
// location or in a second one. MinIO is stopped and started again (same
// port, same data) once in the middle. Then, after a last gc:
//
//   - every checkpoint whose capture exited 0, and every copy cp reported
//     done, unless rm removed it since, verifies and extracts byte for
//     byte as the client sent it;
//   - check reports both locations clean, and ls lists exactly what should
//     be there (nothing rm removed, nothing unknown);
//   - captures, gc, rm and cp that nothing legitimate could break (no
//     SIGKILL, no MinIO restart while they ran, no rm of the checkpoint a
//     cp was reading) exited 0: a gc that takes what a live capture wrote
//     (issue 37, F3, F4, F9) makes that capture fail its commit, and
//     without the commit's proof, its checkpoint fail verify.
//
// TORTURE_SEED (default 37) fixes every choice: what each capture sends,
// whether and when it is killed, gc's ages, what rm and cp pick. Timing
// still differs from run to run, as in restic's and kopia's stress tests;
// a failure prints the seed and a timeline of every run. TORTURE_ITERATIONS
// (default 120) is the number of captures per store, gc, rm and cp running
// for as long as they do: TORTURE_ITERATIONS=1000 for a longer run by hand.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/manifest"
)

func TestTortureDir(t *testing.T) {
	dir := ShortTempDir(t)
	runTorture(t, tortureEnv{kind: "dir", main: filepath.Join(dir, "loc"), second: filepath.Join(dir, "loc2")})
}

func TestTortureS3(t *testing.T) {
	e := startS3(t)
	runTorture(t, tortureEnv{kind: "s3", main: e.url("torture"), second: e.url("torture2"), srv: e})
}

// tortureEnv is where a torture test runs: the location captures write
// to, the second one cp also copies to, and the MinIO server behind them.
type tortureEnv struct {
	kind         string
	main, second string
	srv          *s3Env // nil for a directory
}

// ckptState is what the test knows of a checkpoint name.
type ckptState int

const (
	// stUncertain: its writer was killed or failed: it may be there or
	// not (if it is, check and ls take it as any other).
	stUncertain ckptState = iota
	stCommitted           // its writer exited 0
	stRemoved             // rm exited 0
)

// tckpt is one checkpoint name the test wrote or tried to.
type tckpt struct {
	loc, name string
	spec      imageSpec
	state     ckptState
	copying   int  // cp runs reading it
	raced     bool // rm began while cp read it: that cp may fail
}

func (c *tckpt) url() string { return strings.TrimRight(c.loc, "/") + "/" + c.name }

type tortureCounts struct {
	captures, dedup, killed, failed int
	aged                            int // captures whose lock was set back
	gcRuns, gcKilled, gcEmpty       int
	rm, cp, cpFailed, verified      int
}

type torture struct {
	t    *testing.T
	ctx  context.Context
	env  tortureEnv
	seed uint64
	n    int
	bin  string
	tmp  string
	t0   time.Time

	mu       sync.Mutex
	ckpts    []*tckpt
	pool     []*tckpt     // committed, not picked by rm: what rm and cp pick from
	killed   []int        // PIDs of the runs SIGKILLed
	down     [2]time.Time // MinIO stopped, and started again
	gcs      []gcSpan
	count    tortureCounts
	timeline []string
}

func runTorture(t *testing.T, env tortureEnv) {
	seed := uint64(envInt("TORTURE_SEED", 37))
	n := envInt("TORTURE_ITERATIONS", 120)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute+time.Duration(n)*10*time.Second)
	defer cancel()
	tt := &torture{t: t, ctx: ctx, env: env, seed: seed, n: n, bin: BuildBinary(t, "./cmd/gpucr-stream"), tmp: ShortTempDir(t), t0: time.Now()}
	t.Cleanup(func() {
		if t.Failed() || testing.Verbose() {
			t.Logf("timeline:\n%s", strings.Join(tt.timeline, "\n"))
		}
		if t.Failed() {
			t.Logf("torture %s failed with TORTURE_SEED=%d TORTURE_ITERATIONS=%d (run it again with those)", env.kind, seed, n)
		}
	})
	tt.storm(cancel)
	if ctx.Err() != nil {
		return // a restart failed, or the time ran out
	}
	tt.settle()
	c := tt.count
	t.Logf("torture %s, seed %d: %d captures (%d --dedup, %d killed, %d with their lock set back, %d failed), %d gc runs (%d killed, %d on an empty location), %d rm, %d cp (%d failed), %d checkpoints verified and extracted byte-exact",
		env.kind, seed, c.captures, c.dedup, c.killed, c.aged, c.failed, c.gcRuns, c.gcKilled, c.gcEmpty, c.rm, c.cp, c.cpFailed, c.verified)
}

// storm runs the captures, gc, rm and cp at once, and restarts MinIO
// when half the captures have started.
func (tt *torture) storm(cancel context.CancelFunc) {
	var wg sync.WaitGroup
	stop := make(chan struct{})
	half := make(chan struct{})
	defer func() { // when a restart failed the test, the workers end first
		if tt.t.Failed() {
			cancel()
		}
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}()
	var next atomic.Int64
	var captures sync.WaitGroup
	for range 3 {
		captures.Go(func() {
			for {
				id := int(next.Add(1))
				if id > tt.n || tt.ctx.Err() != nil {
					return
				}
				if id == tt.n/2+1 {
					close(half)
				}
				tt.capture(id)
			}
		})
	}
	wg.Go(func() { tt.gcLoop(stop) })
	wg.Go(func() { tt.rmLoop(stop) })
	wg.Go(func() { tt.cpLoop(stop) })
	if tt.env.srv != nil {
		select {
		case <-half:
			tt.restartMinIO()
		case <-tt.ctx.Done():
		}
	}
	captures.Wait()
	close(stop)
	wg.Wait()
}

// restartMinIO stops the server (SIGKILL) for a moment and starts it again
// on the same port and data.
func (tt *torture) restartMinIO() {
	r := rand.New(rand.NewPCG(tt.seed, 0))
	time.Sleep(time.Duration(r.IntN(500)) * time.Millisecond)
	tt.mu.Lock()
	tt.down[0] = time.Now()
	tt.mu.Unlock()
	tt.logf("minio: stopped")
	tt.env.srv.srv.Stop()
	time.Sleep(time.Duration(500+r.IntN(1500)) * time.Millisecond)
	tt.env.srv.srv.Restart(tt.t)
	tt.mu.Lock()
	tt.down[1] = time.Now()
	tt.mu.Unlock()
	tt.logf("minio: started again")
}

func (tt *torture) logf(format string, args ...any) {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	tt.timeline = append(tt.timeline, fmt.Sprintf("%8.3fs %s", time.Since(tt.t0).Seconds(), fmt.Sprintf(format, args...)))
}

// excused says a run that failed may have: MinIO was down while it ran.
func (tt *torture) excused(r trun) bool {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	if tt.down[0].IsZero() || r.end.Before(tt.down[0]) {
		return false
	}
	return tt.down[1].IsZero() || r.start.Before(tt.down[1])
}

// capture runs capture number id: its choices come from the seed and id
// alone, whichever worker runs it.
func (tt *torture) capture(id int) {
	r := rand.New(rand.NewPCG(tt.seed, uint64(id)))
	c := &tckpt{loc: tt.env.main, name: fmt.Sprintf("c%03d", id)}
	c.spec = imageSpec{base: r.IntN(len(tortureBases)), seed: r.Uint64(), change: r.IntN(40), tag: c.name}
	dedup := r.IntN(2) == 0
	feed := feeding{stallAt: -1, piece: 64 << 10, pause: func() time.Duration { return time.Duration(r.IntN(6)) * time.Millisecond }}
	if r.IntN(2) == 0 { // CRIU busy elsewhere for a while: gc sees the capture's segments age
		feed.stallAt, feed.stall = r.IntN(32), time.Duration(300+r.IntN(1200))*time.Millisecond
	}
	var killAfter time.Duration // within about what a capture takes here
	if r.IntN(4) == 0 {
		killAfter = time.Duration(1+r.IntN(300))*time.Millisecond + feed.stall
	}
	// F4's recipe, where the test can date a lock (a directory): its lock
	// set back 7 h in a stall before its last piece of pages, as if it
	// had stalled that long, and a gc at 0s then, which takes what it
	// wrote so far (its pages all new: segments or packs of them). It
	// may fail (it must, if gc took anything), never exit 0 with a
	// checkpoint gc took from.
	aged := tt.env.kind == "dir" && feed.stall > 0 && killAfter == 0 && r.IntN(5) == 0
	if aged {
		c.spec.change, feed.stallAt = 100, tortureBases[c.spec.base]/feed.piece-1
	}
	tt.mu.Lock()
	tt.ckpts = append(tt.ckpts, c)
	tt.count.captures++
	if dedup {
		tt.count.dedup++
	}
	tt.mu.Unlock()

	images, err := os.MkdirTemp(tt.tmp, "i")
	if err != nil {
		tt.t.Error(err)
		return
	}
	defer os.RemoveAll(images)
	args := []string{"--images-dir", images, "capture", "--to", c.url(), "--segment-size", "1MiB", "--chunk-size", "256KiB"}
	if dedup {
		args = append(args, "--dedup")
	}
	p, err := tt.launch(args...)
	if err != nil {
		tt.t.Error(err)
		return
	}
	p.killAfter(killAfter)
	if aged {
		feed.onStall = func() { tt.ageLock(c, p.cmd.Process.Pid, dedup) }
	}
	pushErr := feed.push(tt.ctx, p, images, c.spec.files())
	res := tt.result(p)
	what := fmt.Sprintf("capture %s (dedup %v, kill after %v, stall %v, lock aged %v)", c.name, dedup, killAfter, feed.stall, aged)
	tt.logf("%s: %s", what, res)
	if res.code > 0 && !aged && !tt.excused(res) {
		tt.t.Errorf("%s exited %d, not killed and with MinIO up (push: %v): %s", what, res.code, pushErr, res.stderr)
	}
	tt.mu.Lock()
	defer tt.mu.Unlock()
	switch {
	case res.code == -1:
		tt.count.killed++
	case res.code == 0:
		c.state = stCommitted
		tt.pool = append(tt.pool, c)
	default:
		tt.count.failed++
	}
}

// feeding is how the synthetic CRIU sends a capture its images: the pages
// in pieces with short pauses, and a stall before one piece.
type feeding struct {
	piece   int
	pause   func() time.Duration
	stallAt int // the piece before which it stalls; -1: none
	stall   time.Duration
	onStall func() // called as the stall begins
}

// push sends files to the capture p listening in images, inventory.img
// last as CRIU does; a failed push aborts the session (the capture must
// then fail).
func (f feeding) push(ctx context.Context, p *tproc, images string, files map[string][]byte) error {
	select {
	case <-p.listening:
	case <-p.exited:
		return fmt.Errorf("capture ended before it listened")
	}
	cl, err := criusock.Dial(ctx, images)
	if err != nil {
		return err
	}
	names := slices.Sorted(maps.Keys(files))
	names = append(slices.DeleteFunc(names, func(n string) bool { return n == "inventory.img" }), "inventory.img")
	for _, n := range names {
		var r io.Reader = bytes.NewReader(files[n])
		if strings.HasPrefix(n, "pages-") {
			r = &trickle{b: files[n], f: f}
		}
		if err := cl.Push(ctx, n, r); err != nil {
			cl.Abort()
			return err
		}
	}
	return cl.Close()
}

// trickle reads b a piece at a time, pausing between pieces.
type trickle struct {
	b   []byte
	off int
	f   feeding
}

func (t *trickle) Read(p []byte) (int, error) {
	if t.off == len(t.b) {
		return 0, io.EOF
	}
	if t.off%t.f.piece == 0 {
		time.Sleep(t.f.pause())
		if t.off/t.f.piece == t.f.stallAt {
			if t.f.onStall != nil {
				t.f.onStall()
			}
			time.Sleep(t.f.stall)
		}
	}
	end := min(len(t.b), t.off-t.off%t.f.piece+t.f.piece, t.off+len(p))
	n := copy(p, t.b[t.off:end])
	t.off += n
	return n, nil
}

// ageLock sets the lock of c's capture, process pid, 7 h back, then runs
// gc at 0s: the capture's lock is stale by the store's clock, and gc takes
// what it wrote so far for a dead capture's.
func (tt *torture) ageLock(c *tckpt, pid int, dedup bool) {
	pattern := filepath.Join(c.loc, c.name, manifest.SegmentPrefix, "*.lock")
	if dedup {
		pattern = filepath.Join(c.loc, chunkstore.LockPrefix, chunkstore.LockCapture+"-*")
	}
	locks, _ := filepath.Glob(pattern)
	aged := ""
	for _, l := range locks {
		var h struct{ PID int }
		b, err := os.ReadFile(l)
		if err == nil && json.Unmarshal(b, &h) == nil && h.PID == pid {
			then := time.Now().Add(-7 * time.Hour)
			if err := os.Chtimes(l, then, then); err == nil {
				aged = l
			}
		}
	}
	res := tt.gc(0, "0s", c.loc)
	tt.logf("capture %s: lock %q set 7h back, then gc --older-than 0s: %s", c.name, aged, res)
	if res.code != 0 {
		tt.t.Errorf("gc --older-than 0s %s: %s", c.loc, res)
	}
	tt.mu.Lock()
	tt.count.aged++
	tt.mu.Unlock()
}

// gcFoundEmpty says gc refused loc for holding no checkpoint: one cp has
// not reached yet, or one rm and gc emptied. It says so as other
// not-found messages do: "gc: LOC: what is missing: not found" (no such
// directory, or nothing of gpucr-stream's there).
func gcFoundEmpty(res trun, loc string) bool {
	msg := strings.TrimSpace(res.stderr)
	return res.code == 4 && strings.Contains(msg, "gc: "+loc+": ") && strings.HasSuffix(msg, ": not found")
}

// gcSpan is when a gc ran on loc (end zero: it runs).
type gcSpan struct {
	loc        string
	start, end time.Time
}

// gc runs gc on loc at age, SIGKILLed after killAfter (0: never), and
// keeps when it ran.
func (tt *torture) gc(killAfter time.Duration, age, loc string) trun {
	tt.mu.Lock()
	i := len(tt.gcs)
	tt.gcs = append(tt.gcs, gcSpan{loc: loc, start: time.Now()})
	tt.count.gcRuns++
	tt.mu.Unlock()
	res := tt.run(killAfter, "gc", "--older-than", age, loc)
	tt.mu.Lock()
	tt.gcs[i].end = res.end
	tt.mu.Unlock()
	return res
}

// gcBeside says a gc ran on loc while r did.
func (tt *torture) gcBeside(loc string, r trun) bool {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	for _, g := range tt.gcs {
		if g.loc == loc && g.start.Before(r.end) && (g.end.IsZero() || g.end.After(r.start)) {
			return true
		}
	}
	return false
}

// tortureAges are gc's --older-than choices.
var tortureAges = []string{"0s", "0s", "0s", "200ms", "1s", "3s", "1h"}

// gcLoop runs gc, at a random age on a random location, some killed,
// until stop.
func (tt *torture) gcLoop(stop <-chan struct{}) {
	for k := 0; ; k++ {
		r := rand.New(rand.NewPCG(tt.seed, 1<<32+uint64(k)))
		if !sleepOrStop(stop, time.Duration(r.IntN(400))*time.Millisecond) {
			return
		}
		loc := tt.env.main
		if r.IntN(4) == 0 {
			loc = tt.env.second
		}
		age := tortureAges[r.IntN(len(tortureAges))]
		var killAfter time.Duration
		if r.IntN(6) == 0 {
			killAfter = time.Duration(1+r.IntN(500)) * time.Millisecond
		}
		res := tt.gc(killAfter, age, loc)
		tt.logf("gc --older-than %s %s (kill after %v): %s", age, loc, killAfter, res)
		empty := gcFoundEmpty(res, loc)
		if res.code > 0 && !empty && !tt.excused(res) {
			tt.t.Errorf("gc --older-than %s %s exited %d, not killed and with MinIO up: %s", age, loc, res.code, res.stderr)
		}
		tt.mu.Lock()
		switch {
		case res.code == -1:
			tt.count.gcKilled++
		case empty:
			tt.count.gcEmpty++
		}
		tt.mu.Unlock()
	}
}

// rmLoop removes committed checkpoints, one at a time, until stop.
func (tt *torture) rmLoop(stop <-chan struct{}) {
	for k := 0; ; k++ {
		r := rand.New(rand.NewPCG(tt.seed, 2<<32+uint64(k)))
		if !sleepOrStop(stop, time.Duration(300+r.IntN(1500))*time.Millisecond) {
			return
		}
		tt.mu.Lock()
		if len(tt.pool) == 0 {
			tt.mu.Unlock()
			continue
		}
		i := r.IntN(len(tt.pool))
		c := tt.pool[i]
		tt.pool = slices.Delete(tt.pool, i, i+1)
		c.raced = c.copying > 0
		tt.mu.Unlock()
		res := tt.run(0, "rm", c.url())
		tt.logf("rm %s (cp reading it: %v): %s", c.url(), c.raced, res)
		if res.code != 0 && !tt.excused(res) {
			tt.t.Errorf("rm %s exited %d with MinIO up: %s", c.url(), res.code, res.stderr)
		}
		tt.mu.Lock()
		c.state = stUncertain
		if res.code == 0 {
			c.state = stRemoved
			tt.count.rm++
		}
		tt.mu.Unlock()
	}
}

// cpLoop copies committed checkpoints to new names, in the same location
// or the second one, until stop.
func (tt *torture) cpLoop(stop <-chan struct{}) {
	for k := 0; ; k++ {
		r := rand.New(rand.NewPCG(tt.seed, 3<<32+uint64(k)))
		if !sleepOrStop(stop, time.Duration(200+r.IntN(1000))*time.Millisecond) {
			return
		}
		tt.mu.Lock()
		if len(tt.pool) == 0 {
			tt.mu.Unlock()
			continue
		}
		src := tt.pool[r.IntN(len(tt.pool))]
		src.copying++
		dst := &tckpt{loc: tt.env.main, name: fmt.Sprintf("%s-cp%d", src.name, k), spec: src.spec}
		if r.IntN(2) == 0 {
			dst.loc = tt.env.second
		}
		tt.ckpts = append(tt.ckpts, dst)
		tt.mu.Unlock()
		res := tt.run(0, "cp", src.url(), dst.url())
		tt.logf("cp %s %s: %s", src.url(), dst.url(), res)
		tt.mu.Lock()
		src.copying--
		raced := src.raced
		if res.code == 0 {
			dst.state = stCommitted
			tt.pool = append(tt.pool, dst)
			tt.count.cp++
		} else {
			tt.count.cpFailed++
		}
		tt.mu.Unlock()
		if res.code != 0 && !raced && !tt.excused(res) && !tt.cpBesideGC(src, dst, res) {
			tt.t.Errorf("cp %s %s exited %d, its source not removed, MinIO up: %s", src.url(), dst.url(), res.code, res.stderr)
		}
	}
}

// cpBesideGC says r, a cp of src to dst that failed, failed as it may
// beside a gc (docs/FORMAT.md, 17.5): a gc of the source's location
// repacked a pack it was to read (not found), or a gc held the
// destination's location, where it would have shared a pack.
func (tt *torture) cpBesideGC(src, dst *tckpt, r trun) bool {
	return (r.code == 4 && strings.Contains(r.stderr, chunkstore.Dir+"packs/") && tt.gcBeside(src.loc, r)) ||
		(strings.Contains(r.stderr, "a gc holds") && tt.gcBeside(dst.loc, r))
}

func sleepOrStop(stop <-chan struct{}, d time.Duration) bool {
	select {
	case <-stop:
		return false
	case <-time.After(d):
		return true
	}
}
