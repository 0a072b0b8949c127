package criusock

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	imgstreamer "github.com/checkpoint-restore/go-criu/v7/crit/images/img-streamer"
	"github.com/gpucr/gpucr-stream/errdefs"
	"google.golang.org/protobuf/proto"
)

// Producers are image sources and sinks other than CRIU that share the
// image-streamer sockets with it: GPU dumpers in the style of GPU-CR or Cedana
// push named files into the image beside CRIU's during a dump, and pull
// them back during the restore. They speak CRIU's own protocol (a
// length-prefixed img_streamer_request_entry per file, then a pipe passed
// with SCM_RIGHTS) with one addition: the first request of a producer's
// connection is a hello, a request whose file name is ProducerHelloPrefix
// followed by the producer's name. It carries no pipe; the image streamer
// answers it with a reply {exists: true} once it has taken the producer
// on, or closes the connection if it takes no more producers (the image is
// already complete). CRIU never names an image with a leading dot, so the
// two cannot be confused, and a connection without a hello is CRIU's.
//
// On the capture socket a producer may push several files at once (one
// pipe each), and closes its connection when done; the image is complete
// when CRIU has sent inventory.img, every producer connection has closed
// cleanly and every pipe is drained (see IntakeSession). On the serve
// socket a producer's requests are answered as CRIU's are: a reply
// {exists}, then, if the file exists, the producer sends the write end of
// a pipe and reads the file from the read end.

// ProducerHelloPrefix starts the hello request of a producer connection.
const ProducerHelloPrefix = ".gpucr-producer:"

// ProducerHello is the hello request's file name for a producer.
func ProducerHello(name string) (string, error) {
	if name == "" || len(name) > 256 || strings.ContainsAny(name, "/\x00\n") {
		return "", fmt.Errorf("producer name %q: want 1..256 bytes without '/', NUL or newline", name)
	}
	return ProducerHelloPrefix + name, nil
}

// ParseProducerHello returns the producer's name if request name is a hello.
func ParseProducerHello(name string) (string, bool) {
	return strings.CutPrefix(name, ProducerHelloPrefix)
}

// ReadReply reads one length-prefixed img_streamer_reply_entry (the
// client side of WriteReply).
func ReadReply(r io.Reader) (bool, error) {
	var lenBuf [4]byte
	if _, err := io.ReadFull(r, lenBuf[:]); err != nil {
		return false, fmt.Errorf("reply length: %w", err)
	}
	n := binary.LittleEndian.Uint32(lenBuf[:])
	if n > maxRequest {
		return false, fmt.Errorf("reply length %d out of range", n)
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(r, buf); err != nil {
		return false, fmt.Errorf("reply body: %w", err)
	}
	var rep imgstreamer.ImgStreamerReplyEntry
	if err := proto.Unmarshal(buf, &rep); err != nil {
		return false, fmt.Errorf("reply: %w", err)
	}
	return rep.GetExists(), nil
}

// DialProducer connects to the capture socket in dir as producer name:
// the files it pushes go into the same image as CRIU's, flagged external.
// Connect before CRIU's dump ends; push files (concurrently if wanted) and
// Close when done. A producer that fails must not Close cleanly: Abort
// instead, so that the checkpoint fails.
func DialProducer(ctx context.Context, dir, name string) (*Client, error) {
	return dialHello(ctx, dir, CaptureSocket, name)
}

// DialPull connects to the serve socket in dir as producer name, to pull
// files back during a restore.
func DialPull(ctx context.Context, dir, name string) (*Client, error) {
	return dialHello(ctx, dir, ServeSocket, name)
}

func dialHello(ctx context.Context, dir, sock, name string) (*Client, error) {
	path := filepath.Join(dir, sock)
	hello, err := ProducerHello(name)
	if err != nil {
		return nil, err
	}
	req, err := EncodeRequest(hello)
	if err != nil {
		return nil, err
	}
	conn, err := dialIn(ctx, dir, sock)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Write(req); err != nil {
		conn.Close()
		return nil, fmt.Errorf("hello on %s: %w", path, err)
	}
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	ok, err := ReadReply(conn)
	stop()
	if err != nil || !ok {
		conn.Close()
		return nil, fmt.Errorf("%s refused producer %q (the image is complete or the streamer is not gpucr-stream): %v", path, name, err)
	}
	return &Client{conn: conn}, nil
}

// Pull asks the serve socket for one file and copies it into w. Several
// pulls may run at once on one client.
func (c *Client) Pull(ctx context.Context, name string, w io.Writer) (int64, error) {
	req, err := EncodeRequest(name)
	if err != nil {
		return 0, err
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return 0, err
	}
	defer pr.Close()
	err = func() error {
		c.mu.Lock()
		defer c.mu.Unlock()
		defer pw.Close() // the server holds its own copy once sent
		if _, err := c.conn.Write(req); err != nil {
			return fmt.Errorf("pull %s: request: %w", name, err)
		}
		exists, err := ReadReply(c.conn)
		if err != nil {
			return fmt.Errorf("pull %s: %w", name, err)
		}
		if !exists {
			return fmt.Errorf("pull %s: no such file in the checkpoint: %w", name, errdefs.ErrNotFound)
		}
		if err := SendPipe(c.conn, pw); err != nil {
			return fmt.Errorf("pull %s: send pipe: %w", name, err)
		}
		return nil
	}()
	if err != nil {
		return 0, err
	}
	stop := context.AfterFunc(ctx, func() { pr.Close() })
	defer stop()
	n, err := io.Copy(w, pr)
	if err != nil {
		return n, fmt.Errorf("pull %s: %w", name, err)
	}
	return n, nil
}
