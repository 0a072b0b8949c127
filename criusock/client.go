package criusock

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
)

// Client is the producer side of the capture socket: it sends image files
// the way `criu dump --stream` does. Producers other than CRIU (an on-disk
// images directory, external dumpers) and tests use it.
type Client struct {
	conn *net.UnixConn
	// mu keeps each request and its descriptor together on the socket, so
	// that several files may be pushed or pulled at once.
	mu sync.Mutex
}

// Dial connects to the capture socket in dir.
func Dial(ctx context.Context, dir string) (*Client, error) {
	c, err := dialIn(ctx, dir, CaptureSocket)
	if err != nil {
		return nil, err
	}
	return &Client{conn: c}, nil
}

// Push sends one file: the request, then a pipe whose write end gets r.
// Several pushes may run at once on one client (one pipe each).
func (c *Client) Push(ctx context.Context, name string, r io.Reader) error {
	req, err := EncodeRequest(name)
	if err != nil {
		return err
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return err
	}
	defer pw.Close()
	c.mu.Lock()
	if _, err := c.conn.Write(req); err != nil {
		c.mu.Unlock()
		pr.Close()
		return fmt.Errorf("push %s: request: %w", name, err)
	}
	err = SendPipe(c.conn, pr)
	c.mu.Unlock()
	pr.Close()
	if err != nil {
		return fmt.Errorf("push %s: send pipe: %w", name, err)
	}
	stop := context.AfterFunc(ctx, func() { pw.Close() })
	defer stop()
	if _, err := io.Copy(pw, r); err != nil {
		return fmt.Errorf("push %s: %w", name, err)
	}
	return pw.Close()
}

// PushDir sends every image file of an on-disk images directory (what
// `criu dump -D` wrote), inventory.img last as CRIU does. Files CRIU never
// streams (logs, stats-dump, irmap-cache) are left out.
func (c *Client) PushDir(ctx context.Context, dir string) (int, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, err
	}
	var names []string
	for _, e := range ents {
		n := e.Name()
		if !e.Type().IsRegular() || filepath.Ext(n) != ".img" || n == "inventory.img" || n == "stats-dump" || n == "irmap-cache" {
			continue
		}
		names = append(names, n)
	}
	if _, err := os.Stat(filepath.Join(dir, "inventory.img")); err == nil {
		names = append(names, "inventory.img")
	}
	for _, n := range names {
		f, err := os.Open(filepath.Join(dir, n))
		if err != nil {
			return 0, err
		}
		err = c.Push(ctx, n, f)
		f.Close()
		if err != nil {
			return 0, err
		}
	}
	return len(names), nil
}

// Close ends the session, as CRIU closing its socket does. For a producer
// it says "done": call it only after every Push has returned nil.
func (c *Client) Close() error { return c.conn.Close() }

// Abort ends a producer's session so that the dump fails: the connection
// is reset in the middle of a request, which the intake takes as an error
// (a clean Close between requests means "done").
func (c *Client) Abort() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	// Half a request length: the intake reads a truncated request.
	_, _ = c.conn.Write([]byte{1, 0})
	return c.conn.Close()
}
