package checkpoint

// Pre-copy (issue 23): before the stop-and-copy dump, migrate sends what
// the process holds while it runs, in rounds, each a `criu dump
// --leave-running --stream` whose chunks (cut by content, named by their
// BLAKE3 id, as the chunk store's) go to the receiver's chunk cache unless
// it holds them already. Neither kernel we run on tracks dirty pages for
// CRIU, and CRIU's pre-dumps, which would use it, do not stream: content
// ids find what changed instead, at the cost of CRIU freezing the process
// for each round's dump (not for the transfer of what it held already,
// which is neither encoded nor sent). Rounds go on while each sends at
// least Shrink less than the one before, up to Rounds; then the final dump
// sends the chunks the receiver holds by reference (wire.RecRef).
//
// A tree of CUDA processes cannot be dumped by CRIU while it runs on the
// GPU. When all of them take the fast path, a round instead has their
// libraries copy their device memory out while they run (vram.Peek: no
// park, no driver step), which is most of what they hold; their host
// memory goes in the final dump only. The final copy out, parked, then
// finds the unchanged device memory at the receiver by content id.
//
// Never worse on failure: a round leaves the process running whatever
// happens (CRIU resumes it), a failed round fails the migration with the
// process still here, and the receiver frees its cache when the stream is
// read or fails.

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"time"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/transport/tcp"
)

// PrecopyOptions say whether and how long migrate pre-copies.
type PrecopyOptions struct {
	// Off keeps the plain stop-and-copy.
	Off bool
	// Rounds caps the rounds (default 5).
	Rounds int
	// Shrink is how much less a round must send than the one before for
	// another to follow (default 0.25: a quarter less).
	Shrink float64
}

// PrecopyResult says what pre-copy did.
type PrecopyResult struct {
	// Method: "criu dump --leave-running" or "off"; Why says why that one.
	Method string         `json:"method"`
	Why    string         `json:"why"`
	Rounds []PrecopyRound `json:"rounds,omitempty"`
	// FinalWireBytes went over the link during the final dump (stream,
	// records, TLS); FinalRefBytes are the stored bytes it sent by
	// reference instead.
	FinalWireBytes int64 `json:"final_wire_bytes"`
	FinalRefBytes  int64 `json:"final_ref_bytes"`
}

// PrecopyRound is one round while the process ran.
type PrecopyRound struct {
	Secs      float64 `json:"seconds"`
	RawBytes  int64   `json:"raw_bytes"`
	NewChunks int64   `json:"new_chunks"`
	SentBytes int64   `json:"sent_bytes"`
}

func (o PrecopyOptions) withDefaults() PrecopyOptions {
	if o.Rounds <= 0 {
		o.Rounds = 5
	}
	if o.Shrink <= 0 || o.Shrink >= 1 {
		o.Shrink = 0.25
	}
	return o
}

// precopyOff says why migrate does not pre-copy ("" when it does): its
// options, the stream's format, what the receiver keeps, and the CUDA
// processes of the tree (none: nil).
func precopyOff(o PrecopyOptions, f pipeline.Format, info tcp.ReceiverInfo, cudaPIDs []int) string {
	switch {
	case o.Off:
		return "--precopy off"
	case !info.ChunkCache:
		return "the receiver keeps no chunk cache (an older gpucr-stream)"
	case f.Seal != nil:
		return "the stream is encrypted (--key): its chunks are sealed where they are placed"
	case !f.ChunkHashes:
		return "the stream has no chunk hashes, which are the chunks' content ids"
	case len(cudaPIDs) > 0 && !info.Restores:
		return "CUDA processes and a receiver that does not restore: the fast path, which pre-copies device memory, is not taken"
	case len(cudaPIDs) > 1:
		// Seen on 2xH200: the first round of an NCCL pair (all_reduce
		// back to back) never ended. Until it is understood, such trees
		// are not copied while they run.
		return "a tree of several CUDA processes (NCCL ranks): their device memory is not copied while they run (a pre-copy round of an NCCL pair hung; docs/MIGRATION.md)"
	}
	return ""
}

