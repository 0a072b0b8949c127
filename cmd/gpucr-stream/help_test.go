package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/knobs"
	"github.com/gpucr/gpucr-stream/testhook"
)

// commandFlags are the flags each command's help lists: those it takes,
// no others (a flag another command takes is refused, TestCommandFlags).
// They are the flags each command took before its options became its own
// struct, less those migrate ignored (--dedup, --segment-size: no archive;
// --bundle: the receiver restores) and checkpoint's --bundle (restore's).
var commandFlags = []struct{ cmd, flags string }{
	{"capture", "carry chunk-hashes chunk-size codec connect-timeout create-bucket dedup ext-file-fds help images-dir json key-file memory-limit net-timeout no-progress pages-last producers progress-fd s3-endpoint s3-parallel s3-part-size s3-path-style s3-region s3-sse s3-sse-key-file segment-size shard-fds streams tls-ca tls-cert tls-key to token-file version workers"},
	{"serve", "carry connect-timeout early ext-file-fds from help images-dir json key-file memory-limit net-timeout no-progress producers progress-fd s3-endpoint s3-parallel s3-path-style s3-region s3-sse-key-file shard-fds spill-dir tcp-listen-remap tls-ca tls-cert tls-key token-file version workers"},
	{"extract", "ext-file-fds from help images-dir json key-file memory-limit net-timeout no-progress progress-fd s3-endpoint s3-parallel s3-path-style s3-region s3-sse-key-file shard-fds spill-dir tls-ca tls-cert tls-key token-file version workers"},
	{"checkpoint", "carry chunk-hashes chunk-size codec container create-bucket criu criu-opts cuda dedup fast-path help json key-file leave-running lock-timeout memory-limit net-timeout no-progress pages-last pid producers progress-fd runtime runtime-root s3-endpoint s3-parallel s3-part-size s3-path-style s3-region s3-sse s3-sse-key-file segment-size streams tls-ca tls-cert tls-key to token-file version vram-files vram-keep-dir work-dir workers"},
	{"restore", "bundle carry container criu criu-opts cuda from gpu-map help json key-file memory-limit net-timeout no-progress producers progress-fd runtime runtime-root s3-endpoint s3-parallel s3-path-style s3-region s3-sse-key-file spill-dir stage-memory tls-ca tls-cert tls-key token-file version work-dir workers"},
	{"run", "help version"},
	{"gpu", "chunk-hashes chunk-size codec dedup fast-path from gpu-map help host-check json key-file lock-timeout memory-limit no-progress pid progress-fd s3-endpoint s3-parallel s3-part-size s3-path-style s3-region s3-sse s3-sse-key-file segment-size stage-memory to version vram-files vram-keep-dir workers"},
	{"vram", "help images-dir json version"},
	{"migrate", "carry chunk-hashes chunk-size codec container criu criu-opts cuda fast-path help json keep-dir key-file leave-running lock-timeout memory-limit net-timeout no-progress pid precopy precopy-rounds precopy-shrink progress-fd runtime runtime-root streams tls-ca tls-cert tls-key to token-file version vram-files vram-keep-dir work-dir workers"},
	{"receive", "bundle carry container criu criu-opts cuda gpu-map help images-dir json key-file lazy-pages listen memory-limit net-timeout no-progress progress-fd restore runtime runtime-root spill-dir tls-ca tls-cert tls-key token-file version work-dir workers"},
	{"token", "help version"},
	{"keygen", "help version"},
	{"inspect", "from help json key-file s3-endpoint s3-path-style s3-region s3-sse-key-file version"},
	{"verify", "from help json key-file memory-limit no-progress s3-endpoint s3-parallel s3-path-style s3-region s3-sse-key-file spill-dir version workers"},
	{"ls", "help json s3-endpoint s3-path-style s3-region s3-sse-key-file version"},
	{"cp", "create-bucket help json key-file memory-limit no-progress s3-endpoint s3-parallel s3-part-size s3-path-style s3-region s3-sse s3-sse-key-file version workers"},
	{"rm", "dry-run help json s3-endpoint s3-path-style s3-region s3-sse-key-file version"},
	{"gc", "dry-run help json older-than repack-below s3-endpoint s3-path-style s3-region s3-sse-key-file version"},
	{"check", "help json key-file memory-limit read-data repair-index s3-endpoint s3-parallel s3-path-style s3-region s3-sse-key-file version workers"},
	{"env", "help json version"},
	{"version", "help version"},
	{"completion", "help version"},
	{"swrk", "help version"},
}

