package main

import (
	"fmt"
	"os"
	"sync"
	"time"

	pb "github.com/cheggaaa/pb/v3"
	"github.com/gpucr/gpucr-stream/checkpoint"
	"golang.org/x/sys/unix"
)

// bar draws a progress bar on a terminal stderr from live counters; on
// anything else it does nothing, so logs and pipes stay clean.
type bar struct {
	pb     *pb.ProgressBar
	update func()
	stop   chan struct{}
	wg     sync.WaitGroup
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

func startProgress(cfg *config, p checkpoint.Progress) *bar {
	b := &bar{}
	what, c, total := p.What, p.Counters, p.Total
	errFile, ok := cfg.stderr.(*os.File)
	if c == nil || cfg.noProgress || cfg.jsonOut || !ok || !isTerminal(errFile) {
		return b
	}
	tmpl := `{{string . "what"}} {{counters . }} {{speed . }} {{string . "ratio"}}{{string . "extra"}}`
	if total > 0 {
		tmpl = `{{string . "what"}} {{bar . }} {{percent . }} {{speed . }}{{string . "extra"}}`
	}
	uploaded := p.Uploaded
	b.pb = pb.New64(total).SetTemplateString(tmpl).Set(pb.Bytes, true).SetWriter(errFile).Set("what", what)
	b.pb.Start()
	b.update = func() {
		raw := c.RawBytes.Load()
		b.pb.SetCurrent(raw)
		if st := c.StoredBytes.Load(); st > 0 && total == 0 {
			b.pb.Set("ratio", fmt.Sprintf("%.2fx", float64(raw)/float64(st)))
		}
		if uploaded != nil {
			// Bytes the object store acknowledged: they trail the
			// captured bytes by the parts in flight.
			b.pb.Set("extra", " uploaded "+humanBytes(uploaded()))
		}
	}
	b.stop = make(chan struct{})
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-b.stop:
				return
			case <-t.C:
				b.update()
			}
		}
	}()
	return b
}

// finish stops the bar; it may be called more than once.
func (b *bar) finish() {
	if b.pb == nil {
		return
	}
	close(b.stop)
	b.wg.Wait()
	b.update() // the final totals
	b.pb.Finish()
	b.pb = nil
}
