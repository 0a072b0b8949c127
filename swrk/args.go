package swrk

// CRIU's RPC options as its command line: what cr-service.c's
// setup_opts_from_req does with each field of criu_opts, written as the
// options criu/config.c parses. A field with no command-line form that
// changes what a streamed dump or restore does is refused by name, so a
// runtime never gets a checkpoint other than the one it asked for.

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// ErrUnsupported names an RPC option that stream mode cannot honour.
type ErrUnsupported struct{ Option, Why string }

func (e ErrUnsupported) Error() string {
	return fmt.Sprintf("criu_opts.%s is not supported through gpucr-stream (CRIU's command line in --stream mode): %s", e.Option, e.Why)
}

// maxListed bounds the repeated fields of one request: a runtime lists a
// few dozen mounts, never more than this.
const maxListed = 4096

// maxInheritFD bounds the descriptors a request may name: CRIU gets them
// at their own numbers (package swrk's inherited).
const maxInheritFD = 1 << 16

// translation is a request's options as CRIU's command line.
type translation struct {
	opts []option
	// inherit are the descriptors (>= 3) CRIU must find at the same
	// numbers as in this process (inherit_fd).
	inherit []int
	// logFile is CRIU's log, relative to its work dir ("": stderr).
	logFile string
	// execCmd goes last: CRIU takes everything after "--".
	execCmd []string
}

// option is one --name or --name=value (the form getopt takes for every
// option, those with optional values included).
type option struct {
	name, value string
	hasValue    bool
}

func (o option) String() string {
	if o.hasValue {
		return "--" + o.name + "=" + o.value
	}
	return "--" + o.name
}

func (t *translation) add(name string, values ...string) {
	for _, v := range values {
		t.opts = append(t.opts, option{name, v, true})
	}
}

func (t *translation) flag(name string, on *bool) {
	if on != nil && *on {
		t.opts = append(t.opts, option{name: name})
	}
}

func (t *translation) str(name string, v *string) {
	if v != nil {
		t.add(name, *v)
	}
}

func (t *translation) num(name string, v *uint32) {
	if v != nil {
		t.add(name, strconv.FormatUint(uint64(*v), 10))
	}
}

// args is the command line, without the scalar options that conf (a
// config file's options, see configOptions) sets.
func (t *translation) args(conf map[string]bool) []string {
	var out []string
	for _, o := range t.opts {
		if conf[o.name] && !listOptions[o.name] {
			continue
		}
		out = append(out, o.String())
	}
	return out
}

// translate turns the options of a dump or restore into CRIU's command
// line. Options CRIU's RPC takes from elsewhere (the images and work
// dirs, which are descriptors of the caller, the config file, the
// notification scripts) are the caller's to add.
func translate(mode rpc.CriuReqType, o *rpc.CriuOpts) (*translation, error) {
	if len(o.ProtoReflect().GetUnknown()) > 0 {
		return nil, ErrUnsupported{"(unknown fields)", "the request holds options this build of gpucr-stream does not know; refusing rather than ignoring them"}
	}
	t := &translation{}
	if err := refused(mode, o); err != nil {
		return nil, err
	}
	if err := listsBounded(o); err != nil {
		return nil, err
	}
	if mode == rpc.CriuReqType_DUMP {
		if o.GetPid() <= 0 {
			return nil, ErrUnsupported{"pid", "a dump of the calling process itself (no pid) cannot stream"}
		}
		t.add("tree", strconv.Itoa(int(o.GetPid())))
	}
	t.flag("leave-running", o.LeaveRunning)
	t.flag("leave-stopped", o.LeaveStopped)
	t.flag("ext-unix-sk", o.ExtUnixSk)
	if o.GetExtUnixSk() {
		for _, sk := range o.UnixSkIno {
			t.add("external", fmt.Sprintf("unix[%d]", sk.GetInode()))
		}
	}
	t.flag("tcp-established", o.TcpEstablished)
	t.flag("evasive-devices", o.EvasiveDevices)
	t.flag("shell-job", o.ShellJob)
	t.flag("file-locks", o.FileLocks)
	t.add("verbosity", strconv.Itoa(int(o.GetLogLevel())))
	var err error
	if t.logFile, err = logName(o); err != nil {
		return nil, err
	}
	if t.logFile != "" {
		t.add("log-file", t.logFile)
	}
	t.str("root", o.Root)
	t.flag("link-remap", o.LinkRemap)
	for _, v := range o.Veths {
		t.add("veth-pair", v.GetIfIn()+"="+v.GetIfOut())
	}
	if o.CpuCap != nil {
		t.add("cpu-cap", cpuCap(o.GetCpuCap()))
	}
	t.flag("force-irmap", o.ForceIrmap)
	t.execCmd = o.ExecCmd
	if err := t.environment(o); err != nil {
		return nil, err
	}
	t.num("timeout", o.Timeout)
	t.flag("skip-in-flight", o.TcpSkipInFlight)
	t.flag("weak-sysctls", o.WeakSysctls)
	t.flag("tcp-close", o.TcpClose)
	t.str("lsm-profile", o.LsmProfile)
	t.str("lsm-mount-context", o.LsmMountContext)
	if o.NetworkLock != nil {
		t.add("network-lock", strings.ToLower(o.GetNetworkLock().String()))
	}
	t.flag("mntns-compat-mode", o.MntnsCompatMode)
	t.flag("skip-file-rwx-check", o.SkipFileRwxCheck)
	t.flag("unprivileged", o.Unprivileged)
	t.flag("display-stats", o.DisplayStats)
	return t, nil
}

