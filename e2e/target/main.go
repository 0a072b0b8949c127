// Command target is the process that the end-to-end tests checkpoint and
// restore. It holds memory shaped like an inference process (model weights,
// zero pages, incompressible data, text), a child process fed through a pipe,
// an open log file and a running counter, and on SIGUSR1 writes a proof that
// all of them survived: the memory checksum still matches, the counter and
// the child keep advancing. On SIGUSR2 it rewrites a tenth of its memory
// (one run of pages, with new random bytes), takes the new checksum as the
// expected one, and writes it to DIR/rewritten: the dedup tests' change.
//
// With --rewrite-pct P it rewrites P% of its pages every second while it
// runs (a window that moves through memory, a tenth of it every 100 ms, as
// a ring buffer being written): the live-migration benchmark's load. Its
// proof then checks every page against a CRC-32C table kept beside the
// memory (and migrated with it), and reports the first checksum as both
// expected and actual when every page matches.
//
// It stays within what CRIU dumps without extra flags: no sockets, no tty,
// started by the harness in its own session with stdin on /dev/null.
// --tcp-pair (a connection, dumped with --tcp-established) and --hugetlb
// (huge pages, reserved by the test) add what extras.go says.
package main

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	"log"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

const (
	tick     = 10 * time.Millisecond
	pageSize = 4096

	// Messages on the parent->child pipe: a type byte and 8 bytes of payload.
	// 9 bytes is below PIPE_BUF, so each write is atomic.
	msgValue = 'v' // payload: the parent's counter
	msgQuery = 'q' // payload: a nonce the child echoes in its reply
	msgLen   = 9

	// Reply on the child->parent pipe: nonce, last value, values received, pid.
	replyLen = 32

	childFlag = "--child"
)

// Proof is what the parent writes to DIR/proof.json; e2e.Proof mirrors it.
type Proof struct {
	PID              int    `json:"pid"`
	Counter          uint64 `json:"counter"`
	ChecksumExpected string `json:"checksum_expected"`
	ChecksumActual   string `json:"checksum_actual"`
	ChildPID         int    `json:"child_pid"`
	ChildAlive       bool   `json:"child_alive"`
	ChildLastValue   uint64 `json:"child_last_value"`
	ChildReceived    uint64 `json:"child_received"`
	Seq              uint64 `json:"seq"`
	MemoryBytes      int    `json:"memory_bytes"`
	// HugeTLBBytes of MemoryBytes are huge pages (--hugetlb); TCPBytes
	// went through the --tcp-pair connection for this proof.
	HugeTLBBytes int    `json:"hugetlb_bytes,omitempty"`
	TCPBytes     int64  `json:"tcp_bytes,omitempty"`
	Error        string `json:"error,omitempty"`
	Time         string `json:"time"`
}

func main() {
	// Checked before flag parsing so that --child stays out of the usage text.
	if len(os.Args) > 1 && os.Args[1] == childFlag {
		if err := runChild(); err != nil {
			log.Fatalf("target child: %v", err)
		}
		return
	}
	// Install the handler before anything else: SIGUSR1's default action
	// would kill the process if a proof is requested early.
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	usr2 := make(chan os.Signal, 1)
	signal.Notify(usr2, syscall.SIGUSR2)

	dir := flag.String("dir", "", "work directory (ready, proof.json, target.log)")
	mb := flag.Int("mb", 256, "approximate memory to fill, in MiB")
	mix := flag.String("mix", "model", "memory content: model (weights-like, zeros, random, text) or thirds (random, zeros, text: the capture benchmark's)")
	rewritePct := flag.Float64("rewrite-pct", 0, "rewrite this percentage of the pages every second (0: never)")
	hugeMB := flag.Int("hugetlb", 0, "also map this many MiB of huge pages (MAP_HUGETLB), part of the checked memory")
	tcpPair := flag.Bool("tcp-pair", false, "hold a TCP connection over loopback with bytes in flight both ways, checked by every proof")
	listenTimeWait := flag.Bool("listen-timewait", false, "hold a TCP listener without SO_REUSEADDR whose one accepted connection closed first (a TIME_WAIT socket on its port, as NCCL's bootstrap leaves); its port goes to DIR/listen-port")
	flag.Parse()
	if *dir == "" {
		log.Fatal("target: --dir is required")
	}
	if *mb < 1 {
		log.Fatal("target: --mb must be at least 1")
	}
	if *mix != "model" && *mix != "thirds" {
		log.Fatalf("target: --mix %q: want model or thirds", *mix)
	}
	if *rewritePct < 0 || *rewritePct > 100 {
		log.Fatal("target: --rewrite-pct must be 0..100")
	}
	if *listenTimeWait {
		port, err := listenWithTimeWait()
		if err != nil {
			log.Fatalf("target: --listen-timewait: %v", err)
		}
		if err := writeAtomic(filepath.Join(*dir, "listen-port"), []byte(strconv.Itoa(port)+"\n")); err != nil {
			log.Fatalf("target: %v", err)
		}
	}
	var extra extras
	if *hugeMB > 0 {
		var err error
		if extra.huge, err = hugeRegion(*hugeMB); err != nil {
			log.Fatalf("target: --hugetlb: %v", err)
		}
	}
	if *tcpPair {
		var err error
		if extra.tcp, err = newTCPPair(); err != nil {
			log.Fatalf("target: --tcp-pair: %v", err)
		}
	}
	if err := runParent(*dir, *mb, *mix, *rewritePct, extra, usr1, usr2); err != nil {
		log.Fatalf("target: %v", err)
	}
}

