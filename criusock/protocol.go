// Package criusock speaks CRIU's image-streamer socket protocol on both
// sides: it takes images from `criu dump --stream` into a streamer.Capture
// and serves them from a source.Source to `criu restore --stream`. It also
// runs criu itself (criu.go: dump with its post-dump commit hook, restore,
// lazy pages), and turns other producers (extra files on descriptors, an
// on-disk images directory) into image files on the same sockets.
//
// Size: about 1,900 lines, over the project's 1,500: both sides of the
// socket protocol, the producers beside CRIU on the same sockets, and
// running criu with its post-dump commit hook belong together (a session
// serves CRIU and producers at once); running criu (criu.go) and the
// files.img port remap of --tcp-listen-remap (remap.go) are the parts
// that could stand alone.
package criusock

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"

	imgstreamer "github.com/checkpoint-restore/go-criu/v7/crit/images/img-streamer"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// Socket names inside the images directory, fixed by CRIU.
const (
	CaptureSocket = "streamer-capture.sock"
	ServeSocket   = "streamer-serve.sock"
)

// maxRequest bounds a request message; CRIU's are a file name and a tag.
const maxRequest = 8192

// ReadRequest reads one length-prefixed img_streamer_request_entry and
// returns the file name. It reads exact lengths so that the byte that
// carries the next descriptor stays in the socket. io.EOF means CRIU
// closed the connection between requests.
func ReadRequest(r io.Reader, pos int64) (string, error) {
	var lenBuf [4]byte
	if _, err := io.ReadFull(r, lenBuf[:]); err != nil {
		if errors.Is(err, io.EOF) {
			return "", io.EOF
		}
		return "", fmt.Errorf("criu request at socket offset %d: length: %w", pos, err)
	}
	n := binary.LittleEndian.Uint32(lenBuf[:])
	if n == 0 || n > maxRequest {
		return "", fmt.Errorf("criu request at socket offset %d: length %d out of range (1..%d)", pos, n, maxRequest)
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(r, buf); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF // a length with no body is a cut, not a clean close
		}
		return "", fmt.Errorf("criu request at socket offset %d: body of %d bytes: %w", pos, n, err)
	}
	var req imgstreamer.ImgStreamerRequestEntry
	if err := proto.Unmarshal(buf, &req); err != nil {
		return "", fmt.Errorf("criu request at socket offset %d: %w", pos, err)
	}
	name := req.GetFilename()
	if !ValidImageName(name) {
		return "", fmt.Errorf("criu request at socket offset %d: invalid image name %q", pos, name)
	}
	return name, nil
}

// ValidImageName accepts what CRIU names images: one path component.
func ValidImageName(name string) bool {
	if name == "" || name == "." || name == ".." || len(name) > 4096 {
		return false
	}
	for i := 0; i < len(name); i++ {
		if name[i] == '/' || name[i] == 0 {
			return false
		}
	}
	return true
}

// EncodeRequest is the client side of ReadRequest (used by tests and by
// producers that speak the protocol).
func EncodeRequest(name string) ([]byte, error) {
	b, err := proto.Marshal(&imgstreamer.ImgStreamerRequestEntry{Filename: proto.String(name)})
	if err != nil {
		return nil, err
	}
	out := binary.LittleEndian.AppendUint32(nil, uint32(len(b)))
	return append(out, b...), nil
}

// WriteReply answers a restore request.
func WriteReply(w io.Writer, exists bool) error {
	b, err := proto.Marshal(&imgstreamer.ImgStreamerReplyEntry{Exists: proto.Bool(exists)})
	if err != nil {
		return err
	}
	out := binary.LittleEndian.AppendUint32(nil, uint32(len(b)))
	_, err = w.Write(append(out, b...))
	return err
}

// RecvPipe receives the pipe end CRIU sends after a request: a one-byte
// message with one descriptor. The descriptor is made non-blocking so that
// closing the file wakes any goroutine blocked on it.
func RecvPipe(conn *net.UnixConn, name string) (*os.File, error) {
	var b [1]byte
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := conn.ReadMsgUnix(b[:], oob)
	if err != nil {
		return nil, fmt.Errorf("receive pipe for %s: %w", name, err)
	}
	if n != 1 {
		return nil, fmt.Errorf("receive pipe for %s: connection closed before the descriptor", name)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return nil, fmt.Errorf("receive pipe for %s: %w", name, err)
	}
	var fds []int
	for _, m := range msgs {
		got, err := unix.ParseUnixRights(&m)
		if err == nil {
			fds = append(fds, got...)
		}
	}
	if len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, fmt.Errorf("receive pipe for %s: got %d descriptors, want 1", name, len(fds))
	}
	if err := unix.SetNonblock(fds[0], true); err != nil {
		unix.Close(fds[0])
		return nil, fmt.Errorf("receive pipe for %s: %w", name, err)
	}
	return os.NewFile(uintptr(fds[0]), name), nil
}

// SendPipe is the client side of RecvPipe.
func SendPipe(conn *net.UnixConn, f *os.File) error {
	_, _, err := conn.WriteMsgUnix([]byte{0}, unix.UnixRights(int(f.Fd())), nil)
	return err
}
