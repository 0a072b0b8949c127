package criusock

// CRIU's version, asked the way a container runtime asks it: a VERSION
// request to `criu swrk` (cr-service.c, handle_version). The answer is the
// version a checkpoint's manifest records, and, where gpucr-stream drives a
// runtime, what the swrk that runtime starts answers its own VERSION
// request with (package swrk), instead of starting the real criu a second
// time. A checkpoint asks it in the background while it gets ready:
// starting criu costs 6-13 ms here.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// VersionQuery is criu's version, being asked.
type VersionQuery struct {
	criu string
	done chan struct{}
	v    *rpc.CriuVersion
	err  error
}

// StartVersionQuery asks criu for its version in the background; Wait
// has the answer. The caller owns the query and waits for it (Wait) on
// every path.
func StartVersionQuery(ctx context.Context, criu string) *VersionQuery {
	q := &VersionQuery{criu: criu, done: make(chan struct{})}
	go func() {
		defer close(q.done)
		q.v, q.err = askVersion(ctx, criu)
	}()
	return q
}

// CRIU is the binary asked.
func (q *VersionQuery) CRIU() string { return q.criu }

// Wait returns criu's answer.
func (q *VersionQuery) Wait() (*rpc.CriuVersion, error) {
	<-q.done
	return q.v, q.err
}

// String is the version as `criu --version` prints it ("4.2.1"), "" if
// it could not be asked.
func (q *VersionQuery) String() string {
	v, err := q.Wait()
	if err != nil {
		return ""
	}
	return VersionString(v)
}

// VersionString is v as CRIU writes its version (Makefile.versions,
// CRIU_VERSION): major.minor, then the sublevel and extra that are set.
func VersionString(v *rpc.CriuVersion) string {
	s := strconv.Itoa(int(v.GetMajorNumber())) + "." + strconv.Itoa(int(v.GetMinorNumber()))
	if v.Sublevel != nil {
		s += "." + strconv.Itoa(int(v.GetSublevel()))
	}
	if v.Extra != nil {
		s += "." + strconv.Itoa(int(v.GetExtra()))
	}
	return s
}

// maxVersionAnswer bounds criu's answer: a few numbers and names.
const maxVersionAnswer = 64 << 10

// askVersion runs `criu swrk` on one end of a socket pair and asks it.
func askVersion(ctx context.Context, criu string) (*rpc.CriuVersion, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("criu version: %w", err)
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "criu rpc"), os.NewFile(uintptr(fds[1]), "criu rpc")
	defer ours.Close()
	cmd := exec.CommandContext(ctx, criu, "swrk", "3")
	cmd.ExtraFiles = []*os.File{theirs}
	err = cmd.Start()
	theirs.Close() // criu's end is criu's alone: its exit ends our read
	if err != nil {
		return nil, fmt.Errorf("criu version: start %s: %w", criu, err)
	}
	v, askErr := exchangeVersion(ours)
	ours.Close() // criu's swrk ends when its caller goes
	if err := cmd.Wait(); err != nil && askErr == nil {
		askErr = fmt.Errorf("criu version: %s swrk: %w", criu, err)
	}
	return v, askErr
}

// exchangeVersion sends a VERSION request on sk and reads the answer.
func exchangeVersion(sk *os.File) (*rpc.CriuVersion, error) {
	req, err := proto.Marshal(&rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()})
	if err != nil {
		return nil, err
	}
	if _, err := sk.Write(req); err != nil {
		return nil, fmt.Errorf("criu version: ask: %w", err)
	}
	buf := make([]byte, maxVersionAnswer)
	n, err := sk.Read(buf)
	if err != nil {
		return nil, fmt.Errorf("criu version: read the answer: %w", err)
	}
	resp := &rpc.CriuResp{}
	if err := proto.Unmarshal(buf[:n], resp); err != nil {
		return nil, fmt.Errorf("criu version: the answer: %w", err)
	}
	if resp.GetType() != rpc.CriuReqType_VERSION || !resp.GetSuccess() || resp.GetVersion() == nil {
		return nil, errors.New("criu version: criu answered no version")
	}
	return resp.GetVersion(), nil
}