type parent struct {
	dir      string
	regions  [][]byte
	expected string
	counter  atomic.Uint64
	logFile  *os.File

	childPID  int
	childDead atomic.Bool
	toChild   *os.File
	fromChild *os.File
	writeMu   sync.Mutex
	nonce     uint64
	seq       uint64
	rewrites  uint64

	// With --rewrite-pct: the rewriter holds pageMu while it writes;
	// pageSums are the CRC-32C of every page, as written.
	pageMu   sync.Mutex
	pageSums []uint32

	extras
}

// extras are what the target holds on request (extras.go).
type extras struct {
	huge []byte
	tcp  *tcpPair
}

func runParent(dir string, mb int, mix string, rewritePct float64, extra extras, usr1, usr2 <-chan os.Signal) error {
	p := &parent{dir: dir, extras: extra}
	var err error
	p.logFile, err = os.OpenFile(filepath.Join(dir, "target.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open log: %w", err)
	}
	start := time.Now()
	if mix == "thirds" {
		p.regions = fillThirds(mb << 20)
	} else {
		p.regions = fill(mb << 20)
	}
	if p.huge != nil {
		p.regions = append(p.regions, p.huge)
	}
	p.expected = checksum(p.regions)
	p.logf("filled %d MiB in %v, sha256 %s", mb, time.Since(start).Round(time.Millisecond), p.expected)

	if err := p.startChild(); err != nil {
		return err
	}
	go p.count()
	go p.feedChild()
	if rewritePct > 0 {
		p.pageSums = pageSums(p.regions)
		go p.rewriteLoop(rewritePct)
	}

	if err := writeAtomic(filepath.Join(dir, "ready"), []byte(strconv.Itoa(os.Getpid())+"\n")); err != nil {
		return fmt.Errorf("write ready: %w", err)
	}
	p.logf("ready pid %d child %d", os.Getpid(), p.childPID)

	// Proofs are made one at a time on this goroutine, so seq and the child
	// query nonce need no locking; the counter keeps running meanwhile.
	heartbeat := time.NewTicker(time.Second)
	defer heartbeat.Stop()
	for {
		select {
		case <-usr1:
			if err := p.prove(); err != nil {
				p.logf("proof failed: %v", err)
			}
		case <-usr2:
			if err := p.rewrite(); err != nil {
				p.logf("rewrite failed: %v", err)
			}
		case <-heartbeat.C:
			p.logf("counter %d", p.counter.Load())
		}
	}
}

// rewrite overwrites a tenth of the memory, one run of whole pages from a
// fifth of the way in (in the bf16 weights of the model mix), with new
// values of the same kind: a model whose tensors were updated.
func (p *parent) rewrite() error {
	total := 0
	for _, r := range p.regions {
		total += len(r)
	}
	n := total / 10 / pageSize * pageSize
	skip := total / 5 / pageSize * pageSize
	p.rewrites++
	rnd := rand.New(rand.NewPCG(p.rewrites, 0x7265))
	for _, r := range p.regions {
		if skip >= len(r) {
			skip -= len(r)
			continue
		}
		for i := skip; i+2 <= len(r) && n > 0; i, n = i+2, n-2 {
			w := float32(rnd.NormFloat64() * 0.02)
			binary.LittleEndian.PutUint16(r[i:], uint16(math.Float32bits(w)>>16))
		}
		skip = 0
		if n <= 0 {
			break
		}
	}
	p.expected = checksum(p.regions)
	if p.pageSums != nil {
		p.pageMu.Lock()
		p.pageSums = pageSums(p.regions)
		p.pageMu.Unlock()
	}
	p.logf("rewrote a tenth of memory, sha256 %s", p.expected)
	return writeAtomic(filepath.Join(p.dir, "rewritten"), []byte(p.expected+"\n"))
}

