package swrk

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// runcDump is the request runc 1.1.5 sends for `runc checkpoint` of a
// container with a bind mount (libcontainer/container_linux.go).
func runcDump() *rpc.CriuOpts {
	return &rpc.CriuOpts{
		ImagesDirFd: proto.Int32(5), LogLevel: proto.Int32(4), LogFile: proto.String("dump.log"),
		Root: proto.String("/run/bundle/rootfs"), ManageCgroups: proto.Bool(true), NotifyScripts: proto.Bool(true),
		Pid: proto.Int32(1234), ShellJob: proto.Bool(false), LeaveRunning: proto.Bool(false), TcpEstablished: proto.Bool(true),
		ExtUnixSk: proto.Bool(false), FileLocks: proto.Bool(false), EmptyNs: proto.Uint32(0), OrphanPtsMaster: proto.Bool(true),
		AutoDedup: proto.Bool(false), LazyPages: proto.Bool(false), WorkDirFd: proto.Int32(6),
		ConfigFile:   proto.String("/etc/criu/runc.conf"),
		External:     []string{"net[4026532008]:extRootNetNS"},
		FreezeCgroup: proto.String("/sys/fs/cgroup/freezer/ctr"),
		ExtMnt:       []*rpc.ExtMountMap{{Key: proto.String("/data"), Val: proto.String("/data")}},
	}
}

// runcRestore is runc 1.1.5's `runc restore` request.
func runcRestore() *rpc.CriuOpts {
	return &rpc.CriuOpts{
		ImagesDirFd: proto.Int32(5), EvasiveDevices: proto.Bool(true), LogLevel: proto.Int32(4), LogFile: proto.String("restore.log"),
		RstSibling: proto.Bool(true), Root: proto.String("/run/runc/ctr/criu-root"), ManageCgroups: proto.Bool(true),
		NotifyScripts: proto.Bool(true), OrphanPtsMaster: proto.Bool(true), EmptyNs: proto.Uint32(unix.CLONE_NEWNET),
		ExtMnt:    []*rpc.ExtMountMap{{Key: proto.String("/data"), Val: proto.String("/host/data")}},
		InheritFd: []*rpc.InheritFd{{Key: proto.String("pipe:[1234]"), Fd: proto.Int32(1)}, {Key: proto.String("extRootNetNS"), Fd: proto.Int32(4)}},
		CgRoot:    []*rpc.CgroupRoot{{Ctrl: proto.String("cpu,cpuacct"), Path: proto.String("/ctr")}, {Path: proto.String("/unified")}},
	}
}

func TestTranslate(t *testing.T) {
	for _, tc := range []struct {
		name    string
		mode    rpc.CriuReqType
		opts    *rpc.CriuOpts
		want    []string // in this order
		inherit []int
		log     string
	}{
		{"runc dump", rpc.CriuReqType_DUMP, runcDump(), []string{"--tree=1234", "--tcp-established", "--verbosity=4", "--log-file=dump.log",
			"--root=/run/bundle/rootfs", "--ext-mount-map=/data:/data", "--manage-cgroups=soft", "--freeze-cgroup=/sys/fs/cgroup/freezer/ctr",
			"--external=net[4026532008]:extRootNetNS"}, nil, "dump.log"},
		{"runc restore", rpc.CriuReqType_RESTORE, runcRestore(), []string{"--evasive-devices", "--verbosity=4", "--log-file=restore.log",
			"--root=/run/runc/ctr/criu-root", "--ext-mount-map=/data:/host/data", "--manage-cgroups=soft", "--cgroup-root=cpu,cpuacct:/ctr",
			"--cgroup-root=/unified", "--restore-sibling", "--inherit-fd=fd[1]:pipe:[1234]", "--inherit-fd=fd[4]:extRootNetNS", "--empty-ns=net"}, []int{4}, "restore.log"},
		{"defaults", rpc.CriuReqType_DUMP, &rpc.CriuOpts{ImagesDirFd: proto.Int32(3), Pid: proto.Int32(9)},
			[]string{"--tree=9", "--verbosity=2", "--log-file=criu.log"}, nil, "criu.log"},
		{"stderr, modes, lists", rpc.CriuReqType_RESTORE, &rpc.CriuOpts{ImagesDirFd: proto.Int32(3), LogToStderr: proto.Bool(true),
			ManageCgroups: proto.Bool(true), ManageCgroupsMode: rpc.CriuCgMode_STRICT.Enum(), CpuCap: proto.Uint32(5),
			NetworkLock: rpc.CriuNetworkLockMethod_NFTABLES.Enum(), GhostLimit: proto.Uint32(1 << 20), ExtUnixSk: proto.Bool(true),
			UnixSkIno: []*rpc.UnixSk{{Inode: proto.Uint32(77)}}, JoinNs: []*rpc.JoinNamespace{{Ns: proto.String("ipc"), NsFile: proto.String("/proc/1/ns/ipc"), ExtraOpt: proto.String("x")}},
			Veths: []*rpc.CriuVethPair{{IfIn: proto.String("eth0"), IfOut: proto.String("veth9")}}, AutoExtMnt: proto.Bool(true),
			InheritFd: []*rpc.InheritFd{{Key: proto.String("a"), Fd: proto.Int32(7)}, {Key: proto.String("b"), Fd: proto.Int32(7)}}},
			[]string{"--ext-unix-sk", "--external=unix[77]", "--verbosity=2", "--veth-pair=eth0=veth9", "--cpu-cap=none,fpu,ins",
				"--manage-cgroups=strict", "--inherit-fd=fd[7]:a", "--ext-mount-map=auto", "--ghost-limit=1048576", "--join-ns=ipc:/proc/1/ns/ipc,x",
				"--network-lock=nftables"}, []int{7}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := translate(tc.mode, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			got := tr.args(nil)
			at := 0
			for _, w := range tc.want {
				i := slices.Index(got[at:], w)
				if i < 0 {
					t.Fatalf("args %q: no %q (after position %d)", got, w, at)
				}
				at += i + 1
			}
			for _, never := range []string{"--shell-job", "--leave-running", "--file-locks", "--auto-dedup", "--lazy-pages", "--orphan-pts-master"} {
				if slices.Contains(got, never) {
					t.Errorf("args %q hold %s, which the request left off", got, never)
				}
			}
			if !slices.Equal(tr.inherit, tc.inherit) || tr.logFile != tc.log {
				t.Errorf("inherit %v, log %q; want %v, %q", tr.inherit, tr.logFile, tc.inherit, tc.log)
			}
		})
	}
}