// environment is what the tree is restored into or dumped from beside
// itself: mounts, cgroups, descriptors, namespaces.
func (t *translation) environment(o *rpc.CriuOpts) error {
	for _, m := range o.ExtMnt {
		if strings.Contains(m.GetKey(), ":") {
			return ErrUnsupported{"ext_mnt", fmt.Sprintf("key %q holds a ':', which --ext-mount-map cannot express", m.GetKey())}
		}
		t.add("ext-mount-map", m.GetKey()+":"+m.GetVal())
	}
	if err := t.cgroups(o); err != nil {
		return err
	}
	t.flag("restore-sibling", o.RstSibling)
	for _, f := range o.InheritFd {
		fd := int(f.GetFd())
		if fd < 0 || fd >= maxInheritFD {
			return ErrUnsupported{"inherit_fd", fmt.Sprintf("descriptor %d (want 0..%d)", fd, maxInheritFD-1)}
		}
		t.add("inherit-fd", fmt.Sprintf("fd[%d]:%s", fd, f.GetKey()))
		if fd > 2 && !slices.Contains(t.inherit, fd) {
			t.inherit = append(t.inherit, fd)
		}
	}
	if o.GetAutoExtMnt() {
		t.add("ext-mount-map", "auto")
	}
	t.flag("enable-external-sharing", o.ExtSharing)
	t.flag("enable-external-masters", o.ExtMasters)
	t.add("skip-mnt", o.SkipMnt...)
	t.add("enable-fs", o.EnableFs...)
	t.num("ghost-limit", o.GhostLimit)
	t.add("irmap-scan-path", o.IrmapScanPaths...)
	t.add("external", o.External...)
	if o.EmptyNs != nil && o.GetEmptyNs() != 0 {
		if o.GetEmptyNs() != unix.CLONE_NEWNET {
			return ErrUnsupported{"empty_ns", fmt.Sprintf("%#x: only CLONE_NEWNET is allowed", o.GetEmptyNs())}
		}
		t.add("empty-ns", "net")
	}
	for _, j := range o.JoinNs {
		v := j.GetNs() + ":" + j.GetNsFile()
		if j.ExtraOpt != nil {
			v += "," + j.GetExtraOpt()
		}
		t.add("join-ns", v)
	}
	return nil
}

// refused is the first option stream mode cannot honour.
func refused(mode rpc.CriuReqType, o *rpc.CriuOpts) error {
	switch {
	case o.Ps != nil:
		return ErrUnsupported{"ps", "a page server does not combine with --stream"}
	case o.ParentImg != nil && o.GetParentImg() != "":
		return ErrUnsupported{"parent_img", "incremental dumps (pre-dump parents) do not combine with --stream; the checkpoint streams whole (gpucr-stream --dedup stores only what changed)"}
	case o.GetTrackMem():
		return ErrUnsupported{"track_mem", "memory tracking serves incremental dumps, which do not combine with --stream"}
	case o.GetAutoDedup():
		return ErrUnsupported{"auto_dedup", "does not combine with --stream (gpucr-stream --dedup deduplicates the checkpoint)"}
	case o.GetLazyPages():
		return ErrUnsupported{"lazy_pages", "does not combine with --stream"}
	case o.StatusFd != nil:
		return ErrUnsupported{"status_fd", "serves lazy pages, which do not combine with --stream"}
	case o.GetTls() || o.TlsCacert != nil || o.TlsCacrl != nil || o.TlsCert != nil || o.TlsKey != nil || o.GetTlsNoCnVerify():
		return ErrUnsupported{"tls", "TLS is the page server's, which does not combine with --stream"}
	case mode == rpc.CriuReqType_DUMP && len(o.ExecCmd) > 0:
		return ErrUnsupported{"exec_cmd", "is a restore option"}
	}
	return nil
}