// logf appends to target.log, giving the process an open regular file that
// changes while it runs.
func (p *parent) logf(format string, args ...any) {
	fmt.Fprintf(p.logFile, "%s %s\n", time.Now().Format(time.RFC3339Nano), fmt.Sprintf(format, args...))
}

func (p *parent) count() {
	t := time.NewTicker(tick)
	defer t.Stop()
	for range t.C {
		p.counter.Add(1)
	}
}

func (p *parent) startChild() error {
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find own executable: %w", err)
	}
	toR, toW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("pipe to child: %w", err)
	}
	fromR, fromW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("pipe from child: %w", err)
	}
	cmd := exec.Command(self, childFlag)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.ExtraFiles = []*os.File{toR, fromW} // fds 3 and 4 in the child
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start child: %w", err)
	}
	toR.Close()
	fromW.Close()
	p.childPID = cmd.Process.Pid
	p.toChild, p.fromChild = toW, fromR
	// Release drops the pidfd that os/exec holds for the child. CRIU 4.1
	// dumps pidfds, older CRIUs refuse them; plain wait4 needs no fd at all.
	if err := cmd.Process.Release(); err != nil {
		return fmt.Errorf("release child handle: %w", err)
	}
	go func() {
		var ws syscall.WaitStatus
		for {
			_, err := syscall.Wait4(p.childPID, &ws, 0, nil)
			if errors.Is(err, syscall.EINTR) {
				continue
			}
			break
		}
		p.childDead.Store(true)
		p.logf("child %d exited: %v", p.childPID, ws)
	}()
	return nil
}

func (p *parent) send(kind byte, v uint64) error {
	var m [msgLen]byte
	m[0] = kind
	binary.LittleEndian.PutUint64(m[1:], v)
	p.writeMu.Lock()
	defer p.writeMu.Unlock()
	_, err := p.toChild.Write(m[:])
	return err
}

// feedChild runs apart from count so that a stalled child (full pipe) cannot
// stop the counter.
func (p *parent) feedChild() {
	t := time.NewTicker(tick)
	defer t.Stop()
	for range t.C {
		if err := p.send(msgValue, p.counter.Load()); err != nil {
			p.logf("feed child: %v", err)
			return
		}
	}
}

type childStatus struct {
	pid      int
	last     uint64
	received uint64
}

// queryChild asks the child for the last value it received. Replies carry
// the query's nonce, so a late answer to an earlier, timed-out query is
// skipped instead of being taken for this one.
func (p *parent) queryChild(timeout time.Duration) (childStatus, error) {
	p.nonce++
	if err := p.send(msgQuery, p.nonce); err != nil {
		return childStatus{}, fmt.Errorf("send query: %w", err)
	}
	if err := p.fromChild.SetReadDeadline(time.Now().Add(timeout)); err != nil {
		return childStatus{}, fmt.Errorf("set deadline: %w", err)
	}
	var r [replyLen]byte
	for {
		if _, err := io.ReadFull(p.fromChild, r[:]); err != nil {
			return childStatus{}, fmt.Errorf("read reply: %w", err)
		}
		if binary.LittleEndian.Uint64(r[0:]) == p.nonce {
			return childStatus{
				last:     binary.LittleEndian.Uint64(r[8:]),
				received: binary.LittleEndian.Uint64(r[16:]),
				pid:      int(binary.LittleEndian.Uint64(r[24:])),
			}, nil
		}
	}
}