func TestTranslateRefuses(t *testing.T) {
	unknown := runcDump()
	unknown.ProtoReflect().SetUnknown([]byte{0xf8, 0x7f, 1}) // field 1023, varint 1
	for _, tc := range []struct {
		name   string
		mode   rpc.CriuReqType
		change func(*rpc.CriuOpts)
		option string
	}{
		{"page server", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.Ps = &rpc.CriuPageServerInfo{Port: proto.Int32(1)} }, "ps"},
		{"parent", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.ParentImg = proto.String("../pre") }, "parent_img"},
		{"track mem", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.TrackMem = proto.Bool(true) }, "track_mem"},
		{"auto dedup", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.AutoDedup = proto.Bool(true) }, "auto_dedup"},
		{"lazy pages", rpc.CriuReqType_RESTORE, func(o *rpc.CriuOpts) { o.LazyPages = proto.Bool(true) }, "lazy_pages"},
		{"status fd", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.StatusFd = proto.Int32(9) }, "status_fd"},
		{"tls", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.TlsCert = proto.String("c") }, "tls"},
		{"exec on dump", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.ExecCmd = []string{"x"} }, "exec_cmd"},
		{"self dump", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.Pid = nil }, "pid"},
		{"empty ns", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.EmptyNs = proto.Uint32(unix.CLONE_NEWPID) }, "empty_ns"},
		{"mount key", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.ExtMnt[0].Key = proto.String("/a:b") }, "ext_mnt"},
		{"log subdir", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.LogFile = proto.String("../x.log") }, "log_file"},
		{"negative fd", rpc.CriuReqType_RESTORE, func(o *rpc.CriuOpts) { o.InheritFd = []*rpc.InheritFd{{Key: proto.String("k"), Fd: proto.Int32(-1)}} }, "inherit_fd"},
		{"cg mode", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.ManageCgroupsMode = rpc.CriuCgMode(99).Enum() }, "manage_cgroups_mode"},
		{"long lists", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.External = make([]string, maxListed+1) }, "(lists)"},
		{"unknown fields", rpc.CriuReqType_DUMP, func(o *rpc.CriuOpts) { o.ProtoReflect().SetUnknown(unknown.ProtoReflect().GetUnknown()) }, "(unknown fields)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := runcDump()
			tc.change(o)
			_, err := translate(tc.mode, o)
			var u ErrUnsupported
			if !errors.As(err, &u) || u.Option != tc.option || !strings.Contains(err.Error(), tc.option) {
				t.Fatalf("got %v, want a refusal of %s", err, tc.option)
			}
		})
	}
}

// TestConfigFileWins: CRIU's RPC applies the config file (runc.conf, the
// org.criu.config annotation) after the request, its command line before;
// a scalar option the file sets is left off the command line, a list
// option is kept beside the file's.
func TestConfigFileWins(t *testing.T) {
	conf := filepath.Join(t.TempDir(), "runc.conf")
	body := "# runc's\nlog-file custom.log\n  tcp-close\nno-tcp-established\nexternal mnt[]:m\nstream\n\n"
	if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	set, err := configOptions(conf)
	if err != nil {
		t.Fatal(err)
	}
	tr, err := translate(rpc.CriuReqType_DUMP, runcDump())
	if err != nil {
		t.Fatal(err)
	}
	got := tr.args(set)
	for _, gone := range []string{"--log-file=dump.log", "--tcp-established"} {
		if slices.Contains(got, gone) {
			t.Errorf("%s kept, though the config file sets it: %q", gone, got)
		}
	}
	for _, kept := range []string{"--external=net[4026532008]:extRootNetNS", "--tree=1234", "--root=/run/bundle/rootfs"} {
		if !slices.Contains(got, kept) {
			t.Errorf("%s dropped: %q", kept, got)
		}
	}
}

// FuzzTranslate: any request a caller sends is translated or refused,
// without a panic, into a bounded command line.
func FuzzTranslate(f *testing.F) {
	for _, o := range []*rpc.CriuOpts{runcDump(), runcRestore()} {
		b, _ := proto.Marshal(&rpc.CriuReq{Type: rpc.CriuReqType_DUMP.Enum(), Opts: o})
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		req := &rpc.CriuReq{}
		if proto.Unmarshal(b, req) != nil {
			return
		}
		for _, mode := range []rpc.CriuReqType{rpc.CriuReqType_DUMP, rpc.CriuReqType_RESTORE} {
			tr, err := translate(mode, requestOpts(req))
			if err != nil {
				continue
			}
			if n := len(tr.args(nil)); n > 3*maxListed+100 {
				t.Fatalf("%d arguments", n)
			}
			for _, fd := range tr.inherit {
				if fd < 3 {
					t.Fatalf("inherit %d", fd)
				}
			}
		}
	})
}