// helpFlags are the flags a help lists, each with its line.
func helpFlags(t *testing.T, args ...string) map[string]string {
	t.Helper()
	var out bytes.Buffer
	if err := run(context.Background(), args, strings.NewReader(""), &out, &out); err != nil {
		t.Fatalf("%v: %v", args, err)
	}
	lines := map[string]string{}
	for _, l := range strings.Split(out.String(), "\n") {
		if m := helpFlag.FindStringSubmatch(l); m != nil {
			lines[m[1]] = l
		}
	}
	return lines
}

var helpFlag = regexp.MustCompile(`^  (?:-[A-Za-z], |    )--([a-z0-9-]+)  `)

// TestCommandHelpFlags: each command's help lists exactly its flags, and
// each flag's environment variable.
func TestCommandHelpFlags(t *testing.T) {
	var names []string
	for _, tc := range commandFlags {
		names = append(names, tc.cmd)
		t.Run(tc.cmd, func(t *testing.T) {
			lines := helpFlags(t, tc.cmd, "--help")
			var got []string
			for n := range lines {
				got = append(got, n)
			}
			slices.Sort(got)
			if want := strings.Fields(tc.flags); !slices.Equal(got, want) {
				t.Errorf("%s --help lists %v, want %v", tc.cmd, got, want)
			}
			for n, l := range lines {
				env := " $" + knobs.FlagVar(n)
				if hasEnv(n) != strings.HasSuffix(l, env) {
					t.Errorf("%s --help: %q: want it to end in %q only where the flag has a variable", tc.cmd, l, env)
				}
			}
		})
	}
	var all []string
	for _, c := range commands() {
		all = append(all, c.name)
	}
	if !slices.Equal(names, all) {
		t.Errorf("the table covers %v, the commands are %v", names, all)
	}
}

// TestHelpListsEveryFlag: the full help lists every flag with its
// variable, and every flag is some command's.
func TestHelpListsEveryFlag(t *testing.T) {
	lines := helpFlags(t, "--help")
	offered := map[string]bool{}
	for _, tc := range commandFlags {
		for _, n := range strings.Fields(tc.flags) {
			offered[n] = true
		}
	}
	for _, d := range flagTable {
		l, ok := lines[d.name]
		if !ok {
			t.Errorf("--help does not list --%s", d.name)
		} else if hasEnv(d.name) && !strings.HasSuffix(l, "$"+knobs.FlagVar(d.name)) {
			t.Errorf("--help: %q does not name $%s", l, knobs.FlagVar(d.name))
		}
		if !offered[d.name] {
			t.Errorf("no command takes --%s", d.name)
		}
	}
	var out bytes.Buffer
	run(context.Background(), []string{"--help"}, strings.NewReader(""), &out, &out)
	for _, k := range knobs.All() {
		if !strings.Contains(out.String(), "  "+k.Name+"\n") {
			t.Errorf("--help does not name %s", k.Name)
		}
	}
}

// TestHelpInCommandTerms: where commands use a flag differently, each
// one's help says how it does (issue 38: extract's -D, verify's
// --spill-dir, tcp:// where --to or --from takes it).
func TestHelpInCommandTerms(t *testing.T) {
	tests := []struct {
		cmd, flag   string
		has, hasNot []string
	}{
		{"extract", "images-dir", []string{"write the image files"}, []string{"listens"}},
		{"capture", "images-dir", []string{"criu dump", "listens"}, nil},
		{"serve", "images-dir", []string{"criu restore", "listens"}, nil},
		{"verify", "spill-dir", []string{"stream"}, []string{"serve", "held images"}},
		{"serve", "spill-dir", []string{"held"}, nil},
		{"capture", "to", []string{"tcp://"}, nil},
		{"checkpoint", "to", []string{"tcp://"}, nil},
		{"migrate", "to", []string{"tcp://"}, []string{"s3://"}},
		{"serve", "from", []string{"tcp://"}, nil},
		{"extract", "from", []string{"tcp://"}, nil},
		{"restore", "from", []string{"tcp://"}, nil},
		{"verify", "from", nil, []string{"tcp://"}},
		{"inspect", "from", nil, []string{"tcp://"}},
		{"gpu", "to", []string{"suspend"}, []string{"tcp://"}},
		{"capture", "shard-fds", []string{"spread"}, []string{"gather"}},
		{"serve", "shard-fds", []string{"gather"}, []string{"spread"}},
		{"checkpoint", "pid", []string{"checkpoint"}, []string{"migrate"}},
		{"migrate", "pid", []string{"migrate"}, nil},
		{"capture", "memory-limit", nil, []string{"spill"}},
		{"restore", "memory-limit", []string{"spill"}, nil},
	}
	for _, tc := range tests {
		l := helpFlags(t, tc.cmd, "--help")[tc.flag]
		for _, w := range tc.has {
			if !strings.Contains(l, w) {
				t.Errorf("%s --help: %q lacks %q", tc.cmd, l, w)
			}
		}
		for _, w := range tc.hasNot {
			if strings.Contains(l, w) {
				t.Errorf("%s --help: %q has %q", tc.cmd, l, w)
			}
		}
	}
}