func (p *parent) prove() error {
	p.seq++
	pr := Proof{
		PID:              os.Getpid(),
		ChecksumExpected: p.expected,
		ChildPID:         p.childPID,
		Seq:              p.seq,
		MemoryBytes:      totalLen(p.regions),
	}
	var errs []string
	st, err := p.queryChild(2 * time.Second)
	if err != nil {
		errs = append(errs, fmt.Sprintf("query child: %v", err))
	} else {
		pr.ChildLastValue, pr.ChildReceived = st.last, st.received
		if st.pid != p.childPID {
			errs = append(errs, fmt.Sprintf("child reports pid %d, expected %d", st.pid, p.childPID))
		}
	}
	pr.ChildAlive = err == nil && !p.childDead.Load() && processAlive(p.childPID)
	pr.HugeTLBBytes = len(p.huge)
	if p.tcp != nil {
		if pr.TCPBytes, err = p.tcp.check(); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if p.pageSums != nil {
		pr.ChecksumActual = p.checkPages()
	} else {
		pr.ChecksumActual = checksum(p.regions)
	}
	pr.Counter = p.counter.Load()
	pr.Time = time.Now().Format(time.RFC3339Nano)
	pr.Error = strings.Join(errs, "; ")

	b, err := json.MarshalIndent(pr, "", "  ")
	if err != nil {
		return fmt.Errorf("marshal proof: %w", err)
	}
	if err := writeAtomic(filepath.Join(p.dir, "proof.json"), append(b, '\n')); err != nil {
		return fmt.Errorf("write proof: %w", err)
	}
	p.logf("proof seq %d counter %d child %d", pr.Seq, pr.Counter, pr.ChildLastValue)
	return nil
}

// processAlive is false for a zombie as well as for a missing pid.
func processAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		return false
	}
	state := s[i+2]
	return state != 'Z' && state != 'X'
}

func runChild() error {
	in := os.NewFile(3, "from-parent")
	out := os.NewFile(4, "to-parent")
	if in == nil || out == nil {
		return errors.New("fds 3 and 4 must be the parent's pipes")
	}
	var last, received uint64
	var m [msgLen]byte
	for {
		if _, err := io.ReadFull(in, m[:]); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				return nil // parent gone
			}
			return fmt.Errorf("read from parent: %w", err)
		}
		v := binary.LittleEndian.Uint64(m[1:])
		switch m[0] {
		case msgValue:
			last = v
			received++
		case msgQuery:
			var r [replyLen]byte
			binary.LittleEndian.PutUint64(r[0:], v)
			binary.LittleEndian.PutUint64(r[8:], last)
			binary.LittleEndian.PutUint64(r[16:], received)
			binary.LittleEndian.PutUint64(r[24:], uint64(os.Getpid()))
			if _, err := out.Write(r[:]); err != nil {
				return fmt.Errorf("reply to parent: %w", err)
			}
		default:
			return fmt.Errorf("unknown message type %q", m[0])
		}
	}
}

// fill allocates about total bytes in regions of different character, so
// that codecs see the mix a real checkpoint has: float weights (40%), zero
// pages that are touched and so really dumped (15%), random bytes (25%) and
// text (20%). A fixed seed makes the content identical on every run.
func fill(total int) [][]byte {
	r := rand.New(rand.NewPCG(0x6770, 0x6372))
	part := func(pct int) int {
		n := total / 100 * pct
		return max(pageSize, n/pageSize*pageSize)
	}
	weights := part(40)
	bf16 := make([]byte, weights/4*3/pageSize*pageSize)
	f32 := make([]byte, weights-len(bf16))
	zeros := make([]byte, part(15))
	random := make([]byte, part(25))
	text := make([]byte, part(20))

	// bf16 is the top half of a float32; weights of a trained layer are
	// roughly normal with a small standard deviation.
	for i := 0; i+2 <= len(bf16); i += 2 {
		w := float32(r.NormFloat64() * 0.02)
		binary.LittleEndian.PutUint16(bf16[i:], uint16(math.Float32bits(w)>>16))
	}
	for i := 0; i+4 <= len(f32); i += 4 {
		w := float32(r.NormFloat64() * 0.05)
		binary.LittleEndian.PutUint32(f32[i:], math.Float32bits(w))
	}
	// make() returns untouched memory that the kernel backs lazily (CRIU
	// would skip it); writing each page makes it resident.
	for i := 0; i < len(zeros); i += pageSize {
		zeros[i] = 0
	}
	for i := 0; i+8 <= len(random); i += 8 {
		binary.LittleEndian.PutUint64(random[i:], r.Uint64())
	}
	fillText(text, r)
	return [][]byte{bf16, f32, zeros, random, text}
}

// fillThirds is a third random bytes, a third touched zero pages and a
// third text: what the capture CPU figures of docs/bench-log/2026-11.md use.
func fillThirds(total int) [][]byte {
	r := rand.New(rand.NewPCG(0x6770, 0x6372))
	third := max(pageSize, total/3/pageSize*pageSize)
	random, zeros, text := make([]byte, third), make([]byte, third), make([]byte, third)
	for i := 0; i+8 <= len(random); i += 8 {
		binary.LittleEndian.PutUint64(random[i:], r.Uint64())
	}
	for i := 0; i < len(zeros); i += pageSize {
		zeros[i] = 0
	}
	fillText(text, r)
	return [][]byte{random, zeros, text}
}