// precopy runs the rounds; the process runs on, here, whatever happens.
func (m *migration) precopy(ctx context.Context) error {
	res := &PrecopyResult{Method: "off"}
	m.res.Precopy = res
	if res.Why = precopyOff(m.o.Precopy, m.out.Format(), m.info, m.cc.PIDs()); res.Why != "" {
		return nil
	}
	o := m.o.Precopy.withDefaults()
	round := m.precopyRound
	res.Method = "criu dump --leave-running"
	res.Why = "CRIU's pre-dumps cannot stream; content ids find what changed"
	if m.cc != nil {
		round = m.precopyVRAMRound
		res.Method = "device memory through the library while the program runs; host memory in the final dump only"
		res.Why = "CRIU cannot dump a CUDA process that runs on the GPU; content ids find the device memory that changed"
	} else if exec.CommandContext(ctx, m.criu, "check", "--feature", "mem_dirty_track").Run() != nil {
		res.Why = "the kernel does not track dirty pages for CRIU (criu check --feature mem_dirty_track fails), and CRIU's pre-dumps cannot stream; content ids find what changed"
	}
	stop := m.keepAlive()
	defer stop()
	var prev int64
	for i := range o.Rounds {
		r, err := round(ctx)
		if nr := (noRound{}); errors.As(err, &nr) {
			res.Method, res.Why = "off", nr.why
			return nil
		}
		if err != nil {
			m.out.Cancel("a pre-copy round failed on the sender; the process keeps running there")
			m.dropKeep()
			return fmt.Errorf("migrate %d: pre-copy round %d: %w; the process was not migrated and keeps running here", m.o.PID, i+1, err)
		}
		res.Rounds = append(res.Rounds, r)
		m.o.Hooks.log(fmt.Sprintf("migrate: pre-copy round %d: %.1f MiB dumped, %d new chunks, %.1f MiB sent in %.2fs",
			i+1, float64(r.RawBytes)/(1<<20), r.NewChunks, float64(r.SentBytes)/(1<<20), r.Secs))
		if i > 0 && float64(r.SentBytes) > (1-o.Shrink)*float64(prev) || r.SentBytes == 0 {
			break
		}
		prev = r.SentBytes
	}
	// The final dump cuts by content too, and sends what the receiver
	// holds by reference; without a local copy it does not even encode it.
	if tee, ok := m.output.(streamer.TeeOutput); ok {
		tee.Primary = tcp.RefOutput{Output: m.out}
		m.output = tee
	} else {
		m.output = tcp.RefOutput{Output: m.out, Skip: true}
	}
	return nil
}

// keepAlive tells the receiver the link lives every third of its
// timeout while rounds run, until stop.
func (m *migration) keepAlive() (stop func()) {
	every := m.o.TCP.Timeout / 3
	if every <= 0 {
		every = tcp.DefaultTCPTimeout / 3
	}
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-t.C:
				m.out.KeepAlive()
			}
		}
	}()
	return func() {
		close(quit)
		<-done
	}
}

// aheadCapture is a round's capture: its chunks go ahead of the stream
// into the receiver's cache, and a failed transfer aborts it.
func (m *migration) aheadCapture(ctx context.Context) (*streamer.Capture, *tcp.AheadOutput, error) {
	out := &tcp.AheadOutput{Out: m.out}
	c, err := streamer.NewCapture(ctx, out, m.o.Stream)
	if err != nil {
		return nil, nil, err
	}
	m.out.OnFailure(func(err error) { c.Abort(err) })
	return c, out, nil
}

// noRound: a round of device memory cannot be taken, and why.
type noRound struct{ why string }

func (e noRound) Error() string { return "no pre-copy round: " + e.why }

// precopyVRAMRound copies the device memory of the running CUDA processes
// once into the receiver's cache (gpuckpt.PrecopyVRAM).
func (m *migration) precopyVRAMRound(ctx context.Context) (PrecopyRound, error) {
	start := time.Now()
	c, out, err := m.aheadCapture(ctx)
	if err != nil {
		return PrecopyRound{}, err
	}
	n, why, err := m.cc.PrecopyVRAM(ctx, m.o.FastPath, c, m.o.Hooks.log)
	if err == nil && why != "" {
		err = noRound{why}
	}
	if err == nil {
		_, err = c.Close(ctx, manifest.Manifest{Tool: m.o.Tool})
	}
	if err != nil {
		c.Abort(err)
		return PrecopyRound{}, err
	}
	return PrecopyRound{Secs: time.Since(start).Seconds(), RawBytes: n, NewChunks: out.Chunks, SentBytes: out.Sent}, nil
}

// precopyRound dumps the running process once into the receiver's cache.
func (m *migration) precopyRound(ctx context.Context) (PrecopyRound, error) {
	start := time.Now()
	c, out, err := m.aheadCapture(ctx)
	if err != nil {
		return PrecopyRound{}, err
	}
	meta := manifest.Manifest{Tool: m.o.Tool, Process: processOf(m.o.PID)}
	man, _, err := dump(ctx, c, meta, criusock.DumpOptions{
		CRIU: m.criu, PID: m.o.PID, WorkDir: m.o.CRIU.WorkDir, LeaveRunning: true, ExtraArgs: m.o.CRIU.Args,
		Hooks: criusock.Hooks{Log: m.o.Hooks.Log}, Carry: m.o.CRIU.Carry, Launcher: m.o.CRIU.Launcher,
	}, m.cc)
	if err != nil {
		return PrecopyRound{}, err
	}
	return PrecopyRound{Secs: time.Since(start).Seconds(), RawBytes: man.Stats.RawBytes, NewChunks: out.Chunks, SentBytes: out.Sent}, nil
}