// TestEnvCommand: env shows each flag's variable and each knob with its
// value here, and never a secret's.
func TestEnvCommand(t *testing.T) {
	t.Setenv(knobs.Key.Name, "0123456789abcdef")
	t.Setenv("GPUCR_CODEC", "zstd:3")
	t.Setenv(knobs.NoSparse.Name, "1")
	var out bytes.Buffer
	if err := run(context.Background(), []string{"env"}, strings.NewReader(""), &out, &out); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`(?m)^GPUCR_CODEC +zstd:3 +the default of --codec$`),
		regexp.MustCompile(`(?m)^GPUCR_KEY +\(set, not shown\) `),
		regexp.MustCompile(`(?m)^GPUCR_NO_SPARSE +1 `),
		regexp.MustCompile(`(?m)^GPUCR_READAHEAD +- `),
	} {
		if !want.MatchString(s) {
			t.Errorf("env output lacks %s:\n%s", want, s)
		}
	}
	if strings.Contains(s, "0123456789abcdef") {
		t.Errorf("env shows the key:\n%s", s)
	}
	if strings.Contains(s, "GPUCR_TEST_") != testhook.Enabled {
		t.Errorf("env lists the test hooks: %v, built with them: %v", strings.Contains(s, "GPUCR_TEST_"), testhook.Enabled)
	}
	for _, d := range flagTable {
		if hasEnv(d.name) && !strings.Contains(s, knobs.FlagVar(d.name)+" ") {
			t.Errorf("env does not list %s", knobs.FlagVar(d.name))
		}
	}
}

// TestNoTestHooksInRelease: the binary built as make build builds it has
// no test hook (no GPUCR_TEST_ in it, none listed by env); the one built
// with the tag has both.
func TestNoTestHooksInRelease(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go is needed to build the binaries: %v", err)
	}
	dir := t.TempDir()
	for _, tc := range []struct {
		tags  string
		hooks bool
	}{{"", false}, {testhook.Tag, true}} {
		bin := filepath.Join(dir, "gpucr-stream"+tc.tags)
		cmd := exec.Command(goBin, "build", "-trimpath", "-tags", tc.tags, "-o", bin, ".")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build -tags %q: %v\n%s", tc.tags, err, out)
		}
		b, err := os.ReadFile(bin)
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"GPUCR_TEST_FAULT", "GPUCR_TEST_PAUSE"} {
			if bytes.Contains(b, []byte(name)) != tc.hooks {
				t.Errorf("built with tags %q: %s in the binary: %v", tc.tags, name, !tc.hooks)
			}
		}
		out, err := exec.Command(bin, "env").Output()
		if err != nil {
			t.Fatalf("%s env: %v", bin, err)
		}
		if regexp.MustCompile(`(?m)^GPUCR_TEST_FAULT `).Match(out) != tc.hooks {
			t.Errorf("built with tags %q: env lists GPUCR_TEST_FAULT: %v", tc.tags, !tc.hooks)
		}
	}
}

// TestEnvReadThroughKnobs: no package of the binary reads a GPUCR_
// variable itself; package knobs does (its table, or a flag's variable).
func TestEnvReadThroughKnobs(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go is needed to list the packages: %v", err)
	}
	for _, tags := range []string{"", testhook.Tag, "gpucr_bench"} {
		out, err := exec.Command(goBin, "list", "-tags", tags, "-deps", "-f", `{{if not .Standard}}{{.ImportPath}} {{.Dir}} {{join .GoFiles " "}}{{end}}`, ".").Output()
		if err != nil {
			t.Fatalf("go list: %v", err)
		}
		reads := regexp.MustCompile(`(?:Getenv|LookupEnv)\("GPUCR_`)
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			f := strings.Fields(line)
			if len(f) < 2 || !strings.HasPrefix(f[0], "github.com/gpucr/gpucr-stream/") || strings.HasSuffix(f[0], "/knobs") {
				continue
			}
			for _, name := range f[2:] {
				b, err := os.ReadFile(filepath.Join(f[1], name))
				if err != nil {
					t.Fatal(err)
				}
				if reads.Match(b) {
					t.Errorf("%s/%s reads a GPUCR_ variable itself: read it through package knobs", f[0], name)
				}
			}
		}
	}
}