var words = strings.Fields(`the model layer attention weight token batch
	request tensor device memory restore checkpoint stream process kernel cache
	prompt output input hidden state value key query head embedding gradient
	optimizer step epoch loss server client worker queue latency throughput`)

// fillText writes in place: building a string first would double the
// memory the process touches.
func fillText(b []byte, r *rand.Rand) {
	pos := 0
	put := func(s string) { pos += copy(b[pos:], s) }
	for pos < len(b) {
		for n := 3 + r.IntN(12); n > 0; n-- {
			put(words[r.IntN(len(words))])
			if r.IntN(4) == 0 {
				put(" " + strconv.Itoa(r.IntN(100000)))
			}
			put(" ")
		}
		put(".\n")
	}
}

func checksum(regions [][]byte) string {
	h := sha256.New()
	for _, b := range regions {
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func totalLen(regions [][]byte) int {
	n := 0
	for _, b := range regions {
		n += len(b)
	}
	return n
}

// writeAtomic replaces path in one step, so a reader never sees half a file.
func writeAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// pageSums are the CRC-32C of every page of the regions, in order.
func pageSums(regions [][]byte) []uint32 {
	var sums []uint32
	for _, r := range regions {
		for i := 0; i+pageSize <= len(r); i += pageSize {
			sums = append(sums, crc32.Checksum(r[i:i+pageSize], castagnoli))
		}
	}
	return sums
}

// rewriteLoop rewrites pct% of the pages a second, every 100 ms the next
// window of pct/10 % of them with new random bytes, wrapping around.
func (p *parent) rewriteLoop(pct float64) {
	n := max(1, int(float64(len(p.pageSums))*pct/1000))
	rnd := rand.New(rand.NewPCG(uint64(os.Getpid()), 0x7077))
	next := 0
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for range t.C {
		p.pageMu.Lock()
		for range n {
			r, off := p.page(next)
			for i := 0; i < pageSize; i += 8 {
				binary.LittleEndian.PutUint64(r[off+i:], rnd.Uint64())
			}
			p.pageSums[next] = crc32.Checksum(r[off:off+pageSize], castagnoli)
			next = (next + 1) % len(p.pageSums)
		}
		p.pageMu.Unlock()
	}
}

// page is the region and offset of whole page k.
func (p *parent) page(k int) ([]byte, int) {
	for _, r := range p.regions {
		if n := len(r) / pageSize; k >= n {
			k -= n
			continue
		}
		return r, k * pageSize
	}
	panic("page out of range")
}

// checkPages compares every page with its CRC-32C: the expected checksum
// when all match (the memory is what the rewriter wrote), else why not.
func (p *parent) checkPages() string {
	p.pageMu.Lock()
	defer p.pageMu.Unlock()
	now := pageSums(p.regions)
	bad, first := 0, -1
	for i := range now {
		if now[i] != p.pageSums[i] {
			if first < 0 {
				first = i
			}
			bad++
		}
	}
	if bad > 0 {
		return fmt.Sprintf("%d of %d pages differ from what was written (the first: page %d)", bad, len(now), first)
	}
	return p.expected
}

// listenWithTimeWait makes a listener on 127.0.0.1 without SO_REUSEADDR
// (Go's own listeners set it), kept open for the life of the process, and
// leaves a TIME_WAIT socket on its port: one connection to it, whose
// accepted side closes first.
func listenWithTimeWait() (int, error) {
	l, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		return 0, err
	}
	lo := [4]byte{127, 0, 0, 1}
	if err := syscall.Bind(l, &syscall.SockaddrInet4{Addr: lo}); err != nil {
		return 0, err
	}
	if err := syscall.Listen(l, 4); err != nil {
		return 0, err
	}
	sa, err := syscall.Getsockname(l)
	if err != nil {
		return 0, err
	}
	port := sa.(*syscall.SockaddrInet4).Port
	c, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		return 0, err
	}
	defer syscall.Close(c)
	if err := syscall.Connect(c, &syscall.SockaddrInet4{Addr: lo, Port: port}); err != nil {
		return 0, err
	}
	a, _, err := syscall.Accept(l)
	if err != nil {
		return 0, err
	}
	syscall.Close(a)
	var b [1]byte
	if _, err := syscall.Read(c, b[:]); err != nil {
		return 0, err
	}
	return port, nil
}
