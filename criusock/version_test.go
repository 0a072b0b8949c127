package criusock

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// TestVersionString: CRIU's own rule for its version string.
func TestVersionString(t *testing.T) {
	for _, c := range []struct {
		v    *rpc.CriuVersion
		want string
	}{
		{&rpc.CriuVersion{MajorNumber: proto.Int32(4), MinorNumber: proto.Int32(2), Sublevel: proto.Int32(1)}, "4.2.1"},
		{&rpc.CriuVersion{MajorNumber: proto.Int32(4), MinorNumber: proto.Int32(0)}, "4.0"},
		{&rpc.CriuVersion{MajorNumber: proto.Int32(3), MinorNumber: proto.Int32(17), Sublevel: proto.Int32(1), Extra: proto.Int32(2), Gitid: proto.String("v3.17.1-2-g0")}, "3.17.1.2"},
	} {
		if got := VersionString(c.v); got != c.want {
			t.Errorf("VersionString(%v) = %q, want %q", c.v, got, c.want)
		}
	}
}

// TestExchangeVersion: the request criu gets, and what each answer
// gives, criu's end played here.
func TestExchangeVersion(t *testing.T) {
	v := &rpc.CriuVersion{MajorNumber: proto.Int32(4), MinorNumber: proto.Int32(2), Sublevel: proto.Int32(1)}
	for _, c := range []struct {
		name   string
		answer *rpc.CriuResp // nil: criu goes without answering
		err    bool
	}{
		{"version", &rpc.CriuResp{Type: rpc.CriuReqType_VERSION.Enum(), Success: proto.Bool(true), Version: v}, false},
		{"failed", &rpc.CriuResp{Type: rpc.CriuReqType_VERSION.Enum(), Success: proto.Bool(false)}, true},
		{"no version", &rpc.CriuResp{Type: rpc.CriuReqType_VERSION.Enum(), Success: proto.Bool(true)}, true},
		{"another type", &rpc.CriuResp{Type: rpc.CriuReqType_CHECK.Enum(), Success: proto.Bool(true), Version: v}, true},
		{"gone", nil, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			ours, theirs := os.NewFile(uintptr(fds[0]), "ours"), os.NewFile(uintptr(fds[1]), "theirs")
			defer ours.Close()
			asked := make(chan *rpc.CriuReq, 1)
			go func() {
				defer theirs.Close()
				buf := make([]byte, 4096)
				n, err := theirs.Read(buf)
				req := &rpc.CriuReq{}
				if err != nil || proto.Unmarshal(buf[:n], req) != nil {
					req = nil
				}
				asked <- req
				if c.answer != nil {
					b, _ := proto.Marshal(c.answer)
					theirs.Write(b)
				}
			}()
			got, err := exchangeVersion(ours)
			if req := <-asked; req.GetType() != rpc.CriuReqType_VERSION {
				t.Errorf("criu was asked %v", req)
			}
			if c.err {
				if err == nil {
					t.Errorf("no error; got %v", got)
				}
				return
			}
			if err != nil || !proto.Equal(got, v) {
				t.Errorf("got %v, %v; want %v", got, err, v)
			}
		})
	}
}

// TestVersionQueryNoCRIU: a criu that cannot start gives an error, and
// an empty String.
func TestVersionQueryNoCRIU(t *testing.T) {
	q := StartVersionQuery(context.Background(), filepath.Join(t.TempDir(), "criu"))
	if v, err := q.Wait(); err == nil {
		t.Errorf("no error; got %v", v)
	}
	if s := q.String(); s != "" {
		t.Errorf("String() = %q", s)
	}
}
