package location

import (
	"context"

	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/transport/tcp"
)

// tcpLoc is tcp://HOST:PORT: a receiver to send to, or an address to
// listen on for one sender.
type tcpLoc struct{ unsupported }

func (l tcpLoc) settings(c *Config) (TCPConfig, error) {
	if c.TCP == nil {
		return TCPConfig{}, nil
	}
	return c.TCP()
}

// output is --to tcp://HOST:PORT for capture and checkpoint: they cannot
// tell when the source process is gone, so the receiver is told to go
// ahead as soon as it has acknowledged the stream (migrate does better).
func (l tcpLoc) output(ctx context.Context, c *Config) (*Output, error) {
	t, err := l.settings(c)
	if err != nil {
		return nil, err
	}
	format, err := c.Options.NewFormat()
	if err != nil {
		return nil, err
	}
	out, err := tcp.Dial(ctx, l.loc.Path, tcp.SendOptions{Auth: t.Auth, Timeout: t.Timeout, Streams: t.Streams, AutoCommit: true, Format: format})
	if err != nil {
		return nil, err
	}
	return &Output{Output: out, Sizes: out.Sizes}, nil
}

// source is --from tcp://HOST:PORT (serve, restore, extract): listen there
// for one sender and return once its checkpoint is complete, verified and
// committed, so that a transfer that breaks fails the command before
// anything is served (serve prints socket-init only then; receive is the
// form that listens on CRIU's socket from the start).
func (l tcpLoc) source(ctx context.Context, c *Config, so source.StreamSourceOptions) (source.Source, error) {
	t, err := l.settings(c)
	if err != nil {
		return nil, err
	}
	ln, err := tcp.Listen(ctx, l.loc.Path, tcp.ListenOptions{Auth: t.Auth, Timeout: t.Timeout, PIDSpace: proc.Space(), Log: c.Log})
	if err != nil {
		return nil, err
	}
	c.log("listening on " + ln.Addr().String())
	src := tcp.NewSource(ctx, ln, so)
	if _, err := src.WaitCommitted(ctx); err != nil {
		src.Close()
		return nil, err
	}
	return src, nil
}