// listsBounded refuses requests whose lists no runtime would send.
func listsBounded(o *rpc.CriuOpts) error {
	n := len(o.Veths) + len(o.ExecCmd) + len(o.ExtMnt) + len(o.CgRoot) + len(o.InheritFd) + len(o.SkipMnt) + len(o.EnableFs) +
		len(o.UnixSkIno) + len(o.IrmapScanPaths) + len(o.External) + len(o.JoinNs) + len(o.CgroupDumpController)
	if n > maxListed {
		return ErrUnsupported{"(lists)", fmt.Sprintf("%d list entries, over %d", n, maxListed)}
	}
	return nil
}

// logName is CRIU's log file as the RPC sets it: log_file in the work
// dir, criu.log when none is named, none ("") on stderr.
func logName(o *rpc.CriuOpts) (string, error) {
	switch {
	case o.LogFile != nil:
		if strings.Contains(o.GetLogFile(), "/") || o.GetLogFile() == "" {
			return "", ErrUnsupported{"log_file", fmt.Sprintf("%q: a file name in the work dir is wanted", o.GetLogFile())}
		}
		return o.GetLogFile(), nil
	case o.GetLogToStderr():
		return "", nil
	}
	return "criu.log", nil // cr-service.c's DEFAULT_LOG_FILENAME
}

// cgroupModes are criu_cg_mode's names on the command line.
var cgroupModes = map[rpc.CriuCgMode]string{
	rpc.CriuCgMode_IGNORE: "ignore", rpc.CriuCgMode_CG_NONE: "none", rpc.CriuCgMode_PROPS: "props",
	rpc.CriuCgMode_SOFT: "soft", rpc.CriuCgMode_FULL: "full", rpc.CriuCgMode_STRICT: "strict",
	rpc.CriuCgMode_DEFAULT: "soft", // CG_MODE_DEFAULT is CG_MODE_SOFT
}

func (t *translation) cgroups(o *rpc.CriuOpts) error {
	mode := ""
	if o.ManageCgroups != nil {
		mode = map[bool]string{true: "soft", false: "ignore"}[o.GetManageCgroups()]
	}
	if o.ManageCgroupsMode != nil {
		m, ok := cgroupModes[o.GetManageCgroupsMode()]
		if !ok {
			return ErrUnsupported{"manage_cgroups_mode", fmt.Sprintf("unknown mode %d", o.GetManageCgroupsMode())}
		}
		mode = m
	}
	if mode != "" {
		t.add("manage-cgroups", mode)
	}
	for _, r := range o.CgRoot {
		v := r.GetPath()
		if r.Ctrl != nil && r.GetCtrl() != "" {
			v = r.GetCtrl() + ":" + v
		}
		t.add("cgroup-root", v)
	}
	t.str("cgroup-props", o.CgroupProps)
	t.str("cgroup-props-file", o.CgroupPropsFile)
	t.add("cgroup-dump-controller", o.CgroupDumpController...)
	t.str("freeze-cgroup", o.FreezeCgroup)
	t.str("cgroup-yard", o.CgroupYard)
	return nil
}

// cpuCap writes criu_opts.cpu_cap's bits as --cpu-cap's list.
func cpuCap(bits uint32) string {
	s := "none"
	for _, c := range []struct {
		bit  uint32
		name string
	}{{1 << 0, "fpu"}, {1 << 1, "cpu"}, {1 << 2, "ins"}} {
		if bits&c.bit != 0 {
			s += "," + c.name
		}
	}
	return s
}

// configOptions are the long option names a CRIU config file sets (the
// first word of each statement; "no-X" counts as X). CRIU's RPC applies
// the config file after the request's options, its command line before:
// an option the file sets is left off the command line so the file wins,
// as it does over RPC. List options add up either way.
func configOptions(path string) (map[string]bool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	set := map[string]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		name, _, _ := strings.Cut(f[0], "=")
		set[strings.TrimPrefix(name, "no-")] = true
	}
	return set, nil
}

// listOptions add up over the config file and the command line.
var listOptions = map[string]bool{
	"veth-pair": true, "ext-mount-map": true, "cgroup-root": true, "inherit-fd": true, "skip-mnt": true, "enable-fs": true,
	"irmap-scan-path": true, "external": true, "join-ns": true, "cgroup-dump-controller": true, "action-script": true,
}

// requestOpts is a request's options, never nil.
func requestOpts(req *rpc.CriuReq) *rpc.CriuOpts {
	if req.Opts == nil {
		return &rpc.CriuOpts{ImagesDirFd: proto.Int32(-1)}
	}
	return req.Opts
}
