package source

import (
	"context"
	"sync"
)

// inflight bounds the bytes of DATA frames between the stream and their
// place (memory or spill file): payloads being read, queued for a
// decoder, and decoded. Each shard's reader reserves a frame's stored and
// raw bytes before reading its payload and the decoder gives them back
// once the chunk is stored; without it, 16 shards of 64 MiB chunks held
// 930 MB under a 16 MiB --memory-limit.
//
// A reader waits for room only while frames that need no more input
// (read, queued or decoding) hold it: those are freed whatever the peer
// does. Frames still being read may need input that the peer sends only
// once another shard is drained (one writer interleaves the shards), so
// waiting for them could deadlock; a frame that finds no room and nothing
// to wait for is read and decoded into buffers of an unlinked spill file
// instead (newFileBuf), which the kernel can write back: the process's own
// memory for frames stays within the budget whatever the shards and chunk
// sizes (16 shards of 64 MiB chunks once held 930 MB under 16 MiB).
type inflight struct {
	mu      sync.Mutex
	used    int64
	reading int64 // of used, held by frames still being read
	max     int64
	peak    int64         // the most ever held (for tests)
	spilled int64         // frames sent to spill files (for tests)
	freed   chan struct{} // closed and replaced on every release
}

func newInflight(max int64) *inflight {
	return &inflight{max: max, freed: make(chan struct{})}
}

// acquire reserves n bytes for a frame about to be read: at once where
// they fit, else once enough is released. Where they do not fit and only
// frames still being read hold the room, it reserves nothing and answers
// false: the frame goes to a spill file.
func (b *inflight) acquire(ctx context.Context, n int64) (bool, error) {
	for {
		b.mu.Lock()
		if b.used+n <= b.max {
			b.used += n
			b.reading += n
			b.peak = max(b.peak, b.used)
			b.mu.Unlock()
			return true, nil
		}
		if b.used == b.reading {
			b.spilled++
			b.mu.Unlock()
			return false, nil
		}
		ch := b.freed
		b.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return false, context.Cause(ctx)
		}
	}
}

// read marks n acquired bytes as read: their frame needs no more input.
func (b *inflight) read(n int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reading -= n
}

// release gives back n bytes of a frame that was read.
func (b *inflight) release(n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.used -= n
	close(b.freed)
	b.freed = make(chan struct{})
}
